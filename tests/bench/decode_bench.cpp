// writescope-bench decode: whole decode steps through the engine as the model runtime will drive
// it (Engine::prefill, then begin_step / attend_layer per layer / end_step), with the policy
// calibrated at the start and tracking online. It reports what the entry point adds to the
// layers' attention (appends, seals, planning, trackers), the spilled KV rate of the layers
// against the ceilings measured in the same run, the prompt store rate, and r over the steps.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench_util.hpp"
#include "read_bandwidth.hpp"
#include "writescope/core/dtype.hpp"
#include "writescope/core/engine.hpp"
#include "writescope/core/host_region_memory.hpp"
#include "writescope/cpu/worker_pool.hpp"

#if WRITESCOPE_BENCH_CUDA
#include "copy_rate.hpp"
#include "writescope/cuda/device.hpp"
#endif

namespace writescope::bench {
namespace {

struct Options {
    std::string model = "qwen3-30b-a3b";
    int layers = 8;
    std::size_t context = 32768, batch = 4, steps = 160, block = 128;
    int gpu = 0;  // -1: the CPU engine
    std::uint64_t vram_mb = 1024, pinned_mb = 8192, host_mb = 8192;
    int threads = 0;
};

void help() {
    std::puts(
        "usage: writescope-bench decode [options]\n"
        "  --model NAME       geometry preset (qwen3-30b-a3b, mixtral-8x7b, deepseek-v2-lite)\n"
        "  --layers N         layers of the model that are run (default 8)\n"
        "  --context N        prompt tokens per sequence, stored by prefill (default 32K)\n"
        "  --batch N          sequences per step (default 4)\n"
        "  --steps N          decode steps (default 160: each sequence seals a block or two)\n"
        "  --block N          tokens per KV block (default 128)\n"
        "  --gpu N            GPU index, -1 for the CPU engine (default 0)\n"
        "  --vram-mb N, --pinned-mb N, --host-mb N\n"
        "                     KV budgets (defaults 1024, 8192, 8192: with a GPU most KV spills)\n"
        "  --threads N        CPU attention threads (default: one per allowed CPU)");
}

Options parse(int argc, char** argv) {
    Options o;
    for_each_option(argc, argv, &help, [&](const std::string& a, auto& value) {
        if (a == "--model")
            o.model = value();
        else if (a == "--layers")
            o.layers = std::stoi(value());
        else if (a == "--context")
            o.context = parse_list(value()).at(0);
        else if (a == "--batch")
            o.batch = std::stoull(value());
        else if (a == "--steps")
            o.steps = std::stoull(value());
        else if (a == "--block")
            o.block = std::stoull(value());
        else if (a == "--gpu")
            o.gpu = std::stoi(value());
        else if (a == "--vram-mb")
            o.vram_mb = std::stoull(value());
        else if (a == "--pinned-mb")
            o.pinned_mb = std::stoull(value());
        else if (a == "--host-mb")
            o.host_mb = std::stoull(value());
        else if (a == "--threads")
            o.threads = std::stoi(value());
        else
            return false;
        return true;
    });
    if (o.layers < 1 || o.batch < 1 || o.steps < 1 || o.context < 1)
        throw std::invalid_argument("--layers, --batch, --steps and --context must be positive");
    return o;
}

double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

// Random values in the KV dtype (never zeros), from a fast generator: timings do not depend on
// the values, but zeros could hide unwritten data.
void fill_random(std::vector<std::byte>& buf, DType t, std::uint64_t seed) {
    const std::size_t es = dtype_bytes(t), n = buf.size() / es;
    std::uint64_t x = seed | 1;
    for (std::size_t i = 0; i < n; ++i) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        store_from_f32(buf.data(), i, t, static_cast<float>(x >> 40) / 4194304.0f - 2.0f);
    }
}

}  // namespace

