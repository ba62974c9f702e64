#include "writescope/core/step_plan.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

namespace writescope {

namespace {

PlanCosts sanitize(PlanCosts c) noexcept {
    c.a = sanitized_per_token_cost(c.a);
    c.a_pinned = std::max(sanitized_per_token_cost(c.a_pinned), c.a);
    c.b = sanitized_per_token_cost(c.b);
    c.b_pageable = std::max(sanitized_per_token_cost(c.b_pageable), c.b);
    c.delta = sanitized_fixed_cost(c.delta);
    c.cpu_fixed = sanitized_fixed_cost(c.cpu_fixed);
    return c;
}

struct EngineTimes {
    double x = 0;  // the side that shrinks as k grows
    double y = 0;  // the side that grows as k grows
};

// The k in [0, n] minimising max(x(k), y(k)) when x is nonincreasing and y nondecreasing in k;
// among equal minima the smallest k (fewest moved blocks). Exact, O(log n) evaluations: the
// minimum is at the first k where x ≤ y or just before it.
template <class Eval>
std::uint64_t minimise_crossing(std::uint64_t n, Eval eval) {
    std::uint64_t lo = 0, hi = n + 1;  // first k with x ≤ y lies in [lo, hi]; n + 1 = none
    while (lo < hi) {
        const std::uint64_t mid = lo + (hi - lo) / 2;
        const EngineTimes t = eval(mid);
        if (t.x <= t.y) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    const std::uint64_t first = lo;
    if (first == 0) return 0;  // y already dominates: moving only makes it worse
    const std::uint64_t before = first - 1;
    const double f_before = eval(before).x;  // x > y there
    if (first <= n) {
        const EngineTimes t = eval(first);
        if (std::max(t.x, t.y) < f_before) return first;
    }
    // Before the crossing the step time is x(k), nonincreasing: find the first k reaching it.
    std::uint64_t a = 0, b = before;
    while (a < b) {
        const std::uint64_t mid = a + (b - a) / 2;
        if (eval(mid).x <= f_before) {
            b = mid;
        } else {
            a = mid + 1;
        }
    }
    return a;
}

// Nearest integer k in [0, n] to a non-negative real target.
std::uint64_t nearest_count(double target, std::uint64_t n) noexcept {
    if (!(target > 0)) return 0;
    if (target >= static_cast<double>(n)) return n;
    return static_cast<std::uint64_t>(std::llround(target));
}

}  // namespace

PlanCosts PlanCosts::from(const RooflineCosts& c, const RegionPenalties& p) noexcept {
    PlanCosts out;
    out.a = c.a;
    out.a_pinned = c.a * p.pinned_read;
    out.b = c.b;
    out.b_pageable = c.b * p.pageable_copy;
    out.delta = c.delta;
    out.cpu_fixed = c.cpu_fixed;
    return out;
}

void StepPlan::reserve(std::size_t max_seqs, std::size_t max_total_blocks) {
    if (max_total_blocks > std::numeric_limits<std::uint32_t>::max()) {
        throw std::length_error("step plan: more than 2^32 - 1 blocks per step");
    }
    seqs_.resize(std::max(max_seqs, seqs_.size()));
    index_.resize(std::max(max_total_blocks, index_.size()));
}

std::span<const std::uint32_t> StepPlan::cpu_blocks(std::size_t seq) const noexcept {
    const SequenceSplit& s = seqs_[seq];
    return {index_.data() + s.offset, s.num_cpu};
}

std::span<const std::uint32_t> StepPlan::gpu_blocks(std::size_t seq) const noexcept {
    const SequenceSplit& s = seqs_[seq];
    return {index_.data() + s.offset + s.num_cpu, s.num_gpu};
}

void plan_step(std::span<const SequenceBlocks> batch, const PlanOptions& opts, StepPlan& plan) {
    plan.num_seqs_ = 0;
    plan.totals_ = {};
    if (opts.block_tokens == 0) throw std::invalid_argument("step plan: block_tokens is 0");
    if (batch.size() > plan.seqs_.size()) {
        throw std::length_error("step plan: " + std::to_string(batch.size()) +
                                " sequences, reserved for " + std::to_string(plan.seqs_.size()));
    }
    const PlanCosts c = sanitize(opts.costs);
    const double bt = static_cast<double>(opts.block_tokens);
    const bool gpu = opts.has_gpu;

    // Pass 1: count each sequence's stored blocks and lay out its segment of the index array.
    std::uint64_t n_u = 0, n_p = 0, n_g = 0, t_tokens = 0, total = 0;
    for (std::size_t i = 0; i < batch.size(); ++i) {
        const SequenceBlocks& sb = batch[i];
        if (sb.open_tokens > opts.block_tokens) {
            throw std::invalid_argument("step plan: sequence " + std::to_string(i) + " has " +
                                        std::to_string(sb.open_tokens) +
                                        " open tokens, more than a block's " +
                                        std::to_string(opts.block_tokens));
        }
        if (total + sb.blocks.size() > plan.index_.size()) {
            throw std::length_error("step plan: more than the " +
                                    std::to_string(plan.index_.size()) + " reserved block entries");
        }
        SequenceSplit s;
        s.offset = static_cast<std::uint32_t>(total);
        for (const BlockRef& ref : sb.blocks) {
            switch (ref.region) {
                case Region::U:
                    ++s.u_blocks;
                    break;
                case Region::P:
                    ++s.p_blocks;
                    break;
                case Region::G:
                    ++n_g;
                    break;
                case Region::T:
                    t_tokens += sb.open_tokens;
                    break;
            }
        }
        n_u += s.u_blocks;
        n_p += s.p_blocks;
        total += sb.blocks.size();
        plan.seqs_[i] = s;
    }

    // How many U blocks the GPU pulls (k_u) or P blocks the CPU reads in place (k_p).
    std::uint64_t k_u = 0, k_p = 0;
    const auto cpu_time = [&](std::uint64_t ku, std::uint64_t kp) {
        const double u_tok = static_cast<double>(n_u - ku) * bt;
        const double p_tok = static_cast<double>(kp) * bt;
        return (u_tok + p_tok > 0) ? c.cpu_fixed + cost_of(c.a, u_tok) + cost_of(c.a_pinned, p_tok)
                                   : 0.0;
    };
    const auto gpu_time = [&](std::uint64_t ku, std::uint64_t kp) {
        return c.delta + cost_of(c.b, static_cast<double>(n_p - kp) * bt) +
               cost_of(c.b_pageable, static_cast<double>(ku) * bt);
    };
    if (!gpu) {
        k_p = n_p;
    } else {
        switch (opts.mode.kind) {
            case ModeKind::gpu_only:
            case ModeKind::monolithic:
                k_u = opts.gpu_pulls_u ? n_u : 0;
                break;
            case ModeKind::cpu_only:
                k_p = n_p;
                break;
            case ModeKind::static_split: {
                const double r = std::clamp(opts.mode.static_share, 0.0, 1.0);
                const double target_blocks = r * static_cast<double>(n_u + n_p);
                if (target_blocks < static_cast<double>(n_u)) {
                    if (opts.gpu_pulls_u)
                        k_u = nearest_count(static_cast<double>(n_u) - target_blocks, n_u);
                } else {
                    k_p = nearest_count(target_blocks - static_cast<double>(n_u), n_p);
                }
                break;
            }
            case ModeKind::writescope: {
                const double cpu0 = cpu_time(0, 0), gpu0 = gpu_time(0, 0);
                if (cpu0 > gpu0 && opts.gpu_pulls_u) {
                    k_u = minimise_crossing(n_u, [&](std::uint64_t k) {
                        return EngineTimes{cpu_time(k, 0), gpu_time(k, 0)};
                    });
                } else if (gpu0 > cpu0) {
                    k_p = minimise_crossing(n_p, [&](std::uint64_t k) {
                        return EngineTimes{gpu_time(0, k), cpu_time(0, k)};
                    });
                }
                break;
            }
        }
    }

    // Pass 2: spread the moves over the sequences in proportion to what each stores (cumulative
    // rounding: sequence i moves floor(k·C_i/N) − floor(k·C_{i−1}/N), C the running count), and
    // write each sequence's CPU and GPU lists in token order.
    std::uint64_t cum_u = 0, cum_p = 0, moved_u = 0, moved_p = 0;
    std::uint64_t cpu_spilled = 0;
    for (std::size_t i = 0; i < batch.size(); ++i) {
        SequenceSplit& s = plan.seqs_[i];
        cum_u += s.u_blocks;
        cum_p += s.p_blocks;
        const std::uint64_t to_u = n_u ? k_u * cum_u / n_u : 0;
        const std::uint64_t to_p = n_p ? k_p * cum_p / n_p : 0;
        s.u_to_gpu = static_cast<std::uint32_t>(to_u - moved_u);
        s.p_to_cpu = static_cast<std::uint32_t>(to_p - moved_p);
        moved_u = to_u;
        moved_p = to_p;

        const std::size_t n = batch[i].blocks.size();
        const std::uint32_t resident = static_cast<std::uint32_t>(n) - s.u_blocks - s.p_blocks;
        s.num_cpu = (s.u_blocks - s.u_to_gpu) + s.p_to_cpu + (gpu ? 0 : resident);
        s.num_gpu = static_cast<std::uint32_t>(n) - s.num_cpu;
        s.cpu_spilled_tokens =
            static_cast<std::uint64_t>(s.u_blocks - s.u_to_gpu + s.p_to_cpu) * opts.block_tokens;
        s.gpu_spilled_tokens =
            static_cast<std::uint64_t>(s.u_blocks + s.p_blocks) * opts.block_tokens -
            s.cpu_spilled_tokens;
        cpu_spilled += s.cpu_spilled_tokens;

        std::uint32_t* to_cpu = plan.index_.data() + s.offset;
        std::uint32_t* to_gpu = to_cpu + s.num_cpu;
        std::uint32_t u_seen = 0, p_seen = 0;
        const std::uint32_t u_keep = s.u_blocks - s.u_to_gpu;  // the first u_keep U stay on CPU
        const std::uint32_t p_keep = s.p_blocks - s.p_to_cpu;  // the first p_keep P stay on GPU
        for (std::size_t j = 0; j < n; ++j) {
            const auto idx = static_cast<std::uint32_t>(j);
            bool on_cpu = !gpu;
            switch (batch[i].blocks[j].region) {
                case Region::U:
                    on_cpu = on_cpu || u_seen++ < u_keep;
                    break;
                case Region::P:
                    on_cpu = on_cpu || p_seen++ >= p_keep;
                    break;
                case Region::T:
                case Region::G:
                    break;
            }
            *(on_cpu ? to_cpu++ : to_gpu++) = idx;
        }
    }
    plan.num_seqs_ = batch.size();

    StepTotals& t = plan.totals_;
    t.spilled_tokens = (n_u + n_p) * opts.block_tokens;
    t.cpu_spilled_tokens = cpu_spilled;
    t.u_to_gpu_blocks = k_u;
    t.p_to_cpu_blocks = k_p;
    t.cpu_share = t.spilled_tokens
                      ? static_cast<double>(cpu_spilled) / static_cast<double>(t.spilled_tokens)
                      : (gpu ? 0.0 : 1.0);
    if (gpu) {
        t.cpu_seconds = cpu_time(k_u, k_p);
        t.gpu_seconds = gpu_time(k_u, k_p);
    } else {
        // Everything on the CPU: the spilled blocks (k_p = n_p) plus T and G at A.
        const double resident_tokens =
            static_cast<double>(n_g) * bt + static_cast<double>(t_tokens);
        const double spilled = cpu_time(0, n_p);
        t.cpu_seconds = spilled > 0 || resident_tokens > 0
                            ? (spilled > 0 ? spilled : c.cpu_fixed) + cost_of(c.a, resident_tokens)
                            : 0.0;
        t.gpu_seconds = 0;
    }
    t.step_seconds = std::max(t.cpu_seconds, t.gpu_seconds);
}

double routing_target_share(const ExecutionMode& mode, const RooflineCosts& costs,
                            double spilled_tokens, bool has_gpu) noexcept {
    if (!has_gpu) return 1.0;
    switch (mode.kind) {
        case ModeKind::writescope:
            return roofline_share(costs, spilled_tokens);
        case ModeKind::cpu_only:
            return 1.0;
        case ModeKind::gpu_only:
        case ModeKind::monolithic:
            return 0.0;
        case ModeKind::static_split:
            return std::clamp(mode.static_share, 0.0, 1.0);
    }
    return 1.0;
}

}  // namespace writescope
