// writescopectl: the command-line client of writescoped (see writescopectl(1)).
#include <errno.h>
#include <grp.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iostream>
#include <optional>
#include <thread>

#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "ctl_render.hpp"
#include "http_client.hpp"

using namespace writescope::daemon;
using json = nlohmann::json;

namespace {

constexpr const char* kDefaultSocket = "/run/writescope/writescoped.sock";

// Exit statuses (writescopectl(1)).
constexpr int kExitOk = 0;
constexpr int kExitApiError = 1;     // the daemon answered with an error
constexpr int kExitUsage = 2;        // bad command line
constexpr int kExitUnreachable = 3;  // not running, or the socket cannot be used

struct Failure {
    int code;
    std::string message;
};

std::string owner_text(const std::string& path) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) return {};
    const passwd* pw = ::getpwuid(st.st_uid);
    const group* gr = ::getgrgid(st.st_gid);
    return fmt::format("mode {:04o}, owner {}:{}", st.st_mode & 07777,
                       pw ? pw->pw_name : std::to_string(st.st_uid),
                       gr ? gr->gr_name : std::to_string(st.st_gid));
}

Failure unreachable(const ConnectError& e) {
    const auto& p = e.path();
    switch (e.errno_value()) {
        case ENOENT:
            return {kExitUnreachable,
                    fmt::format("writescoped is not running: there is no socket at {} (start it "
                                "with `systemctl start writescoped`, or name another socket with "
                                "--socket)",
                                p)};
        case ECONNREFUSED:
            return {kExitUnreachable,
                    fmt::format("writescoped is not running: nothing accepts connections on {} "
                                "(a stale socket file left by a daemon that died)",
                                p)};
        case EACCES:
        case EPERM: {
            const auto owner = owner_text(p);
            return {kExitUnreachable,
                    fmt::format("permission denied on {}{}: run as root or as a member of the "
                                "socket's group (usually: sudo usermod -aG writescope $USER, then "
                                "log in again)",
                                p, owner.empty() ? "" : " (" + owner + ")")};
        }
        case ENOTSOCK:
        case ENAMETOOLONG:
        default:
            return {kExitUnreachable, e.what()};
    }
}

class Client {
  public:
    Client(std::string socket, std::chrono::milliseconds timeout)
        : socket_(std::move(socket)), timeout_(timeout) {}

    // The parsed JSON of a successful response (2xx); a Failure otherwise.
    json call(std::string_view method, std::string_view target, std::string_view body = {}) {
        ClientResponse r;
        try {
            r = http_request(socket_, method, target, body, timeout_);
        } catch (const ConnectError& e) {
            throw unreachable(e);
        } catch (const std::exception& e) {
            throw Failure{
                kExitUnreachable,
                fmt::format("no usable answer from writescoped on {}: {}", socket_, e.what())};
        }
        json j = json::parse(r.body, nullptr, false);
        if (r.status >= 200 && r.status < 300) {
            if (j.is_discarded())
                throw Failure{kExitApiError,
                              fmt::format("the answer to {} {} is not JSON", method, target)};
            return j;
        }
        if (!j.is_discarded() && j.contains("error") && j["error"].is_object()) {
            const auto& e = j["error"];
            throw Failure{kExitApiError,
                          fmt::format("{} ({} {})", e.value("message", std::string("?")), r.status,
                                      e.value("type", std::string("?")))};
        }
        throw Failure{kExitApiError, fmt::format("HTTP {} {}", r.status, r.reason)};
    }

