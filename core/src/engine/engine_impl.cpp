#include "writescope/core/engine_impl.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <thread>

namespace writescope {

namespace {

double lower_quartile(std::vector<double> v) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    return v[v.size() / 4];
}

// Random KV values (never zeros, which would hide outputs a kernel never wrote).
void random_values(void* dst, std::size_t n, DType t, std::mt19937_64& rng) {
    std::uniform_real_distribution<float> u(-2.0f, 2.0f);
    for (std::size_t i = 0; i < n; ++i)
        store_from_f32(dst, i, t, u(rng));
}

}  // namespace

EngineImpl::EngineImpl(const EngineOptions& opts, EngineParts parts)
    : opts_(opts),
      parts_(std::move(parts)),
      mode_(parse_execution_mode(opts.mode)),
      tracker_cfg_{},
      trackers_(tracker_cfg_) {
    if (!parts_.gpu_pool || !parts_.cpu) throw std::invalid_argument("engine: missing backends");
    if (mode_needs_gpu(mode_) && !parts_.gpu)
        throw std::invalid_argument("policy mode '" + opts.mode +
                                    "' needs a GPU; this engine runs on the CPU only");
    set_tracker(opts.tracker_alpha, opts.tracker_clamp);
    cache_ = std::make_unique<KvCache>(
        parts_.kv, parts_.pinned ? parts_.pinned->slab_slots() : std::size_t{0});
    r_deployed_ = parts_.gpu ? 0.5 : 1.0;
    exec_ = std::make_unique<StepExecutor>(StepExecutorConfig{opts.max_batch}, *cache_,
                                           *parts_.gpu_pool, parts_.pinned.get(),
                                           parts_.unpinned.get(), *parts_.cpu, parts_.gpu.get());
    // A handful of random linear blocks, copied round-robin wherever synthetic KV is needed.
    std::mt19937_64 rng(0x5eed);
    const std::size_t elems =
        LinearBlockLayout::of(parts_.kv.geometry, parts_.kv.block_tokens).elems();
    random_blocks_.resize(7);
    for (auto& b : random_blocks_) {
        b.resize(elems * dtype_bytes(parts_.kv.geometry.dtype));
        random_values(b.data(), elems, parts_.kv.geometry.dtype, rng);
    }
}

EngineImpl::~EngineImpl() {
    // The part thread refers to the executor, the executor to the cache, and the cache to the
    // parts: release them first.
    part_task_.reset();
    exec_.reset();
    cache_.reset();
}

void EngineImpl::fill_layer0(KvCache& cache, std::span<const std::uint64_t> ids, std::size_t tokens,
                             std::mt19937_64& rng) {
    std::size_t k = rng() % random_blocks_.size();
    auto next_block = [&]() -> const std::vector<std::byte>& {
        k = (k + 1) % random_blocks_.size();
        return random_blocks_[k];
    };
    for (std::uint64_t id : ids) {
        for (const SealMove& m : cache.append(id, tokens)) {
            const auto& src = next_block();
            switch (m.kind) {
                case MoveKind::remap:
                    parts_.write_pool_block(0, m.dest.slot, src.data());
                    break;
                case MoveKind::copy_to_pinned:
                    std::memcpy(parts_.pinned->block(0, m.dest.slot), src.data(), src.size());
                    break;
                case MoveKind::pack_to_unpinned:
                    parts_.cpu->pack_block(src.data(), parts_.unpinned->block(0, m.dest.slot));
                    break;
            }
        }
        parts_.write_pool_block(0, cache.open_block(id).t_slot, next_block().data());
    }
}