int run_decode(int argc, char** argv) {
    const Options o = parse(argc, argv);
    auto g = kv_geometry_preset(o.model, DType::bf16);
    if (!g) throw std::invalid_argument("unknown model preset " + o.model);
    g->num_layers = o.layers;
    const std::size_t L = static_cast<std::size_t>(o.layers);
    char date[64];
    const std::time_t tt = std::time(nullptr);
    std::strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", std::gmtime(&tt));
    const std::size_t threads = o.threads > 0 ? static_cast<std::size_t>(o.threads)
                                              : cpu::WorkerPool::allowed_cpus().size();

    // Ceilings, before the engine's threads exist: the host read rate with as many threads, and
    // the pinned host-to-device copy rate.
    double cpu_read = 0, pinned = 0;
    {
        cpu::WorkerPoolOptions po;
        po.threads = threads;
        po.pin = true;
        cpu::WorkerPool pool(po);
        const std::size_t bytes = std::size_t{1} << 30;
        HostRegionMemory buf("bandwidth", 1, 1, bytes);
        std::memset(buf.block(0, 0), 0x33, bytes);
        cpu_read = measure_read_bandwidth(pool, buf.block(0, 0), bytes, cpu::select_isa(), 5);
    }
#if WRITESCOPE_BENCH_CUDA
    if (o.gpu >= 0) {
        if (cuda::device_count() <= o.gpu)
            throw std::runtime_error("no CUDA GPU " + std::to_string(o.gpu));
        cuda::set_device(o.gpu);
        const std::size_t bytes = std::size_t{256} << 20;
        cuda::PinnedSlabs host(bytes, bytes);
        std::memset(host.slab(0), 0x5a, bytes);
        cuda::DeviceBuffer dev(bytes);
        cuda::Stream s;
        pinned = copy_rate_gbps(dev.data(), host.slab(0), bytes, 1.0, s);
    }
#else
    if (o.gpu >= 0) throw std::runtime_error("this build has no CUDA backend: use --gpu -1");
#endif

    EngineOptions eo;
    eo.geometry = *g;
    eo.block_tokens = o.block;
    eo.gpu_index = o.gpu;
    eo.vram_kv_bytes = o.vram_mb << 20;
    eo.pinned_kv_bytes = o.gpu >= 0 ? o.pinned_mb << 20 : 0;
    eo.host_kv_bytes = o.host_mb << 20;
    eo.attention_threads = static_cast<int>(threads);
    eo.max_batch = o.batch;
    auto e = Engine::create(eo);
    const EngineStatus s0 = e->status();
    std::printf(
        "writescope-bench decode (%s)\n%s, %d of %d layers, block %zu, %zu CPU threads "
        "(%s)%s%s\n",
        date, o.model.c_str(), o.layers, kv_geometry_preset(o.model, DType::bf16)->num_layers,
        o.block, threads, s0.cpu_isa.c_str(), s0.gpu ? ", GPU kernel: " : ", no GPU",
        s0.gpu_kernel.c_str());
    std::printf("ceilings: CPU read %.1f GB/s%s", cpu_read, pinned > 0 ? ", pinned H2D " : "");
    if (pinned > 0) std::printf("%.1f GB/s", pinned);
    std::printf("\n");

    const Calibration c = e->calibrate(nullptr);
    e->set_calibration(c);
    std::printf(
        "calibration: A %.3g ns/token (R^2 %.3f), B %.3g ns/token, delta %.3g us, c0 %.3g "
        "us, %.2f s\n",
        c.a * 1e9, c.a_r2, c.b * 1e9, c.delta * 1e6, c.cpu_intercept * 1e6, c.seconds_taken);

    // The prompts: every layer's K and V of `context` tokens per sequence, stored by prefill.
    const LinearBlockLayout lay = LinearBlockLayout::of(*g, o.block);
    const std::size_t es = dtype_bytes(g->dtype);
    const std::size_t k_row = lay.row_heads() * lay.dk * es, v_row = lay.row_heads() * lay.dv * es;
    const double bytes_per_token = static_cast<double>(g->bytes_per_token_layer());
    std::vector<std::uint64_t> ids;
    std::vector<double> prefill_rates;
    {
        std::vector<std::byte> k(L * o.context * k_row), v(g->mla ? 0 : L * o.context * v_row);
        fill_random(k, g->dtype, 1);
        fill_random(v, g->dtype, 2);
        for (std::size_t i = 0; i < o.batch; ++i) {
            const std::uint64_t id = 1 + i;
            const Admission a = e->admit(id, o.context + o.steps);
            if (!a.ok)
                throw std::runtime_error("admission of sequence " + std::to_string(id) +
                                         " refused: " + a.error);
            const double t0 = now();
            e->prefill(id, o.context, k.data(), v.empty() ? nullptr : v.data());
            prefill_rates.push_back(bytes_per_token * static_cast<double>(L * o.context) /
                                    (now() - t0) / 1e9);
            ids.push_back(id);
        }
    }
    const EngineStatus s1 = e->status();
    std::printf(
        "prompts: %zu x %zu tokens stored at %.2f GB/s (median of %zu); blocks in G %zu, "
        "P %zu, U %zu\n",
        o.batch, o.context, median(prefill_rates), prefill_rates.size(),
        s1.regions[static_cast<int>(Region::G)].used_blocks,
        s1.regions[static_cast<int>(Region::P)].used_blocks,
        s1.regions[static_cast<int>(Region::U)].used_blocks);

    // The decode steps, back to back, one set of random q, k and v per layer.
    const std::size_t q_bytes = o.batch * g->num_q_heads * g->head_dim_k * es;
    const std::size_t rows = o.batch * g->num_q_heads, dv = g->head_dim_v;
    std::vector<std::vector<std::byte>> q(L), kn(L), vn(L);
    for (std::size_t l = 0; l < L; ++l) {
        q[l].resize(q_bytes);
        kn[l].resize(o.batch * k_row);
        vn[l].resize(g->mla ? 0 : o.batch * v_row);
        fill_random(q[l], g->dtype, 10 + l);
        fill_random(kn[l], g->dtype, 100 + l);
        fill_random(vn[l], g->dtype, 200 + l);
    }
    std::vector<float> out_o(rows * dv), out_lse(rows);
    std::printf("%5s %6s %10s %10s %10s %12s %6s %10s %10s\n", "step", "r", "layer ms", "CPU ms",
                "GPU ms", "overhead us", "seals", "A ns/tok", "B ns/tok");
    std::vector<double> layer_ms, overhead_us, spilled_rate;
    std::size_t seals = 0;
    for (std::size_t step = 0; step < o.steps; ++step) {
        const double t0 = now();
        e->begin_step(ids);
        for (std::size_t l = 0; l < L; ++l)
            e->attend_layer(l, q[l].data(), {kn[l].data(), vn[l].empty() ? nullptr : vn[l].data()},
                            {out_o.data(), out_lse.data(), rows, dv});
        const StepReport r = e->end_step();
        const double wall = now() - t0;
        const double per_layer = r.seconds / static_cast<double>(L);
        layer_ms.push_back(per_layer * 1e3);
        overhead_us.push_back((wall - r.seconds) * 1e6);
        spilled_rate.push_back(bytes_per_token *
                               static_cast<double>(r.cpu_spilled_tokens + r.gpu_spilled_tokens) /
                               per_layer / 1e9);
        seals += r.sealed_g + r.sealed_p + r.sealed_u;
        if (step % 8 == 0 || step + 1 == o.steps) {
            const EngineStatus st = e->status();
            std::printf("%5zu %6.3f %10.3f %10.3f %10.3f %12.1f %6zu %10.3g %10.3g\n", step, r.r,
                        per_layer * 1e3, r.cpu_seconds * 1e3, r.gpu_seconds * 1e3,
                        (wall - r.seconds) * 1e6, r.sealed_g + r.sealed_p + r.sealed_u, st.a * 1e9,
                        st.b * 1e9);
        }
    }
    const double ceiling = cpu_read + pinned;
    const double ms = median(layer_ms), rate = median(spilled_rate), ov = median(overhead_us);
    std::printf(
        "summary: %zu steps of %zu x %zu tokens; per layer %.3f ms (median), spilled KV at %.1f "
        "GB/s = %.2f of CPU read + pinned H2D (%.1f GB/s, each measured alone); the entry point "
        "adds %.1f us per step (median; largest %.1f, where blocks were sealed) = %.2f %% of the "
        "step; %zu blocks sealed\n",
        o.steps, o.batch, o.context, ms, rate, ceiling > 0 ? rate / ceiling : 0.0, ceiling, ov,
        *std::max_element(overhead_us.begin(), overhead_us.end()),
        100 * ov / (ov + ms * 1e3 * static_cast<double>(L)), seals);
    for (auto id : ids)
        e->release(id);
    return 0;
}

}  // namespace writescope::bench