    // A streamed POST: on_body(bytes) as they come; throws a Failure like call() when the
    // answer is not 2xx. The timeout counts from the last bytes received.
    void stream(std::string_view target, std::string_view body,
                const std::function<void(std::string_view)>& on_body) {
        ClientResponse r;
        bool ok = false;
        try {
            r = http_request_streamed(
                socket_, "POST", target, body,
                [&](std::string_view bytes) {
                    if (ok) on_body(bytes);
                },
                timeout_, [&](int status) { ok = status >= 200 && status < 300; });
        } catch (const ConnectError& e) {
            throw unreachable(e);
        } catch (const Failure&) {
            throw;
        } catch (const std::exception& e) {
            throw Failure{
                kExitUnreachable,
                fmt::format("no usable answer from writescoped on {}: {}", socket_, e.what())};
        }
        if (ok) return;
        json j = json::parse(r.body, nullptr, false);
        if (!j.is_discarded() && j.contains("error") && j["error"].is_object()) {
            const auto& e = j["error"];
            throw Failure{kExitApiError,
                          fmt::format("{} ({} {})", e.value("message", std::string("?")), r.status,
                                      e.value("type", std::string("?")))};
        }
        throw Failure{kExitApiError, fmt::format("HTTP {} {}", r.status, r.reason)};
    }

  private:
    std::string socket_;
    std::chrono::milliseconds timeout_;
};

std::vector<std::int64_t> id_list(const std::string& text, const char* option) {
    std::vector<std::int64_t> out;
    std::size_t at = 0;
    while (at <= text.size()) {
        const auto comma = text.find(',', at);
        const std::string part =
            text.substr(at, comma == std::string::npos ? std::string::npos : comma - at);
        char* end = nullptr;
        const long long v = std::strtoll(part.c_str(), &end, 10);
        if (part.empty() || !end || *end != '\0' || v < 0)
            throw Failure{kExitUsage, fmt::format("{}: \"{}\" is not a token id (give ids as "
                                                  "1,2,3)",
                                                  option, part)};
        out.push_back(v);
        if (comma == std::string::npos) break;
        at = comma + 1;
    }
    return out;
}

// Streams a request to `route` and hands each server-sent event's JSON to on_chunk (printed
// whole with --json); then the summary on stderr: tokens, finish_reason, usage. An error the
// daemon sent in the stream fails the command with it.
template <class OnChunk>
int stream_events(Client& c, const std::string& route, const json& request, bool as_json,
                  OnChunk&& on_chunk) {
    std::string pending;
    std::string finish;
    json usage;
    std::string error;
    c.stream(route, request.dump(), [&](std::string_view bytes) {
        pending.append(bytes);
        for (;;) {
            const auto end = pending.find("\n\n");
            if (end == std::string::npos) break;
            std::string event = pending.substr(0, end);
            pending.erase(0, end + 2);
            if (!event.starts_with("data: ")) continue;
            event.erase(0, 6);
            if (event == "[DONE]") continue;
            const json j = json::parse(event, nullptr, false);
            if (j.is_discarded()) continue;
            if (as_json) std::cout << j.dump() << "\n" << std::flush;
            if (j.contains("error")) error = j["error"].value("message", std::string("?"));
            if (j.contains("usage") && j["usage"].is_object()) usage = j["usage"];
            if (!j.contains("choices")) continue;
            for (const auto& ch : j["choices"]) {
                if (!as_json) on_chunk(ch);
                if (ch.contains("finish_reason") && ch["finish_reason"].is_string())
                    finish = ch["finish_reason"].get<std::string>();
            }
        }
    });
    if (!as_json) {
        std::cout << "\n";
        std::cerr << fmt::format("{} tokens, finish_reason {}",
                                 usage.is_object() ? usage.value("completion_tokens", 0) : 0,
                                 finish.empty() ? "none" : finish);
        if (usage.is_object())
            std::cerr << fmt::format(" (prompt {}, total {})", usage.value("prompt_tokens", 0),
                                     usage.value("total_tokens", 0));
        std::cerr << "\n";
    }
    if (!error.empty()) throw Failure{kExitApiError, error};
    return kExitOk;
}

// `complete`: streams a completion, printing token ids as they come (or each event's JSON).
int complete(Client& c, const json& request, bool as_json) {
    std::size_t printed = 0;
    return stream_events(c, "/v1/completions", request, as_json, [&](const json& ch) {
        for (const auto& t : ch["token_ids"])
            std::cout << (printed++ ? " " : "") << t.get<std::int64_t>() << std::flush;
    });
}