Calibration EngineImpl::calibrate(const std::function<void(double, std::string_view)>& progress,
                                  const std::atomic<bool>* cancel) {
    // The calibration works on the regions' memory with a cache of its own; the engine stays
    // answerable (status, policy) meanwhile, and admission waits for it to finish.
    {
        std::lock_guard lock(mu_);
        if (calibrating_) throw std::runtime_error("a calibration is already running");
        if (stepping_ || storing_)
            throw std::runtime_error(
                "calibration needs an idle engine: a step is open or a "
                "prompt is being stored");
        if (cache_->sequence_count() != 0)
            throw std::runtime_error(
                "calibration needs an idle engine: " + std::to_string(cache_->sequence_count()) +
                " sequences are active");
        calibrating_ = true;
    }
    struct Done {
        EngineImpl* e;
        ~Done() {
            std::lock_guard lock(e->mu_);
            e->calibrating_ = false;
        }
    } done{this};
    // The calibration writes into the regions' slots: every earlier seal must have landed.
    if (parts_.sealer) parts_.sealer->flush();
    const PlanCosts plan_costs = [&] {
        std::lock_guard lock(mu_);
        return trackers_.plan_costs();
    }();
    const double t_start = steady_seconds();
    const bool gpu = parts_.gpu != nullptr;
    const std::size_t B = parts_.kv.block_tokens;
    // A temporary cache over the same memory with no G: every sealed block spills, half to U and
    // half to P with a GPU (so each engine is measured while the other runs), all to U without.
    KvCacheConfig cfg = parts_.kv;
    cfg.g_slots = 0;
    cfg.target_r = gpu ? 0.5 : 1.0;
    KvCache cache(cfg, parts_.pinned ? parts_.pinned->slab_slots() : std::size_t{0});
    const auto& cap = cache.capacity();
    const std::size_t nseq = std::min<std::size_t>(4, std::max<std::size_t>(1, cfg.t_slots));
    std::size_t spill_blocks = cap.slots[static_cast<int>(Region::U)];
    if (gpu) {
        const std::size_t p_blocks = cache.region_stats(Region::P).capacity_blocks;
        spill_blocks = 2 * std::min(spill_blocks, p_blocks);
    }
    // Lengths: up to 128K spilled tokens (a long lever for the slope, still well under a second
    // per point), leaving a margin of a few blocks per sequence for rounding and P extents.
    const std::size_t margin = nseq * (cache.extent_slots() + 2);
    if (spill_blocks <= margin + nseq)
        throw std::runtime_error("calibration needs spill room: the KV budgets leave " +
                                 std::to_string(spill_blocks) + " spill blocks (need more than " +
                                 std::to_string(margin + nseq) + ")");
    const std::size_t max_tokens = std::min<std::size_t>(131072, (spill_blocks - margin) * B);
    const std::vector<double> fractions{0.125, 0.25, 0.5, 0.75, 1.0};
    StepExecutor exec(StepExecutorConfig{nseq}, cache, *parts_.gpu_pool, parts_.pinned.get(),
                      parts_.unpinned.get(), *parts_.cpu, parts_.gpu.get());
    const auto& g = parts_.kv.geometry;
    std::mt19937_64 rng(0xca11b);
    std::vector<std::byte> q(nseq * g.num_q_heads * g.head_dim_k * dtype_bytes(g.dtype));
    random_values(q.data(), q.size() / dtype_bytes(g.dtype), g.dtype, rng);
    const std::size_t rows = nseq * g.num_q_heads;
    std::vector<float> o(rows * g.head_dim_v), lse(rows);
    const ExecutionMode split =
        gpu ? ExecutionMode{ModeKind::static_split, 0.5} : ExecutionMode{ModeKind::cpu_only, 0};
    Calibration c;
    c.has_gpu = gpu;
    std::vector<double> cx, cy, gx, gy;
    std::vector<std::uint64_t> ids(nseq);
    // Each timed layer step reads another layer than the few before it, as a decode does: the
    // same layer again would find its KV in the last-level cache (the small points fit it), and
    // the CPU's slope and fixed cost would come out of cache reads. Only layer 0 holds the
    // points' random KV; the others hold zeros or older KV, which the kernels take as long on
    // (no kernel branches on a value per token: only masks and the final normalization do).
    const std::size_t layers = std::max<std::size_t>(1, static_cast<std::size_t>(g.num_layers));
    std::size_t layer = 0;
    for (std::size_t pi = 0; pi < fractions.size(); ++pi) {
        if (cancel && cancel->load()) throw std::runtime_error("calibration cancelled");
        const std::size_t per_seq =
            std::max<std::size_t>(B, static_cast<std::size_t>(fractions[pi] * max_tokens) / nseq);
        for (std::size_t i = 0; i < nseq; ++i) {
            ids[i] = 1000000 + pi * 100 + i;
            auto t = cache.admit(ids[i], per_seq + 1);
            if (!t.ok()) throw std::runtime_error("calibration: " + t.error());
        }
        fill_layer0(cache, ids, per_seq, rng);
        exec.plan(ids, split, plan_costs);
        std::vector<double> ct, gt;
        std::uint64_t cpu_tokens = 0, gpu_tokens = 0;
        for (int rep = 0; rep < 15; ++rep) {
            const auto r = exec.run_layer(
                layer, q.data(),
                {o.data(), lse.data(), rows, static_cast<std::size_t>(g.head_dim_v)});
            layer = (layer + 1) % layers;
            if (rep < 3) continue;  // warm-up
            // Both engines on one clock from the step's start: the CPU side's finish time (with
            // whatever of the GPU enqueue it waited for, part of c0) and the GPU's attention,
            // timed by events from the same start.
            ct.push_back(r.cpu_seconds);
            gt.push_back(r.gpu.attention_seconds);
            cpu_tokens = r.cpu_spilled_tokens;
            gpu_tokens = r.gpu_spilled_tokens;
        }
        CalibrationPoint p;
        p.tokens = per_seq * nseq;
        // The lower quartile: interference from other work (the daemon's own threads, other
        // tenants) only ever adds time, and the tracker follows lasting changes online.
        p.cpu_seconds = lower_quartile(ct);
        p.gpu_seconds = lower_quartile(gt);
        c.points.push_back(p);
        cx.push_back(static_cast<double>(cpu_tokens));
        cy.push_back(p.cpu_seconds);
        gx.push_back(static_cast<double>(gpu_tokens));
        gy.push_back(p.gpu_seconds);
        for (auto id : ids)
            cache.free(id);
        if (progress)
            progress(static_cast<double>(pi + 1) / fractions.size(),
                     gpu ? "measuring CPU and GPU attention together" : "measuring CPU attention");
    }
    const LineFit fa = fit_line(cx, cy);
    c.a = std::max(fa.slope, 0.0);
    c.cpu_intercept = std::max(fa.intercept, 0.0);
    c.a_r2 = fa.r2;
    if (gpu) {
        const LineFit fb = fit_line(gx, gy);
        c.b = std::max(fb.slope, 0.0);
        // Δ: the GPU side's own fixed cost. The merge round trip follows both engines, so
        // it is in neither side of the balance.
        c.delta = std::max(fb.intercept, 0.0);
        c.b_r2 = fb.r2;
    }
    c.seconds_taken = steady_seconds() - t_start;
    return c;
}

void EngineImpl::set_calibration(const Calibration& c) {
    std::lock_guard lock(mu_);
    calib_ = c;
    RooflineCosts rc;
    rc.a = c.a;
    rc.b = parts_.gpu ? c.b : std::numeric_limits<double>::infinity();
    rc.delta = c.delta;
    rc.cpu_fixed = c.cpu_intercept;
    trackers_.seed(rc);
    retarget_locked();
}

