// writescope-bench cpu-attention: decode attention over packed (U) KV on the CPU, against the
// DRAM read bandwidth measured with the same threads in the same run.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "bench_util.hpp"
#include "read_bandwidth.hpp"
#include "writescope/core/kv_geometry.hpp"
#include "writescope/cpu/attention.hpp"
#include "writescope/cpu/cpu_isa.hpp"
#include "writescope/cpu/worker_pool.hpp"

namespace writescope::bench {
namespace {

using Clock = std::chrono::steady_clock;

struct Options {
    std::size_t threads = 0;  // 0: every CPU of the affinity mask
    bool quick = false;
    std::string json;
    std::optional<cpu::Isa> isa;
    int reps = 7;
    std::size_t block_tokens = 128;
    bool pin = true;
    bool prefetch = true;
    std::size_t items_per_worker = 4;
    std::vector<std::string> models;
    std::vector<std::size_t> tokens;
    std::vector<std::size_t> batches;
    bool hot = true;
    std::size_t hot_kib = 1024;  // KV per call of the cache-resident point
    bool scaling = false;
    bool bf16_dot = false;
    bool amx = true;
    bool amx_pv = false;
    bool amx_pv_mla = true;
    bool huge_pages = true;
};

void usage(std::FILE* f) {
    std::fputs(
        "usage: writescope-bench cpu-attention [options]\n"
        "  Measures the multi-threaded DRAM read bandwidth, then times CPU decode attention\n"
        "  (one layer, bf16 KV in the packed U layout) and prints its KV rate against it.\n"
        "  --threads N          worker threads (default: every CPU of the affinity mask)\n"
        "  --quick              small sizes (seconds on a 2-core machine)\n"
        "  --json FILE          also write the results as JSON\n"
        "  --isa NAME           kernel level: portable | avx2 | avx512 (default: the best)\n"
        "  --reps N             timed repetitions per point, after a warm-up (default 7)\n"
        "  --block-tokens N     tokens per KV block (default 128)\n"
        "  --models A,B         presets (default: qwen3-30b-a3b,mixtral-8x7b,deepseek-v2-lite)\n"
        "  --tokens N,M         context lengths (default 8192,32768,131072; quick 1024,4096)\n"
        "  --batches N,M        batch sizes (default 1,16; quick 1,4)\n"
        "  --no-pin             do not pin the worker threads\n"
        "  --no-prefetch        no software prefetch of the next block\n"
        "  --items-per-worker N work items per worker (default 4)\n"
        "  --bf16-dot           Q·K with vdpbf16ps instead of widening + FMA\n"
        "  --no-amx             no AMX-BF16 tiles (default: Q·K on them where present, group >= "
        "8)\n"
        "  --amx-pv             P·V on AMX tiles too (default: for MLA only)\n"
        "  --no-amx-pv          P·V on FMAs for every model, MLA included\n"
        "  --no-huge-pages      do not ask for transparent huge pages for the KV buffer\n"
        "  --no-hot             skip the cache-resident (compute-bound) single-thread rates\n"
        "  --hot-kib N          KV per call of the cache-resident point (default 1024: inside\n"
        "                       L2; larger calls weigh the per-item costs less)\n"
        "  --scaling            also sweep thread counts (bandwidth and qwen3 at 32K)\n",
        f);
}

std::vector<std::string> split(std::string_view s) {
    std::vector<std::string> out;
    std::size_t start = 0;
    while (start <= s.size()) {
        const std::size_t comma = s.find(',', start);
        const std::size_t end = comma == std::string_view::npos ? s.size() : comma;
        if (end > start) out.emplace_back(s.substr(start, end - start));
        start = end + 1;
    }
    return out;
}

std::vector<std::size_t> split_sizes(std::string_view s) {
    std::vector<std::size_t> out;
    for (const auto& x : split(s)) {
        char* end = nullptr;
        const unsigned long long v = std::strtoull(x.c_str(), &end, 10);
        if (!end || *end || v == 0) throw std::invalid_argument("not a positive number: " + x);
        out.push_back(static_cast<std::size_t>(v));
    }
    return out;
}

Options parse(int argc, char** argv) {
    Options o;
    auto value = [&](int& i) -> std::string {
        if (i + 1 >= argc) throw std::invalid_argument(std::string(argv[i]) + " needs a value");
        return argv[++i];
    };
    for (int i = 0; i < argc; ++i) {
        const std::string_view a = argv[i];
        if (a == "--threads") {
            o.threads = split_sizes(value(i)).at(0);
        } else if (a == "--quick") {
            o.quick = true;
        } else if (a == "--json") {
            o.json = value(i);
        } else if (a == "--isa") {
            const std::string v = value(i);
            o.isa = cpu::parse_isa(v);
            if (!o.isa) throw std::invalid_argument("--isa: expected portable, avx2 or avx512");
        } else if (a == "--reps") {
            o.reps = static_cast<int>(split_sizes(value(i)).at(0));
        } else if (a == "--block-tokens") {
            o.block_tokens = split_sizes(value(i)).at(0);
        } else if (a == "--models") {
            o.models = split(value(i));
        } else if (a == "--tokens") {
            o.tokens = split_sizes(value(i));
        } else if (a == "--batches") {
            o.batches = split_sizes(value(i));
        } else if (a == "--no-pin") {
            o.pin = false;
        } else if (a == "--no-prefetch") {
            o.prefetch = false;
        } else if (a == "--items-per-worker") {
            o.items_per_worker = split_sizes(value(i)).at(0);
        } else if (a == "--no-hot") {
            o.hot = false;
        } else if (a == "--hot-kib") {
            o.hot_kib = split_sizes(value(i)).at(0);
        } else if (a == "--scaling") {
            o.scaling = true;
        } else if (a == "--bf16-dot") {
            o.bf16_dot = true;
        } else if (a == "--no-amx") {
            o.amx = false;
        } else if (a == "--amx-pv") {
            o.amx_pv = true;
        } else if (a == "--no-amx-pv") {
            o.amx_pv = o.amx_pv_mla = false;
        } else if (a == "--no-huge-pages") {
            o.huge_pages = false;
        } else if (a == "--help" || a == "-h") {
            usage(stdout);
            std::exit(0);
        } else {
            throw std::invalid_argument("unknown option " + std::string(a));
        }
    }
    if (o.models.empty()) o.models = kv_geometry_preset_names();
    if (o.tokens.empty())
        o.tokens = o.quick ? std::vector<std::size_t>{1024, 4096}
                           : std::vector<std::size_t>{8192, 32768, 131072};
    if (o.batches.empty())
        o.batches = o.quick ? std::vector<std::size_t>{1, 4} : std::vector<std::size_t>{1, 16};
    if (o.quick) o.reps = std::min(o.reps, 3);
    return o;
}

// One anonymous mapping, 2 MiB aligned; transparent huge pages on request (fewer TLB misses on a
// multi-GiB scan, but on some virtual machines first touch becomes several times slower and no
// huge page is delivered, so they are opt-in).
struct Buffer {
    char* p = nullptr;
    std::size_t bytes = 0;
    Buffer(std::size_t n, bool huge) : bytes((n + (2u << 20) - 1) / (2u << 20) * (2u << 20)) {
        void* m = mmap(nullptr, bytes + (2u << 20), PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED)
            throw std::runtime_error("mmap of " + std::to_string(bytes) + " bytes failed");
        base_ = m;
        const auto a = (reinterpret_cast<std::uintptr_t>(m) + (2u << 20) - 1) &
                       ~std::uintptr_t{(2u << 20) - 1};
        p = reinterpret_cast<char*>(a);
        if (huge) madvise(p, bytes, MADV_HUGEPAGE);
    }
    ~Buffer() { munmap(base_, bytes + (2u << 20)); }
    Buffer(const Buffer&) = delete;
    Buffer& operator=(const Buffer&) = delete;