// `chat`: streams a chat completion, printing its text as it comes (or each event's JSON).
int chat(Client& c, const json& request, bool as_json) {
    return stream_events(c, "/v1/chat/completions", request, as_json, [&](const json& ch) {
        if (!ch.contains("delta")) return;
        const json& d = ch["delta"];
        if (d.contains("content") && d["content"].is_string())
            std::cout << d["content"].get<std::string>() << std::flush;
        if (d.contains("tool_calls"))
            for (const auto& t : d["tool_calls"])
                std::cout << fmt::format("[tool call {}({})]", t["function"].value("name", ""),
                                         t["function"].value("arguments", ""))
                          << std::flush;
    });
}

void print(const json& j, bool as_json, const std::string& human) {
    if (as_json)
        std::cout << j.dump(2) << "\n";
    else
        std::cout << human;
}

int calibrate(Client& c, bool as_json, bool wait) {
    const json started = c.call("POST", "/v1/calibration", "{}");
    if (!wait) {
        print(started, as_json, "calibration started\n");
        return kExitOk;
    }
    const bool tty = ::isatty(2);
    std::string last_stage;
    json state;
    for (;;) {
        state = c.call("GET", "/v1/calibration");
        const auto& job = state["job"];
        const double progress = job.value("progress", 0.0);
        const std::string stage = job.value("stage", std::string());
        if (tty) {
            std::cerr << "\r\033[K" << progress_line(progress, stage) << std::flush;
        } else if (stage != last_stage) {
            std::cerr << fmt::format("{:3.0f}% {}\n", progress * 100, stage);
        }
        last_stage = stage;
        if (job.value("state", std::string()) != "running") break;
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (tty) std::cerr << "\n";
    const auto& job = state["job"];
    const std::string outcome = job.value("state", std::string());
    if (outcome != "done") {
        const std::string err = job.contains("error") && job["error"].is_string()
                                    ? job["error"].get<std::string>()
                                    : "";
        throw Failure{kExitApiError,
                      fmt::format("the calibration {}{}", outcome, err.empty() ? "" : ": " + err)};
    }
    print(state, as_json, render_calibration(state));
    return kExitOk;
}

}  // namespace