void EngineImpl::retarget_locked(double coming) {
    // New spilled blocks are routed toward the share the policy would deploy at the spilled
    // length the cache holds now, with what is about to be placed (an upper bound on what of
    // it spills: G may take some).
    const double L = static_cast<double>(cache_->region_stats(Region::P).used_blocks +
                                         cache_->region_stats(Region::U).used_blocks) *
                         static_cast<double>(parts_.kv.block_tokens) +
                     coming;
    cache_->set_target_r(routing_target_share(mode_, trackers_.costs(), L, parts_.gpu != nullptr));
}

EngineStatus EngineImpl::status() const {
    std::lock_guard lock(mu_);
    EngineStatus s;
    const auto st = cache_->stats();
    for (int i = 0; i < kNumRegions; ++i) {
        auto& r = s.regions[i];
        r.region = st[i].region;
        r.capacity_blocks = st[i].capacity_blocks;
        r.used_blocks = st[i].used_blocks;
        r.reserved_blocks = st[i].reserved_blocks;
        r.capacity_bytes = st[i].capacity_bytes;
        r.used_bytes = st[i].used_bytes;
        r.reserved_bytes = st[i].reserved_bytes;
    }
    s.sequences = cache_->sequence_count();
    s.mode = format_execution_mode(mode_);
    const auto c = trackers_.costs();
    s.a = c.a;
    s.b = parts_.gpu ? c.b : 0.0;
    s.delta = c.delta;
    s.r_target = cache_->target_r();
    s.r_deployed = r_deployed_;
    s.steps = steps_;
    s.step_seconds_mean = step_stats_.mean;
    s.cpu_isa = parts_.cpu->kernel_name();
    if (parts_.gpu) {
        s.gpu_kernel = parts_.gpu->kernel_name();
        s.gpu_tensor_cores = parts_.gpu->tensor_cores();
    }
    s.attention_threads = parts_.cpu->threads();
    s.gpu = parts_.gpu != nullptr;
    return s;
}

void EngineImpl::set_mode(std::string_view mode) {
    const ExecutionMode m = parse_execution_mode(mode);
    std::lock_guard lock(mu_);
    if (mode_needs_gpu(m) && !parts_.gpu)
        throw std::invalid_argument("policy mode '" + std::string(mode) +
                                    "' needs a GPU; this engine runs on the CPU only");
    mode_ = m;
    retarget_locked();
}

void EngineImpl::set_tracker(double alpha, double clamp) {
    TrackerConfig cfg = tracker_cfg_;
    cfg.alpha = alpha;
    cfg.clamp = clamp;
    if (const std::string e = cfg.validate(); !e.empty()) throw std::invalid_argument(e);
    std::unique_lock lock(mu_, std::defer_lock);
    if (cache_) lock.lock();  // not yet shared while constructing
    const RooflineCosts keep = trackers_.costs();
    const bool had = trackers_.a().has_estimate();
    tracker_cfg_ = cfg;
    trackers_ = PolicyTrackers(cfg);
    if (had) trackers_.seed(keep);
}

WorkloadKey EngineImpl::workload_key() const {
    std::uint64_t tokens = 0;
    for (auto id : cache_->sequences())
        tokens += cache_->sequence_stats(id).tokens;
    const std::size_t n = cache_->sequence_count();
    return make_workload_key(parts_.kv.geometry.name, parts_.kv.geometry.dtype, n,
                             n ? tokens / n : 0);
}

std::string EngineImpl::export_policy_state() const {
    std::lock_guard lock(mu_);
    return format_policy_state(
        capture_policy_state(workload_key(), trackers_, r_deployed_, step_stats_));
}

void EngineImpl::import_policy_state(std::string_view text) {
    const PolicyState s = parse_policy_state(text);
    std::lock_guard lock(mu_);
    if (s.key.model != parts_.kv.geometry.name || s.key.kv_dtype != parts_.kv.geometry.dtype)
        throw std::invalid_argument("policy state is for " + format_workload_key(s.key) +
                                    ", not for this engine's model " + parts_.kv.geometry.name +
                                    "/" + std::string(dtype_name(parts_.kv.geometry.dtype)));
    restore_policy_state(s, trackers_);
    r_deployed_ = s.r_deployed;
    step_stats_ = s.step_seconds;
    retarget_locked();
}

Admission EngineImpl::admit(std::uint64_t seq_id, std::size_t max_tokens) {
    std::lock_guard lock(mu_);
    if (calibrating_) return {false, "the engine is calibrating; retry when it has finished"};
    // The reservation follows the share at the length this sequence may bring.
    retarget_locked(static_cast<double>(max_tokens));
    AdmissionTicket t = cache_->prepare_admit(seq_id, max_tokens);
    const bool ok = t.ok();
    if (ok) cache_->apply(std::move(t));
    retarget_locked();
    if (!ok) return {false, t.error()};
    return {true, {}};
}

void EngineImpl::release(std::uint64_t seq_id) {
    std::lock_guard lock(mu_);
    if (stepping_ && std::find(step_ids_.begin(), step_ids_.end(), seq_id) != step_ids_.end())
        throw std::logic_error("sequence " + std::to_string(seq_id) +
                               " is in the open decode step: end or abort the step first");
    if (storing_ && storing_id_ == seq_id)
        throw std::logic_error("sequence " + std::to_string(seq_id) +
                               " is having its prompt stored: release it afterwards");
    cache_->free(seq_id);
}

