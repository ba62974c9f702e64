#include "writescope/core/model/kv_demand.hpp"

#include <algorithm>
#include <cmath>

namespace writescope::model {

std::uint64_t KvDemand::bucket_tokens(std::uint32_t b) noexcept {
    b = std::min(b, kMaxBucket);
    // 2^(b/4) exactly for whole powers; the quarter steps rounded up to whole tokens.
    const std::uint64_t whole = std::uint64_t{1} << (b / 4);
    static constexpr double kQuarter[4] = {1.0, 1.189207115002721, 1.414213562373095,
                                           1.681792830507429};
    if (b % 4 == 0) return whole;
    return static_cast<std::uint64_t>(std::ceil(static_cast<double>(whole) * kQuarter[b % 4]));
}

std::uint32_t KvDemand::bucket_of(std::uint64_t tokens) noexcept {
    if (tokens <= 1) return 0;
    // A first guess from the logarithm, then the exact smallest bucket by the integer bounds.
    auto b = static_cast<std::uint32_t>(
        std::clamp(std::floor(4.0 * std::log2(static_cast<double>(tokens))) - 1.0, 0.0,
                   static_cast<double>(kMaxBucket)));
    while (b > 0 && bucket_tokens(b - 1) >= tokens)
        --b;
    while (b < kMaxBucket && bucket_tokens(b) < tokens)
        ++b;
    return b;
}

void KvDemand::add_step(std::uint64_t tokens, std::size_t sequences) {
    Bucket& x = buckets[bucket_of(tokens)];
    ++x.steps;
    x.sequence_steps += sequences;
}

void KvDemand::add(const KvDemand& other) {
    for (const auto& [b, x] : other.buckets) {
        Bucket& mine = buckets[b];
        mine.steps += x.steps;
        mine.sequence_steps += x.sequence_steps;
    }
}

KvDemand KvDemand::since(const KvDemand& saved) const {
    KvDemand d;
    for (const auto& [b, x] : buckets) {
        const auto it = saved.buckets.find(b);
        const Bucket s = it == saved.buckets.end() ? Bucket{} : it->second;
        Bucket out{x.steps - std::min(s.steps, x.steps),
                   x.sequence_steps - std::min(s.sequence_steps, x.sequence_steps)};
        if (out.steps || out.sequence_steps) d.buckets[b] = out;
    }
    return d;
}

std::uint64_t KvDemand::steps() const noexcept {
    std::uint64_t n = 0;
    for (const auto& [b, x] : buckets)
        n += x.steps;
    return n;
}

double KvDemand::mean_batch() const noexcept {
    const std::uint64_t n = steps();
    std::uint64_t s = 0;
    for (const auto& [b, x] : buckets)
        s += x.sequence_steps;
    return n ? static_cast<double>(s) / static_cast<double>(n) : 0.0;
}

KvForG kv_tokens_for_g(const KvDemand& d, int experts_per_token, int num_experts) noexcept {
    KvForG r;
    r.steps = d.steps();
    if (r.steps == 0) return r;
    r.mean_batch = d.mean_batch();
    r.largest = KvDemand::bucket_tokens(d.buckets.rbegin()->first);
    if (num_experts <= 0 || experts_per_token <= 0) {
        r.expert_read = 0;  // no experts to give the VRAM to
    } else {
        const double miss =
            1.0 - std::min(1.0, static_cast<double>(experts_per_token) / num_experts);
        r.expert_read = 1.0 - std::pow(miss, std::max(r.mean_batch, 1.0));
    }
    // The smallest bucket bound x with (steps holding more than x) / steps <= p; the last
    // bucket leaves none beyond it, so the walk always stops.
    const auto total = static_cast<double>(r.steps);
    std::uint64_t at_or_below = 0;
    for (const auto& [b, x] : d.buckets) {
        at_or_below += x.steps;
        r.tokens = KvDemand::bucket_tokens(b);
        r.steps_beyond = static_cast<double>(r.steps - at_or_below) / total;
        if (r.steps_beyond <= r.expert_read) break;
    }
    return r;
}

}  // namespace writescope::model
