// writescope-bench attention-step: one decode step of one layer with most of the KV spilled,
// in every execution mode, against ceilings measured in the same run (pinned PCIe, HBM, CPU
// read bandwidth, and the host's aggregate read rate while the CPU and the copy engine both run).
//
// The data path is the engine's: the CPU backend attends U blocks in place while the GPU backend
// attends T and G in place and streams P through its staging ring, and one merge joins them.
// To sweep the split without rewriting gigabytes per point, every spilled block is written twice
// at set-up, once in U (packed, pageable) and once in P (linear, pinned): a split with CPU share
// r then reads exactly what a cache routed at r would hold (the CPU the U copies of the first
// r·s blocks of each sequence, the GPU the P copies of the rest). Monolithic is the executor's
// `monolithic` mode: every step gathers each sequence's spilled KV into one pageable buffer,
// page-locks it, streams it to the GPU, attends it and unlocks it (the "prepare" pass the paper
// measured).
//
// Every mode's time comes from interleaved repetitions (one step of each candidate split per
// round, in rotating order), so slow drift of the machine falls on all of them alike. The policy
// gap is measured on a fresh sample: the sweep picks the best split, then that split, the
// policy's and the two single engines run head to head again.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <unistd.h>

#include "bench_util.hpp"
#include "ceilings.hpp"
#include "copy_rate.hpp"
#include "read_bandwidth.hpp"
#include "writescope/core/engine_impl.hpp"
#include "writescope/core/host_region_memory.hpp"
#include "writescope/core/policy_trackers.hpp"
#include "writescope/core/roofline_policy.hpp"
#include "writescope/core/step_executor.hpp"
#include "writescope/cpu/attention.hpp"
#include "writescope/cuda/device.hpp"
#include "writescope/cuda/gpu_kv_memory.hpp"
#include "writescope/cuda/gpu_step_backend.hpp"

namespace writescope::bench {

namespace {

double now() {
    return steady_seconds();  // the executor's clock (start_engines times from it)
}

struct Options {
    std::vector<std::string> models{"qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite"};
    std::vector<std::size_t> contexts{8192, 16384, 32768, 65536, 131072};
    std::vector<std::size_t> batches{1, 4, 16};
    std::size_t threads = 0;
    std::size_t block = 128;
    int reps = 5;
    double sweep_step = 0.05;
    double g_fraction = 1.0 / 16;  // share of each sequence's blocks resident in G
    int gpu = 0;
    bool cpu_load = false;
    bool flush = true;
    bool trace = false;
    bool overlap = true;
    bool anatomy = false;
    std::string json;
};

void usage() {
    std::puts(
        "usage: writescope-bench attention-step [options]\n"
        "  --models a,b,c     presets (default: qwen3-30b-a3b,mixtral-8x7b,deepseek-v2-lite)\n"
        "  --contexts list    tokens per sequence, K suffix allowed (default 8K,16K,32K,64K,128K)\n"
        "  --batches list     sequences per step (default 1,4,16)\n"
        "  --threads N        CPU attention threads (default: every core)\n"
        "  --block N          tokens per KV block (default 128)\n"
        "  --reps N           timed repetitions per point, median reported (default 5)\n"
        "  --sweep-step X     step of the r sweep (default 0.05)\n"
        "  --g-fraction X     share of each sequence's blocks resident in G (default 1/16)\n"
        "  --gpu N            GPU index (default 0)\n"
        "  --cpu-load         afterwards, show A and r tracking expert-like CPU and PCIe load\n"
        "  --no-flush         keep the CPU caches between steps (default: stream twice the L3\n"
        "                     through them before every step, as the expert weights of a MoE\n"
        "                     layer do, so no step reads the previous step's KV from cache)\n"
        "  --trace            print the policy's tracking steps of every configuration\n"
        "  --no-overlap       enqueue the GPU side before the CPU threads are woken (default: the\n"
        "                     CPU's calling thread enqueues it once they run, as the engine does,\n"
        "                     StepExecutorConfig::overlap_gpu_launch)\n"
        "  --anatomy          instead of the full run: where one step's time goes (enqueue, CPU,\n"
        "                     GPU, merge = from the GPU's end to the result, so with the wait for\n"
        "                     the CPU at r > 0) at r = 0, 0.5, 1, after a flush, a sleep or "
        "nothing\n"
        "  --quick            small sizes (one model, 8K/16K, batch 1/4)\n"
        "  --json FILE        write the summary as JSON");
}

Options parse(int argc, char** argv) {
    Options o;
    for_each_option(argc, argv, usage, [&](const std::string& a, auto& val) {
        if (sweep_option(a, val, o.models, o.contexts, o.batches)) return true;
        if (a == "--threads") {
            o.threads = std::stoull(val());
        } else if (a == "--block") {
            o.block = std::stoull(val());
        } else if (a == "--reps") {
            o.reps = std::stoi(val());
        } else if (a == "--sweep-step") {
            o.sweep_step = std::stod(val());
        } else if (a == "--g-fraction") {
            o.g_fraction = std::stod(val());
        } else if (a == "--gpu") {
            o.gpu = std::stoi(val());
        } else if (a == "--cpu-load") {
            o.cpu_load = true;
        } else if (a == "--no-flush") {
            o.flush = false;
        } else if (a == "--trace") {
            o.trace = true;
        } else if (a == "--no-overlap") {
            o.overlap = false;
        } else if (a == "--anatomy") {
            o.anatomy = true;
        } else if (a == "--quick") {
            o.models = {"qwen3-30b-a3b"};
            o.contexts = {8192, 16384};
            o.batches = {1, 4};
            o.reps = 3;
            o.sweep_step = 0.1;
        } else if (a == "--json") {
            o.json = val();
        } else {
            return false;
        }
        return true;
    });
    if (o.reps < 1 || o.sweep_step <= 0 || o.sweep_step > 1 || o.g_fraction < 0 ||
        o.g_fraction >= 1)
        throw std::invalid_argument("bad --reps, --sweep-step or --g-fraction");
    return o;
}

// Evicts the KV of the previous step from the CPU caches (untimed, before each step): one layer's
// KV of a small configuration fits the last-level cache, and timing the same layer again would
// measure the cache. In a real decode the layers' KV differ and the expert weights stream through
// between them.
class CacheFlusher {
  public:
    CacheFlusher(cpu::WorkerPool& pool, cpu::Isa isa, bool on) : pool_(pool), isa_(isa) {
        if (!on) return;
        long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
        if (l3 <= 0) l3 = 256l << 20;
        bytes_ = (2 * static_cast<std::size_t>(l3) + kSlice - 1) / kSlice * kSlice;
        HostMemoryOptions ho;
        buf_ = std::make_unique<HostRegionMemory>("cache flush", 1, 1, bytes_, ho);
        std::memset(buf_->block(0, 0), 0x5a, bytes_);
    }
    std::size_t bytes() const { return bytes_; }
    void operator()() {
        if (!buf_) return;
        const auto* p = static_cast<const char*>(buf_->block(0, 0));
        pool_.parallel_for(bytes_ / kSlice, [&](std::size_t i, std::size_t) {
            sink_.fetch_xor(read_stream(p + i * kSlice, kSlice, isa_), std::memory_order_relaxed);
        });
        // This pool's threads spin a while (up to ~0.3 ms) before they sleep, on the cores the
        // attention threads are pinned to: let them go to sleep before the step is timed.
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }

