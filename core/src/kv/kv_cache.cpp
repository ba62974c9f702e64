#include "writescope/core/kv_cache.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <stdexcept>

#include "byte_units.hpp"

namespace writescope {
namespace {

constexpr std::size_t kMinRunBytes = std::size_t{1} << 20;  // a P run of one layer: ≥ 1 MiB
constexpr std::size_t kMaxSlots = std::numeric_limits<std::uint32_t>::max();
constexpr auto kT = static_cast<std::size_t>(Region::T);
constexpr auto kG = static_cast<std::size_t>(Region::G);
constexpr auto kP = static_cast<std::size_t>(Region::P);
constexpr auto kU = static_cast<std::size_t>(Region::U);

std::size_t ceil_div(std::size_t a, std::size_t b) {
    return a / b + (a % b != 0);
}

std::uint64_t mul_sat(std::uint64_t a, std::uint64_t b) {
    std::uint64_t r;
    return __builtin_mul_overflow(a, b, &r) ? std::numeric_limits<std::uint64_t>::max() : r;
}

std::string num(std::uint64_t v) {
    return std::to_string(v);
}

}  // namespace

KvCapacity kv_capacity(const KvCacheConfig& cfg) {
    if (std::string err = cfg.geometry.validate(); !err.empty())
        throw std::invalid_argument("kv cache geometry: " + err);
    if (cfg.block_tokens == 0 || cfg.block_tokens > 65536)
        throw std::invalid_argument(
            "kv cache block_tokens must be in [1, 65536] (tuned: 64-256), got " +
            num(cfg.block_tokens));
    if (cfg.t_slots == 0)
        throw std::invalid_argument(
            "kv cache t_slots must be positive (one open block per sequence)");
    if (!(cfg.target_r >= 0.0 && cfg.target_r <= 1.0))
        throw std::invalid_argument("kv cache target_r must be in [0, 1]");
    KvCapacity c;
    c.layers = static_cast<std::size_t>(cfg.geometry.num_layers);
    c.linear_block_bytes = LinearBlockLayout::of(cfg.geometry, cfg.block_tokens).elems() *
                           dtype_bytes(cfg.geometry.dtype);
    c.u_block_bytes = cfg.u_block_bytes ? cfg.u_block_bytes : c.linear_block_bytes;
    c.extent_slots =
        cfg.p_extent_slots ? cfg.p_extent_slots : ceil_div(kMinRunBytes, c.linear_block_bytes);
    c.slots[kT] = cfg.t_slots;
    c.slots[kG] = cfg.g_slots;
    c.slots[kP] = static_cast<std::size_t>(cfg.pinned_bytes / (c.layers * c.linear_block_bytes));
    c.slots[kU] = static_cast<std::size_t>(cfg.host_bytes / (c.layers * c.u_block_bytes));
    if (c.slots[kT] + c.slots[kG] > kMaxSlots || c.slots[kT] > kMaxSlots || c.slots[kG] > kMaxSlots)
        throw std::invalid_argument("kv cache t_slots + g_slots exceeds 2^32 - 1 slots");
    if (c.slots[kP] > kMaxSlots)
        throw std::invalid_argument("kv cache pinned_bytes gives more than 2^32 - 1 P slots");
    if (c.slots[kU] > kMaxSlots)
        throw std::invalid_argument("kv cache host_bytes gives more than 2^32 - 1 U slots");
    return c;
}

KvCache::KvCache(const KvCacheConfig& cfg, std::size_t p_slab_slots)
    : cfg_(cfg), cap_(kv_capacity(cfg)), r_(cfg.target_r) {
    const std::size_t e = cap_.extent_slots;
    const std::size_t p_slots = cap_.slots[kP];
    p_slab_slots_ = p_slab_slots ? p_slab_slots : std::max(p_slots, e);
    if (p_slots >= e && p_slab_slots_ < e)
        throw std::invalid_argument("kv cache: a P slab of " + num(p_slab_slots_) +
                                    " slots cannot hold one extent of " + num(e) + " slots");
    // Extents tile each slab from its start; a slab's tail shorter than E is left unused.
    for (std::size_t slab = 0; slab < p_slots; slab += p_slab_slots_) {
        const std::size_t len = std::min(p_slab_slots_, p_slots - slab);
        for (std::size_t j = 0; j + e <= len; j += e)
            extent_first_.push_back(static_cast<std::uint32_t>(slab + j));
    }
    extent_taken_.assign(extent_first_.size(), 0);

    // Stacks hand out the lowest slot first; their capacity is final, so a push never allocates.
    const std::size_t pool = cap_.gpu_pool_slots();
    gpu_free_.reserve(pool);
    for (std::size_t i = pool; i-- > 0;)
        gpu_free_.push_back(static_cast<std::uint32_t>(i));
    u_free_.reserve(cap_.slots[kU]);
    for (std::size_t i = cap_.slots[kU]; i-- > 0;)
        u_free_.push_back(static_cast<std::uint32_t>(i));
}

KvCache::Sequence& KvCache::find(std::uint64_t seq_id) {
    auto it = seqs_.find(seq_id);
    if (it == seqs_.end())
        throw std::out_of_range("kv cache: sequence " + num(seq_id) + " is not admitted");
    return it->second;
}
const KvCache::Sequence& KvCache::find(std::uint64_t seq_id) const {
    return const_cast<KvCache*>(this)->find(seq_id);
}

AdmissionTicket KvCache::prepare_admit(std::uint64_t seq_id, std::size_t max_tokens) const {
    AdmissionTicket t;
    t.cache_ = this;
    t.generation_ = generation_;
    auto refuse = [&](AdmitRefusal why, std::string msg) {
        t.refusal_ = why;
        t.error_ = std::move(msg);
        return std::move(t);
    };
    const std::string who = "sequence " + num(seq_id);
    if (seqs_.count(seq_id))
        return refuse(AdmitRefusal::duplicate_id, who + " is already admitted");
    if (max_tokens == 0)
        return refuse(AdmitRefusal::bad_request, who + ": max_tokens must be positive");
    const std::uint64_t linear_all = mul_sat(cap_.linear_block_bytes, cap_.layers);
    if (seqs_.size() >= cap_.slots[kT])
        return refuse(AdmitRefusal::no_open_slot,
                      who + " cannot open a block: T has no free slot (all " + num(cap_.slots[kT]) +
                          " open-block slots are held, one per admitted sequence; " +
                          kv_detail::format_bytes(mul_sat(cap_.slots[kT], linear_all)) + ")");

    const std::size_t b = cfg_.block_tokens;
    const std::size_t e = cap_.extent_slots;
    const std::size_t n = ceil_div(max_tokens, b);
    const std::size_t g = std::min(n, g_free());
    const std::size_t spill = n - g;
    const std::size_t u_room = u_free();
    const std::size_t p_room = p_free_extents() * e;
    if (spill > u_room + p_room) {
        const std::uint64_t u_all = mul_sat(cap_.u_block_bytes, cap_.layers);
        return refuse(AdmitRefusal::no_room,
                      who + " does not fit: max_tokens " + num(max_tokens) + " needs " + num(n) +
                          " sealed blocks of " + num(b) + " tokens; G has " + num(g) + " free of " +
                          num(cap_.slots[kG]) + ", leaving " + num(spill) + " spill blocks (" +
                          kv_detail::format_bytes(mul_sat(spill, cap_.linear_block_bytes)) +
                          " per layer); P has " + num(p_room) + " free (" + num(p_free_extents()) +
                          " extents of " + num(e) + "; budget " +
                          kv_detail::format_bytes(cfg_.pinned_bytes) + ", " +
                          kv_detail::format_bytes(mul_sat(extent_first_.size() * e, linear_all)) +
                          " usable), U has " + num(u_room) + " free (budget " +
                          kv_detail::format_bytes(cfg_.host_bytes) + ", " +
                          kv_detail::format_bytes(mul_sat(cap_.slots[kU], u_all)) + " usable)");
    }
    // U gets what the deficit rule will ask for, shifted to whichever spill region has room.
    const std::size_t lo = spill > p_room ? spill - p_room : 0;
    const std::size_t hi = std::min(spill, u_room);
    const std::size_t u = std::clamp(deficit_u_blocks(spill, r_), lo, hi);
    const std::size_t p_ext = ceil_div(spill - u, e);

    std::map<std::uint64_t, Sequence> holder;
    Sequence& s = holder[seq_id];
    s.max_tokens = max_tokens;
    s.max_blocks = n;
    s.table.reserve(n);
    s.p_extents.reserve(ceil_div(n, e));
    s.res_g = g;
    s.res_u = u;
    s.res_p_ext = p_ext;
    t.node_ = holder.extract(holder.begin());
    t.g_ = g;
    t.u_ = u;
    t.p_ext_ = p_ext;
    return t;
}

void KvCache::apply(AdmissionTicket&& ticket) {
    if (!ticket.ok())
        throw std::logic_error("kv cache: cannot apply a refused admission: " + ticket.error());
    if (ticket.cache_ != this)
        throw std::logic_error("kv cache: the admission ticket belongs to another cache");
    if (ticket.node_.empty())
        throw std::logic_error("kv cache: the admission ticket was already applied");
    if (ticket.generation_ != generation_)
        throw std::logic_error(
            "kv cache: stale admission ticket (the cache changed after prepare_admit)");
    // From here on nothing allocates: the node was built in prepare, the free stacks are sized.
    Sequence& s = ticket.node_.mapped();
    s.t_slot = gpu_free_.back();
    gpu_free_.pop_back();
    res_g_ += s.res_g;
    res_u_ += s.res_u;
    res_p_ext_ += s.res_p_ext;
    seqs_.insert(std::move(ticket.node_));
    ++generation_;
}

AdmissionTicket KvCache::admit(std::uint64_t seq_id, std::size_t max_tokens) {
    AdmissionTicket t = prepare_admit(seq_id, max_tokens);
    if (t.ok()) apply(std::move(t));
    return t;
}

std::vector<SealMove> KvCache::append(std::uint64_t seq_id, std::size_t n) {
    Sequence& s = find(seq_id);
    if (n > s.max_tokens - s.tokens)
        throw std::length_error("kv cache: appending " + num(n) + " tokens to sequence " +
                                num(seq_id) + " (holding " + num(s.tokens) +
                                ") exceeds its admitted max_tokens " + num(s.max_tokens));
    const std::size_t b = cfg_.block_tokens;
    const std::size_t open = s.tokens - s.table.size() * b;
    std::vector<SealMove> moves;
    moves.reserve((open + n) / b);  // the last thing that may throw
    for (std::size_t i = 0, seals = (open + n) / b; i < seals; ++i)
        moves.push_back(seal(seq_id, s));
    s.tokens += n;
    if (n) ++generation_;
    return moves;
}

std::uint32_t KvCache::take_extent(const Sequence& s) noexcept {
    // Prefer the extent right after the sequence's last one: the two then form one longer run.
    if (!s.p_extents.empty()) {
        const std::size_t next = s.p_extents.back() + 1;
        if (next < extent_taken_.size() && !extent_taken_[next])
            return static_cast<std::uint32_t>(next);
    }
    std::size_t i = 0;
    while (extent_taken_[i])
        ++i;  // admission guarantees one is free
    return static_cast<std::uint32_t>(i);
}

SealMove KvCache::seal(std::uint64_t seq_id, Sequence& s) noexcept {
    SealMove m;
    m.seq_id = seq_id;
    m.block_index = s.table.size();
    m.t_slot = s.t_slot;
    RouteRoom room;
    room.g = s.res_g > 0 || g_free() > 0;
    room.p = s.p_open > 0 || s.res_p_ext > 0 || p_free_extents() > 0;
    room.u = s.res_u > 0 || u_free() > 0;
    const RouteChoice choice =
        route_sealed_block(room, s.blocks[kU], s.blocks[kP] + s.blocks[kU], r_);
    switch (choice.region) {
        case Region::G:
            if (s.res_g > 0) {
                --s.res_g;
                --res_g_;
            }
            ++used_g_;
            m.dest = {Region::G, s.t_slot};
            m.kind = MoveKind::remap;
            s.t_slot = gpu_free_.back();
            gpu_free_.pop_back();
            break;
        case Region::U:
            if (s.res_u > 0) {
                --s.res_u;
                --res_u_;
            }
            ++used_u_;
            m.dest = {Region::U, u_free_.back()};
            m.kind = MoveKind::pack_to_unpinned;
            u_free_.pop_back();
            break;
        case Region::P:
        case Region::T: {
            const std::size_t e = cap_.extent_slots;
            if (s.p_open == 0) {
                if (s.res_p_ext > 0) {
                    --s.res_p_ext;
                    --res_p_ext_;
                }
                const std::uint32_t ext = take_extent(s);
                extent_taken_[ext] = 1;
                s.p_extents.push_back(ext);
                ++p_alloc_ext_;
                s.p_open = e;
                p_open_ += e;
            }
            ++used_p_;
            m.dest = {Region::P, static_cast<std::uint32_t>(extent_first_[s.p_extents.back()] +
                                                            (e - s.p_open))};
            m.kind = MoveKind::copy_to_pinned;
            --s.p_open;
            --p_open_;
            break;
        }
    }
    s.table.push_back(m.dest);
    ++s.blocks[static_cast<std::size_t>(m.dest.region)];
    if (choice.diverted()) {
        m.diverted = true;
        ++diverted_;
    }
    trim_reservation(s);
    return m;
}

// A seal that used unreserved room (a free G slot, a U slot, a new P extent) leaves the sequence
// holding more than it can still need; give the surplus back so other requests can be admitted.
// U is kept at what the rule will still ask for; P goes back in whole extents only.
void KvCache::trim_reservation(Sequence& s) noexcept {
    const std::size_t e = cap_.extent_slots;
    const std::size_t need = s.max_blocks - s.table.size();
    if (s.res_g > need) {
        res_g_ -= s.res_g - need;
        s.res_g = need;
    }
    const std::size_t cover = s.res_g + s.res_u + s.p_open + e * s.res_p_ext;
    std::size_t surplus = cover - need;
    if (surplus == 0) return;
    const std::size_t spill_need = need - s.res_g;
    const std::size_t spilled = s.blocks[kP] + s.blocks[kU];
    const auto u_total =
        static_cast<std::size_t>(std::ceil(r_ * static_cast<double>(spilled + spill_need)));
    const std::size_t u_target =
        std::min(spill_need, u_total > s.blocks[kU] ? u_total - s.blocks[kU] : 0);
    if (s.res_u > u_target) {
        const std::size_t rel = std::min(surplus, s.res_u - u_target);
        s.res_u -= rel;
        res_u_ -= rel;
        surplus -= rel;
    }
    while (surplus >= e && s.res_p_ext > 0) {
        --s.res_p_ext;
        --res_p_ext_;
        surplus -= e;
    }
}

bool KvCache::free(std::uint64_t seq_id) noexcept {
    auto it = seqs_.find(seq_id);
    if (it == seqs_.end()) return false;
    Sequence& s = it->second;
    gpu_free_.push_back(s.t_slot);
    for (const BlockRef& ref : s.table) {
        switch (ref.region) {
            case Region::G:
                gpu_free_.push_back(ref.slot);
                --used_g_;
                break;
            case Region::U:
                u_free_.push_back(ref.slot);
                --used_u_;
                break;
            case Region::P:
                --used_p_;
                break;
            case Region::T:
                break;
        }
    }
    for (std::uint32_t ext : s.p_extents)
        extent_taken_[ext] = 0;
    p_alloc_ext_ -= s.p_extents.size();
    p_open_ -= s.p_open;
    res_g_ -= s.res_g;
    res_u_ -= s.res_u;
    res_p_ext_ -= s.res_p_ext;
    seqs_.erase(it);
    ++generation_;
    return true;
}

void KvCache::set_target_r(double r) {
    if (!(r >= 0.0 && r <= 1.0))
        throw std::invalid_argument("kv cache: target r must be in [0, 1], got " +
                                    std::to_string(r));
    if (r != r_) ++generation_;
    r_ = r;
}

std::vector<std::uint64_t> KvCache::sequences() const {
    std::vector<std::uint64_t> ids;
    ids.reserve(seqs_.size());
    for (const auto& [id, s] : seqs_)
        ids.push_back(id);
    return ids;
}

std::span<const BlockRef> KvCache::block_table(std::uint64_t seq_id) const {
    return find(seq_id).table;
}

OpenBlock KvCache::open_block(std::uint64_t seq_id) const {
    const Sequence& s = find(seq_id);
    return {s.t_slot, s.table.size(), s.tokens - s.table.size() * cfg_.block_tokens};
}

std::vector<SlotRun> KvCache::p_runs(std::uint64_t seq_id) const {
    const Sequence& s = find(seq_id);
    const std::size_t e = cap_.extent_slots;
    std::vector<SlotRun> runs;
    for (std::size_t i = 0; i < s.p_extents.size(); ++i) {
        const std::uint32_t first = extent_first_[s.p_extents[i]];
        const auto count =
            static_cast<std::uint32_t>(i + 1 < s.p_extents.size() ? e : e - s.p_open);
        if (!runs.empty()) {
            SlotRun& last = runs.back();
            // Only the last extent is partial, so an earlier run always ends on a full extent.
            if (last.first_slot + last.count == first &&
                last.first_slot / p_slab_slots_ == first / p_slab_slots_) {
                last.count += count;
                continue;
            }
        }
        runs.push_back({first, count});
    }
    return runs;
}

KvSequenceStats KvCache::sequence_stats(std::uint64_t seq_id) const {
    const Sequence& s = find(seq_id);
    const std::size_t b = cfg_.block_tokens;
    KvSequenceStats st;
    st.seq_id = seq_id;
    st.tokens = s.tokens;
    st.max_tokens = s.max_tokens;
    st.open_tokens = s.tokens - s.table.size() * b;
    st.t_slot = s.t_slot;
    st.blocks = s.blocks;
    st.blocks[kT] = 1;
    st.reserved[kG] = s.res_g;
    st.reserved[kP] = s.p_open + s.res_p_ext * cap_.extent_slots;
    st.reserved[kU] = s.res_u;
    st.p_extents = s.p_extents.size();
    st.spilled_tokens = (s.blocks[kP] + s.blocks[kU]) * b;
    st.u_tokens = s.blocks[kU] * b;
    st.u_share = st.spilled_tokens
                     ? static_cast<double>(st.u_tokens) / static_cast<double>(st.spilled_tokens)
                     : 0.0;
    return st;
}

KvRegionStats KvCache::region_stats(Region r) const noexcept {
    KvRegionStats st;
    st.region = r;
    const std::uint64_t linear_all = std::uint64_t{cap_.linear_block_bytes} * cap_.layers;
    st.block_bytes = linear_all;
    switch (r) {
        case Region::T:
            st.capacity_blocks = cap_.slots[kT];
            st.used_blocks = seqs_.size();
            break;
        case Region::G:
            st.capacity_blocks = cap_.slots[kG];
            st.used_blocks = used_g_;
            st.reserved_blocks = res_g_;
            break;
        case Region::P:
            st.capacity_blocks = extent_first_.size() * cap_.extent_slots;
            st.used_blocks = used_p_;
            st.reserved_blocks = p_open_ + res_p_ext_ * cap_.extent_slots;
            break;
        case Region::U:
            st.block_bytes = std::uint64_t{cap_.u_block_bytes} * cap_.layers;
            st.capacity_blocks = cap_.slots[kU];
            st.used_blocks = used_u_;
            st.reserved_blocks = res_u_;
            break;
    }
    st.free_blocks = st.capacity_blocks - st.used_blocks - st.reserved_blocks;
    st.capacity_bytes = st.capacity_blocks * st.block_bytes;
    st.used_bytes = st.used_blocks * st.block_bytes;
    st.reserved_bytes = st.reserved_blocks * st.block_bytes;
    return st;
}

std::array<KvRegionStats, kNumRegions> KvCache::stats() const noexcept {
    return {region_stats(Region::T), region_stats(Region::G), region_stats(Region::P),
            region_stats(Region::U)};
}

std::string KvCache::dump_state() const {
    std::string out;
    char buf[160];
    std::snprintf(buf, sizeof buf, "r %.17g generation %llu diverted %llu\n", r_,
                  static_cast<unsigned long long>(generation_),
                  static_cast<unsigned long long>(diverted_));
    out += buf;
    out += "counters used_g " + num(used_g_) + " used_p " + num(used_p_) + " used_u " +
           num(used_u_) + " res_g " + num(res_g_) + " res_u " + num(res_u_) + " res_p_ext " +
           num(res_p_ext_) + " p_alloc_ext " + num(p_alloc_ext_) + " p_open " + num(p_open_) + "\n";
    auto list = [&out](const char* name, const auto& v) {
        out += name;
        for (auto x : v) {
            out += ' ';  // (char + string trips g++ 12's -Wrestrict false positive)
            out += num(x);
        }
        out += '\n';
    };
    list("gpu_free", gpu_free_);
    list("u_free", u_free_);
    list("extent_taken", extent_taken_);
    for (const auto& [id, s] : seqs_) {
        out += "seq " + num(id) + " max_tokens " + num(s.max_tokens) + " tokens " + num(s.tokens) +
               " t_slot " + num(s.t_slot) + " p_open " + num(s.p_open) + " res " + num(s.res_g) +
               "/" + num(s.res_u) + "/" + num(s.res_p_ext) + " blocks " + num(s.blocks[kG]) + "/" +
               num(s.blocks[kP]) + "/" + num(s.blocks[kU]) + "\n";
        out += " table";
        for (const BlockRef& ref : s.table) {
            out += ' ';
            out += region_name(ref.region);
            out += num(ref.slot);
        }
        out += '\n';
        list(" extents", s.p_extents);
    }
    return out;
}

std::string KvCache::check_invariants() const {
    const std::size_t b = cfg_.block_tokens;
    const std::size_t e = cap_.extent_slots;
    const std::size_t pool = cap_.gpu_pool_slots();
    std::vector<std::uint8_t> pool_seen(pool, 0), u_seen(cap_.slots[kU], 0);
    std::vector<std::uint8_t> ext_seen(extent_first_.size(), 0);
    std::size_t used_g = 0, used_p = 0, used_u = 0, res_g = 0, res_u = 0, res_p = 0, alloc = 0,
                open = 0;
    auto mark = [](std::vector<std::uint8_t>& seen, std::size_t i) {
        if (i >= seen.size() || seen[i]) return false;
        seen[i] = 1;
        return true;
    };
    for (std::uint32_t slot : gpu_free_)
        if (!mark(pool_seen, slot))
            return "GPU free slot " + num(slot) + " is out of range or twice";
    for (std::uint32_t slot : u_free_)
        if (!mark(u_seen, slot)) return "U free slot " + num(slot) + " is out of range or twice";
    for (const auto& [id, s] : seqs_) {
        const std::string who = "sequence " + num(id) + ": ";
        if (s.tokens > s.max_tokens) return who + "more tokens than admitted";
        if (s.table.size() != s.tokens / b) return who + "sealed blocks do not match its tokens";
        if (s.max_blocks != ceil_div(s.max_tokens, b)) return who + "max_blocks is wrong";
        if (!mark(pool_seen, s.t_slot)) return who + "T slot is out of range or shared";
        std::array<std::size_t, kNumRegions> blocks{};
        std::size_t p_index = 0;
        for (const BlockRef& ref : s.table) {
            ++blocks[static_cast<std::size_t>(ref.region)];
            if (ref.region == Region::G && !mark(pool_seen, ref.slot))
                return who + "G slot " + num(ref.slot) + " is out of range or shared";
            if (ref.region == Region::U && !mark(u_seen, ref.slot))
                return who + "U slot " + num(ref.slot) + " is out of range or shared";
            if (ref.region == Region::P) {
                // The i-th P block sits at slot i % E of the sequence's (i / E)-th extent.
                const std::size_t k = p_index / e;
                if (k >= s.p_extents.size() ||
                    ref.slot != extent_first_[s.p_extents[k]] + p_index % e)
                    return who + "P block " + num(p_index) + " is not where its extents say";
                ++p_index;
            }
            if (ref.region == Region::T) return who + "a sealed block in T";
        }
        if (blocks != s.blocks) return who + "per-region block counts are wrong";
        if (s.p_extents.size() * e != blocks[kP] + s.p_open)
            return who + "P extents are not filled in order";
        for (std::uint32_t ext : s.p_extents)
            if (!mark(ext_seen, ext) || !extent_taken_[ext])
                return who + "extent " + num(ext) + " is not held by it alone";
        const std::size_t need = s.max_blocks - s.table.size();
        if (s.res_g + s.res_u + s.p_open + e * s.res_p_ext < need)
            return who + "reservations do not cover the " + num(need) + " blocks it may still seal";
        used_g += blocks[kG];
        used_p += blocks[kP];
        used_u += blocks[kU];
        res_g += s.res_g;
        res_u += s.res_u;
        res_p += s.res_p_ext;
        alloc += s.p_extents.size();
        open += s.p_open;
    }
    if (used_g != used_g_ || used_p != used_p_ || used_u != used_u_) return "used counters drifted";
    if (res_g != res_g_ || res_u != res_u_ || res_p != res_p_ext_)
        return "reserved counters drifted";
    if (alloc != p_alloc_ext_ || open != p_open_) return "P extent counters drifted";
    for (std::size_t i = 0; i < extent_taken_.size(); ++i)
        if (extent_taken_[i] != ext_seen[i]) return "extent " + num(i) + " taken flag is wrong";
    if (std::count(pool_seen.begin(), pool_seen.end(), 0) != 0) return "a GPU slot is lost";
    if (std::count(u_seen.begin(), u_seen.end(), 0) != 0) return "a U slot is lost";
    if (seqs_.size() > cap_.slots[kT]) return "T over capacity";
    if (used_g_ + res_g_ > cap_.slots[kG]) return "G over capacity";
    if (used_u_ + res_u_ > cap_.slots[kU]) return "U over capacity";
    if (p_alloc_ext_ + res_p_ext_ > extent_first_.size()) return "P over capacity";
    return {};
}

}  // namespace writescope
