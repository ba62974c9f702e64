// writescope-bench experts: the CPU's MoE expert FFNs (CpuModelOps::moe, bf16 experts of the
// real shapes, random weights) at decode batch sizes, against the DRAM read bandwidth measured
// with the same thread count in the same run. Several layers' worth of experts are resident and
// the steps cycle through them, so that between two visits of a layer far more than the last
// level cache has been read: every step streams its experts from DRAM, as a model's do.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "read_bandwidth.hpp"
#include "writescope/cpu/cpu_isa.hpp"
#include "writescope/cpu/model_ops.hpp"
#include "writescope/cpu/worker_pool.hpp"

namespace writescope::bench {
namespace {

using Clock = std::chrono::steady_clock;

// The routed experts of one MoE layer (shared experts stay on the GPU: docs/design.md section 5).
struct ExpertShape {
    const char* name;
    std::size_t hidden, ffn, experts, k;
    bool renormalise;  // top-k weights renormalised (norm_topk_prob)
};
const ExpertShape kShapes[] = {
    {"qwen3-30b-a3b", 2048, 768, 128, 8, true},
    {"mixtral-8x7b", 4096, 14336, 8, 2, true},
    {"deepseek-v2-lite", 2048, 1408, 64, 6, false},
};

struct Options {
    std::size_t threads = 0;
    int iters = 30;
    std::string json;
    std::optional<cpu::Isa> isa;
    std::vector<std::string> models;
    std::vector<std::size_t> batches{1, 4, 16};
    double max_gib = 8;       // resident expert weights per model, at most
    double llc_multiple = 8;  // bytes read between two visits of a layer, in LLCs
    bool pin = true;
    bool huge_pages = false;
    std::size_t amx_min_tokens = 4;
};

void help() {
    std::fputs(
        "usage: writescope-bench experts [options]\n"
        "  Times CpuModelOps::moe over bf16 experts of the real shapes (all experts of a layer\n"
        "  resident, layers cycled so each step reads from DRAM), tokens routed as a router\n"
        "  would (softmax over logits with a per-expert popularity bias, top-k), and prints the\n"
        "  weight rate against the read bandwidth measured with the same threads.\n"
        "  --threads N       expert threads (default: every CPU of the affinity mask)\n"
        "  --iters N         timed steps per configuration, after warm-up (default 30)\n"
        "  --json FILE       also write the results as JSON\n"
        "  --isa NAME        kernel level: portable | avx2 | avx512 (default: the best)\n"
        "  --models A,B      qwen3-30b-a3b,mixtral-8x7b,deepseek-v2-lite (default: all)\n"
        "  --batches N,M     tokens per step (default 1,4,16)\n"
        "  --max-gib G       resident expert weights per model, at most (default 8)\n"
        "  --no-pin          do not pin the threads\n"
        "  --huge-pages      ask for transparent huge pages for the weights\n"
        "  --amx-min-tokens N  AMX tiles for experts with at least N tokens (0: never; 4)\n",
        stdout);
}

Options parse(int argc, char** argv) {
    Options o;
    for_each_option(argc, argv, &help, [&](const std::string& a, auto& value) {
        if (a == "--threads")
            o.threads = std::stoull(value());
        else if (a == "--iters")
            o.iters = std::max(1, std::stoi(value()));
        else if (a == "--json")
            o.json = value();
        else if (a == "--isa") {
            o.isa = cpu::parse_isa(value());
            if (!o.isa) throw std::invalid_argument("--isa: expected portable, avx2 or avx512");
        } else if (a == "--models")
            o.models = split_names(value());
        else if (a == "--batches")
            o.batches = parse_list(value());
        else if (a == "--max-gib")
            o.max_gib = std::stod(value());
        else if (a == "--no-pin")
            o.pin = false;
        else if (a == "--huge-pages")
            o.huge_pages = true;
        else if (a == "--amx-min-tokens")
            o.amx_min_tokens = std::stoull(value());
        else
            return false;
        return true;
    });
    for (const auto& m : o.models)
        if (std::none_of(std::begin(kShapes), std::end(kShapes),
                         [&](const ExpertShape& s) { return m == s.name; }))
            throw std::invalid_argument("unknown model " + m);
    for (std::size_t b : o.batches)
        if (b == 0 || b > 512) throw std::invalid_argument("--batches: 1 to 512 tokens");
    return o;
}

// One anonymous mapping, page aligned (64-byte aligned is what the read loop needs).
class Mapping {
  public:
    Mapping(std::size_t bytes, bool huge) : bytes_(bytes) {
        void* m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED)
            throw std::runtime_error("mmap of " + std::to_string(bytes) + " bytes failed");
        p_ = static_cast<char*>(m);
        if (huge) madvise(p_, bytes, MADV_HUGEPAGE);
    }
    ~Mapping() { munmap(p_, bytes_); }
    Mapping(const Mapping&) = delete;
    Mapping& operator=(const Mapping&) = delete;
    char* data() const noexcept { return p_; }
    std::size_t bytes() const noexcept { return bytes_; }

