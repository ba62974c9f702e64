// writescoped's life: profile → socket → serving loop (signals, watchdog, timers) → boot on its
// own thread → READY=1 → ... → SIGTERM: drain, persist, exit.
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "engine_host.hpp"
#include "machine.hpp"
#include "model_host.hpp"
#include "profile.hpp"
#include "service.hpp"

namespace writescope::daemon {

inline constexpr const char* kDefaultConfigPath = "/etc/writescope/writescope.toml";

struct DaemonArgs {
    std::filesystem::path config = kDefaultConfigPath;
    bool config_given = false;             // --config: the file must exist
    std::optional<std::string> socket;     // --socket
    std::optional<std::string> state_dir;  // --state-dir
    AllocatorInfo allocator;
    EngineFactory engine_factory;
    ModelFactory model_factory;  // none: no model is served (/v1/completions answers 503)
};

struct LoadedProfile {
    Profile profile;
    std::string source;  // the file read, or "<built-in defaults>"
};

// The profile as the daemon runs it: the file (or the built-in defaults when the default path
// does not exist and --config was not given) with the command-line overrides applied. Throws
// ProfileError.
LoadedProfile load_effective_profile(const DaemonArgs& args);

// The profile checked the one way startup, --check-config and a reload all check it: the effective
// profile (above) mapped onto the engine's options on this machine.
struct CheckedProfile {
    LoadedProfile loaded;
    EngineOptions options;
    std::vector<ProfileIssue> unchecked;  // values this machine could not verify (key, why)
};
// Throws ProfileError listing the problems.
CheckedProfile check_effective_profile(const DaemonArgs& args, const MachineInfo& machine);

// Runs the daemon until it is told to stop; returns the process exit status.
int run_daemon(const DaemonArgs& args);

}  // namespace writescope::daemon
