// The profile → EngineOptions mapping: model resolution, GPU choice, budgets.
#pragma once

#include <string_view>
#include <vector>

#include "machine.hpp"
#include "profile.hpp"
#include "writescope/core/engine.hpp"

namespace writescope::daemon {

// Whether this build carries the CUDA backend (set by the build; without it, "auto" is no GPU
// and an explicit GPU index is an error).
bool build_has_cuda() noexcept;

// Builds the engine's options from a profile on a machine. Throws ProfileError naming the key
// when a value cannot be honoured (unknown preset, model directory without config.json, a GPU
// index on a build without CUDA or past the GPUs this machine has, a geometry the core rejects).
// `source` names the profile file. What could not be verified on this machine is appended to
// `unchecked` (key and why; line and column 0), when given.
EngineOptions engine_options_from_profile(const Profile& p, const MachineInfo& m,
                                          std::string_view source,
                                          std::vector<ProfileIssue>* unchecked = nullptr);

// hardware.gpu = `index` on a build with the CUDA backend, against the NVIDIA GPUs the machine
// lists (m.gpus). Throws ProfileError naming the key, the value and the number of GPUs when the
// driver is loaded and has no such GPU. Without a loaded driver the GPUs cannot be counted: the
// index is accepted and why it was not checked is appended to `unchecked` (when given); the
// engine finds out when it starts.
void check_gpu_index(int index, const MachineInfo& m, std::string_view source,
                     std::vector<ProfileIssue>* unchecked);

// p's policy.mode against the GPU the daemon runs with (gpu_index < 0: none). Throws ProfileError
// naming policy.mode when the mode sends work to a GPU and there is none.
void check_mode_gpu(const Profile& p, int gpu_index, std::string_view source);

}  // namespace writescope::daemon
