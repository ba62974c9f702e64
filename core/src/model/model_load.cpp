// Loading a model: from a Hugging Face directory (validated headers, memory-mapped data), or
// generated (seeded random weights at the config's shapes); and saving one as a directory.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <new>
#include <set>
#include <thread>

#include "model_tensors.hpp"
#include "writescope/core/model/model.hpp"
#include "writescope/core/model/safetensors.hpp"

namespace writescope::model {
namespace {

namespace fs = std::filesystem;
using detail::TensorSlot;

std::string shape_text(const std::vector<std::int64_t>& s) {
    std::string t = "[";
    for (std::size_t i = 0; i < s.size(); ++i)
        t += (i ? ", " : "") + std::to_string(s[i]);
    return t + "]";
}

// Norm weights and biases are converted to fp32 copies the model owns: they are tiny, the
// forward pass reads them as fp32, and the checkpoint's bytes need not be aligned.
void own_vector_as_f32(Vector& v, const void* src, DType dtype, std::vector<float>& store) {
    store.resize(v.n);
    const std::size_t es = dtype_bytes(dtype);
    for (std::size_t i = 0; i < v.n; ++i) {
        const auto* p = static_cast<const unsigned char*>(src) + i * es;
        if (dtype == DType::f32) {
            std::memcpy(&store[i], p, 4);
        } else {
            std::uint16_t h;
            std::memcpy(&h, p, 2);
            store[i] = dtype == DType::bf16 ? bf16_to_f32(h) : f16_to_f32(h);
        }
    }
    v.data = store.data();
    v.dtype = DType::f32;
}

// splitmix64: a counter-based generator, so every element is a pure function of (seed, tensor,
// index) and tensors fill in parallel with the same result on any thread count.
inline std::uint64_t mix64(std::uint64_t x) noexcept {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}
// An approximately normal N(0, 1) value: the sum of four uniforms, rescaled (Irwin-Hall; the
// tails are bounded, which suits weights).
inline float normalish(std::uint64_t key) noexcept {
    const std::uint64_t r = mix64(key);
    // The four 16-bit fields summed as integers: the same value as summing them as floats (every
    // partial sum is exact in 24 bits), with one conversion instead of four.
    const auto sum = static_cast<std::uint32_t>((r & 0xffff) + ((r >> 16) & 0xffff) +
                                                ((r >> 32) & 0xffff) + (r >> 48));
    const float s = static_cast<float>(sum) * (1.0f / 65536.0f);
    return (s - 2.0f) * 1.7320508f;  // variance of the sum: 4/12
}

// Element i of a generated tensor: a pure function of the tensor's key and i.
inline float random_element(std::uint64_t key, std::size_t i, float mean, float std) noexcept {
    return mean + std * normalish(key ^ (i * 0x100000001b3ull));
}

// Elements [first, last) of a generated tensor, the loop specialised per dtype.
template <class Store>
void fill_range(std::size_t first, std::size_t last, std::uint64_t key, float mean, float std,
                Store store) {
    for (std::size_t i = first; i < last; ++i)
        store(i, random_element(key, i, mean, std));
}
void fill_range(void* dst, DType dtype, std::size_t first, std::size_t last, std::uint64_t key,
                float mean, float std) {
    switch (dtype) {
        case DType::f32:
            fill_range(first, last, key, mean, std,
                       [p = static_cast<float*>(dst)](std::size_t i, float v) { p[i] = v; });
            break;
        case DType::f16:
            fill_range(first, last, key, mean, std,
                       [p = static_cast<std::uint16_t*>(dst)](std::size_t i, float v) {
                           p[i] = f32_to_f16(v);
                       });
            break;
        case DType::bf16:
            fill_range(first, last, key, mean, std,
                       [p = static_cast<std::uint16_t*>(dst)](std::size_t i, float v) {
                           p[i] = f32_to_bf16(v);
                       });
            break;
    }
}

// One generated matrix: its buffer, dtype, size and distribution.
struct FillJob {
    void* dst;
    DType dtype;
    std::size_t n;
    std::uint64_t key;
    float mean, std;
};

// Fills every job's buffer, the chunks of all of them shared by one set of threads (a model's
// matrices are many and mostly small: Qwen3's experts are 1.5 M elements each, so a pool per
// matrix would keep two threads busy). The values do not depend on the thread count.
void fill_all(const std::vector<FillJob>& jobs, unsigned threads) {
    constexpr std::size_t chunk = std::size_t{1} << 20;
    std::vector<std::pair<std::size_t, std::size_t>> items;  // (job, chunk)
    for (std::size_t j = 0; j < jobs.size(); ++j)
        for (std::size_t c = 0; c * chunk < jobs[j].n; ++c)
            items.emplace_back(j, c);
    std::atomic<std::size_t> next{0};
    auto work = [&] {
        for (std::size_t k; (k = next.fetch_add(1, std::memory_order_relaxed)) < items.size();) {
            const FillJob& f = jobs[items[k].first];
            const std::size_t b = items[k].second * chunk;
            fill_range(f.dst, f.dtype, b, std::min(f.n, b + chunk), f.key, f.mean, f.std);
        }
    };
    threads = static_cast<unsigned>(std::min<std::size_t>(threads, items.size()));
    std::vector<std::thread> pool;
    for (unsigned t = 1; t < threads; ++t)
        pool.emplace_back(work);
    work();
    for (auto& t : pool)
        t.join();
}

std::uint64_t name_hash(const std::string& s) noexcept {
    std::uint64_t h = 0xcbf29ce484222325ull;
    for (unsigned char ch : s)
        h = (h ^ ch) * 0x100000001b3ull;
    return h;
}

class LoadedModel final : public Model {
  public:
    // The directory's mapped files (null for a generated model) and the generated buffers.
    std::unique_ptr<WeightFiles> files;
    // Each generated matrix in pages of its own: the GPU runtime page-locks host-resident
    // experts widened to whole pages (CudaModelOps::pin_host), and a page it locks must hold
    // nothing else, or copies of that other object across the bus would straddle a locked range.
    struct PageFree {
        void operator()(std::byte* p) const noexcept { std::free(p); }
    };
    std::vector<std::unique_ptr<std::byte, PageFree>> buffers;
    std::map<const Vector*, std::vector<float>> vectors;