void EngineImpl::begin_step(std::span<const std::uint64_t> seq_ids) {
    if (!parts_.sealer) throw std::logic_error("this engine has no seal mover: no decode steps");
    // (The last step's seals may still be landing: each layer waits for its own, attend_layer.)
    std::lock_guard lock(mu_);
    if (stepping_) throw std::logic_error("begin_step: a decode step is already open");
    if (storing_) throw std::logic_error("begin_step: a prompt is being stored");
    if (calibrating_)
        throw std::runtime_error("the engine is calibrating; retry when it has finished");
    if (seq_ids.empty()) throw std::invalid_argument("begin_step: no sequences");
    if (seq_ids.size() > opts_.max_batch)
        throw std::length_error("begin_step: " + std::to_string(seq_ids.size()) +
                                " sequences, more than max_batch (" +
                                std::to_string(opts_.max_batch) + ")");
    // (step_ids_ is free between steps: sorted there for the check, then set in batch order.)
    step_ids_.assign(seq_ids.begin(), seq_ids.end());
    std::sort(step_ids_.begin(), step_ids_.end());
    const bool repeated = std::adjacent_find(step_ids_.begin(), step_ids_.end()) != step_ids_.end();
    step_ids_.clear();
    if (repeated) throw std::invalid_argument("begin_step: a sequence appears twice in the batch");
    // The split: the mode's plan, except that the trackers may ask for a probe share after a
    // run of steps at one end (PolicyTrackers::deploy); then that share, as static:R.
    const PlanCosts costs = trackers_.plan_costs();
    // (Planned without laying out the work: that happens once, for the plan that runs.)
    const StepPlan* plan = &exec_->plan(seq_ids, mode_, costs, true, false);  // checks ids, room
    if (parts_.gpu && mode_.kind == ModeKind::writescope && plan->totals().spilled_tokens > 0) {
        const double planned = plan->totals().cpu_share;
        const double d = trackers_.deploy(planned);
        if (d != planned)
            plan =
                &exec_->plan(seq_ids, ExecutionMode{ModeKind::static_split, d}, costs, true, false);
    }
    exec_->build();
    const StepTotals& t = plan->totals();
    std::uint64_t p_to_cpu = 0;
    for (std::size_t i = 0; i < plan->num_seqs(); ++i)
        p_to_cpu += plan->split(i).p_to_cpu;
    step_cpu_p_tokens_ = static_cast<double>(p_to_cpu * parts_.kv.block_tokens);
    step_cpu_u_tokens_ = static_cast<double>(t.cpu_spilled_tokens) - step_cpu_p_tokens_;
    step_ = {};
    device_layer_seconds_.clear();
    step_.sequences = seq_ids.size();
    step_.r = t.spilled_tokens > 0 ? t.cpu_share : (parts_.gpu ? 0.0 : 1.0);
    step_ids_.assign(seq_ids.begin(), seq_ids.end());
    layers_done_ = 0;
    stepping_ = true;
}

void EngineImpl::prefill(std::uint64_t seq_id, std::size_t n, const void* k, const void* v) {
    if (!parts_.sealer || !parts_.write_pool_rows)
        throw std::logic_error("this engine cannot store a prompt (no seal mover)");
    const auto& g = parts_.kv.geometry;
    if (n == 0) return;
    if (!k || (!g.mla && !v))
        throw std::invalid_argument("prefill: the prompt's K and V are needed");
    parts_.sealer->flush();  // no earlier move may still read a T slot written below
    // Under the lock: the checks and the homes (the router decides them as the blocks fill).
    // The bytes are written without it (status and policy calls stay answered meanwhile);
    // storing_ keeps steps, calibration and the sequence's release out until they are.
    KvSequenceStats st;
    std::vector<SealMove> moves;
    std::uint32_t tail_slot = 0;
    {
        std::lock_guard lock(mu_);
        if (stepping_) throw std::logic_error("prefill: a decode step is open");
        if (storing_) throw std::logic_error("prefill: another prompt is being stored");
        if (calibrating_)
            throw std::runtime_error("the engine is calibrating; retry when it has finished");
        st = cache_->sequence_stats(seq_id);  // throws for an unknown id
        if (st.tokens + n > st.max_tokens)
            throw std::length_error("prefill: sequence " + std::to_string(seq_id) + " holds " +
                                    std::to_string(st.tokens) + " tokens; " + std::to_string(n) +
                                    " more pass its admitted maximum of " +
                                    std::to_string(st.max_tokens));
        retarget_locked(static_cast<double>(n));  // its blocks go at the length they make
        moves = cache_->append(seq_id, n);
        tail_slot = cache_->open_block(seq_id).t_slot;
        storing_ = true;
        storing_id_ = seq_id;
    }
    struct Stored {
        EngineImpl* e;
        ~Stored() {
            std::lock_guard lock(e->mu_);
            e->storing_ = false;
            e->retarget_locked();  // the spilled length changed
        }
    } stored{this};
    const std::size_t B = parts_.kv.block_tokens, es = dtype_bytes(g.dtype);
    const std::size_t layers = static_cast<std::size_t>(g.num_layers);
    const LinearBlockLayout lay = LinearBlockLayout::of(g, B);
    const std::size_t k_row = lay.row_heads() * lay.dk * es, v_row = lay.row_heads() * lay.dv * es;
    std::vector<std::byte> image(lay.elems() * es);
    // Tokens [first, first + count) of this prompt into rows [row0, row0 + count) of img, layer l.
    const auto put = [&](std::size_t l, std::size_t first, std::size_t row0, std::size_t count,
                         std::vector<std::byte>& img) {
        const auto* kl = static_cast<const char*>(k) + (l * n + first) * k_row;
        const auto* vl = g.mla ? nullptr : static_cast<const char*>(v) + (l * n + first) * v_row;
        lay.put_rows(es, kl, vl, row0, count, img.data());
    };
    // The open block's rows first: it holds st.open_tokens already, in its T slot.
    const std::size_t head = std::min(n, B - st.open_tokens);
    for (std::size_t l = 0; l < layers; ++l) {
        put(l, 0, st.open_tokens, head, image);
        parts_.write_pool_rows(l, st.t_slot, image.data(), st.open_tokens, head);
    }
    std::size_t next = 0;  // the next move to carry out
    if (!moves.empty() && moves[0].block_index == st.tokens / B) {
        // It filled: moved like a decode step's seal (out of T), and T may then be reused.
        parts_.sealer->apply(std::span<const SealMove>(moves.data(), 1));
        parts_.sealer->flush();
        next = 1;
    }
    // Every further sealed block is whole in this prompt: written straight to its home. G goes
    // through the device, on this thread; P and U are host memory, laid out on several threads
    // at once (block and layer pairs; no step can run meanwhile, so the cores are free).
    std::vector<std::pair<std::size_t, std::size_t>> host_work;  // (move, layer)
    for (; next < moves.size(); ++next) {
        const SealMove& m = moves[next];
        const std::size_t first = m.block_index * B - st.tokens;
        for (std::size_t l = 0; l < layers; ++l) {
            if (m.kind != MoveKind::remap) {
                host_work.emplace_back(next, l);
                continue;
            }
            put(l, first, 0, B, image);
            parts_.write_pool_block(l, m.dest.slot, image.data());
        }
    }
    const std::size_t helpers = std::min<std::size_t>(
        host_work.size() / 8, std::max(1u, std::thread::hardware_concurrency()));
    std::atomic<std::size_t> cursor{0};
    const auto drain = [&] {
        std::vector<std::byte> img(image.size());
        for (std::size_t i; (i = cursor.fetch_add(1)) < host_work.size();) {
            const auto [mi, l] = host_work[i];
            const SealMove& m = moves[mi];
            put(l, m.block_index * B - st.tokens, 0, B, img);
            if (m.kind == MoveKind::copy_to_pinned)
                std::memcpy(parts_.pinned->block(l, m.dest.slot), img.data(), img.size());
            else
                parts_.cpu->pack_block(img.data(), parts_.unpinned->block(l, m.dest.slot));
        }
    };
    {
        std::vector<std::jthread> pool;
        for (std::size_t t = 1; t < helpers; ++t)
            pool.emplace_back(drain);
        drain();
    }
    // What is left opens the next block.
    const std::size_t tail = (st.tokens + n) % B;
    if (head < n && tail > 0) {
        for (std::size_t l = 0; l < layers; ++l) {
            put(l, n - tail, 0, tail, image);
            parts_.write_pool_rows(l, tail_slot, image.data(), 0, tail);
        }
    }
}

