// The profile → EngineOptions mapping: model resolution, GPU choice, budgets.
#pragma once

#include "machine.hpp"
#include "profile.hpp"
#include "writescope/core/engine.hpp"

namespace writescope::daemon {

// Whether this build carries the CUDA backend (set by the build; without it, "auto" is no GPU
// and an explicit GPU index is an error).
bool build_has_cuda() noexcept;

// Builds the engine's options from a profile on a machine. Throws ProfileError naming the key
// when a value cannot be honoured (unknown preset, model directory without config.json, a GPU
// index on a build without CUDA, a geometry the core rejects). `source` names the profile file.
EngineOptions engine_options_from_profile(const Profile& p, const MachineInfo& m,
                                          std::string_view source);

}  // namespace writescope::daemon
