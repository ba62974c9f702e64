#include "engine_options.hpp"

#include <algorithm>
#include <filesystem>

#include <fmt/format.h>

#include "units.hpp"
#include "writescope/core/execution_mode.hpp"

namespace writescope::daemon {
namespace {

[[noreturn]] void fail(std::string_view source, std::string key, std::string message) {
    throw ProfileError(std::string(source), {{std::move(key), std::move(message), 0, 0}});
}

// A value names a directory when it could only be a path; preset names have no slash.
bool looks_like_path(const std::string& s) {
    return s.find('/') != std::string::npos || s.starts_with('.') || s.starts_with('~');
}

// The problems of `e` that have no place yet, placed where the profile wrote their key; a key
// at its default keeps none.
ProfileError placed(const Profile& p, const ProfileError& e) {
    std::vector<ProfileIssue> issues = e.issues();
    for (auto& i : issues) {
        if (i.line != 0) continue;
        if (const auto it = p.places.find(i.key); it != p.places.end()) {
            i.line = it->second.line;
            i.column = it->second.column;
        }
    }
    return ProfileError(e.source(), std::move(issues));
}

std::unique_ptr<model::Model> load_profile_model_unplaced(const Profile& p, std::string_view source,
                                                          bool headers_only) {
    const auto& src = p.model.source;
    const auto presets = model::model_preset_names();
    const bool builtin = std::find(presets.begin(), presets.end(), src) != presets.end();
    namespace fs = std::filesystem;
    std::error_code ec;
    if (!builtin && !looks_like_path(src) && !fs::is_directory(src, ec))
        fail(source, "model.source",
             fmt::format("\"{}\" is neither a built-in preset ({}) nor a model directory", src,
                         fmt::join(presets, ", ")));
    if (!builtin && !fs::is_directory(src, ec))
        fail(source, "model.source", fmt::format("model directory {} does not exist", src));
    model::ModelLoadOptions o;
    o.max_layers =
        p.model.layers < 0 ? (builtin ? Profile::Model::kAutoBuiltinLayers : 0) : p.model.layers;
    o.seed = p.model.seed;
    o.headers_only = headers_only;
    std::unique_ptr<model::Model> m;
    try {
        m = builtin ? model::make_builtin_model(src, o) : model::load_model_dir(src, o);
    } catch (const std::exception& e) {
        fail(source, "model.source", e.what());
    }
    if (p.model.layers > m->full_layers())
        fail(source, "model.layers",
             fmt::format("{} layers asked, and {} has {}", p.model.layers, src, m->full_layers()));
    return m;
}

EngineOptions engine_options_unplaced(const Profile& p, const MachineInfo& m,
                                      std::string_view source, std::vector<ProfileIssue>* unchecked,
                                      const model::KvDemand* kv_history, AutoKv* kv_auto);
void check_mode_gpu_unplaced(const Profile& p, int gpu_index, std::string_view source);

}  // namespace

void fail_at_key(const Profile& p, std::string_view source, std::string key, std::string message) {
    throw placed(p,
                 ProfileError(std::string(source), {{std::move(key), std::move(message), 0, 0}}));
}

std::unique_ptr<model::Model> load_profile_model(const Profile& p, std::string_view source,
                                                 bool headers_only) {
    try {
        return load_profile_model_unplaced(p, source, headers_only);
    } catch (const ProfileError& e) {
        throw placed(p, e);
    }
}

EngineOptions engine_options_from_profile(const Profile& p, const MachineInfo& m,
                                          std::string_view source,
                                          std::vector<ProfileIssue>* unchecked,
                                          const model::KvDemand* kv_history, AutoKv* kv_auto) {
    try {
        EngineOptions o = engine_options_unplaced(p, m, source, unchecked, kv_history, kv_auto);
        if (unchecked)
            *unchecked = placed(p, ProfileError(std::string(source), *unchecked)).issues();
        return o;
    } catch (const ProfileError& e) {
        throw placed(p, e);
    }
}

std::uint64_t model_weight_bytes(const model::Model& m) noexcept {
    // Every parameter in the model's dtype (the norms are kept in fp32, a rounding error here).
    return m.config().parameter_count() * dtype_bytes(m.config().dtype);
}

DType kv_dtype_of(const Profile& p, const model::ModelConfig& c) noexcept {
    return p.kv.dtype.value_or(c.dtype);
}

std::string gpu_unused_reason(const Profile& p, const MachineInfo& m, const EngineOptions& o) {
    if (p.hardware.gpu.choice != GpuChoice::automatic || o.gpu_index >= 0 || !build_has_cuda() ||
        m.gpus.empty())
        return {};
    return fmt::format(
        "hardware.gpu \"auto\": GPU 0 is not used for model {}: {}; the model "
        "and its KV run on the CPU",
        o.geometry.name, gpu_attention_refusal(o.geometry));
}

bool build_has_cuda() noexcept {
#if defined(WRITESCOPE_HAVE_CUDA) && WRITESCOPE_HAVE_CUDA
    return true;
#else
    return false;
#endif
}

void check_mode_gpu(const Profile& p, int gpu_index, std::string_view source) {
    try {
        check_mode_gpu_unplaced(p, gpu_index, source);
    } catch (const ProfileError& e) {
        throw placed(p, e);
    }
}

namespace {

void check_mode_gpu_unplaced(const Profile& p, int gpu_index, std::string_view source) {
    if (gpu_index < 0 && mode_needs_gpu(parse_execution_mode(p.policy.mode)))
        fail(source, "policy.mode",
             fmt::format("mode \"{}\" sends work to a GPU, and this daemon runs without one "
                         "(hardware.gpu = {}{})",
                         p.policy.mode, profile_value(p, "hardware.gpu"),
                         build_has_cuda() ? "" : "; this build has no CUDA backend"));
}

}  // namespace

void check_gpu_index(int index, const MachineInfo& m, std::string_view source,
                     std::vector<ProfileIssue>* unchecked) {
    const std::size_t found = m.gpus.size();
    if (static_cast<std::size_t>(index) < found) return;
    if (m.gpu_driver_loaded || found > 0) {
        const std::string driver =
            m.gpu_driver.empty() ? "the NVIDIA driver" : "NVIDIA driver " + m.gpu_driver;
        fail(source, "hardware.gpu",
             found == 0 ? fmt::format("GPU {} requested, but no GPU was found: {} is loaded and "
                                      "/proc/driver/nvidia/gpus lists none; use \"none\" or "
                                      "\"auto\"",
                                      index, driver)
                        : fmt::format("GPU {} requested, but {} GPU{} found ({} in "
                                      "/proc/driver/nvidia/gpus, {}); use one of those, \"none\" "
                                      "or \"auto\"",
                                      index, found, found == 1 ? " was" : "s were",
                                      found == 1 ? std::string("index 0")
                                                 : fmt::format("indices 0 to {}", found - 1),
                                      driver));
    }
    if (unchecked)
        unchecked->push_back(
            {"hardware.gpu",
             fmt::format("GPU {} not checked: no NVIDIA driver is loaded here "
                         "(/proc/driver/nvidia is missing), so the GPUs cannot be counted; the "
                         "engine checks the index when it starts",
                         index),
             0, 0});
}

namespace {

EngineOptions engine_options_unplaced(const Profile& p, const MachineInfo& m,
                                      std::string_view source, std::vector<ProfileIssue>* unchecked,
                                      const model::KvDemand* kv_history, AutoKv* kv_auto) {
    EngineOptions o;
    const auto loaded = load_profile_model(p, source, true);
    o.geometry = loaded->config().kv_geometry(kv_dtype_of(p, loaded->config()));
    if (auto e = o.geometry.validate(); !e.empty())
        fail(source, "model.source", fmt::format("geometry of {}: {}", o.geometry.name, e));
    o.block_tokens = p.kv.block_tokens;
    switch (p.hardware.gpu.choice) {
        case GpuChoice::none:
            o.gpu_index = -1;
            break;
        case GpuChoice::automatic:
            // GPU 0 where there is one and its attention kernels take the model's KV; else the
            // CPU (the boot log says why: gpu_unused_reason).
            o.gpu_index =
                build_has_cuda() && !m.gpus.empty() && gpu_attention_supports(o.geometry) ? 0 : -1;
            break;
        case GpuChoice::index:
            if (!build_has_cuda())
                fail(source, "hardware.gpu",
                     fmt::format("GPU {} requested, but this build has no CUDA backend; use "
                                 "\"none\" or \"auto\"",
                                 p.hardware.gpu.index));
            check_gpu_index(p.hardware.gpu.index, m, source, unchecked);
            o.gpu_index = p.hardware.gpu.index;
            break;
    }
    const bool auto_kv = !p.hardware.vram_kv_budget;
    o.vram_kv_bytes = o.gpu_index >= 0 ? p.hardware.vram_kv_budget.value_or(0) : 0;
    // The KV's bytes in VRAM the host budgets below are sized beyond ("auto": G's as planned).
    std::uint64_t vram_kv_held = o.vram_kv_bytes;
    if (o.gpu_index >= 0 && auto_kv) {
        AutoKvInputs in;
        in.geometry = o.geometry;
        in.block_tokens = o.block_tokens;
        in.max_batch = static_cast<std::size_t>(p.kv.max_batch);
        in.context_tokens = static_cast<std::uint64_t>(loaded->config().max_position_embeddings);
        in.experts_per_token = loaded->config().experts_per_token;
        in.num_experts = loaded->config().num_experts;
        in.vram_budget = p.hardware.vram_budget;
        const AutoKv a = plan_auto_kv(kv_history ? *kv_history : model::KvDemand{}, in);
        o.vram_kv_bytes = a.cap_bytes;
        o.vram_kv_g_blocks = a.g_blocks;
        vram_kv_held = a.g_bytes;
        if (kv_auto) *kv_auto = a;
    }
    // A GPU engine's prompt workspace is sized for the model runtime's chunk (where the daemon
    // has no GPU model runtime, its engine factory sets it back to 0: no prompt is attended on
    // the device).
    o.max_prompt_tokens = o.gpu_index >= 0 ? prefill_chunk_tokens(p, true) : 0;
    // One VRAM budget: the KV's part is inside it (the weights take what it leaves).
    if (o.gpu_index >= 0 && p.hardware.vram_budget != 0 && !auto_kv &&
        o.vram_kv_bytes > p.hardware.vram_budget)
        fail(source, "hardware.vram_kv_budget",
             fmt::format("{} is more than hardware.vram_budget ({}), which holds it: lower it, "
                         "or raise vram_budget",
                         format_size(o.vram_kv_bytes), format_size(p.hardware.vram_budget)));
    // What "auto" host budgets grant: the KV of kv.max_batch sequences that reach the model's
    // context (whole blocks), less what the GPU holds. Either host region may end up holding all
    // of the spill (the router's CPU share decides), so each gets all of it, within its cap.
    const std::uint64_t context_blocks =
        (static_cast<std::uint64_t>(loaded->config().max_position_embeddings) + o.block_tokens -
         1) /
        std::max<std::uint64_t>(o.block_tokens, 1);
    const std::uint64_t needed = static_cast<std::uint64_t>(p.kv.max_batch) * context_blocks *
                                 o.block_tokens * o.geometry.bytes_per_token();
    // At least the room the boot calibration spills into (it measures up to 128K spilled tokens
    // over both host regions and refuses to run with fewer than about 30 blocks of them): on a
    // GPU whose budget holds every sequence's KV, "auto" would otherwise grant nothing.
    constexpr std::uint64_t kCalibrationBlocks = 64;
    const std::uint64_t calibration_room =
        kCalibrationBlocks * o.block_tokens * o.geometry.bytes_per_token();
    const std::uint64_t spill =
        std::max(needed > vram_kv_held ? needed - vram_kv_held : 0, calibration_room);
    constexpr std::uint64_t kMinAutoHost = 1ull << 20;      // host_kv_budget's floor
    constexpr std::uint64_t kGpuStepPinned = 256ull << 20;  // the GPU step's own buffers
    // Without a GPU nothing streams over PCIe, so pinning host memory would only take it away
    // from everything else.
    o.pinned_kv_bytes = o.gpu_index >= 0 ? p.hardware.pinned_kv_budget.resolve(
                                               m.memory_bytes, spill + kGpuStepPinned)
                                         : 0;
    o.host_kv_bytes =
        p.hardware.host_kv_budget.resolve(m.memory_bytes, std::max(spill, kMinAutoHost));
    if (m.memory_bytes && o.pinned_kv_bytes + o.host_kv_bytes > m.memory_bytes)
        fail(source, "hardware.host_kv_budget",
             fmt::format("pinned ({}) and host ({}) KV budgets together exceed the physical "
                         "memory ({} bytes)",
                         o.pinned_kv_bytes, o.host_kv_bytes, m.memory_bytes));
    // A built-in model's random weights live in host memory beside the KV (a directory's are
    // mapped from its files and may be paged).
    const std::uint64_t weights = loaded->builtin() ? model_weight_bytes(*loaded) : 0;
    if (m.memory_bytes && weights && o.pinned_kv_bytes + o.host_kv_bytes + weights > m.memory_bytes)
        fail(source, "model.layers",
             fmt::format("{} needs {} of host memory for its generated weights, which with the "
                         "pinned ({}) and host ({}) KV budgets exceeds the physical memory ({}); "
                         "cut it to fewer layers or lower hardware.host_kv_budget",
                         loaded->description(), format_size_human(weights),
                         format_size_human(o.pinned_kv_bytes), format_size_human(o.host_kv_bytes),
                         format_size_human(m.memory_bytes)));
    o.attention_threads = p.hardware.attention_threads;
    o.pin_threads = p.hardware.pin_threads;
    o.max_batch = p.kv.max_batch;
    o.mode = p.policy.mode;
    check_mode_gpu(p, o.gpu_index, source);
    o.tracker_alpha = p.policy.tracker_alpha;
    o.tracker_clamp = p.policy.tracker_clamp;
    return o;
}

}  // namespace

}  // namespace writescope::daemon