    void finish(const std::vector<TensorSlot>& slots) {
        weight_bytes_ = 0;
        for (const auto& s : slots)
            weight_bytes_ += s.matrix ? s.matrix->bytes() : s.vector->n * 4;
        if (config_.tie_word_embeddings) weights_.lm_head = weights_.embed;
    }
    friend std::unique_ptr<Model> load_model_dir(const fs::path&, const ModelLoadOptions&);
    friend std::unique_ptr<Model> make_random_model(const ModelConfig&, std::uint64_t, double);
    friend std::unique_ptr<Model> make_builtin_model(std::string_view, const ModelLoadOptions&);
    void set_identity(std::string desc, bool builtin, int full_layers) {
        description_ = std::move(desc);
        builtin_ = builtin;
        full_layers_ = full_layers;
    }
    ModelConfig& mutable_config() { return config_; }
    ModelWeights& mutable_weights() { return weights_; }
};

// `bytes` (uninitialised) in whole pages of their own (LoadedModel::buffers says why).
std::unique_ptr<std::byte, LoadedModel::PageFree> page_buffer(std::size_t bytes) {
    constexpr std::size_t kPage = 4096;
    std::unique_ptr<std::byte, LoadedModel::PageFree> buf(static_cast<std::byte*>(
        std::aligned_alloc(kPage, std::max(kPage, (bytes + kPage - 1) / kPage * kPage))));
    if (!buf) throw std::bad_alloc();
    return buf;
}

int cut_layers(const ModelConfig& c, int max_layers) {
    return max_layers > 0 ? std::min(max_layers, c.num_layers) : c.num_layers;
}

}  // namespace

std::unique_ptr<Model> load_model_dir(const fs::path& dir, const ModelLoadOptions& opts) {
    std::error_code ec;
    if (!fs::is_directory(dir, ec))
        throw ModelFileError(dir.string() +
                             ": not a directory (a model directory holds "
                             "config.json and *.safetensors)");
    ModelConfig cfg = read_model_config(dir.string());
    WeightFilesOptions wo;
    wo.map_data = !opts.headers_only;
    auto files = std::make_unique<WeightFiles>(WeightFiles::open_dir(dir, wo));

    auto m = std::make_unique<LoadedModel>();
    const int full = cfg.num_layers;
    // Validate every layer's tensors against the full config, then keep the first `layers`.
    ModelWeights all;
    const auto every = detail::tensor_slots(cfg, all, full);
    std::set<std::string, std::less<>> expected;
    for (const auto& s : every) {
        expected.insert(s.name);
        const TensorEntry* t = files->find(s.name);
        if (!t)
            throw ModelFileError(dir.string() + ": tensor " + s.name +
                                 " is missing (config.json describes a " + cfg.model_type +
                                 " model that has it)");
        if (t->shape != s.shape)
            throw ModelFileError(files->file_of(*t).string() + ": tensor " + s.name + ": shape " +
                                 shape_text(t->shape) + ", but config.json implies " +
                                 shape_text(s.shape));
    }
    std::vector<std::string> unexpected;
    for (const auto& t : files->tensors()) {
        if (expected.count(t.name)) continue;
        // Old checkpoints carry the rotary tables as buffers; they are recomputed here.
        if (t.name.ends_with(".rotary_emb.inv_freq")) continue;
        if (cfg.tie_word_embeddings && t.name == "lm_head.weight") continue;
        unexpected.push_back(t.name);
    }
    if (!unexpected.empty()) {
        const TensorEntry* t = files->find(unexpected.front());
        std::string msg = files->file_of(*t).string() + ": tensor " + unexpected.front() +
                          " is not part of the " + cfg.model_type + " model config.json describes";
        if (unexpected.size() > 1)
            msg += " (and " + std::to_string(unexpected.size() - 1) + " more unexpected tensors)";
        throw ModelFileError(msg);
    }

    const int layers = cut_layers(cfg, opts.max_layers);
    cfg.num_layers = layers;
    m->mutable_config() = cfg;
    const auto slots = detail::tensor_slots(cfg, m->mutable_weights(), layers);
    for (const auto& s : slots) {
        const TensorEntry* t = files->find(s.name);
        if (s.matrix) {
            s.matrix->dtype = t->dtype;  // headers only too: weight_bytes() counts the file's
            s.matrix->data = t->data;    // null without data
            if (opts.copy_data && t->data) {
                const std::size_t bytes = s.matrix->bytes();
                auto buf = page_buffer(bytes);
                std::memcpy(buf.get(), t->data, bytes);
                s.matrix->data = buf.get();
                m->buffers.push_back(std::move(buf));
            }
        } else if (!opts.headers_only) {
            own_vector_as_f32(*s.vector, t->data, t->dtype, m->vectors[s.vector]);
        }
    }
    m->finish(slots);
    std::string desc =
        dir.string() + " (" + cfg.model_type + ", " + std::string(dtype_name(cfg.dtype)) + ")";
    if (layers < full)
        desc += ", " + std::to_string(layers) + " of " + std::to_string(full) + " layers";
    m->set_identity(desc, false, full);
    m->files = std::move(files);
    return m;
}

std::unique_ptr<Model> make_random_model(const ModelConfig& config, std::uint64_t seed,
                                         double std) {
    if (const std::string e = config.validate(); !e.empty())
        throw ModelConfigError("model " + config.name + ": " + e);
    auto m = std::make_unique<LoadedModel>();
    m->mutable_config() = config;
    const auto slots =
        detail::tensor_slots(m->mutable_config(), m->mutable_weights(), config.num_layers);
    std::vector<FillJob> jobs;
    for (const auto& s : slots) {
        const std::uint64_t key = mix64(seed ^ name_hash(s.name));
        if (s.matrix) {
            const std::size_t n = s.matrix->rows * s.matrix->cols;
            // Not zeroed first: every element is generated (a serial memset of each tensor
            // took as long as filling it).
            auto buf = page_buffer(n * dtype_bytes(config.dtype));
            // Embeddings are N(0, 1) so the first norm sees unit-scale rows; everything else
            // uses the init's std.
            const bool embed = s.name == "model.embed_tokens.weight";
            jobs.push_back(
                {buf.get(), config.dtype, n, key, 0.0f, embed ? 1.0f : static_cast<float>(std)});
            s.matrix->data = buf.get();
            s.matrix->dtype = config.dtype;
            m->buffers.push_back(std::move(buf));
        } else {
            auto& store = m->vectors[s.vector];
            store.resize(s.vector->n);
            const float mean = s.is_norm ? 1.0f : 0.0f;
            const float sd = s.is_norm ? 0.1f : static_cast<float>(std);
            // Rounded to the model's dtype, as a checkpoint in that dtype would hold them.
            for (std::size_t i = 0; i < store.size(); ++i) {
                float v = random_element(key, i, mean, sd);
                if (config.dtype == DType::bf16) v = bf16_to_f32(f32_to_bf16(v));
                if (config.dtype == DType::f16) v = f16_to_f32(f32_to_f16(v));
                store[i] = v;
            }
            s.vector->data = store.data();
            s.vector->dtype = DType::f32;
        }
    }
    fill_all(jobs, std::max(1u, std::thread::hardware_concurrency()));
    m->finish(slots);
    m->set_identity(config.name + " (random weights, seed " + std::to_string(seed) + ")", true,
                    config.num_layers);
    return m;
}

std::unique_ptr<Model> make_builtin_model(std::string_view preset, const ModelLoadOptions& opts) {
    std::optional<ModelConfig> cfg = model_preset(preset);
    if (!cfg) {
        std::string names;
        for (const auto& n : model_preset_names())
            names += (names.empty() ? "" : ", ") + n;
        throw ModelConfigError("no built-in model \"" + std::string(preset) + "\" (" + names + ")");
    }
    const int full = cfg->num_layers;
    cfg->num_layers = cut_layers(*cfg, opts.max_layers);
    std::unique_ptr<Model> m;
    if (opts.headers_only) {
        auto lm = std::make_unique<LoadedModel>();
        lm->mutable_config() = *cfg;
        const auto slots = detail::tensor_slots(*cfg, lm->mutable_weights(), cfg->num_layers);
        for (const auto& s : slots)
            if (s.matrix) s.matrix->dtype = cfg->dtype;
        lm->finish(slots);
        m = std::move(lm);
    } else {
        m = make_random_model(*cfg, opts.seed);
    }
    auto* lm = static_cast<LoadedModel*>(m.get());
    std::string desc =
        std::string(preset) + " (built-in, random weights seed " + std::to_string(opts.seed);
    if (cfg->num_layers < full)
        desc += ", " + std::to_string(cfg->num_layers) + " of " + std::to_string(full) + " layers";
    lm->set_identity(desc + ")", true, full);
    return m;
}

OpLimits op_limits(const ModelConfig& c) noexcept {
    const auto z = [](int v) { return static_cast<std::size_t>(std::max(v, 0)); };
    OpLimits l;
    l.max_ffn = std::max({z(c.intermediate_size), z(c.moe_intermediate_size), z(c.shared_width())});
    l.max_cols = std::max({z(c.hidden_size), z(c.num_heads) * z(c.head_dim), l.max_ffn});
    if (c.mla())
        l.max_cols = std::max({l.max_cols, z(c.num_heads) * z(c.v_head_dim), z(c.q_lora_rank),
                               z(c.kv_lora_rank), z(c.qk_nope_head_dim)});
    l.max_experts = std::max<std::size_t>(1, z(c.num_experts));
    l.max_k = std::max<std::size_t>(1, z(c.experts_per_token));
    return l;
}

std::uint64_t largest_expert_bytes(const ModelWeights& w) noexcept {
    std::uint64_t most = 0;
    for (const LayerWeights& L : w.layers)
        for (const FfnWeights& f : L.experts)
            most = std::max<std::uint64_t>(most, f.bytes());
    return most;
}

void save_model_dir(const Model& model, const fs::path& dir) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) throw ModelFileError(dir.string() + ": cannot be created: " + ec.message());
    const ModelConfig& c = model.config();
    // A copy of the views, listed without resetting them: each slot points at the copy's field,
    // which holds the model's data pointer.
    ModelWeights views = model.weights();
    const auto slots = detail::tensor_slots(c, views, c.num_layers, /*reset=*/false);
    std::vector<std::vector<std::byte>> converted;
    converted.reserve(slots.size());
    std::vector<TensorToWrite> out;
    for (const auto& s : slots) {
        TensorToWrite t;
        t.name = s.name;
        t.shape = s.shape;
        if (s.matrix) {
            if (!s.matrix->data)
                throw ModelFileError(dir.string() + ": tensor " + s.name + " has no data to save");
            t.data = s.matrix->data;
            t.dtype = s.matrix->dtype;
        } else {
            const Vector& v = *s.vector;
            if (!v.data)
                throw ModelFileError(dir.string() + ": tensor " + s.name + " has no data to save");
            // Vectors are held as fp32; they are saved in the model's dtype.
            std::vector<std::byte> buf(v.n * dtype_bytes(c.dtype));
            for (std::size_t i = 0; i < v.n; ++i)
                store_from_f32(buf.data(), i, c.dtype, load_as_f32(v.data, i, v.dtype));
            converted.push_back(std::move(buf));
            t.data = converted.back().data();
            t.dtype = c.dtype;
        }
        out.push_back(std::move(t));
    }
    write_safetensors(dir / "model.safetensors", out, {{"format", "pt"}});
    std::ofstream cfg(dir / "config.json", std::ios::binary | std::ios::trunc);
    cfg << model_config_json(c);
    if (!cfg) throw ModelFileError((dir / "config.json").string() + ": cannot be written");
}

}  // namespace writescope::model