bool EngineImpl::device_side() const noexcept {
    return parts_.gpu && parts_.gpu->device_side();
}

int EngineImpl::gpu_device() const noexcept {
    return parts_.gpu ? opts_.gpu_index : -1;
}

void EngineImpl::check_layer_locked(std::size_t layer, const void* q, NewTokens fresh) const {
    if (!stepping_) throw std::logic_error("attend_layer: no decode step is open");
    if (in_layer_) throw std::logic_error("attend_layer: another layer is running");
    if (layer != layers_done_)
        throw std::logic_error("attend_layer: layer " + std::to_string(layer) +
                               " out of order; the step is at layer " +
                               std::to_string(layers_done_));
    if (!q || !fresh.k) throw std::invalid_argument("attend_layer: q and the new K are needed");
}

void EngineImpl::layer_done_locked(const LayerStepResult& r, bool device_side) {
    if (device_side)
        device_layer_seconds_.push_back(r.step_seconds);  // the GPU's at end_step
    else
        step_.seconds += r.step_seconds;
    step_.cpu_seconds += r.cpu_seconds;
    step_.gpu_seconds += r.gpu.attention_seconds;
    step_.cpu_spilled_tokens = r.cpu_spilled_tokens;
    step_.gpu_spilled_tokens = r.gpu_spilled_tokens;
    ++layers_done_;
}

void EngineImpl::attend_layer(std::size_t layer, const void* q, NewTokens fresh, StateView out,
                              void* device_stream) {
    {
        std::lock_guard lock(mu_);
        check_layer_locked(layer, q, fresh);
        in_layer_ = true;
    }
    struct Clear {
        EngineImpl* e;
        ~Clear() {
            std::lock_guard lock(e->mu_);
            e->in_layer_ = false;
        }
    } clear{this};
    // This layer of the blocks sealed so far must have landed (U laid out) before either
    // engine reads it; later layers are still being laid out meanwhile.
    parts_.sealer->wait_layer(layer);
    const LayerStepResult r = exec_->run_layer(layer, q, out, fresh, device_stream);
    std::lock_guard lock(mu_);
    layer_done_locked(r, device_stream != nullptr);
}

bool EngineImpl::attends_in_parts() const noexcept {
    return exec_ && exec_->parts_possible();
}

void EngineImpl::attend_layer_first(std::size_t layer, const void* q, NewTokens fresh,
                                    StateView out, void* device_stream, std::size_t split) {
    if (!device_stream || !attends_in_parts() || split == 0 || split >= exec_->planned_seqs()) {
        attend_layer(layer, q, fresh, out, device_stream);
        return;
    }
    {
        std::lock_guard lock(mu_);
        check_layer_locked(layer, q, fresh);
        in_layer_ = true;
    }
    try {
        parts_.sealer->wait_layer(layer);
        part_result_ = exec_->run_layer_first(layer, q, out, fresh, device_stream, split);
        if (!part_task_) part_task_ = std::make_unique<BackgroundTask>();
        // The second part on the engine's own thread: the CPU attends its sequences while the
        // caller computes on the first part's rows.
        part_task_->start([this] { part_result_ = exec_->run_layer_rest(part_result_); });
    } catch (...) {
        std::lock_guard lock(mu_);
        in_layer_ = false;
        throw;
    }
    std::lock_guard lock(mu_);
    in_parts_ = true;
}

