// Long random runs of admit / append / free / r changes against the cache's guarantees, checked
// from the public API after every operation.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "kv_test_util.hpp"
#include "test_seed.hpp"
#include "writescope/core/kv_cache.hpp"

using namespace writescope;
using test::ridx;

namespace {

// What the test remembers about a sequence to judge the router.
struct Shadow {
    std::size_t max_tokens = 0;
    bool r_fixed_since_first_spill = true;  // the share must then stay within one block
    bool diverted = false;                  // a seal went to the unwanted spill region
};

void check_cache(const KvCache& c, const std::map<std::uint64_t, Shadow>& shadow,
                 std::uint64_t pinned_budget, std::uint64_t host_budget) {
    const std::string inv = c.check_invariants();
    INFO(inv);
    REQUIRE(inv.empty());
    const std::size_t b = c.block_tokens();
    const std::size_t e = c.extent_slots();
    const std::size_t slab = c.p_slab_slots();
    const auto stats = c.stats();

    // Budgets are never exceeded.
    for (const KvRegionStats& st : stats) {
        INFO("region " << region_name(st.region));
        REQUIRE(st.used_blocks + st.reserved_blocks <= st.capacity_blocks);
        REQUIRE(st.used_blocks + st.reserved_blocks + st.free_blocks == st.capacity_blocks);
    }
    REQUIRE(stats[ridx(Region::P)].capacity_bytes <= pinned_budget);
    REQUIRE(stats[ridx(Region::U)].capacity_bytes <= host_budget);
    REQUIRE(stats[ridx(Region::T)].used_blocks == shadow.size());

    // Every token is in exactly one place, and no slot is shared.
    std::set<std::uint32_t> gpu, p, u;
    std::array<std::size_t, kNumRegions> used{};
    for (const auto& [id, sh] : shadow) {
        INFO("sequence " << id);
        REQUIRE(c.contains(id));
        const KvSequenceStats st = c.sequence_stats(id);
        const auto table = c.block_table(id);
        REQUIRE(st.max_tokens == sh.max_tokens);
        REQUIRE(table.size() * b + st.open_tokens == st.tokens);
        REQUIRE(st.open_tokens < b);
        REQUIRE(gpu.insert(st.t_slot).second);
        std::vector<std::uint32_t> p_slots;
        for (const BlockRef& ref : table) {
            ++used[ridx(ref.region)];
            if (ref.region == Region::G) REQUIRE(gpu.insert(ref.slot).second);
            if (ref.region == Region::U) REQUIRE(u.insert(ref.slot).second);
            if (ref.region == Region::P) {
                REQUIRE(p.insert(ref.slot).second);
                p_slots.push_back(ref.slot);
            }
            REQUIRE(ref.region != Region::T);
        }
        // Reservations cover every block it can still seal.
        const std::size_t need = (st.max_tokens + b - 1) / b - table.size();
        REQUIRE(st.reserved[ridx(Region::G)] + st.reserved[ridx(Region::P)] +
                    st.reserved[ridx(Region::U)] >=
                need);

        // P blocks form runs of whole extents (only the last is partial), in token order,
        // each inside one slab.
        const std::vector<SlotRun> runs = c.p_runs(id);
        std::vector<std::uint32_t> from_runs;
        for (std::size_t i = 0; i < runs.size(); ++i) {
            const SlotRun& r = runs[i];
            REQUIRE(r.count > 0);
            REQUIRE(((r.first_slot % slab) % e) == 0);
            REQUIRE(r.first_slot / slab == (r.first_slot + r.count - 1) / slab);
            if (i + 1 < runs.size()) REQUIRE(r.count % e == 0);
            for (std::uint32_t k = 0; k < r.count; ++k)
                from_runs.push_back(r.first_slot + k);
        }
        REQUIRE(from_runs == p_slots);
        REQUIRE(st.p_extents == (p_slots.size() + e - 1) / e);

        // U's share tracks r within one block while r has not moved and nothing was diverted.
        if (sh.r_fixed_since_first_spill && !sh.diverted) {
            const double gap = std::abs(static_cast<double>(st.u_tokens) -
                                        c.target_r() * static_cast<double>(st.spilled_tokens));
            REQUIRE(gap <= static_cast<double>(b) + 1e-6);
        }
    }
    REQUIRE(used[ridx(Region::G)] == stats[ridx(Region::G)].used_blocks);
    REQUIRE(used[ridx(Region::P)] == stats[ridx(Region::P)].used_blocks);
    REQUIRE(used[ridx(Region::U)] == stats[ridx(Region::U)].used_blocks);
    for (std::uint32_t s : gpu)
        REQUIRE(s < c.capacity().gpu_pool_slots());
    for (std::uint32_t s : u)
        REQUIRE(s < stats[ridx(Region::U)].capacity_blocks);
}

}  // namespace

