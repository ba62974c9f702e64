// writescoped: the writescope inference daemon (see writescoped(8)).
#include <mimalloc.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "daemon.hpp"
#include "engine_host.hpp"
#include "engine_options.hpp"
#include "machine.hpp"
#include "model_host.hpp"
#include "units.hpp"

using namespace writescope;
using namespace writescope::daemon;

namespace {

// mimalloc replaces malloc when linked; this says whether it really did, for /v1/status.
AllocatorInfo allocator_info() {
    AllocatorInfo a;
    a.name = "mimalloc";
    const int v = mi_version();  // 209 for 2.0.9
    a.version = fmt::format("{}.{}.{}", v / 100, (v / 10) % 10, v % 10);
    void* p = std::malloc(64);
    a.overrides_malloc = mi_is_in_heap_region(p);
    std::free(p);
    return a;
}

int check_config(const DaemonArgs& args) {
    try {
        const MachineInfo machine = probe_machine();
        const auto checked = check_effective_profile(args, machine);
        const auto& source = checked.loaded.source;
        const auto& o = checked.options;
        if (const std::string why = gpu_unused_reason(checked.loaded.profile, machine, o);
            !why.empty())
            std::cerr << fmt::format("{}: {}\n", source, why);
        // What this machine cannot tell is said, not passed over: valid, but not verified.
        std::vector<std::string> unchecked_keys;
        for (const auto& i : checked.unchecked) {
            std::cerr << fmt::format("{}: {}: {}\n", source, i.key, i.message);
            unchecked_keys.push_back(i.key);
        }
        const auto model = load_profile_model(checked.loaded.profile, source, true);
        // The boot loads the directory's tokenizer beside the weights: one that does not load
        // fails the boot, so it fails the check; a chat template that does not compile only
        // turns chat off, which is said.
        if (!model->builtin()) {
            const Profile& p = checked.loaded.profile;
            try {
                const ModelText text = load_model_text(p.model.source);
                if (!text.chat_problem.empty())
                    std::cerr << fmt::format(
                        "{}: model.source: {}; {}\n", source, text.chat_problem,
                        text.tokenizer ? "/v1/chat/completions refuses requests"
                                       : "the model takes token ids only");
            } catch (const std::runtime_error& e) {
                fail_at_key(p, source, "model.source", e.what());
            }
        }
        std::cout << fmt::format(
            "{}: ok: model {} ({} KV, {} per token; {}, {} of weights), GPU {}, budgets VRAM {} / "
            "pinned {} / host {}, mode {}{}\n",
            source, o.geometry.name, dtype_name(o.geometry.dtype),
            format_size_human(o.geometry.bytes_per_token()), model->description(),
            format_size_human(model_weight_bytes(*model)),
            o.gpu_index >= 0 ? std::to_string(o.gpu_index) : std::string("none"),
            o.vram_kv_g_blocks ? std::string("\"auto\" (sized at start from the KV history)")
                               : format_size_human(o.vram_kv_bytes),
            format_size_human(o.pinned_kv_bytes), format_size_human(o.host_kv_bytes), o.mode,
            unchecked_keys.empty() ? std::string()
                                   : fmt::format("; not checked on this machine: {}",
                                                 fmt::join(unchecked_keys, ", ")));
        return 0;
    } catch (const ProfileError& e) {
        std::cerr << e.what() << "\n";
        return 1;
    }
}

}  // namespace

int main(int argc, char** argv) {
    CLI::App app{
        "writescoped: the writescope inference daemon. Serves the HTTP API (JSON over a "
        "Unix socket) for a long-context MoE model whose KV cache spills to host "
        "memory, splitting decode attention between CPU and GPU (see writescoped(8)).",
        "writescoped"};
    DaemonArgs args;
    std::string config = kDefaultConfigPath, socket, state_dir;
    bool check = false, print_default = false, print_reference = false, version = false;
    auto* config_opt =
        app.add_option("-c,--config", config,
                       "the profile (TOML); without it, " + std::string(kDefaultConfigPath) +
                           " when it exists, else the built-in defaults");
    app.add_option("--socket", socket,
                   "listen on this Unix socket path (overrides server.socket; "
                   "unused when systemd passes a socket)");
    app.add_option("--state-dir", state_dir,
                   "keep the store in this directory (overrides storage.state_dir)");
    app.add_flag("--check-config", check,
                 "validate the profile (values, model, budgets on this machine), print a summary "
                 "and exit: 0 when valid, 1 listing every problem with its key and line");
    app.add_flag("--print-default-config", print_default,
                 "print the default profile (every key at its default, documented) and exit");
    app.add_flag("--print-config-reference", print_reference,
                 "print the key reference of docs/configuration.md (Markdown) and exit");
    app.add_flag("-V,--version", version, "print the version and exit");
    app.footer(
        "Signals: SIGHUP reloads the profile (keeps the running one if the new file is bad); "
        "SIGTERM or SIGINT stops after in-flight requests, persisting the workload history.\n"
        "Under systemd: Type=notify (READY=1, STATUS=, WATCHDOG=1), socket activation.\n"
        "Exit status: 0 stopped on request, 1 bad profile / cannot listen / boot failed, 2 bad "
        "command line.");
    try {
        app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
        return app.exit(e) == 0 ? 0 : 2;
    }
    if (version) {
        std::cout << "writescoped " << WRITESCOPE_VERSION
                  << (build_has_cuda() ? " (CUDA backend)" : " (CPU backend only)") << "\n";
        return 0;
    }
    if (print_default) {
        std::cout << default_profile_toml();
        return 0;
    }
    if (print_reference) {
        std::cout << profile_reference_markdown();
        return 0;
    }
    args.config = config;
    args.config_given = config_opt->count() > 0;
    if (!socket.empty()) args.socket = socket;
    if (!state_dir.empty()) args.state_dir = state_dir;
    if (check) return check_config(args);

    args.allocator = allocator_info();
    args.engine_factory = real_engine_factory();
    args.model_factory = real_model_factory();
    return run_daemon(args);
}
