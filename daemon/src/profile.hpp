// The daemon's profile (the TOML configuration file): its values, and the one table of keys that
// drives parsing, defaults, the shipped etc/writescope.toml and the key reference in the docs.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "writescope/core/dtype.hpp"
#include "writescope/core/model/runtime.hpp"  // the default prompt chunks

namespace writescope::daemon {

enum class GpuChoice : std::uint8_t { automatic, none, index };
struct GpuSelector {
    GpuChoice choice = GpuChoice::automatic;
    int index = 0;  // meaningful only for GpuChoice::index
    friend bool operator==(const GpuSelector&, const GpuSelector&) = default;
};

// A host-memory budget: a byte size, a share of the machine's physical memory ("50%"), or
// "auto": what the model needs (needed_bytes, from kv.max_batch, the model's context and its KV
// bytes per token), within kAutoShare percent of the physical memory. Budgets are hard (touched
// at start-up), so a default must not take more than the model can use.
struct HostBudget {
    std::uint64_t bytes = 0;  // when !relative
    double percent = 0;       // when relative, in (0, 100]
    bool relative = false;
    bool automatic = false;
    // Two daemons on one machine, each with its generated weights beside it, still fit.
    static constexpr double kAutoShare = 20;
    // Bytes this budget grants on a machine with physical_bytes of memory.
    std::uint64_t resolve(std::uint64_t physical_bytes,
                          std::uint64_t needed_bytes = 0) const noexcept;
    friend bool operator==(const HostBudget&, const HostBudget&) = default;
};

// When boot measures the roofline constants instead of reusing stored ones.
enum class Recalibrate : std::uint8_t { automatic, always, never };

struct Profile {
    struct Hardware {
        GpuSelector gpu;
        // Bytes of GPU memory for T + G + staging; none ("auto"): G sized at start-up from the
        // stored KV demand (auto_kv.hpp).
        std::optional<std::uint64_t> vram_kv_budget;
        // Bytes of GPU memory writescope takes in all: the KV's part above and, with the GPU
        // model runtime, the weights and its workspaces in the rest. 0: "auto" (what the GPU
        // has free at start-up, less a reserve).
        std::uint64_t vram_budget = 0;
        HostBudget pinned_kv_budget;  // P region (pinned host memory)
        HostBudget host_kv_budget;    // U region (ordinary host memory)
        int attention_threads = 0;    // 0: one per online core
        int expert_threads = 0;       // 0: as many as attention_threads
        bool pin_threads = true;
        // The GPU model runtime page-locks the routed experts it leaves in host memory, so that
        // prompt chunks stream them to the GPU at the PCIe rate.
        bool lock_host_experts = true;
        // Decode steps may split each host-resident expert by rows between the CPU and the GPU,
        // which reads its rows of the page-locked experts across PCIe (RuntimeOptions::
        // expert_rows, automatic: where timed faster).
        bool split_host_experts = true;
    } hardware;
    struct Model {
        std::string source;      // a preset name or a model directory
        int layers = -1;         // the first n layers; 0: all; -1 ("auto"): kAutoBuiltinLayers of a
                                 // built-in model, all of a directory's
        std::uint64_t seed = 0;  // built-in models: the random weights' seed
        // "think": a chat answer's leading <think>…</think> is message.reasoning_content
        // (reasoning.hpp); "none": it stays in the content.
        std::string reasoning_parser = "none";
        // The most prompt tokens one forward pass computes (RuntimeOptions::prefill_chunk_tokens;
        // the GPU engine's prompt workspace is sized for it too); 0 ("auto"): kAutoChunkGpu
        // where the model runs on the GPU, kAutoChunkCpu on the CPU (prefill_chunk_tokens());
        // the GPU runtime takes kAutoChunkCpu where kAutoChunkGpu's larger workspace would cost
        // more than a quarter of the weights' part of the VRAM budget (start_gpu_runtime).
        std::size_t prefill_chunk_tokens = 0;
        static constexpr std::size_t kAutoChunkGpu = model::kGpuPrefillChunk,
                                     kAutoChunkCpu = model::kCpuPrefillChunk;
        static constexpr int kAutoBuiltinLayers = 2;
    } model;
    struct Kv {
        std::optional<DType> dtype;  // none ("auto"): the checkpoint's dtype
        std::size_t block_tokens = 0;
        std::size_t max_batch = 0;
    } kv;
    struct Policy {
        std::string mode;
        double tracker_alpha = 0;
        double tracker_clamp = 0;
        Recalibrate recalibrate = Recalibrate::automatic;
        std::chrono::milliseconds recalibrate_max_age{0};
        bool warm_start = true;
    } policy;
    struct Server {
        std::string socket;
        unsigned socket_mode = 0;  // permission bits of the socket file when the daemon binds it
        std::uint64_t max_body_bytes = 0;
        std::size_t max_concurrent_requests = 0;
        std::size_t max_prompt_tokens = 0;
        std::size_t max_queued_requests = 0;  // completions waiting for a sequence slot
        std::chrono::milliseconds request_timeout{0};
        // A body must arrive within this (and within request_timeout) once the header is in.
        std::chrono::milliseconds body_timeout{0};
        // A prefill chunk or decode step running longer is a hang (0: never): the daemon stops
        // answering the service manager's watchdog, which kills and restarts it.
        std::chrono::milliseconds step_timeout{0};
        std::string admin_group;  // may change state besides root and the daemon's user; "": none
    } server;
    struct Storage {
        std::string state_dir;
        std::size_t sample_log_max = 0;  // rows kept in the sample log
        std::chrono::milliseconds sample_interval{0};
        std::chrono::milliseconds history_flush_interval{0};
    } storage;