int main(int argc, char** argv) {
    CLI::App app{
        "writescopectl: talk to writescoped, the writescope inference daemon, over its "
        "Unix socket (see writescopectl(1)).",
        "writescopectl"};
    const char* env_socket = std::getenv("WRITESCOPE_SOCKET");
    std::string socket = env_socket && *env_socket ? env_socket : kDefaultSocket;
    bool as_json = false, version = false;
    double timeout_s = 30;
    app.add_option("-s,--socket", socket,
                   "the daemon's socket (default: $WRITESCOPE_SOCKET, else " +
                       std::string(kDefaultSocket) + ")");
    app.add_flag("-j,--json", as_json, "print the daemon's JSON instead of tables (for scripts)");
    app.add_option("--timeout", timeout_s, "seconds to wait for each answer (default 30)")
        ->check(CLI::PositiveNumber);
    app.add_flag("-V,--version", version, "print the version and exit");
    app.require_subcommand(0, 1);

    auto* status = app.add_subcommand("status",
                                      "budgets and use of the KV regions, the policy, "
                                      "the calibration, uptime");
    auto* health = app.add_subcommand("health", "whether the daemon is ready (exit 0) or not");
    auto* calibrate_cmd =
        app.add_subcommand("calibrate",
                           "measure A, B and delta again (with a progress display), "
                           "or show the calibration in use with --show");
    bool no_wait = false, show = false;
    calibrate_cmd->add_flag("--no-wait", no_wait, "start the calibration and return at once");
    calibrate_cmd->add_flag("--show", show, "show the calibration in use; measure nothing");
    auto* policy = app.add_subcommand("policy", "show the policy, or change it with `policy set`");
    policy->add_subcommand("show", "show the policy (the default)");
    auto* policy_set = policy->add_subcommand(
        "set", "change the mode or the tracker settings until the next reload or restart");
    std::optional<std::string> mode;
    std::optional<double> alpha, clamp;
    policy_set->add_option("--mode", mode,
                           "writescope | gpu-only | cpu-only | static:R | monolithic");
    policy_set->add_option("--alpha", alpha, "tracker smoothing factor, in (0, 1]");
    policy_set->add_option("--clamp", clamp, "tracker outlier clamp ratio, >= 1");
    std::vector<std::string> assignments;
    policy_set->add_option("assignments", assignments,
                           "the same as key=value: mode=M, tracker_alpha=X, tracker_clamp=Y");
    auto* history = app.add_subcommand("history", "the stored workload history and sample log");
    std::size_t samples = 20;
    history->add_option("-n,--samples", samples, "newest samples to show (default 20)");
    auto* complete_cmd = app.add_subcommand(
        "complete", "generate from a prompt of token ids, printing the tokens as they come");
    std::string prompt_ids, stop_ids;
    std::size_t max_tokens = 16;
    std::optional<double> temperature, top_p, min_p;
    std::optional<int> top_k, logprobs;
    std::optional<std::uint64_t> seed;
    bool ignore_eos = false;
    complete_cmd->add_option("--prompt-ids", prompt_ids, "the prompt: token ids, as 1,2,3")
        ->required();
    complete_cmd->add_option("--max-tokens", max_tokens, "most tokens to generate (default 16)");
    complete_cmd->add_option("--temperature", temperature, "0 (greedy) to 2 (default 1)");
    complete_cmd->add_option("--top-p", top_p, "nucleus sampling share, in (0, 1]");
    complete_cmd->add_option("--top-k", top_k, "keep the k most likely tokens (0: all)");
    complete_cmd->add_option("--min-p", min_p, "drop tokens below min_p × the most likely's");
    complete_cmd->add_option("--seed", seed, "seed of the request's sampling");
    complete_cmd->add_option("--stop-ids", stop_ids, "token ids that end the completion, as 5,7");
    complete_cmd->add_flag("--ignore-eos", ignore_eos, "do not stop at the model's eos tokens");
    complete_cmd->add_option("--logprobs", logprobs,
                             "with --json: the chosen token's and the top n's logprobs");
    auto* chat_cmd = app.add_subcommand(
        "chat",
        "send a message through the model's chat template, printing the answer as it comes");
    std::string message, system_prompt;
    std::size_t chat_max_tokens = 256;
    bool no_thinking = false;
    chat_cmd->add_option("message", message, "the user's message")->required();
    chat_cmd->add_option("--system", system_prompt, "a system message before it");
    chat_cmd->add_option("--max-tokens", chat_max_tokens, "most tokens to generate (default 256)");
    chat_cmd->add_option("--temperature", temperature, "0 (greedy) to 2 (default 1)");
    chat_cmd->add_option("--top-p", top_p, "nucleus sampling share, in (0, 1]");
    chat_cmd->add_option("--seed", seed, "seed of the request's sampling");
    chat_cmd->add_flag("--ignore-eos", ignore_eos, "do not stop at the model's eos tokens");
    chat_cmd->add_flag("--no-thinking", no_thinking,
                       "the template's enable_thinking false (Qwen3: answer without <think>)");
    app.footer(
        "Exit status: 0 success, 1 the daemon answered with an error, 2 bad command line, "
        "3 the daemon cannot be reached.");

    try {
        app.parse(argc, argv);
    } catch (const CLI::ParseError& e) {
        return app.exit(e) == 0 ? kExitOk : kExitUsage;
    }
    if (version) {
        std::cout << "writescopectl " << WRITESCOPE_VERSION << "\n";
        return kExitOk;
    }
    if (app.get_subcommands().empty()) {
        std::cerr << app.help();
        return kExitUsage;
    }

    Client client(socket, std::chrono::milliseconds(static_cast<long long>(timeout_s * 1000)));
    try {
        if (status->parsed()) {
            const auto j = client.call("GET", "/v1/status");
            print(j, as_json, render_status(j));
        } else if (health->parsed()) {
            const auto j = client.call("GET", "/v1/health");
            print(j, as_json, render_health(j));
        } else if (calibrate_cmd->parsed()) {
            if (show) {
                const auto j = client.call("GET", "/v1/calibration");
                print(j, as_json, render_calibration(j));
            } else {
                return calibrate(client, as_json, !no_wait);
            }
        } else if (policy_set->parsed()) {
            for (const auto& a : assignments) {
                const auto eq = a.find('=');
                const std::string key = a.substr(0, eq);
                const std::string value = eq == std::string::npos ? "" : a.substr(eq + 1);
                char* end = nullptr;
                const double number = std::strtod(value.c_str(), &end);
                const bool is_number = !value.empty() && end && *end == '\0';
                if (key == "mode" && !value.empty()) {
                    mode = value;
                } else if ((key == "tracker_alpha" || key == "alpha") && is_number) {
                    alpha = number;
                } else if ((key == "tracker_clamp" || key == "clamp") && is_number) {
                    clamp = number;
                } else {
                    std::cerr << "writescopectl: policy set: \"" << a
                              << "\" is not mode=M, tracker_alpha=X or tracker_clamp=Y\n";
                    return kExitUsage;
                }
            }
            json body = json::object();
            if (mode) body["mode"] = *mode;
            if (alpha) body["tracker"]["alpha"] = *alpha;
            if (clamp) body["tracker"]["clamp"] = *clamp;
            if (body.empty()) {
                std::cerr << "writescopectl: policy set: give --mode, --alpha or --clamp\n";
                return kExitUsage;
            }
            const auto j = client.call("PUT", "/v1/policy", body.dump());
            print(j, as_json, render_policy(j));
        } else if (policy->parsed()) {
            const auto j = client.call("GET", "/v1/policy");
            print(j, as_json, render_policy(j));
        } else if (complete_cmd->parsed()) {
            json body = {{"prompt", id_list(prompt_ids, "--prompt-ids")},
                         {"max_tokens", max_tokens},
                         {"stream", true},
                         {"stream_options", {{"include_usage", true}}}};
            if (temperature) body["temperature"] = *temperature;
            if (top_p) body["top_p"] = *top_p;
            if (top_k) body["top_k"] = *top_k;
            if (min_p) body["min_p"] = *min_p;
            if (seed) body["seed"] = *seed;
            if (logprobs) body["logprobs"] = *logprobs;
            if (!stop_ids.empty()) body["stop_token_ids"] = id_list(stop_ids, "--stop-ids");
            if (ignore_eos) body["ignore_eos"] = true;
            return complete(client, body, as_json);
        } else if (chat_cmd->parsed()) {
            json messages = json::array();
            if (!system_prompt.empty())
                messages.push_back({{"role", "system"}, {"content", system_prompt}});
            messages.push_back({{"role", "user"}, {"content", message}});
            json body = {{"messages", std::move(messages)},
                         {"max_tokens", chat_max_tokens},
                         {"stream", true},
                         {"stream_options", {{"include_usage", true}}}};
            if (temperature) body["temperature"] = *temperature;
            if (top_p) body["top_p"] = *top_p;
            if (seed) body["seed"] = *seed;
            if (ignore_eos) body["ignore_eos"] = true;
            if (no_thinking) body["chat_template_kwargs"] = {{"enable_thinking", false}};
            return chat(client, body, as_json);
        } else if (history->parsed()) {
            const auto j = client.call("GET", fmt::format("/v1/history?samples={}", samples));
            print(j, as_json, render_history(j));
        }
    } catch (const Failure& f) {
        std::cerr << "writescopectl: " << f.message << "\n";
        return f.code;
    }
    return kExitOk;
}
