// The profile → EngineOptions mapping: model resolution, GPU choice, budgets.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "auto_kv.hpp"
#include "machine.hpp"
#include "profile.hpp"
#include "writescope/core/engine.hpp"
#include "writescope/core/model/model.hpp"

namespace writescope::daemon {

// Whether this build carries the CUDA backend (set by the build; without it, "auto" is no GPU
// and an explicit GPU index is an error).
bool build_has_cuda() noexcept;
// Why hardware.gpu "auto" left the machine's GPU unused for these options (the GPU's attention
// kernels do not take the model's KV: gpu_attention_refusal); empty when it did not.
std::string gpu_unused_reason(const Profile& p, const MachineInfo& m, const EngineOptions& o);

// The model of a profile: model.source as a built-in preset or a directory, cut to model.layers
// (model.seed for a built-in one). headers_only: the config and every safetensors header,
// validated, no weights (what --check-config and every profile check read). Throws ProfileError
// naming model.source (or model.layers) with the loader's message.
std::unique_ptr<model::Model> load_profile_model(const Profile& p, std::string_view source,
                                                 bool headers_only);
// Throws ProfileError naming `key` with `message`, placed where the profile wrote the key (as
// every check of this file places its own).
[[noreturn]] void fail_at_key(const Profile& p, std::string_view source, std::string key,
                              std::string message);
// The bytes of a model's weights: its parameters in the config's dtype (what a built-in model
// generates in host memory; known from the headers alone).
std::uint64_t model_weight_bytes(const model::Model& m) noexcept;
// kv.dtype as it runs: the checkpoint's dtype for "auto".
DType kv_dtype_of(const Profile& p, const model::ModelConfig& c) noexcept;

// Builds the engine's options from a profile on a machine: the KV geometry is the model's
// (load_profile_model, headers only), in kv_dtype_of. Throws ProfileError naming the key
// when a value cannot be honoured (unknown preset, model directory without config.json, a GPU
// index on a build without CUDA or past the GPUs this machine has, a geometry the core rejects).
// `source` names the profile file. What could not be verified on this machine is appended to
// `unchecked` (key and why; line and column 0), when given.
//
// hardware.vram_kv_budget "auto" with a GPU: G is sized by plan_auto_kv from `kv_history` (the
// store's KV demand of this model; null or empty: none yet), and what it decided is written to
// `kv_auto` when given.
EngineOptions engine_options_from_profile(const Profile& p, const MachineInfo& m,
                                          std::string_view source,
                                          std::vector<ProfileIssue>* unchecked = nullptr,
                                          const model::KvDemand* kv_history = nullptr,
                                          AutoKv* kv_auto = nullptr);

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