  private:
    static constexpr std::size_t kSlice = std::size_t{4} << 20;
    cpu::WorkerPool& pool_;
    cpu::Isa isa_;
    std::size_t bytes_ = 0;
    std::unique_ptr<HostRegionMemory> buf_;
    std::atomic<std::uint64_t> sink_{0};
};

// Layers per decode step in the policy's tracking loops (the engine's trackers see one
// measurement per step, summed over the layers).
constexpr int kLayersPerStep = 8;

struct StepTime {
    double total = 0;     // s, launch → merged result
    double cpu = 0;       // s, CPU attention
    double gpu_attn = 0;  // s, GPU attention incl. P stream
    double overhead = 0;  // s, from the end of the GPU's attention to the result: waiting for
                          // the CPU's partials, then the last merge (GpuLayerTiming::merge_seconds)
    double p_rate = 0;    // GB/s of the P stream's copies
    double launch = 0;    // s, from the start until the GPU side was enqueued
    std::uint64_t cpu_tokens = 0, gpu_tokens = 0;
};

// The step of median total time (its parts belong to that one step).
StepTime median_step(std::vector<StepTime> v) {
    std::sort(v.begin(), v.end(),
              [](const StepTime& a, const StepTime& b) { return a.total < b.total; });
    return v[v.size() / 2];
}

// What a step tells the trackers: the CPU attended U blocks only, the GPU streamed P blocks.
StepMeasurement measurement_of(const StepTime& s) {
    StepMeasurement m;
    m.cpu_seconds = s.cpu;
    m.cpu_u_tokens = static_cast<double>(s.cpu_tokens);
    m.gpu_seconds = s.gpu_attn;
    m.gpu_p_tokens = static_cast<double>(s.gpu_tokens);
    return m;
}

// Everything one model needs for its largest configuration, written once.
struct ModelRig {
    KvGeometry g;
    std::size_t B, lin, packed, s_max, g_max, nb_max, batch_max;
    std::unique_ptr<cuda::DevicePool> pool;
    std::unique_ptr<cuda::DeviceRegionMemory> gmem, landing;
    std::unique_ptr<cuda::PinnedRegionMemory> pmem;
    std::unique_ptr<HostRegionMemory> umem;
    // The monolithic caches: one pageable buffer per sequence (one layer of its spilled KV).
    std::vector<std::unique_ptr<PageBuffer>> mono;
    std::unique_ptr<cpu::CpuAttention> cpu;
    std::unique_ptr<cuda::GpuStepBackend> gpu, gpu_inplace;
    std::vector<std::byte> q;
    std::vector<float> o, lse;
    CacheFlusher* flush = nullptr;
    bool overlap = false;
};

std::size_t blocks_for(std::size_t tokens, std::size_t B) {
    return (tokens + B - 1) / B;
}

// Per sequence: g resident blocks, s spilled blocks, one open T block holding the remainder.
struct Shape {
    std::size_t nb, g, s, t_tokens;
};
Shape shape_of(std::size_t ctx, std::size_t B, double g_fraction) {
    Shape sh;
    sh.nb = blocks_for(ctx, B);
    sh.t_tokens = ctx - (sh.nb - 1) * B;
    sh.g = static_cast<std::size_t>(std::floor(g_fraction * static_cast<double>(sh.nb)));
    if (sh.g + 1 > sh.nb) sh.g = sh.nb - 1;
    sh.s = sh.nb - 1 - sh.g;
    return sh;
}

std::unique_ptr<ModelRig> build_rig(const std::string& name, const Options& o, std::size_t threads,
                                    cpu::WorkerPool& fill_pool) {
    auto rig = std::make_unique<ModelRig>();
    auto g = kv_geometry_preset(name, DType::bf16);
    if (!g) throw std::invalid_argument("unknown model preset " + name);
    rig->g = *g;
    rig->g.num_layers = 1;  // one layer's KV: every timing is per layer
    rig->B = o.block;
    rig->lin = LinearBlockLayout::of(rig->g, o.block).elems() * 2;
    const std::size_t ctx_max = *std::max_element(o.contexts.begin(), o.contexts.end());
    rig->batch_max = *std::max_element(o.batches.begin(), o.batches.end());
    const Shape sh = shape_of(ctx_max, o.block, o.g_fraction);
    rig->s_max = sh.s;
    rig->g_max = sh.g;
    rig->nb_max = sh.nb;
    const std::size_t nseq = rig->batch_max;
    rig->cpu = std::make_unique<cpu::CpuAttention>(rig->g, o.block, threads, true, nseq);
    rig->packed = rig->cpu->packed_block_bytes();
    const std::size_t spill_slots = nseq * sh.s, pool_slots = nseq * (sh.g + 1);
    // Device: the T+G pool, the landing area of the monolithic baseline, two step backends.
    const std::size_t dev_bytes = (pool_slots + nseq * sh.nb) * rig->lin + (std::size_t{1} << 30) +
                                  2 * nseq * sh.nb * (rig->g.num_q_heads * 520 + 64);
    rig->pool = std::make_unique<cuda::DevicePool>(dev_bytes);
    rig->gmem =
        std::make_unique<cuda::DeviceRegionMemory>("T+G", *rig->pool, 1, pool_slots, rig->lin);
    rig->landing = std::make_unique<cuda::DeviceRegionMemory>("landing", *rig->pool, 1,
                                                              nseq * sh.nb, rig->lin);
    rig->pmem = std::make_unique<cuda::PinnedRegionMemory>("P", 1, spill_slots, rig->lin, 1);
    HostMemoryOptions ho;
    rig->umem = std::make_unique<HostRegionMemory>("U", 1, spill_slots, rig->packed, ho);
    for (std::size_t i = 0; i < nseq; ++i)  // ordinary pageable memory, as such a system has
        rig->mono.push_back(std::make_unique<PageBuffer>(sh.s * rig->lin));
    cuda::GpuStepOptions so;
    so.geometry = rig->g;
    so.block_tokens = o.block;
    so.max_seqs = nseq;
    so.max_blocks = nseq * sh.nb;
    rig->gpu = std::make_unique<cuda::GpuStepBackend>(so, *rig->pool, *rig->gmem, rig->pmem.get());
    rig->gpu_inplace =
        std::make_unique<cuda::GpuStepBackend>(so, *rig->pool, *rig->landing, nullptr);

    // Random KV (never zeros), a few distinct blocks copied round-robin.
    std::mt19937_64 rng(std::random_device{}());
    std::vector<std::vector<std::byte>> src(13, std::vector<std::byte>(rig->lin));
    std::uniform_real_distribution<float> u(-2.0f, 2.0f);
    for (auto& b : src)
        for (std::size_t i = 0; i < rig->lin / 2; ++i)
            store_from_f32(b.data(), i, DType::bf16, u(rng));
    fill_pool.parallel_for(spill_slots, [&](std::size_t i, std::size_t) {
        const auto& b = src[i % src.size()];
        std::memcpy(rig->pmem->block(0, i), b.data(), rig->lin);
        rig->cpu->pack_block(b.data(), rig->umem->block(0, i));
    });
    fill_pool.parallel_for(nseq, [&](std::size_t i, std::size_t) {
        std::memset(rig->mono[i]->data(), 0x3c, sh.s * rig->lin);  // touched once: no first-fault
    });
    for (std::size_t i = 0; i < pool_slots; ++i)
        cuda::copy_sync(rig->gmem->device_block(0, i), src[i % src.size()].data(), rig->lin);
    for (std::size_t i = 0; i < nseq * sh.nb; ++i)
        cuda::copy_sync(rig->landing->device_block(0, i), src[(i + 5) % src.size()].data(),
                        rig->lin);
    rig->q.resize(nseq * rig->g.num_q_heads * rig->g.head_dim_k * 2);
    for (std::size_t i = 0; i < rig->q.size() / 2; ++i)
        store_from_f32(rig->q.data(), i, DType::bf16, u(rng) * 0.3f);
    const std::size_t rows = nseq * rig->g.num_q_heads;
    rig->o.resize(rows * rig->g.head_dim_v);
    rig->lse.resize(rows);
    return rig;
}

// One configuration: the lists of every split are built on the fly from the shape.
struct Config {
    ModelRig* rig;
    std::size_t ctx, batch;
    Shape sh;
    std::uint64_t spilled_tokens() const {
        return static_cast<std::uint64_t>(batch) * sh.s * rig->B;
    }
    std::uint64_t spilled_bytes() const {
        return spilled_tokens() * rig->g.bytes_per_token_layer();
    }