TEST_CASE("random admit/append/free/r runs keep every cache guarantee", "[unit][kv][random]") {
    auto rng = test::seeded_rng("kv cache random ops");
    // B = 4 tokens; T 12, G 30, P 150 slots in extents of 4 within slabs of 18, U 120.
    const KvCacheConfig cfg = test::small_kv_config(4, 12, 30, 150, 120, 4, 0.5);
    KvCache c(cfg, 18);
    std::map<std::uint64_t, Shadow> shadow;
    std::uint64_t next_id = 1;
    std::size_t admitted = 0, refused = 0, seals = 0, spills = 0;

    auto pick = [&]() {
        auto it = shadow.begin();
        std::advance(it, std::uniform_int_distribution<std::size_t>(0, shadow.size() - 1)(rng));
        return it;
    };
    std::uniform_int_distribution<int> op_dist(0, 99);
    for (int step = 0; step < 20000; ++step) {
        const int op = op_dist(rng);
        if (op < 12) {
            // Admission: sizes from tiny to more than the whole cache.
            const std::size_t max_tokens =
                std::uniform_int_distribution<std::size_t>(1, op < 2 ? 1500 : 240)(rng);
            const std::string before = c.dump_state();
            const std::uint64_t id = next_id++;
            AdmissionTicket t = c.admit(id, max_tokens);
            if (t.ok()) {
                ++admitted;
                shadow[id] = {max_tokens, true, false};
            } else {
                ++refused;
                INFO(t.error());
                REQUIRE(!t.error().empty());
                REQUIRE(c.dump_state() == before);  // a refusal leaves no trace
                REQUIRE_FALSE(c.contains(id));
            }
        } else if (op < 17 && !shadow.empty()) {
            auto it = pick();
            REQUIRE(c.free(it->first));
            shadow.erase(it);
        } else if (op < 19) {
            const int kind = std::uniform_int_distribution<int>(0, 3)(rng);
            const double r = kind == 0   ? 0.0
                             : kind == 1 ? 1.0
                                         : std::uniform_real_distribution<double>(0, 1)(rng);
            if (r != c.target_r())
                for (auto& [id, sh] : shadow)
                    if (c.sequence_stats(id).spilled_tokens > 0)
                        sh.r_fixed_since_first_spill = false;
            c.set_target_r(r);
        } else if (op < 20 && !shadow.empty()) {
            // Appending past the admitted maximum is an error that changes nothing.
            auto it = pick();
            const KvSequenceStats st = c.sequence_stats(it->first);
            const std::string before = c.dump_state();
            REQUIRE_THROWS_AS(c.append(it->first, st.max_tokens - st.tokens + 1),
                              std::length_error);
            REQUIRE(c.dump_state() == before);
        } else if (!shadow.empty()) {
            auto it = pick();
            const std::uint64_t id = it->first;
            const KvSequenceStats st = c.sequence_stats(id);
            const std::size_t room = st.max_tokens - st.tokens;
            if (room == 0) continue;
            // Mostly decode-sized appends, sometimes a prefill of everything left.
            const std::size_t n =
                op < 25 ? room
                        : std::min(room, std::uniform_int_distribution<std::size_t>(1, 6)(rng));
            const double r = c.target_r();
            std::size_t u_blocks = st.u_tokens / c.block_tokens();
            std::size_t spilled = st.spilled_tokens / c.block_tokens();
            const std::size_t first_block = st.tokens / c.block_tokens();
            const std::vector<SealMove> moves = c.append(id, n);
            REQUIRE(moves.size() == (st.open_tokens + n) / c.block_tokens());
            bool spilled_here = false;
            for (std::size_t i = 0; i < moves.size(); ++i) {
                const SealMove& m = moves[i];
                REQUIRE(m.seq_id == id);
                REQUIRE(m.block_index == first_block + i);
                REQUIRE(c.block_table(id)[m.block_index] == m.dest);
                ++seals;
                if (m.dest.region == Region::G) {
                    REQUIRE(m.kind == MoveKind::remap);
                    REQUIRE(m.dest.slot == m.t_slot);
                    REQUIRE_FALSE(spilled_here);  // G is taken first, while it lasts
                    continue;
                }
                spilled_here = true;
                ++spills;
                REQUIRE(m.kind == (m.dest.region == Region::U ? MoveKind::pack_to_unpinned
                                                              : MoveKind::copy_to_pinned));
                // The deficit gap never grows (beyond one block) unless the block was diverted.
                const double before =
                    std::abs(static_cast<double>(u_blocks) - r * static_cast<double>(spilled));
                if (m.dest.region == Region::U) ++u_blocks;
                ++spilled;
                const double after =
                    std::abs(static_cast<double>(u_blocks) - r * static_cast<double>(spilled));
                if (m.diverted)
                    shadow[id].diverted = true;
                else
                    REQUIRE(after <= std::max(1.0, before) + 1e-9);
            }
            if (spilled_here) {
                // It spilled only because G had nothing for it.
                REQUIRE(c.sequence_stats(id).reserved[ridx(Region::G)] == 0);
                REQUIRE(c.region_stats(Region::G).free_blocks == 0);
            }
        }
        check_cache(c, shadow, cfg.pinned_bytes, cfg.host_bytes);

        if (step % 5000 == 4999) {
            // Free everything: every slot and reservation comes back.
            for (const auto& [id, sh] : shadow)
                REQUIRE(c.free(id));
            shadow.clear();
            for (const KvRegionStats& st : c.stats()) {
                REQUIRE(st.used_blocks == 0);
                REQUIRE(st.reserved_blocks == 0);
                REQUIRE(st.free_blocks == st.capacity_blocks);
            }
            check_cache(c, shadow, cfg.pinned_bytes, cfg.host_bytes);
        }
    }
    std::fprintf(
        stderr, "[kv random] admitted %zu refused %zu seals %zu spills %zu diverted %llu\n",
        admitted, refused, seals, spills, static_cast<unsigned long long>(c.diverted_seals()));
    CHECK(admitted > 100);
    CHECK(refused > 10);
    CHECK(spills > 1000);
}