  private:
    void* base_ = nullptr;
};

// Random bf16 values in ±[2^-7, 2): sign and 7 mantissa bits random, exponent 120..127. Never
// zero, never NaN or Inf, so timing sees real data.
std::uint64_t random_bf16x4(std::uint64_t& s) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    const std::uint64_t r = s * 0x2545f4914f6cdd1dull;
    const std::uint64_t exps = (((r >> 7) & 0x0007000700070007ull) + 0x0078007800780078ull) << 7;
    return (r & 0x807f807f807f807full) | exps;
}

void fill_random(cpu::WorkerPool& pool, char* p, std::size_t bytes, std::uint64_t seed) {
    constexpr std::size_t kSlice = std::size_t{16} << 20;
    const std::size_t n = (bytes + kSlice - 1) / kSlice;
    pool.parallel_for(n, [&](std::size_t i, std::size_t) {
        std::uint64_t s = seed ^ (0x9e3779b97f4a7c15ull * (i + 1));
        auto* w = reinterpret_cast<std::uint64_t*>(p + i * kSlice);
        const std::size_t words = std::min(kSlice, bytes - i * kSlice) / 8;
        for (std::size_t k = 0; k < words; ++k)
            w[k] = random_bf16x4(s);
    });
}

std::string read_first_line(const char* path) {
    std::ifstream in(path);
    std::string line;
    std::getline(in, line);
    return line.empty() ? "unavailable" : line;
}

struct Result {
    std::string model;
    std::string qk;  // the Q·K route: amx, dot (vdpbf16ps) or fma
    std::size_t tokens = 0, batch = 0, threads = 0;
    double kv_bytes = 0;  // KV bytes of one layer scanned per call
    double seconds = 0;   // median time per call (one layer)
    double gbs = 0;       // kv_bytes / seconds / 1e9
    double best_gbs = 0;  // kv_bytes / the fastest call / 1e9 (steadier on a shared host)
    double ratio = 0;     // gbs / measured read bandwidth
    int reps = 0;
};

// Times CpuAttention over `batch` sequences of `tokens` tokens of packed bf16 KV placed in the
// buffer: blocks in a shuffled order (as a block pool hands them out), and each repetition on a
// fresh region of the buffer while the buffer allows, so no repetition finds its KV in a cache.
Result time_attention(cpu::WorkerPool& pool, const KvGeometry& g, const Options& o, Buffer& buf,
                      std::size_t tokens, std::size_t batch, int reps, bool rotate,
                      std::mt19937_64& rng) {
    cpu::CpuAttentionOptions ao;
    ao.isa = o.isa;
    ao.max_seqs = batch;
    ao.prefetch = o.prefetch;
    ao.items_per_worker = o.items_per_worker;
    ao.bf16_dot_product = o.bf16_dot;
    ao.amx = o.amx;
    ao.amx_pv = o.amx_pv;
    ao.amx_pv_mla = o.amx_pv_mla;
    cpu::CpuAttention attn(g, o.block_tokens, pool, ao);
    const std::size_t B = o.block_tokens;
    const std::size_t per_seq = (tokens + B - 1) / B;
    const std::size_t nblocks = batch * per_seq;
    const std::size_t block_bytes = attn.packed_block_bytes();
    const std::size_t region = nblocks * block_bytes;
    if (region > buf.bytes) throw std::runtime_error("buffer too small");
    const std::size_t regions = rotate ? buf.bytes / region : 1;

    std::vector<std::size_t> slot(nblocks);
    std::iota(slot.begin(), slot.end(), std::size_t{0});
    std::shuffle(slot.begin(), slot.end(), rng);

    const std::size_t es = dtype_bytes(g.dtype);
    // The queries: (batch, q heads, head_dim_k) bf16, random, in 64-bit words.
    std::vector<std::uint64_t> q((batch * g.num_q_heads * g.head_dim_k * es + 7) / 8);
    std::uint64_t s = rng() | 1;
    for (auto& w : q)
        w = random_bf16x4(s);

    std::vector<cpu::AttnBlock> blocks(nblocks);
    std::vector<cpu::AttnSeq> seqs(batch);
    const std::size_t q_bytes = g.num_q_heads * g.head_dim_k * es;
    for (std::size_t b = 0; b < batch; ++b)
        seqs[b] = {reinterpret_cast<const char*>(q.data()) + b * q_bytes,
                   {blocks.data() + b * per_seq, per_seq}};
    auto place = [&](std::size_t r) {
        char* base = buf.p + (r % regions) * region;
        for (std::size_t b = 0; b < batch; ++b)
            for (std::size_t i = 0; i < per_seq; ++i) {
                const std::size_t k = b * per_seq + i;
                const std::size_t n = std::min(B, tokens - i * B);
                blocks[k] = {base + slot[k] * block_bytes, static_cast<std::uint32_t>(n), true};
            }
    };
    const std::size_t rows = batch * g.num_q_heads;
    std::vector<float> out_o(rows * g.head_dim_v), out_lse(rows);  // (rows, dv), (rows) fp32
    const StateView out{out_o.data(), out_lse.data(), rows, static_cast<std::size_t>(g.head_dim_v)};

    place(0);
    auto t0 = Clock::now();
    attn.run(seqs, out);  // warm-up: page faults, caches of the planner, frequency
    const double warm = std::chrono::duration<double>(Clock::now() - t0).count();
    // Short points get more repetitions (up to ~0.3 s of them), for a stable median.
    const int n_reps = std::max(reps, std::min(200, static_cast<int>(0.3 / std::max(warm, 1e-6))));
    std::vector<double> times;
    for (int r = 0; r < n_reps; ++r) {
        place(static_cast<std::size_t>(r) + 1);
        t0 = Clock::now();
        attn.run(seqs, out);
        times.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    for (float x : out_lse)
        if (!std::isfinite(x)) throw std::runtime_error("attention produced a non-finite lse");

    Result res;
    res.model = g.name;
    res.tokens = tokens;
    res.batch = batch;
    res.threads = pool.concurrency();
    res.kv_bytes = static_cast<double>(batch * tokens * g.bytes_per_token_layer());
    res.seconds = median(times);
    res.gbs = res.kv_bytes / res.seconds / 1e9;
    res.best_gbs = res.kv_bytes / *std::min_element(times.begin(), times.end()) / 1e9;
    res.reps = n_reps;
    res.qk = attn.uses_amx() ? (attn.uses_amx_pv() ? "amx+pv" : "amx") : o.bf16_dot ? "dot" : "fma";
    return res;
}

// Checks the configured kernel against the portable one on a small random batch (the benchmark
// must not time a kernel that computes something else): returns max |Δo| / max |o|.
double verify(cpu::WorkerPool& pool, const KvGeometry& g, const Options& o, std::mt19937_64& rng) {
    const std::size_t B = o.block_tokens, batch = 2, tokens = 5 * B + B / 2 + 1;
    const std::size_t per_seq = (tokens + B - 1) / B;
    cpu::CpuAttentionOptions ao;
    ao.isa = o.isa;
    ao.bf16_dot_product = o.bf16_dot;
    ao.amx = o.amx;
    ao.amx_pv = o.amx_pv;
    ao.amx_pv_mla = o.amx_pv_mla;
    cpu::CpuAttention fast(g, B, pool, ao);
    cpu::CpuAttentionOptions po;
    po.isa = cpu::Isa::portable;
    cpu::CpuAttention ref(g, B, pool, po);
    const std::size_t bb = fast.packed_block_bytes();
    // KV: (batch × per_seq) packed bf16 blocks; queries: (batch, q heads, dk) bf16.
    std::vector<std::uint64_t> kv((batch * per_seq * bb + 7) / 8),
        q((batch * g.num_q_heads * g.head_dim_k * 2 + 7) / 8);
    std::uint64_t s = rng() | 1;
    for (auto& w : kv)
        w = random_bf16x4(s);
    for (auto& w : q)
        w = random_bf16x4(s);
    std::vector<cpu::AttnBlock> blocks(batch * per_seq);
    std::vector<cpu::AttnSeq> seqs(batch);
    for (std::size_t b = 0; b < batch; ++b) {
        for (std::size_t i = 0; i < per_seq; ++i)
            blocks[b * per_seq + i] = {
                reinterpret_cast<const char*>(kv.data()) + (b * per_seq + i) * bb,
                static_cast<std::uint32_t>(std::min(B, tokens - i * B)), true};
        seqs[b] = {reinterpret_cast<const char*>(q.data()) + b * g.num_q_heads * g.head_dim_k * 2,
                   {blocks.data() + b * per_seq, per_seq}};
    }
    const std::size_t rows = batch * g.num_q_heads, dv = g.head_dim_v;
    std::vector<float> o1(rows * dv), l1(rows), o2(rows * dv), l2(rows);
    fast.run(seqs, {o1.data(), l1.data(), rows, dv});
    ref.run(seqs, {o2.data(), l2.data(), rows, dv});
    double num = 0, den = 0;
    for (std::size_t i = 0; i < o1.size(); ++i) {
        num = std::max(num, static_cast<double>(std::abs(o1[i] - o2[i])));
        den = std::max(den, static_cast<double>(std::abs(o2[i])));
    }
    for (std::size_t i = 0; i < rows; ++i)
        num = std::max(num, std::abs(static_cast<double>(l1[i]) - l2[i]) * den /
                                std::max(1.0, std::abs(static_cast<double>(l2[i]))));
    return std::isfinite(num) ? num / den : 1.0;
}

std::string json_escape(const std::string& s) {
    std::string o;
    for (char c : s) {
        if (c == '"' || c == '\\') o += '\\';
        if (static_cast<unsigned char>(c) < 0x20) continue;
        o += c;
    }
    return o;
}

std::string result_json(const Result& r) {
    std::ostringstream j;
    j << "{\"model\": \"" << json_escape(r.model) << "\", \"qk\": \"" << r.qk
      << "\", \"tokens\": " << r.tokens << ", \"batch\": " << r.batch
      << ", \"threads\": " << r.threads
      << ", \"kv_bytes\": " << static_cast<std::uint64_t>(r.kv_bytes)
      << ", \"ms_per_layer\": " << r.seconds * 1e3 << ", \"gbs\": " << r.gbs
      << ", \"fastest_call_gbs\": " << r.best_gbs << ", \"ratio_to_read_bw\": " << r.ratio
      << ", \"reps\": " << r.reps << "}";
    return j.str();
}

}  // namespace

int run_cpu_attention(int argc, char** argv) {
    Options o;
    try {
        o = parse(argc, argv);
    } catch (const std::exception& e) {
        std::fprintf(stderr, "cpu-attention: %s\n", e.what());
        usage(stderr);
        return 2;
    }
    const cpu::Isa isa = cpu::select_isa(o.isa);
    const auto cpus = cpu::WorkerPool::allowed_cpus();
    cpu::WorkerPoolOptions po;
    po.threads = o.threads ? o.threads : cpus.size();
    po.pin = o.pin;
    cpu::WorkerPool pool(po);
    const std::uint64_t seed = std::random_device{}();
    std::mt19937_64 rng(seed);

    char date[64];
    const std::time_t now = std::time(nullptr);
    std::strftime(date, sizeof date, "%Y-%m-%d %H:%M:%S %Z", std::localtime(&now));
    const std::string thp = read_first_line("/sys/kernel/mm/transparent_hugepage/enabled");
    std::printf("writescope-bench cpu-attention (%s)\n", date);
    std::printf("machine   : %s, %zu CPUs online to this process\n", cpu::cpu_model_name().c_str(),
                cpus.size());
    std::printf(
        "kernel    : %s (best on this CPU: %s), block %zu tokens, bf16 KV, packed layout, "
        "Q.K by %s, prefetch %s, %zu items per worker\n",
        std::string(cpu::isa_name(isa)).c_str(),
        std::string(cpu::isa_name(cpu::detected_isa())).c_str(), o.block_tokens,
        o.amx && cpu::amx_bf16_available()
            ? (o.amx_pv       ? "AMX tiles where group >= 8, P.V too"
               : o.amx_pv_mla ? "AMX tiles where group >= 8, P.V too for MLA"
                              : "AMX tiles where group >= 8")
        : o.bf16_dot ? "vdpbf16ps"
                     : "widening + FMA",
        o.prefetch ? "on" : "off", o.items_per_worker);
    std::printf("threads   : %zu (caller included), pinned %zu of %zu pool threads%s%s\n",
                pool.concurrency(), pool.pin_report().pinned, pool.pin_report().requested,
                pool.pin_report().error.empty() ? "" : ": ", pool.pin_report().error.c_str());
    std::printf("huge pages: %s (system: %s)\n",
                o.huge_pages ? "asked for (madvise)" : "not asked for", thp.c_str());
    std::printf("seed      : %llu\n", static_cast<unsigned long long>(seed));

    // The buffer holds the largest point (and rotation room for the smaller ones).
    std::vector<KvGeometry> geos;
    std::size_t largest = 0;
    for (const auto& name : o.models) {
        auto g = kv_geometry_preset(name, DType::bf16);
        if (!g) {
            std::fprintf(stderr, "cpu-attention: unknown model preset %s\n", name.c_str());
            return 2;
        }
        geos.push_back(*g);
        for (std::size_t t : o.tokens)
            for (std::size_t b : o.batches)
                largest = std::max(largest, b * ((t + o.block_tokens - 1) / o.block_tokens) *
                                                o.block_tokens * g->bytes_per_token_layer());
    }
    if (o.scaling)  // the sweep's largest point: qwen3, 16 × 32768 tokens
        largest =
            std::max(largest, 16 * std::size_t{32768} *
                                  kv_geometry_preset("qwen3-30b-a3b")->bytes_per_token_layer());
    // Far larger than the caches: 4 GiB; quick: 768 MiB (still 3x the 260 MiB L3 of the
    // largest Xeons).
    const std::size_t bw_bytes = o.quick ? (std::size_t{768} << 20) : (std::size_t{4} << 30);
    Buffer buf(std::max({largest, bw_bytes, std::size_t{64} << 20}), o.huge_pages);
    auto t_fill = Clock::now();
    fill_random(pool, buf.p, buf.bytes, seed);
    std::printf("buffer    : %.2f GiB of random bf16, filled in %.2f s\n",
                static_cast<double>(buf.bytes) / (1u << 30),
                std::chrono::duration<double>(Clock::now() - t_fill).count());

    // The ceiling: the read bandwidth measured at the start, after each model and at the end (a
    // shared host's bandwidth drifts); ratios are taken against the highest, conservatively.
    std::vector<double> bws;
    auto measure_bw = [&](const char* when) {
        bws.push_back(measure_read_bandwidth(pool, buf.p, bw_bytes, isa, o.quick ? 3 : 5));
        std::printf("read bandwidth (%zu threads, %s loads over %.2f GiB), %s: %.1f GB/s\n",
                    pool.concurrency(), std::string(cpu::isa_name(isa)).c_str(),
                    static_cast<double>(bw_bytes) / (1u << 30), when, bws.back());
        std::fflush(stdout);
    };
    measure_bw("at start");

    for (const auto& g : geos) {
        const double err = verify(pool, g, o, rng);
        std::printf("check     : %s against the portable kernel: max |do| / max |o| = %.1e\n",
                    g.name.c_str(), err);
        if (err > 1e-4) {
            std::fprintf(stderr, "cpu-attention: the kernel disagrees with the portable one\n");
            return 1;
        }
    }
    std::fflush(stdout);
    std::vector<Result> results;
    for (const auto& g : geos) {
        for (std::size_t t : o.tokens)
            for (std::size_t b : o.batches) {
                results.push_back(time_attention(pool, g, o, buf, t, b, o.reps, true, rng));
                std::fprintf(stderr, ".");
            }
        measure_bw(("after " + g.name).c_str());
    }
    const double bw = *std::max_element(bws.begin(), bws.end());
    std::printf("\nratio = KV GB/s / %.1f GB/s (the highest read bandwidth measured above)\n", bw);
    std::printf("%-18s %8s %6s %5s %10s %12s %9s %9s\n", "model", "tokens", "batch", "Q.K",
                "KV MiB", "ms/layer", "GB/s", "ratio");
    for (Result& r : results) {
        r.ratio = r.gbs / bw;
        std::printf("%-18s %8zu %6zu %5s %10.1f %12.3f %9.1f %9.2f\n", r.model.c_str(), r.tokens,
                    r.batch, r.qk.c_str(), r.kv_bytes / (1 << 20), r.seconds * 1e3, r.gbs, r.ratio);
    }

    // Compute ceiling: one thread on KV that stays in its caches (~1 MiB per layer call).
    std::vector<Result> hot;
    if (o.hot) {
        std::printf("\ncache-resident KV, 1 thread (the kernel's compute rate per core):\n");
        cpu::WorkerPool one({.threads = 1});
        for (const auto& g : geos) {
            const std::size_t per_block = o.block_tokens * g.bytes_per_token_layer();
            const std::size_t blocks = std::max<std::size_t>(1, (o.hot_kib << 10) / per_block);
            Result r = time_attention(one, g, o, buf, blocks * o.block_tokens, 1,
                                      std::max(o.reps, 20), false, rng);
            std::printf(
                "%-18s %8zu tokens %8.2f MiB  %9.1f GB/s per core  (x %zu threads = "
                "%.0f GB/s; fastest call %.1f GB/s)\n",
                r.model.c_str(), r.tokens, r.kv_bytes / (1 << 20), r.gbs, pool.concurrency(),
                r.gbs * static_cast<double>(pool.concurrency()), r.best_gbs);
            hot.push_back(r);
        }
    }

    // Thread scaling: bandwidth and the Qwen3 32K point at 1, 2, 4, ... threads.
    struct Scale {
        std::size_t threads;
        double bw;
        Result b1, b16;
    };
    std::vector<Scale> scaling;
    if (o.scaling) {
        std::printf("\nthread scaling (qwen3-30b-a3b, 32768 tokens):\n%8s %10s %12s %8s %12s %8s\n",
                    "threads", "read GB/s", "b1 GB/s", "ratio", "b16 GB/s", "ratio");
        const auto qwen = *kv_geometry_preset("qwen3-30b-a3b", DType::bf16);
        const std::size_t max_t = pool.concurrency();
        for (std::size_t t = 1; t <= max_t; t = t * 2 > max_t && t < max_t ? max_t : t * 2) {
            cpu::WorkerPoolOptions so = po;
            so.threads = t;
            cpu::WorkerPool sp(so);
            Scale s{t, measure_read_bandwidth(sp, buf.p, bw_bytes, isa, 3), {}, {}};
            s.b1 = time_attention(sp, qwen, o, buf, 32768, 1, 5, true, rng);
            s.b16 = time_attention(sp, qwen, o, buf, 32768, 16, 3, true, rng);
            s.b1.ratio = s.b1.gbs / s.bw;
            s.b16.ratio = s.b16.gbs / s.bw;
            std::printf("%8zu %10.1f %12.1f %8.2f %12.1f %8.2f\n", t, s.bw, s.b1.gbs, s.b1.ratio,
                        s.b16.gbs, s.b16.ratio);
            std::fflush(stdout);
            scaling.push_back(s);
        }
    }

    if (!o.json.empty()) {
        std::ofstream j(o.json);
        j << "{\n  \"date\": \"" << date << "\",\n  \"cpu\": \""
          << json_escape(cpu::cpu_model_name()) << "\",\n  \"cpus\": " << cpus.size()
          << ",\n  \"threads\": " << pool.concurrency()
          << ",\n  \"pinned\": " << pool.pin_report().pinned << ",\n  \"isa\": \""
          << cpu::isa_name(isa) << "\",\n  \"block_tokens\": " << o.block_tokens
          << ",\n  \"prefetch\": " << (o.prefetch ? "true" : "false")
          << ",\n  \"items_per_worker\": " << o.items_per_worker
          << ",\n  \"bf16_dot_product\": " << (o.bf16_dot ? "true" : "false")
          << ",\n  \"amx\": " << (o.amx && cpu::amx_bf16_available() ? "true" : "false")
          << ",\n  \"amx_pv\": "
          << (o.amx && o.amx_pv && cpu::amx_bf16_available() ? "true" : "false")
          << ",\n  \"amx_pv_mla\": "
          << (o.amx && (o.amx_pv || o.amx_pv_mla) && cpu::amx_bf16_available() ? "true" : "false")
          << ",\n  \"huge_pages\": " << (o.huge_pages ? "true" : "false")
          << ",\n  \"read_bandwidth_gbs\": " << bw << ",\n  \"read_bandwidth_measurements_gbs\": [";
        for (std::size_t i = 0; i < bws.size(); ++i)
            j << (i ? ", " : "") << bws[i];
        j << "],\n  \"results\": [";
        for (std::size_t i = 0; i < results.size(); ++i)
            j << (i ? ",\n    " : "\n    ") << result_json(results[i]);
        j << "\n  ],\n  \"hot_single_thread\": [";
        for (std::size_t i = 0; i < hot.size(); ++i)
            j << (i ? ",\n    " : "\n    ") << result_json(hot[i]);
        j << "\n  ],\n  \"scaling\": [";
        for (std::size_t i = 0; i < scaling.size(); ++i)
            j << (i ? ",\n    " : "\n    ") << "{\"threads\": " << scaling[i].threads
              << ", \"read_bandwidth_gbs\": " << scaling[i].bw
              << ", \"batch1\": " << result_json(scaling[i].b1)
              << ", \"batch16\": " << result_json(scaling[i].b16) << "}";
        j << "\n  ]\n}\n";
        if (!j) {
            std::fprintf(stderr, "cpu-attention: could not write %s\n", o.json.c_str());
            return 1;
        }
        std::printf("\nJSON written to %s\n", o.json.c_str());
    }
    return 0;
}

}  // namespace writescope::bench