    std::vector<std::vector<std::uint32_t>> pool_slots{}, p_slots{};
    std::vector<std::vector<CpuBlock>> cpu_blocks{};
    std::vector<GpuSeqWork> gw{};
    std::vector<CpuSeqWork> cw{};

    // The spilled blocks of each sequence the CPU attends at share r (the first ones).
    std::size_t cpu_share_blocks(double r) const {
        return static_cast<std::size_t>(std::llround(r * static_cast<double>(sh.s)));
    }

    // The split at CPU share r; `gpu_cap` bounds the P blocks per sequence (the rest of the
    // spilled KV is then left out of the step: the fixed-cost steps use it).
    void prepare(double r, std::size_t gpu_cap = SIZE_MAX) {
        pool_slots.assign(batch, {});
        p_slots.assign(batch, {});
        cpu_blocks.assign(batch, {});
        gw.assign(batch, {});
        cw.assign(batch, {});
        const std::size_t q_row = rig->g.num_q_heads * rig->g.head_dim_k * 2;
        const std::size_t k = cpu_share_blocks(r);
        for (std::size_t i = 0; i < batch; ++i) {
            for (std::size_t j = 0; j <= sh.g; ++j)
                pool_slots[i].push_back(static_cast<std::uint32_t>(i * (rig->g_max + 1) + j));
            for (std::size_t j = 0; j < sh.s; ++j) {
                const std::size_t slot = i * rig->s_max + j;
                if (j < k)
                    cpu_blocks[i].push_back(
                        {rig->umem->block(0, slot), static_cast<std::uint32_t>(rig->B), true});
                else if (p_slots[i].size() < gpu_cap)
                    p_slots[i].push_back(static_cast<std::uint32_t>(slot));
            }
            gw[i] = {pool_slots[i], true, static_cast<std::uint32_t>(sh.t_tokens), p_slots[i]};
            cw[i] = {rig->q.data() + i * q_row, cpu_blocks[i]};
        }
        rig->gpu->set_work(gw);
    }

    // What precedes a timed step: the benchmark's protocol (flush the caches, let the threads
    // fall asleep), only the sleep (threads asleep, KV maybe in L3), or nothing (back to back).
    enum class Pre { flush, sleep, none };

    StepTime run_once(Pre pre = Pre::flush) {
        ModelRig& m = *rig;
        const std::size_t rows = batch * m.g.num_q_heads, dv = m.g.head_dim_v;
        StepTime t;
        if (pre == Pre::flush) (*m.flush)();
        if (pre == Pre::sleep) std::this_thread::sleep_for(std::chrono::milliseconds(1));
        const double t0 = now();
        bool any_cpu = false;
        for (const auto& c : cw)
            any_cpu = any_cpu || !c.blocks.empty();
        // As the executor does (the same start_engines); the CPU partials go where the GPU
        // side's last merge reads them.
        const StateView part = m.gpu->cpu_partial_buffer(rows);
        const EnginesStarted e =
            start_engines(*m.cpu, m.gpu.get(), 0, m.q.data(), {}, cw, any_cpu, part, m.overlap, t0);
        t.launch = e.gpu_launch_seconds;
        const GpuLayerTiming g =
            m.gpu->finish(any_cpu ? ConstStateView{part.o, part.lse, rows, dv} : ConstStateView{},
                          {m.o.data(), m.lse.data(), rows, dv});
        t.total = now() - t0;
        // From the step's start, as the executor reports it (start_engines: 0 without work).
        t.cpu = e.cpu_seconds;
        t.gpu_attn = g.attention_seconds;
        t.overhead = g.merge_seconds;
        t.p_rate = g.p_copy_seconds > 0 ? g.p_bytes / g.p_copy_seconds / 1e9 : 0;
        for (const auto& c : cpu_blocks)
            t.cpu_tokens += c.size() * m.B;
        for (const auto& p : p_slots)
            t.gpu_tokens += p.size() * m.B;
        return t;
    }