  private:
    char* p_ = nullptr;
    std::size_t bytes_ = 0;
};

// Fills with bf16 values in ±[2^-7, 2) (sign and mantissa random, small exponents): no zeros,
// NaNs or subnormals, so the kernels see data like a checkpoint's. On the pool: GiBs to fill.
void fill_bf16(cpu::WorkerPool& pool, char* p, std::size_t bytes) {
    constexpr std::size_t kChunk = std::size_t{1} << 22;
    pool.parallel_for((bytes + kChunk - 1) / kChunk, [&](std::size_t c, std::size_t) {
        std::uint64_t s = 0x9e3779b97f4a7c15ull * (c + 1);
        auto* w = reinterpret_cast<std::uint64_t*>(p + c * kChunk);
        const std::size_t words = std::min(kChunk, bytes - c * kChunk) / 8;
        for (std::size_t i = 0; i < words; ++i) {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            // Per 16-bit lane: sign (bit 15) and mantissa (bits 0-6) random, exponent 120..127.
            w[i] = (s & 0x807f807f807f807full) | 0x3c003c003c003c00ull |
                   ((s >> 7) & 0x0380038003800380ull);
        }
    });
}

std::size_t llc_bytes() {
    const long v = sysconf(_SC_LEVEL3_CACHE_SIZE);
    return v > 0 ? static_cast<std::size_t>(v) : std::size_t{32} << 20;
}

// Routing as a router makes it, for `steps` steps of n tokens: per token, softmax over logits
// drawn around a per-expert popularity bias (fixed per layer), top-k, renormalised or not.
struct StepRouting {
    std::vector<std::int32_t> expert;  // (n, k)
    std::vector<float> weight;         // (n, k)
    std::size_t distinct = 0;          // experts touched by the step
};
std::vector<StepRouting> route(const ExpertShape& s, std::size_t n, std::size_t steps,
                               std::size_t layers, std::mt19937_64& rng) {
    std::normal_distribution<double> normal(0.0, 1.0);
    std::vector<std::vector<double>> bias(layers, std::vector<double>(s.experts));
    for (auto& b : bias)
        for (auto& v : b)
            v = 1.5 * normal(rng);  // a few experts several times as popular as the median
    std::vector<StepRouting> out(steps);
    std::vector<double> p(s.experts);
    std::vector<std::int32_t> order(s.experts);
    for (std::size_t st = 0; st < steps; ++st) {
        StepRouting& r = out[st];
        r.expert.resize(n * s.k);
        r.weight.resize(n * s.k);
        std::vector<bool> seen(s.experts, false);
        for (std::size_t t = 0; t < n; ++t) {
            double mx = -1e300;
            for (std::size_t e = 0; e < s.experts; ++e) {
                p[e] = bias[st % layers][e] + normal(rng);
                mx = std::max(mx, p[e]);
            }
            double sum = 0;
            for (auto& v : p)
                sum += (v = std::exp(v - mx));
            std::iota(order.begin(), order.end(), 0);
            std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(s.k),
                              order.end(), [&](std::int32_t a, std::int32_t b) {
                                  return p[static_cast<std::size_t>(a)] >
                                         p[static_cast<std::size_t>(b)];
                              });
            double top = 0;
            for (std::size_t j = 0; j < s.k; ++j)
                top += p[static_cast<std::size_t>(order[j])];
            for (std::size_t j = 0; j < s.k; ++j) {
                const auto e = static_cast<std::size_t>(order[j]);
                r.expert[t * s.k + j] = order[j];
                r.weight[t * s.k + j] = static_cast<float>(p[e] / (s.renormalise ? top : sum));
                if (!seen[e]) ++r.distinct;
                seen[e] = true;
            }
        }
    }
    return out;
}