    // Where each key given in the file was written ("section.name" → its value's line and
    // column), so a problem found later (a model directory, a budget against this machine)
    // points at it. Keys at their defaults have no place.
    struct Place {
        std::size_t line = 0, column = 0;
    };
    std::map<std::string, Place> places;
};

// The largest profile file read (a profile is a few KiB).
inline constexpr std::uint64_t kMaxProfileBytes = 1u << 20;

// One problem found in a profile: the key (section.name, empty for a TOML syntax error), where
// it is, and what is wrong.
struct ProfileIssue {
    std::string key;
    std::string message;
    std::size_t line = 0;  // 1-based; 0 when the problem has no place in the file
    std::size_t column = 0;
};

class ProfileError : public std::runtime_error {
  public:
    ProfileError(std::string source, std::vector<ProfileIssue> issues);
    const std::string& source() const noexcept { return source_; }
    const std::vector<ProfileIssue>& issues() const noexcept { return issues_; }

  private:
    std::string source_;
    std::vector<ProfileIssue> issues_;
};

// The built-in defaults (every key at its default).
const Profile& default_profile();

// model.prefill_chunk_tokens resolved: the configured value, or for "auto" the default of the
// runtime that runs the model (gpu_model: the GPU model runtime).
inline std::size_t prefill_chunk_tokens(const Profile& p, bool gpu_model) noexcept {
    if (p.model.prefill_chunk_tokens != 0) return p.model.prefill_chunk_tokens;
    return gpu_model ? Profile::Model::kAutoChunkGpu : Profile::Model::kAutoChunkCpu;
}
// "auto" on the GPU keeps kAutoChunkGpu when its workspace beyond kAutoChunkCpu's,
// extra_workspace, costs at most a quarter of what the smaller chunk leaves the weights
// (weights_bytes); otherwise the GPU runtime takes kAutoChunkCpu (a small VRAM budget keeps its
// experts: 6 GiB with 2 GiB of KV left 2.59 GiB, of which 2048 tokens wanted 1.14 more).
inline bool auto_gpu_chunk_fits(std::uint64_t extra_workspace,
                                std::uint64_t weights_bytes) noexcept {
    return extra_workspace <= weights_bytes / 4;
}

// Parses profile text; keys left out keep their defaults. Throws ProfileError listing every
// problem ("FILE:LINE:COLUMN: section.key: message" per line of what()).
Profile parse_profile(std::string_view toml_text, std::string_view source_name);
// Reads and parses a file (an unreadable file is a ProfileError too).
Profile load_profile(const std::filesystem::path& file);

// The profile as TOML: every key, in table order. With comments, each key is preceded by its
// one-line documentation; default_profile_toml() is exactly the shipped etc/writescope.toml.
std::string render_profile_toml(const Profile& p, bool comments);
std::string default_profile_toml();

// The key reference of docs/configuration.md (Markdown tables, one per section), generated from
// the key table so the docs cannot drift from the parser.
std::string profile_reference_markdown();

// The key table, for documentation and for reload decisions.
struct KeyInfo {
    std::string_view section;
    std::string_view name;
    std::string_view default_value;  // as written in TOML
    std::string_view doc;
    bool reloadable;  // SIGHUP applies it; otherwise it takes a restart
};
std::vector<KeyInfo> profile_keys();

// The running profile after a reload to `next`: the reloadable keys take next's values, the
// others keep running's. needs_restart (when given) receives the non-reloadable keys that differ.
Profile merge_reloadable(const Profile& running, const Profile& next,
                         std::vector<std::string>* needs_restart);

// The value of one key ("section.name") rendered as TOML; empty for an unknown key.
std::string profile_value(const Profile& p, std::string_view key);
// The keys ("section.name") whose values differ.
std::vector<std::string> changed_keys(const Profile& a, const Profile& b);

// Empty when mode is a valid execution mode (writescope, gpu-only, cpu-only, monolithic,
// static:R with R in [0, 1]: core's parse_execution_mode); otherwise why not.
std::string validate_mode(std::string_view mode);

std::string_view recalibrate_name(Recalibrate r) noexcept;

}  // namespace writescope::daemon