    StepTime run(double r, int reps) { return run_interleaved({r}, reps)[0]; }

    // Each side's fixed cost: a step with one spilled block per sequence on that side and none on
    // the other (the T and G blocks in place as always), medians of `reps` interleaved pairs
    // after one warm-up pair. First the CPU's step, then the GPU's.
    std::pair<StepTime, StepTime> run_fixed(int reps) {
        std::vector<StepTime> c, g;
        for (int k = 0; k <= reps; ++k) {
            prepare(1.0 / static_cast<double>(sh.s), 0);
            const StepTime tc = run_once();
            prepare(0.0, 1);
            const StepTime tg = run_once();
            if (k == 0) continue;
            c.push_back(tc);
            g.push_back(tg);
        }
        return {median_step(std::move(c)), median_step(std::move(g))};
    }

    // One decode step as the trackers see it: `layers` layer steps at the prepared split, their
    // times and tokens averaged (the engine feeds the trackers once per step, summed over its
    // layers; one sub-millisecond layer alone varies by ~10 %).
    StepTime run_decode_step(int layers) {
        StepTime sum;
        for (int l = 0; l < layers; ++l) {
            const StepTime t = run_once();
            sum.total += t.total / layers;
            sum.cpu += t.cpu / layers;
            sum.gpu_attn += t.gpu_attn / layers;
            sum.cpu_tokens = t.cpu_tokens;
            sum.gpu_tokens = t.gpu_tokens;
        }
        return sum;
    }

    // Medians of reps steps at each split, interleaved: round k runs every split once, starting
    // at a different one each round. One warm-up step per split first.
    std::vector<StepTime> run_interleaved(const std::vector<double>& rs, int reps) {
        std::vector<std::vector<StepTime>> v(rs.size());
        for (double r : rs) {
            prepare(r);
            run_once();
        }
        for (int k = 0; k < reps; ++k)
            for (std::size_t n = 0; n < rs.size(); ++n) {
                const std::size_t i = (n + static_cast<std::size_t>(k)) % rs.size();
                prepare(rs[i]);
                v[i].push_back(run_once());
            }
        std::vector<StepTime> out;
        for (auto& x : v)
            out.push_back(median_step(std::move(x)));
        return out;
    }

    // Every block of every sequence, attended in place in the landing area (device memory).
    std::vector<GpuSeqWork> landing_work(std::vector<std::vector<std::uint32_t>>& slots) const {
        slots.assign(batch, {});
        std::vector<GpuSeqWork> w(batch);
        for (std::size_t i = 0; i < batch; ++i) {
            for (std::size_t j = 0; j < sh.nb; ++j)
                slots[i].push_back(static_cast<std::uint32_t>(i * rig->nb_max + j));
            w[i] = {slots[i], true, static_cast<std::uint32_t>(sh.t_tokens), {}};
        }
        return w;
    }

    // The monolithic baseline as the executor runs it: every step gathers each sequence's
    // spilled KV (its P copies) into the sequence's pageable cache; the GPU backend page-locks
    // it, streams it through the staging ring and unlocks it; T and G are attended in place.
    double run_monolithic(int reps) {
        ModelRig& m = *rig;
        const std::size_t rows = batch * m.g.num_q_heads, dv = m.g.head_dim_v;
        prepare(0.0);
        for (std::size_t i = 0; i < batch; ++i) {
            gw[i].p_slots = {};
            gw[i].pageable = m.mono[i]->data();
            gw[i].pageable_blocks = static_cast<std::uint32_t>(sh.s);
        }
        m.gpu->set_work(gw);
        std::vector<double> v;
        for (int rep = 0; rep <= reps; ++rep) {
            (*m.flush)();
            const double t0 = now();
            for (std::size_t i = 0; i < batch; ++i) {
                auto* dst = static_cast<char*>(m.mono[i]->data());
                for (std::uint32_t slot : p_slots[i]) {
                    std::memcpy(dst, m.pmem->block(0, slot), m.lin);
                    dst += m.lin;
                }
            }
            m.gpu->launch(0, m.q.data(), {});
            m.gpu->finish({}, {m.o.data(), m.lse.data(), rows, dv});
            if (rep) v.push_back(now() - t0);
        }
        return median(v);
    }

    // Where the time of one step goes, at split r: medians of reps steps after each Pre.
    void anatomy(double r, int reps) {
        prepare(r);
        run_once();
        const char* names[] = {"flush+sleep", "sleep", "none"};
        for (Pre pre : {Pre::flush, Pre::sleep, Pre::none}) {
            std::vector<double> launch, cpu, gpu, merge, total, tail;
            for (int k = 0; k < reps; ++k) {
                const StepTime t = run_once(pre);
                launch.push_back(t.launch);
                cpu.push_back(t.cpu);
                gpu.push_back(t.gpu_attn);
                merge.push_back(t.overhead);
                total.push_back(t.total);
                tail.push_back(t.total - std::max(t.cpu, t.gpu_attn));
            }
            std::printf(
                "    %zuK x %zu r %.2f %-11s: enqueue %6.1f | CPU done %7.1f | GPU attn %7.1f | "
                "merge %5.1f | total %7.1f | after both %6.1f us\n",
                ctx / 1024, batch, r, names[static_cast<int>(pre)], median(launch) * 1e6,
                median(cpu) * 1e6, median(gpu) * 1e6, median(merge) * 1e6, median(total) * 1e6,
                median(tail) * 1e6);
        }
    }