struct Result {
    std::string model;
    std::size_t batch = 0, threads = 0, layers = 0;
    double ms_per_step = 0;       // median
    double experts_per_step = 0;  // distinct experts touched, mean
    double bytes_per_step = 0;    // expert weight bytes read, mean
    double gbs = 0;               // weight bytes ÷ time, over all timed steps
    double read_gbs = 0;          // the measured read ceiling
    double ratio = 0;             // gbs ÷ read_gbs
};

std::string result_json(const Result& r) {
    std::ostringstream j;
    j << "{\"model\": \"" << r.model << "\", \"batch\": " << r.batch
      << ", \"threads\": " << r.threads << ", \"layers\": " << r.layers
      << ", \"ms_per_step\": " << r.ms_per_step << ", \"experts_per_step\": " << r.experts_per_step
      << ", \"weight_bytes_per_step\": " << r.bytes_per_step << ", \"gbs\": " << r.gbs
      << ", \"read_gbs\": " << r.read_gbs << ", \"ratio\": " << r.ratio << "}";
    return j.str();
}

}  // namespace

int run_experts(int argc, char** argv) {
    const Options o = parse(argc, argv);
    const cpu::Isa isa = cpu::select_isa(o.isa);
    std::vector<ExpertShape> shapes;
    for (const auto& s : kShapes)
        if (o.models.empty() ||
            std::find(o.models.begin(), o.models.end(), s.name) != o.models.end())
            shapes.push_back(s);

    cpu::WorkerPool pool({.threads = o.threads, .pin = o.pin});  // fill and the read ceiling
    const std::size_t threads = pool.concurrency();
    const std::size_t llc = llc_bytes();
    std::printf("writescope-bench experts: %s, %zu threads%s, %s kernels, LLC %.0f MiB\n",
                cpu::cpu_model_name().c_str(), threads, o.pin ? " (pinned)" : "",
                std::string(cpu::isa_name(isa)).c_str(), static_cast<double>(llc) / (1 << 20));
    std::mt19937_64 rng(20240611);
    std::vector<Result> results;
    double read_gbs = 0;
    for (const ExpertShape& s : shapes) {
        const std::size_t expert_bytes = 3 * s.hidden * s.ffn * 2;
        const std::size_t layer_bytes = s.experts * expert_bytes;
        // Layers: enough that (layers − 1) steps at batch 1 read llc_multiple LLCs, within
        // max_gib (at least one).
        const std::size_t touched_b1 = s.k * expert_bytes;
        const auto cap = static_cast<std::size_t>(o.max_gib * 1073741824.0) / layer_bytes;
        const std::size_t want = 1 + static_cast<std::size_t>(std::ceil(
                                         o.llc_multiple * static_cast<double>(llc) / touched_b1));
        const std::size_t layers = std::max<std::size_t>(1, std::min(want, cap));
        Mapping weights(layers * layer_bytes, o.huge_pages);
        fill_bf16(pool, weights.data(), weights.bytes());
        // The read ceiling over (up to 4 GiB of) the same memory, same threads, this run.
        const std::size_t probe =
            std::min<std::size_t>(weights.bytes(), std::size_t{4} << 30) / (4u << 20) * (4u << 20);
        read_gbs = measure_read_bandwidth(pool, weights.data(), probe, isa, 5);

        std::vector<std::vector<model::FfnWeights>> experts(layers);
        const std::size_t m = s.hidden * s.ffn * 2;
        for (std::size_t l = 0; l < layers; ++l)
            for (std::size_t e = 0; e < s.experts; ++e) {
                const char* base = weights.data() + l * layer_bytes + e * expert_bytes;
                experts[l].push_back({{base, DType::bf16, s.ffn, s.hidden},
                                      {base + m, DType::bf16, s.ffn, s.hidden},
                                      {base + 2 * m, DType::bf16, s.hidden, s.ffn}});
            }
        const std::size_t max_batch = *std::max_element(o.batches.begin(), o.batches.end());
        cpu::CpuModelOps ops({.threads = threads,
                              .pin = o.pin,
                              .max_tokens = max_batch,
                              .max_hidden = s.hidden,
                              .max_ffn = s.ffn,
                              .max_experts = s.experts,
                              .max_k = s.k,
                              .isa = isa,
                              .amx_min_tokens = o.amx_min_tokens});
        if (&s == &shapes.front()) std::printf("kernels: %s\n", ops.kernel_name());
        std::normal_distribution<float> normal(0.0f, 1.0f);
        std::vector<float> x(max_batch * s.hidden), y(max_batch * s.hidden, 0.0f);
        for (auto& v : x)
            v = normal(rng);
        for (std::size_t n : o.batches) {
            const std::size_t warm = std::max<std::size_t>(layers, 3);
            const std::size_t steps = warm + static_cast<std::size_t>(o.iters);
            const std::vector<StepRouting> routing = route(s, n, steps, layers, rng);
            std::vector<double> times;
            double bytes = 0, seconds = 0, distinct = 0;
            for (std::size_t st = 0; st < steps; ++st) {
                const StepRouting& r = routing[st];
                const auto t0 = Clock::now();
                ops.moe(experts[st % layers], x.data(), n, {r.expert.data(), r.weight.data(), s.k},
                        y.data());
                const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
                if (st < warm) continue;
                times.push_back(dt);
                seconds += dt;
                bytes += static_cast<double>(r.distinct * expert_bytes);
                distinct += static_cast<double>(r.distinct);
            }
            if (!std::all_of(y.begin(), y.begin() + static_cast<std::ptrdiff_t>(n * s.hidden),
                             [](float v) { return std::isfinite(v); }))
                throw std::runtime_error("moe produced a non-finite output");
            Result res;
            res.model = s.name;
            res.batch = n;
            res.threads = threads;
            res.layers = layers;
            res.ms_per_step = median(times) * 1e3;
            res.experts_per_step = distinct / o.iters;
            res.bytes_per_step = bytes / o.iters;
            res.gbs = bytes / seconds / 1e9;
            res.read_gbs = read_gbs;
            res.ratio = res.gbs / read_gbs;
            std::printf(
                "%-17s batch %2zu: %8.3f ms/step  %5.1f experts  %7.1f MB/step  %6.1f GB/s  "
                "read %5.1f GB/s  ratio %.2f  (%zu layers resident, %.1f GiB)\n",
                s.name, n, res.ms_per_step, res.experts_per_step, res.bytes_per_step / 1e6, res.gbs,
                read_gbs, res.ratio, layers, static_cast<double>(weights.bytes()) / 1073741824.0);
            std::fflush(stdout);
            results.push_back(res);
        }
    }
    if (!o.json.empty()) {
        std::ofstream f(o.json);
        if (!f) throw std::runtime_error("cannot write " + o.json);
        const std::time_t now = std::time(nullptr);
        char date[32];
        std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
        f << "{\"bench\": \"experts\", \"date\": \"" << date << "\", \"cpu\": \""
          << cpu::cpu_model_name() << "\", \"threads\": " << threads << ", \"isa\": \""
          << cpu::isa_name(isa) << "\", \"results\": [";
        for (std::size_t i = 0; i < results.size(); ++i)
            f << (i ? ",\n  " : "\n  ") << result_json(results[i]);
        f << "\n]}\n";
    }
    return 0;
}

}  // namespace writescope::bench