TEST_CASE(
    "with r fixed and room to spare no block is diverted and every share stays within a block",
    "[unit][kv][random]") {
    auto rng = test::seeded_rng("kv cache fixed r");
    const double r = std::uniform_real_distribution<double>(0, 1)(rng);
    // 8 sequences of at most 50 blocks need at most 400 + 8·3 (extent rounding) slots; G, P and U
    // hold 20 + 400 + 400.
    const KvCacheConfig cfg = test::small_kv_config(4, 8, 20, 400, 400, 4, r);
    KvCache c(cfg, 40);
    std::map<std::uint64_t, Shadow> shadow;
    std::uint64_t next_id = 1;
    std::size_t spills = 0;
    for (int step = 0; step < 6000; ++step) {
        const int op = std::uniform_int_distribution<int>(0, 99)(rng);
        if (op < 8 && shadow.size() < 8) {
            const std::size_t max_tokens = std::uniform_int_distribution<std::size_t>(1, 200)(rng);
            AdmissionTicket t = c.admit(next_id, max_tokens);
            INFO(t.error());
            REQUIRE(t.ok());
            shadow[next_id++] = {max_tokens, true, false};
        } else if (op < 11 && !shadow.empty()) {
            auto it = shadow.begin();
            std::advance(it, std::uniform_int_distribution<std::size_t>(0, shadow.size() - 1)(rng));
            REQUIRE(c.free(it->first));
            shadow.erase(it);
        } else if (!shadow.empty()) {
            auto it = shadow.begin();
            std::advance(it, std::uniform_int_distribution<std::size_t>(0, shadow.size() - 1)(rng));
            const KvSequenceStats st = c.sequence_stats(it->first);
            const std::size_t room = st.max_tokens - st.tokens;
            const std::size_t n =
                op < 14
                    ? room
                    : std::min<std::size_t>(room, std::uniform_int_distribution<int>(1, 7)(rng));
            for (const SealMove& m : c.append(it->first, n)) {
                REQUIRE_FALSE(m.diverted);
                spills += m.dest.region != Region::G;
            }
        }
        check_cache(c, shadow, cfg.pinned_bytes, cfg.host_bytes);
    }
    CHECK(c.diverted_seals() == 0);
    CHECK(spills > 500);
}