    // The GPU kernel on device-resident KV (the landing area): its rate against HBM.
    double gpu_inplace_rate(int reps) {
        ModelRig& m = *rig;
        const std::size_t rows = batch * m.g.num_q_heads, dv = m.g.head_dim_v;
        std::vector<std::vector<std::uint32_t>> slots;
        const std::vector<GpuSeqWork> w = landing_work(slots);
        m.gpu_inplace->set_work(w);
        std::vector<double> v;
        for (int rep = 0; rep <= reps; ++rep) {
            m.gpu_inplace->launch(0, m.q.data(), {});
            const auto t = m.gpu_inplace->finish({}, {m.o.data(), m.lse.data(), rows, dv});
            if (rep) v.push_back(t.attention_seconds);
        }
        const double bytes = static_cast<double>(batch) * ctx * m.g.bytes_per_token_layer();
        return bytes / median(v) / 1e9;
    }
};

// What the fixed costs leave of the physical limit. Each side's fixed cost is measured as its
// time with one spilled block per sequence and none on the other side; the tail is what
// follows the later engine (the last merge, the wait for it). The bound is the best split if both
// sides paid their fixed costs and then ran at the limit's rate together, shared as the limit
// shares it (the CPU kernel's rate net of its fixed cost, the pinned rate), plus the tail. The
// efficiency is then the product of two measured factors:
//   fixed = limit / bound     (what the fixed costs leave; 1 without any)
//   rest  = bound / the step  (contention between the engines, the policy, noise)
struct LimitParts {
    double cpu_fixed = 0, gpu_fixed = 0;  // s
    double tail = 0;                      // s, median over the sweep's split steps
    double bound_ms = 0;                  // or 0 where it could not be measured
};

// `cpu_one`, `gpu_one`: the steps with one spilled block per sequence on the CPU, on the GPU
// (Config::run_fixed); `sw`: the
// sweep's median steps; `cpu_alone`: the cpu-only step's CPU time (s); `single_ms`: the better
// single engine's step (ms); `pinned`, `aggregate`: the ceilings (GB/s).
LimitParts limit_parts(const StepTime& cpu_one, const StepTime& gpu_one,
                       const std::vector<StepTime>& sw, double spilled_bytes, double cpu_alone,
                       double single_ms, double pinned, double aggregate) {
    LimitParts l;
    std::vector<double> tail;
    for (const StepTime& t : sw)
        if (t.cpu_tokens > 0 && t.gpu_tokens > 0)
            tail.push_back(std::max(0.0, t.total - std::max(t.cpu, t.gpu_attn)));
    if (tail.empty() || cpu_alone <= cpu_one.cpu) return l;
    l.cpu_fixed = cpu_one.cpu;
    l.gpu_fixed = gpu_one.gpu_attn;
    l.tail = median(tail);
    const double cpu_net = spilled_bytes / (cpu_alone - l.cpu_fixed) / 1e9;  // GB/s
    const double rate = std::min(cpu_net + pinned, aggregate);
    const double c = rate * cpu_net / (cpu_net + pinned) * 1e9,
                 g = rate * pinned / (cpu_net + pinned) * 1e9;  // bytes/s
    // max(cpu_fixed + r·S/c, gpu_fixed + (1 - r)·S/g) is least where the two sides meet.
    const double S = spilled_bytes;
    const double r = std::clamp((l.gpu_fixed - l.cpu_fixed + S / g) / (S / c + S / g), 0.0, 1.0);
    const double split = std::max(l.cpu_fixed + r * S / c, l.gpu_fixed + (1 - r) * S / g) + l.tail;
    l.bound_ms = std::min(split * 1e3, single_ms);
    return l;
}

struct Result {
    std::string model;
    std::size_t ctx, batch;
    double spilled_gb;
    double ms_writescope, ms_gpu_only, ms_cpu_only, ms_monolithic, ms_best_swept, ms_sweep_min;
    double r_policy, r_best, r_calibrated;
    double limit_ms;
    double h2h_noise;  // |one median / the other - 1| for the best split run twice head to head
    double cpu_rate, p_frac, g_frac;
    LimitParts parts;
};

void write_json(const std::string& path, const Ceilings& c, const std::vector<Result>& res,
                const std::string& machine, const std::string& date) {
    std::ofstream f(path);
    if (!f) throw std::runtime_error("cannot write " + path);
    f << "{\n  \"benchmark\": \"attention-step\",\n  \"date\": \"" << date
      << "\",\n  \"machine\": \"" << machine
      << "\",\n  \"ceilings_gbps\": {\"pinned_h2d\": " << c.pinned_h2d
      << ", \"hbm_copy\": " << c.hbm << ", \"hbm_read\": " << c.hbm_read
      << ", \"cpu_read\": " << c.cpu_read << ", \"aggregate_cpu\": " << c.agg_cpu
      << ", \"aggregate_copy\": " << c.agg_copy << "},\n  \"configs\": [\n";
    for (std::size_t i = 0; i < res.size(); ++i) {
        const auto& r = res[i];
        const double best_single = std::min(r.ms_gpu_only, r.ms_cpu_only);
        f << "    {\"model\": \"" << r.model << "\", \"context\": " << r.ctx
          << ", \"batch\": " << r.batch << ", \"spilled_gb\": " << r.spilled_gb
          << ", \"mode_ms\": {\"writescope\": " << r.ms_writescope
          << ", \"gpu-only\": " << r.ms_gpu_only << ", \"cpu-only\": " << r.ms_cpu_only
          << ", \"monolithic\": " << r.ms_monolithic << ", \"best-swept\": " << r.ms_best_swept
          << ", \"sweep-min\": " << r.ms_sweep_min << "}, \"r_policy\": " << r.r_policy
          << ", \"r_calibrated\": " << r.r_calibrated << ", \"r_best\": " << r.r_best
          << ", \"speedup_vs_best_single\": " << best_single / r.ms_writescope
          << ", \"speedup_vs_monolithic\": " << r.ms_monolithic / r.ms_writescope
          << ", \"policy_gap\": " << r.ms_writescope / r.ms_best_swept - 1.0
          << ", \"efficiency_vs_limit\": " << r.limit_ms / r.ms_writescope
          << ", \"cpu_kernel_gbps\": " << r.cpu_rate << ", \"p_transfer_frac\": " << r.p_frac
          << ", \"g_kernel_hbm_frac\": " << r.g_frac << ", \"h2h_noise\": " << r.h2h_noise;
        const LimitParts& l = r.parts;
        if (l.bound_ms > 0)
            f << ", \"limit_parts\": {\"cpu_fixed_us\": " << l.cpu_fixed * 1e6
              << ", \"gpu_fixed_us\": " << l.gpu_fixed * 1e6 << ", \"tail_us\": " << l.tail * 1e6
              << ", \"bound_ms\": " << l.bound_ms
              << ", \"factor_fixed\": " << r.limit_ms / l.bound_ms
              << ", \"factor_rest\": " << l.bound_ms / r.ms_writescope << "}";
        f << "}" << (i + 1 < res.size() ? "," : "") << "\n";
    }
    f << "  ]\n}\n";
}

}  // namespace

int run_attention_step(int argc, char** argv) {
    const Options o = parse(argc, argv);
    if (cuda::device_count() <= o.gpu)
        throw std::runtime_error("no CUDA GPU " + std::to_string(o.gpu));
    cuda::set_device(o.gpu);
    const auto info = cuda::device_info(o.gpu);
    char date[64];
    const std::time_t tt = std::time(nullptr);
    std::strftime(date, sizeof date, "%Y-%m-%d %H:%M UTC", std::gmtime(&tt));
    const std::size_t threads = o.threads ? o.threads : cpu::WorkerPool::allowed_cpus().size();
    cpu::WorkerPoolOptions po;
    po.threads = threads;
    po.pin = true;
    cpu::WorkerPool pool(po);
    const cpu::Isa isa = cpu::select_isa();
    std::printf("writescope-bench attention-step (%s)\n%s, %d SMs; %zu CPU threads (%s kernels)\n",
                date, info.name.c_str(), info.sm_count, threads,
                std::string(cpu::isa_name(isa)).c_str());
    const Ceilings c = measure_ceilings(pool, isa);
    std::printf(
        "ceilings: pinned H2D %.1f GB/s, HBM copy %.0f GB/s, HBM read %.0f GB/s, CPU read %.1f "
        "GB/s, both at once %.1f (CPU) + %.1f (copy) = %.1f GB/s\n\n",
        c.pinned_h2d, c.hbm, c.hbm_read, c.cpu_read, c.agg_cpu, c.agg_copy, c.aggregate());

    CacheFlusher flush(pool, isa, o.flush);
    if (o.flush)
        std::printf("before every step: %zu MiB streamed through the CPU caches (untimed)\n",
                    flush.bytes() >> 20);
    std::printf("GPU side enqueued %s\n\n",
                o.overlap ? "by the CPU's calling thread once its workers run"
                          : "before the CPU threads are woken (--no-overlap)");
    if (o.anatomy) {
        // The pool's dispatch alone: n empty items, when each worker took its first one.
        const auto pool_probe = [&](bool sleep) {
            std::vector<double> ret, last;
            std::vector<double> first(pool.concurrency());
            for (int k = 0; k < 200; ++k) {
                if (sleep) std::this_thread::sleep_for(std::chrono::milliseconds(1));
                std::fill(first.begin(), first.end(), 0.0);
                const double t0 = now();
                pool.parallel_for(pool.concurrency(), [&](std::size_t, std::size_t w) {
                    if (first[w] == 0) first[w] = now() - t0;
                });
                ret.push_back(now() - t0);
                last.push_back(*std::max_element(first.begin(), first.end()));
            }
            std::printf(
                "pool of %zu, %s: dispatch returns after %.1f us, last worker starts "
                "after %.1f us (medians of 200)\n",
                pool.concurrency(), sleep ? "asleep (1 ms idle)" : "back to back",
                median(ret) * 1e6, median(last) * 1e6);
        };
        pool_probe(true);
        pool_probe(false);
    }
    std::vector<Result> results;
    for (const auto& name : o.models) {
        auto rig = build_rig(name, o, threads, pool);
        rig->flush = &flush;
        rig->overlap = o.overlap;
        std::printf("%s: block %zu tokens, %zu B/token/layer, G holds %.1f%% of each sequence\n",
                    name.c_str(), o.block, rig->g.bytes_per_token_layer(), 100 * o.g_fraction);
        std::printf("%8s %5s %8s | %9s %9s %9s %9s | %6s %6s %7s %6s | %6s %6s %6s | %6s %5s %5s\n",
                    "context", "batch", "spill GB", "writescp", "gpu-only", "cpu-only", "monolith",
                    "r_pol", "r_best", "gap", "noise", "x best", "x mono", "eff", "CPU GB/s",
                    "P frac", "G/HBM");
        if (o.anatomy) {
            for (std::size_t batch : o.batches)
                for (std::size_t ctx : o.contexts) {
                    Config cf{rig.get(), ctx, batch, shape_of(ctx, o.block, o.g_fraction)};
                    for (double r : {0.0, 0.5, 1.0})
                        cf.anatomy(r, 4 * o.reps);
                }
            continue;
        }
        for (std::size_t batch : o.batches) {
            // Calibration for this batch: 50/50 splits at every context, both engines running.
            std::vector<double> cx, cy, gx, gy, ov;
            std::vector<Config> cfgs;
            for (std::size_t ctx : o.contexts) {
                Config cf{rig.get(), ctx, batch, shape_of(ctx, o.block, o.g_fraction)};
                const StepTime t = cf.run(0.5, o.reps);
                cx.push_back(static_cast<double>(t.cpu_tokens));
                cy.push_back(t.cpu);
                gx.push_back(static_cast<double>(t.gpu_tokens));
                gy.push_back(t.gpu_attn);
                ov.push_back(t.overhead);
                cfgs.push_back(std::move(cf));
            }
            LineFit fa = fit_line(cx, cy), fb = fit_line(gx, gy);
            if (cx.size() < 2) {
                // One length gives no line: per-token costs through the origin.
                std::printf("  (one context only: costs per token without fixed parts)\n");
                fa = {cx[0] > 0 ? cy[0] / cx[0] : 0, 0, 1};
                fb = {gx[0] > 0 ? gy[0] / gx[0] : 0, 0, 1};
            }
            RooflineCosts costs;
            costs.a = std::max(fa.slope, 0.0);
            costs.cpu_fixed = std::max(fa.intercept, 0.0);
            costs.b = std::max(fb.slope, 0.0);
            // Δ is the GPU side's own fixed cost, the intercept of its attention time. The merge
            // round trip (CPU partials up, merge, result down) follows both engines, so it is in
            // neither side of the balance.
            costs.delta = std::max(fb.intercept, 0.0);
            std::printf(
                "  batch %zu calibration: A %.3g ns/token (R^2 %.3f), B %.3g ns/token (R^2 %.3f), "
                "delta %.3g us, c0 %.3g us, merge round trip %.3g us\n",
                batch, costs.a * 1e9, fa.r2, costs.b * 1e9, fb.r2, costs.delta * 1e6,
                costs.cpu_fixed * 1e6, median(ov) * 1e6);
            for (auto& cf : cfgs) {
                Result r{};
                r.model = name;
                r.ctx = cf.ctx;
                r.batch = batch;
                r.spilled_gb = cf.spilled_bytes() / 1e9;
                // The policy as the engine runs it: calibrated constants, then online tracking of
                // A and B at the deployed split for a few steps, r recomputed after each.
                PolicyTrackers tr;
                tr.seed(costs);
                double rr = roofline_share(costs, static_cast<double>(cf.spilled_tokens()));
                for (int step = 0; step < 12; ++step) {
                    cf.prepare(rr);
                    const StepTime t = cf.run_decode_step(kLayersPerStep);
                    tr.observe(measurement_of(t));
                    const RooflineCosts k = tr.costs();
                    if (o.trace)
                        std::printf(
                            "    trace %zuK x %zu step %2d: r %.3f | CPU %6llu tok %7.1f us | GPU "
                            "%6llu tok %7.1f us | total %7.1f us -> A %.3g ns B %.3g ns delta "
                            "%.3g us c0 %.3g us\n",
                            cf.ctx / 1024, batch, step, rr,
                            static_cast<unsigned long long>(t.cpu_tokens), t.cpu * 1e6,
                            static_cast<unsigned long long>(t.gpu_tokens), t.gpu_attn * 1e6,
                            t.total * 1e6, k.a * 1e9, k.b * 1e9, k.delta * 1e6, k.cpu_fixed * 1e6);
                    rr = tr.deploy(roofline_share(k, static_cast<double>(cf.spilled_tokens())));
                }
                r.r_calibrated = roofline_share(costs, static_cast<double>(cf.spilled_tokens()));
                // The policy's split (a probe step, had the 12th been one, is not it).
                r.r_policy = roofline_share(tr.costs(), static_cast<double>(cf.spilled_tokens()));
                // The sweep, interleaved: r = 0, step, ..., 1; its best split is the candidate
                // optimum.
                std::vector<double> grid;
                const int n_grid = static_cast<int>(std::lround(1.0 / o.sweep_step));
                for (int k = 0; k <= n_grid; ++k)
                    grid.push_back(std::min(1.0, k * o.sweep_step));
                const std::vector<StepTime> sw = cf.run_interleaved(grid, o.reps);
                std::size_t best = 0;
                for (std::size_t k = 1; k < sw.size(); ++k)
                    if (sw[k].total < sw[best].total) best = k;
                r.r_best = grid[best];
                // Head to head on a fresh sample: the sweep's best, the policy's split and the
                // two single engines (the minimum of a sweep is biased low by selection; these
                // are not). Short steps get more rounds: their noise is a larger fraction.
                const int h2h_reps = sw[best].total < 5e-3 ? 4 * o.reps : 2 * o.reps;
                // The best split runs twice: how far two medians of one split fall apart is the
                // noise the policy gap is read against.
                const std::vector<StepTime> hh =
                    cf.run_interleaved({0.0, 1.0, r.r_best, r.r_policy, r.r_best}, h2h_reps);
                r.h2h_noise = std::abs(hh[4].total / hh[2].total - 1.0);
                const StepTime &g_only = hh[0], &c_only = hh[1];
                r.ms_gpu_only = g_only.total * 1e3;
                r.ms_cpu_only = c_only.total * 1e3;
                r.ms_writescope = hh[3].total * 1e3;
                // The same split twice is no gap, whatever the two samples say: two shares that
                // give every sequence the same number of CPU blocks are one split.
                r.ms_best_swept = cf.cpu_share_blocks(r.r_best) == cf.cpu_share_blocks(r.r_policy)
                                      ? r.ms_writescope
                                      : std::min(hh[2].total, hh[3].total) * 1e3;
                r.ms_sweep_min = sw[best].total * 1e3;
                r.p_frac = g_only.p_rate / c.pinned_h2d;
                r.cpu_rate = c_only.cpu > 0 ? cf.spilled_bytes() / c_only.cpu / 1e9 : 0;
                r.ms_monolithic = cf.run_monolithic(std::min(o.reps, 3)) * 1e3;
                r.g_frac = cf.gpu_inplace_rate(o.reps) / c.hbm;
                // The physical limit: spilled bytes over the CPU kernel's rate plus the pinned
                // PCIe rate, or over the host's aggregate read rate if that is lower.
                const double rate = std::min(r.cpu_rate + c.pinned_h2d, c.aggregate());
                r.limit_ms = cf.spilled_bytes() / (rate * 1e9) * 1e3;
                // Each side's fixed cost: one block per sequence on it, none on the other.
                if (cf.sh.s >= 1) {
                    const auto [one_cpu, one_gpu] = cf.run_fixed(2 * o.reps);
                    r.parts = limit_parts(
                        one_cpu, one_gpu, sw, static_cast<double>(cf.spilled_bytes()), c_only.cpu,
                        std::min(r.ms_gpu_only, r.ms_cpu_only), c.pinned_h2d, c.aggregate());
                }
                const double best_single = std::min(r.ms_gpu_only, r.ms_cpu_only);
                std::printf(
                    "%8zu %5zu %8.2f | %9.3f %9.3f %9.3f %9.3f | %6.2f %6.2f %6.1f%% %5.1f%% | "
                    "%5.2fx %5.2fx %6.2f | %6.1f %5.2f %5.2f\n",
                    r.ctx, r.batch, r.spilled_gb, r.ms_writescope, r.ms_gpu_only, r.ms_cpu_only,
                    r.ms_monolithic, r.r_policy, r.r_best,
                    100 * (r.ms_writescope / r.ms_best_swept - 1), 100 * r.h2h_noise,
                    best_single / r.ms_writescope, r.ms_monolithic / r.ms_writescope,
                    r.limit_ms / r.ms_writescope, r.cpu_rate, r.p_frac, r.g_frac);
                std::fflush(stdout);
                results.push_back(r);
            }
        }
        std::printf("\n");
    }
    double log_sum = 0, gap_max = 0, eff_min = 1e9;
    int n = 0, gap_ok = 0, eff_ok = 0, gap_in_noise = 0;
    for (const auto& r : results) {
        if (r.ctx < 8192) continue;
        log_sum += std::log(std::min(r.ms_gpu_only, r.ms_cpu_only) / r.ms_writescope);
        const double gap = r.ms_writescope / r.ms_best_swept - 1,
                     eff = r.limit_ms / r.ms_writescope;
        gap_max = std::max(gap_max, gap);
        eff_min = std::min(eff_min, eff);
        gap_ok += gap <= 0.03;
        gap_in_noise += gap > 0.03 && gap <= r.h2h_noise;
        eff_ok += eff >= 0.85;
        ++n;
    }
    if (n)
        std::printf(
            "summary over %d configurations at >= 8K: geomean speedup vs best single engine "
            "%.2fx; policy gap <= 3%% in %d (largest %.1f%%; of the others, %d within the "
            "noise of the best split run twice); efficiency vs limit >= 0.85 in %d (lowest %.2f)\n",
            n, std::exp(log_sum / n), gap_ok, 100 * gap_max, gap_in_noise, eff_ok, eff_min);

    // What the fixed costs leave of the limit, configuration by configuration (LimitParts),
    // and what the speedup would be at the limit (each configuration's speedup over its
    // efficiency).
    double log_bound = 0, log_fixed = 0, log_rest = 0;
    int n_parts = 0;
    for (const auto& r : results) {
        const LimitParts& l = r.parts;
        if (r.ctx < 8192 || l.bound_ms <= 0) continue;
        if (n_parts == 0)
            std::printf(
                "\nwhat the fixed costs leave (eff = fixed x rest; fixed: each side's time with "
                "one spilled block per sequence on it and none on the other, tail: after the later "
                "side):\n%-16s %7s %5s | %5s | %9s "
                "%9s %7s | %8s %8s | %5s %5s\n",
                "model", "context", "batch", "eff", "CPU fix us", "GPU fix us", "tail us",
                "limit ms", "bound ms", "fixed", "rest");
        const double eff = r.limit_ms / r.ms_writescope, f_fixed = r.limit_ms / l.bound_ms,
                     f_rest = l.bound_ms / r.ms_writescope;
        std::printf("%-16s %7zu %5zu | %5.2f | %9.1f %9.1f %7.1f | %8.3f %8.3f | %5.2f %5.2f\n",
                    r.model.c_str(), r.ctx, r.batch, eff, l.cpu_fixed * 1e6, l.gpu_fixed * 1e6,
                    l.tail * 1e6, r.limit_ms, l.bound_ms, f_fixed, f_rest);
        log_bound += std::log(std::min(r.ms_gpu_only, r.ms_cpu_only) / r.limit_ms);
        log_fixed += std::log(f_fixed);
        log_rest += std::log(f_rest);
        ++n_parts;
    }
    if (n_parts)
        std::printf(
            "limits over %d configurations at >= 8K: geomean speedup vs best single engine at the "
            "limit (efficiency 1) %.2fx; geomean factors: fixed %.2f, rest %.2f\n",
            n_parts, std::exp(log_bound / n_parts), std::exp(log_fixed / n_parts),
            std::exp(log_rest / n_parts));

    if (o.cpu_load) {
        // Drift: expert-like CPU streaming (and PCIe traffic) during steps 20–39.
        Options lo = o;
        lo.contexts = {32768};
        lo.batches = {4};
        auto rig = build_rig("qwen3-30b-a3b", lo, threads, pool);
        rig->flush = &flush;
        rig->overlap = o.overlap;
        Config cf{rig.get(), 32768, 4, shape_of(32768, o.block, o.g_fraction)};
        PolicyTrackers tr;
        StepTime t = cf.run(0.5, 3);
        RooflineCosts seed;
        seed.a = t.cpu / t.cpu_tokens;
        seed.b = t.gpu_attn / t.gpu_tokens;
        // One length gives no line: per-token costs through the origin, no fixed costs (as the
        // calibration does with one context); the trackers find the fixed costs.
        tr.seed(seed);
        const std::size_t load_bytes = std::size_t{2} << 30;  // an expert-sized stream, 2 GiB
        HostRegionMemory weights("experts", 1, 1, load_bytes);
        std::memset(weights.block(0, 0), 1, load_bytes);
        cuda::PinnedSlabs pcie(256u << 20, 256u << 20);
        cuda::DeviceBuffer dev(256u << 20);
        std::atomic<bool> load{false}, stop{false};
        std::vector<std::thread> loaders;
        for (int k = 0; k < 4; ++k)
            loaders.emplace_back([&, k] {
                while (!stop) {
                    if (!load) {
                        std::this_thread::sleep_for(std::chrono::milliseconds(1));
                        continue;
                    }
                    // This thread's quarter of the weights, every word, like a GEMV over them,
                    // in 8 MiB pieces so that the load stops within a piece of being switched off.
                    const auto* p = static_cast<const std::uint64_t*>(weights.block(0, 0));
                    const std::size_t words = load_bytes / 8 / 4, piece = (8u << 20) / 8;
                    std::uint64_t acc = 0;
                    for (std::size_t b = k * words; b < (k + 1) * words && load; b += piece)
                        for (std::size_t i = b; i < b + piece; ++i)
                            acc += p[i];
                    if (acc == 42) std::puts("");
                }
            });
        cuda::Stream side;
        std::printf("\n--cpu-load: qwen3-30b-a3b, 32K x 4, expert-like load on steps 20-39\n");
        std::printf("%4s %5s %12s %12s %12s %7s %9s\n", "step", "load", "A meas ns", "A track ns",
                    "B track ns", "r", "ms/layer");
        for (int step = 0; step < 60; ++step) {
            load = step >= 20 && step < 40;
            if (load) cuda::copy_async(dev.data(), pcie.slab(0), 256u << 20, side);
            const double r =
                tr.deploy(roofline_share(tr.costs(), static_cast<double>(cf.spilled_tokens())));
            cf.prepare(r);
            const StepTime s = cf.run_decode_step(kLayersPerStep);
            tr.observe(measurement_of(s));
            std::printf("%4d %5s %12.3f %12.3f %12.3f %7.3f %9.3f\n", step, load ? "on" : "off",
                        s.cpu_tokens ? s.cpu / s.cpu_tokens * 1e9 : 0.0, tr.costs().a * 1e9,
                        tr.costs().b * 1e9, r, s.total * 1e3);
            side.synchronize();
        }
        stop = true;
        for (auto& th : loaders)
            th.join();
    }

    if (!o.json.empty()) {
        std::string machine = info.name + ", " + std::to_string(threads) + " CPU threads";
        write_json(o.json, c, results, machine, date);
        std::printf("wrote %s\n", o.json.c_str());
    }
    return 0;
}

}  // namespace writescope::bench