void EngineImpl::finish_layer(void* device_stream) {
    {
        std::lock_guard lock(mu_);
        if (!in_parts_) return;  // the layer was attended whole
    }
    struct Clear {
        EngineImpl* e;
        ~Clear() {
            std::lock_guard lock(e->mu_);
            e->in_layer_ = false;
            e->in_parts_ = false;
        }
    } clear{this};
    part_task_->join();
    parts_.gpu->device_wait(device_stream);
    std::lock_guard lock(mu_);
    layer_done_locked(part_result_, true);
}

StepReport EngineImpl::end_step() {
    std::lock_guard lock(mu_);
    if (!stepping_) throw std::logic_error("end_step: no decode step is open");
    if (in_layer_) throw std::logic_error("end_step: a layer is running");
    const std::size_t layers = static_cast<std::size_t>(parts_.kv.geometry.num_layers);
    if (layers_done_ != layers)
        throw std::logic_error("end_step: " + std::to_string(layers_done_) + " of " +
                               std::to_string(layers) + " layers attended");
    if (!device_layer_seconds_.empty()) {
        // The layers attended on the device side: the GPU's timings, now that they are done
        // (first: an error of the device's work throws here, before the tokens are appended).
        // A layer lasted until both the host's part (the CPU's share) and the GPU's ended.
        device_timings_.resize(device_layer_seconds_.size());
        const std::size_t n = parts_.gpu->take_device_timings(device_timings_);
        for (std::size_t i = 0; i < device_layer_seconds_.size(); ++i) {
            const double gpu = i < n ? device_timings_[i].total_seconds : 0.0;
            step_.seconds += std::max(device_layer_seconds_[i], gpu);
            if (i < n) step_.gpu_seconds += device_timings_[i].attention_seconds;
        }
        device_layer_seconds_.clear();
    }
    // The tokens join the cache; blocks that filled are sealed where the router sends them.
    // (begin_step checked the room, and release() refuses the step's sequences meanwhile.)
    std::vector<SealMove>& moves = step_moves_;  // reused: no allocation in steady state
    moves.clear();
    for (std::uint64_t id : step_ids_)
        for (const SealMove& m : cache_->append(id, 1))
            moves.push_back(m);
    parts_.sealer->apply(moves);
    for (const SealMove& m : moves) {
        step_.sealed_g += m.kind == MoveKind::remap;
        step_.sealed_p += m.kind == MoveKind::copy_to_pinned;
        step_.sealed_u += m.kind == MoveKind::pack_to_unpinned;
    }
    step_.layers = layers;
    const double L = static_cast<double>(layers);
    step_.cpu_seconds /= L;
    step_.gpu_seconds /= L;
    // The trackers learn from every step, per layer (the calibration's unit).
    StepMeasurement m;
    m.cpu_seconds = step_.cpu_seconds;
    m.cpu_u_tokens = step_cpu_u_tokens_;
    m.cpu_p_tokens = step_cpu_p_tokens_;
    m.gpu_seconds = step_.gpu_seconds;
    m.gpu_p_tokens = static_cast<double>(step_.gpu_spilled_tokens);
    trackers_.observe(m);
    r_deployed_ = step_.r;
    ++steps_;
    step_stats_.add(step_.seconds / L);
    retarget_locked();
    stepping_ = false;
    step_ids_.clear();
    return step_;
}

void EngineImpl::abort_step() {
    bool parts = false;
    {
        std::lock_guard lock(mu_);
        parts = in_parts_;
    }
    if (parts) {
        // A layer in parts: its second part ends first (what it threw is the caller's error,
        // already on its way).
        try {
            part_task_->join();
        } catch (...) {
        }
        std::lock_guard lock(mu_);
        in_parts_ = false;
        in_layer_ = false;
    }
    std::lock_guard lock(mu_);
    if (!stepping_) throw std::logic_error("abort_step: no decode step is open");
    if (in_layer_) throw std::logic_error("abort_step: a layer is running");
    stepping_ = false;
    step_ids_.clear();
}

}  // namespace writescope

namespace writescope {

void EngineImpl::attend_prompt(std::uint64_t seq_id, std::size_t layer, std::size_t m,
                               const void* q, const void* k, const void* v, StateView out,
                               void* device_stream) {
    const auto& g = parts_.kv.geometry;
    const std::size_t qh = static_cast<std::size_t>(g.num_q_heads);
    const std::size_t dv = static_cast<std::size_t>(g.head_dim_v);
    if (m == 0) return;
    if (!q || !k || (!g.mla && !v))
        throw std::invalid_argument("attend_prompt: the chunk's q, K and V are needed");
    if (layer >= static_cast<std::size_t>(g.num_layers))
        throw std::invalid_argument("attend_prompt: layer " + std::to_string(layer) +
                                    " of a model of " + std::to_string(g.num_layers));
    if (out.rows != m * qh || out.dim != dv || !out.o || !out.lse)
        throw std::invalid_argument(
            "attend_prompt: the output must be (m × num_q_heads, "
            "head_dim_v)");
    if (device_stream) {
        if (!device_side())
            throw std::invalid_argument(
                "attend_prompt: device memory, but this engine attends in host memory");
        if (m > device_prompt_tokens())
            throw std::invalid_argument("attend_prompt: a chunk of " + std::to_string(m) +
                                        " tokens on the device, sized for " +
                                        std::to_string(device_prompt_tokens()));
    }
    std::vector<BlockRef> table;
    OpenBlock open;
    {
        std::lock_guard lock(mu_);
        if (stepping_) throw std::logic_error("attend_prompt: a decode step is open");
        if (storing_) throw std::logic_error("attend_prompt: a prompt is being stored");
        if (calibrating_)
            throw std::runtime_error("the engine is calibrating; retry when it has finished");
        const KvSequenceStats st = cache_->sequence_stats(seq_id);  // throws for an unknown id
        if (st.tokens + m > st.max_tokens)
            throw std::length_error("attend_prompt: sequence " + std::to_string(seq_id) +
                                    " holds " + std::to_string(st.tokens) + " tokens; " +
                                    std::to_string(m) + " more pass its admitted maximum of " +
                                    std::to_string(st.max_tokens));
        const auto sealed = cache_->block_table(seq_id);
        table.assign(sealed.begin(), sealed.end());
        open = cache_->open_block(seq_id);
        // Keeps steps, prompts, calibration and this sequence's release out while the blocks
        // are read without the lock.
        storing_ = true;
        storing_id_ = seq_id;
    }
    struct Done {
        EngineImpl* e;
        ~Done() {
            std::lock_guard lock(e->mu_);
            e->storing_ = false;
        }
    } done{this};
    if (parts_.sealer) parts_.sealer->wait_layer(layer);  // sealed blocks of this layer landed
    if (device_stream)
        attend_prompt_device(layer, m, q, k, v, out, table, open, device_stream);
    else
        attend_prompt_host(layer, m, q, k, v, out, table, open);
}

std::size_t EngineImpl::device_prompt_tokens() const noexcept {
    return device_side() ? parts_.gpu->prompt_tokens() : 0;
}

void EngineImpl::attend_prompt_host(std::size_t layer, std::size_t m, const void* q, const void* k,
                                    const void* v, StateView out, std::span<const BlockRef> table,
                                    const OpenBlock& open) {
    const auto& g = parts_.kv.geometry;
    const std::size_t B = parts_.kv.block_tokens, es = dtype_bytes(g.dtype);
    const LinearBlockLayout lay = LinearBlockLayout::of(g, B);
    const std::size_t block_bytes = lay.elems() * es;
    const std::size_t chunk_blocks = (m + B - 1) / B;
    prompt_blocks_.resize(chunk_blocks * block_bytes);
    const std::size_t k_row = lay.row_heads() * lay.dk * es, v_row = lay.row_heads() * lay.dv * es;
    for (std::size_t b = 0; b < chunk_blocks; ++b) {
        const std::size_t first = b * B, count = std::min(B, m - first);
        lay.put_rows(es, static_cast<const char*>(k) + first * k_row,
                     g.mla ? nullptr : static_cast<const char*>(v) + first * v_row, 0, count,
                     prompt_blocks_.data() + b * block_bytes);
    }
    // The stored blocks every query attends: the sealed ones in their regions, then the rows of
    // the open block. T and G in device memory are brought down for the CPU's kernels (one
    // copy per block and chunk: this is the path of an engine without device-side prompts).
    RegionMemory& pool = *parts_.gpu_pool;
    const bool pool_host = pool.host_accessible();
    prompt_pool_slots_.clear();
    for (const BlockRef& ref : table)
        if (!pool_host && (ref.region == Region::G || ref.region == Region::T))
            prompt_pool_slots_.push_back(ref.slot);
    if (!pool_host && open.tokens > 0) prompt_pool_slots_.push_back(open.t_slot);
    if (!pool_host) {
        prompt_pool_.resize(prompt_pool_slots_.size() * pool.slot_bytes());
        pool.read(layer, prompt_pool_slots_, prompt_pool_.data());
    }
    std::size_t pool_read = 0;
    auto pool_block = [&](std::uint32_t slot) -> const void* {
        if (pool_host) return pool.block(layer, slot);
        return prompt_pool_.data() + pool_read++ * pool.slot_bytes();
    };
    std::vector<CpuBlock>& stored = prompt_stored_;
    stored.clear();
    for (const BlockRef& ref : table) {
        switch (ref.region) {
            case Region::U:
                stored.push_back(
                    {parts_.unpinned->block(layer, ref.slot), static_cast<std::uint32_t>(B), true});
                break;
            case Region::P:
                stored.push_back(
                    {parts_.pinned->block(layer, ref.slot), static_cast<std::uint32_t>(B), false});
                break;
            case Region::G:
            case Region::T:
                stored.push_back({pool_block(ref.slot), static_cast<std::uint32_t>(B), false});
                break;
        }
    }
    if (open.tokens > 0)
        stored.push_back({pool_block(open.t_slot), static_cast<std::uint32_t>(open.tokens), false});
    attend_prompt_cpu(m, q, stored, prompt_blocks_.data(), out);
}

void EngineImpl::attend_prompt_cpu(std::size_t m, const void* q, std::span<const CpuBlock> stored,
                                   const std::byte* chunk_blocks, StateView out) {
    const auto& g = parts_.kv.geometry;
    const std::size_t qh = static_cast<std::size_t>(g.num_q_heads);
    const std::size_t dv = static_cast<std::size_t>(g.head_dim_v);
    const std::size_t B = parts_.kv.block_tokens, es = dtype_bytes(g.dtype);
    const std::size_t block_bytes = LinearBlockLayout::of(g, B).elems() * es;
    const std::size_t rows = m * qh;
    // With stored blocks, the chunk's part goes to scratch and the stored part (every query
    // sees them whole, several queries per pass over a block) beside it; then both merge.
    StateView chunk_out = out, stored_out{};
    if (!stored.empty()) {
        prompt_states_.resize(2 * rows * (dv + 1));
        float* base = prompt_states_.data();
        chunk_out = {base, base + rows * dv, rows, dv};
        base += rows * (dv + 1);
        stored_out = {base, base + rows * dv, rows, dv};
        parts_.cpu->attend_shared(m, q, stored, stored_out);
    }
    // The chunk itself: query i sees the chunk's blocks before its own in full and its own up
    // to itself, in batches the CPU backend is sized for.
    const std::size_t batch = std::max<std::size_t>(1, opts_.max_batch);
    const std::size_t q_row = qh * static_cast<std::size_t>(g.head_dim_k) * es;
    for (std::size_t i0 = 0; i0 < m; i0 += batch) {
        const std::size_t n = std::min(batch, m - i0);
        prompt_refs_.clear();
        prompt_begin_.assign(n + 1, 0);
        for (std::size_t j = 0; j < n; ++j) {
            const std::size_t i = i0 + j, own = i / B;
            prompt_begin_[j] = prompt_refs_.size();
            for (std::size_t b = 0; b <= own; ++b)
                prompt_refs_.push_back({chunk_blocks + b * block_bytes,
                                        static_cast<std::uint32_t>(b < own ? B : i - own * B + 1),
                                        false});
        }
        prompt_begin_[n] = prompt_refs_.size();
        prompt_work_.resize(n);
        for (std::size_t j = 0; j < n; ++j)
            prompt_work_[j] = {static_cast<const char*>(q) + (i0 + j) * q_row,
                               std::span<const CpuBlock>(prompt_refs_.data() + prompt_begin_[j],
                                                         prompt_begin_[j + 1] - prompt_begin_[j])};
        StateView part{chunk_out.o + i0 * qh * dv, chunk_out.lse + i0 * qh, n * qh, dv};
        parts_.cpu->attend(std::span<const CpuSeqWork>(prompt_work_.data(), n), part);
    }
    if (!stored.empty()) {
        const ConstStateView parts[] = {{stored_out.o, stored_out.lse, rows, dv},
                                        {chunk_out.o, chunk_out.lse, rows, dv}};
        merge_states(parts, out);
    }
}

void EngineImpl::attend_prompt_device(std::size_t layer, std::size_t m, const void* q,
                                      const void* k, const void* v, StateView out,
                                      std::span<const BlockRef> table, const OpenBlock& open,
                                      void* stream) {
    const std::size_t B = parts_.kv.block_tokens;
    prompt_pool_slots_.clear();
    prompt_p_slots_.clear();
    prompt_u_blocks_.clear();
    for (const BlockRef& ref : table) {
        switch (ref.region) {
            case Region::G:
            case Region::T:
                prompt_pool_slots_.push_back(ref.slot);
                break;
            case Region::P:
                prompt_p_slots_.push_back(ref.slot);
                break;
            case Region::U:
                prompt_u_blocks_.push_back(
                    {parts_.unpinned->block(layer, ref.slot), static_cast<std::uint32_t>(B), true});
                break;
        }
    }
    if (open.tokens > 0) prompt_pool_slots_.push_back(open.t_slot);
    GpuPromptWork work;
    work.pool_slots = prompt_pool_slots_;
    work.has_open = open.tokens > 0;
    work.open_tokens = static_cast<std::uint32_t>(open.tokens);
    work.p_slots = prompt_p_slots_;
    GpuAttentionBackend& gpu = *parts_.gpu;
    // The U blocks go to the GPU too where the backend takes them: each is read once per chunk
    // and layer either way, and the GPU attends a chunk's queries over it hundreds of times
    // faster than the CPU (docs/gpu-runtime.md, "U in prompt attention"); the CPU's part is the
    // layout, piece by piece, while the previous piece crosses PCIe.
    const std::size_t piece = gpu.prompt_u_piece_blocks();
    const bool u_on_gpu = piece > 0 && !prompt_u_blocks_.empty();
    if (u_on_gpu) work.u_blocks = static_cast<std::uint32_t>(prompt_u_blocks_.size());
    const bool cpu_share = !u_on_gpu && !prompt_u_blocks_.empty();
    gpu.launch_prompt(layer, m, q, k, v, work, stream, cpu_share);
    if (u_on_gpu) {
        prompt_u_packed_.clear();
        for (const CpuBlock& b : prompt_u_blocks_)
            prompt_u_packed_.push_back(b.data);
        const std::span<const void* const> all(prompt_u_packed_);
        for (std::size_t i = 0, first = 0; first < all.size(); ++i, first += piece) {
            void* dst = gpu.prompt_u_piece(i);
            parts_.cpu->unpack_blocks(all.subspan(first, std::min(piece, all.size() - first)), dst);
            gpu.prompt_u_ready(i);
        }
    }
    if (!cpu_share) {
        gpu.finish_prompt(ConstStateView{}, out, stream);
        return;
    }
    // The CPU's share: the U blocks, which every query of the chunk sees whole.
    const std::size_t rows = m * static_cast<std::size_t>(parts_.kv.geometry.num_q_heads);
    const StateView part = gpu.prompt_cpu_buffer(rows);
    if (!part.o) throw std::logic_error("attend_prompt: the GPU backend has no CPU buffer");
    parts_.cpu->attend_shared(m, gpu.host_prompt_q(), prompt_u_blocks_, part);
    gpu.finish_prompt(ConstStateView{part.o, part.lse, part.rows, part.dim}, out, stream);
}

}  // namespace writescope
