#include <catch2/catch.hpp>

#include <cmath>
#include <set>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "kv_test_util.hpp"
#include "writescope/core/kv_cache.hpp"

using namespace writescope;
using test::ridx;
using test::small_kv_config;

namespace {

std::vector<Region> regions_of(const KvCache& c, std::uint64_t seq) {
    std::vector<Region> out;
    for (const BlockRef& ref : c.block_table(seq))
        out.push_back(ref.region);
    return out;
}

}  // namespace

TEST_CASE("kv_capacity converts budgets to slots and picks extents of at least 1 MiB",
          "[unit][kv][admission]") {
    for (const char* name : {"qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite"}) {
        for (std::size_t b : {64, 128, 256}) {
            KvCacheConfig cfg;
            cfg.geometry = *kv_geometry_preset(name);
            cfg.block_tokens = b;
            cfg.t_slots = 8;
            cfg.g_slots = 100;
            cfg.pinned_bytes = std::uint64_t{8} << 30;
            cfg.host_bytes = std::uint64_t{16} << 30;
            const KvCapacity cap = kv_capacity(cfg);
            INFO(name << " B=" << b);
            CHECK(cap.linear_block_bytes == b * cfg.geometry.bytes_per_token_layer());
            CHECK(cap.extent_slots * cap.linear_block_bytes >= (1u << 20));
            CHECK((cap.extent_slots - 1) * cap.linear_block_bytes < (1u << 20));
            const std::uint64_t slot_all = cap.linear_block_bytes * cap.layers;
            CHECK(cap.slots[ridx(Region::P)] == cfg.pinned_bytes / slot_all);
            CHECK(cap.slots[ridx(Region::U)] == cfg.host_bytes / slot_all);
            CHECK(cap.gpu_pool_slots() == 108);
        }
    }
    KvCacheConfig bad = small_kv_config(8, 4, 4, 4, 4, 4, 0.5);
    bad.block_tokens = 0;
    CHECK_THROWS_AS(kv_capacity(bad), std::invalid_argument);
    bad = small_kv_config(8, 0, 4, 4, 4, 4, 0.5);
    CHECK_THROWS_AS(kv_capacity(bad), std::invalid_argument);
    bad = small_kv_config(8, 4, 4, 4, 4, 4, 1.5);
    CHECK_THROWS_AS(kv_capacity(bad), std::invalid_argument);
    bad = small_kv_config(8, 4, 4, 4, 4, 4, 0.5);
    bad.geometry.num_kv_heads = 3;
    CHECK_THROWS_WITH(kv_capacity(bad), Catch::Contains("num_q_heads"));
}

TEST_CASE("admission reserves G first, then splits the spill by r in whole P extents",
          "[unit][kv][admission]") {
    // B = 8 tokens, G 10 slots, P 40 slots in extents of 4, U 40 slots, r = 0.5.
    KvCache c(small_kv_config(8, 4, 10, 40, 40, 4, 0.5));
    AdmissionTicket a = c.admit(1, 64);  // 8 blocks: all in G
    REQUIRE(a.ok());
    CHECK(a.reserved_g() == 8);
    CHECK(a.reserved_u() == 0);
    CHECK(a.reserved_p_extents() == 0);

    AdmissionTicket b = c.admit(2, 60);  // ceil(60/8) = 8 blocks: 2 G, 6 spilled: 3 U, 3 P
    REQUIRE(b.ok());
    CHECK(b.reserved_g() == 2);
    CHECK(b.reserved_u() == 3);
    CHECK(b.reserved_p_extents() == 1);

    const auto g = c.region_stats(Region::G);
    CHECK(g.reserved_blocks == 10);
    CHECK(g.free_blocks == 0);
    CHECK(c.region_stats(Region::U).reserved_blocks == 3);
    CHECK(c.region_stats(Region::P).reserved_blocks == 4);
    CHECK(c.region_stats(Region::T).used_blocks == 2);
    CHECK(c.check_invariants().empty());
}

TEST_CASE("refused admissions leave the cache unchanged and say what did not fit",
          "[unit][kv][admission]") {
    KvCache c(small_kv_config(8, 2, 2, 8, 5, 4, 0.5));
    REQUIRE(c.admit(1, 8 * 6).ok());  // 6 blocks: 2 G, 4 spilled: 2 U, 2 P (one extent)
    const std::string before = c.dump_state();
    const std::uint64_t gen = c.generation();

    AdmissionTicket big = c.admit(2, 8 * 20);  // 20 spill blocks; P has 4 free, U 3
    CHECK_FALSE(big.ok());
    CHECK(big.refusal() == AdmitRefusal::no_room);
    CHECK_THAT(big.error(), Catch::Contains("sequence 2") && Catch::Contains("20 spill blocks") &&
                                Catch::Contains("P has 4 free") &&
                                Catch::Contains("U has 3 free") && Catch::Contains("G has 0 free"));
    CHECK(c.dump_state() == before);
    CHECK(c.generation() == gen);

    AdmissionTicket dup = c.admit(1, 8);
    CHECK(dup.refusal() == AdmitRefusal::duplicate_id);
    AdmissionTicket zero = c.admit(3, 0);
    CHECK(zero.refusal() == AdmitRefusal::bad_request);
    CHECK(c.dump_state() == before);

    REQUIRE(c.admit(3, 8).ok());  // the second and last T slot
    const std::string full = c.dump_state();
    AdmissionTicket no_t = c.admit(4, 8);
    CHECK(no_t.refusal() == AdmitRefusal::no_open_slot);
    CHECK_THAT(no_t.error(), Catch::Contains("T has no free slot"));
    CHECK(c.dump_state() == full);

    // A request that exactly fits the rest is admitted: with sequence 3 gone, 4 P and 3 U blocks
    // are free.
    REQUIRE(c.free(3));
    CHECK(c.admit(5, 8 * 7).ok());
    CHECK(c.region_stats(Region::P).free_blocks == 0);
    CHECK(c.region_stats(Region::U).free_blocks == 0);
    CHECK(c.check_invariants().empty());
}

TEST_CASE("tickets apply once, only to an unchanged cache", "[unit][kv][admission]") {
    KvCache c(small_kv_config(8, 4, 4, 8, 8, 4, 0.5));
    KvCache other(small_kv_config(8, 4, 4, 8, 8, 4, 0.5));

    AdmissionTicket t1 = c.prepare_admit(1, 16);
    AdmissionTicket t2 = c.prepare_admit(2, 16);
    REQUIRE(t1.ok());
    REQUIRE(t2.ok());
    c.apply(std::move(t1));
    const std::string after_one = c.dump_state();
    CHECK_THROWS_AS(c.apply(std::move(t2)), std::logic_error);  // stale: the cache changed
    CHECK(c.dump_state() == after_one);

    AdmissionTicket foreign = other.prepare_admit(9, 8);
    CHECK_THROWS_AS(c.apply(std::move(foreign)), std::logic_error);
    AdmissionTicket refused = c.prepare_admit(1, 8);
    CHECK_THROWS_AS(c.apply(std::move(refused)), std::logic_error);
    CHECK(c.dump_state() == after_one);
    CHECK_FALSE(c.contains(2));
}

TEST_CASE("appends seal full blocks G first, then by the deficit rule", "[unit][kv][seal]") {
    // G 2, r = 0.5: blocks go G, G, then U, P, U, P (the deficit rule from an empty start).
    KvCache c(small_kv_config(8, 4, 2, 16, 16, 4, 0.5));
    REQUIRE(c.admit(7, 8 * 6 + 3).ok());
    const std::uint32_t t0 = c.open_block(7).t_slot;

    std::vector<SealMove> moves = c.append(7, 5);
    CHECK(moves.empty());
    CHECK(c.open_block(7).tokens == 5);
    moves = c.append(7, 3);  // fills block 0: a remap into G
    REQUIRE(moves.size() == 1);
    CHECK(moves[0].kind == MoveKind::remap);
    CHECK(moves[0].dest == BlockRef{Region::G, t0});
    CHECK(moves[0].t_slot == t0);
    CHECK(moves[0].block_index == 0);
    CHECK(c.open_block(7).t_slot != t0);  // the next block opens in another GPU slot

    moves = c.append(7, 8 * 5 + 3);  // prefill-sized: seals blocks 1..5 in order
    REQUIRE(moves.size() == 5);
    for (std::size_t i = 0; i < moves.size(); ++i)
        CHECK(moves[i].block_index == i + 1);
    CHECK(moves[0].kind == MoveKind::remap);
    CHECK(moves[1].kind == MoveKind::pack_to_unpinned);
    CHECK(moves[2].kind == MoveKind::copy_to_pinned);
    CHECK(moves[3].kind == MoveKind::pack_to_unpinned);
    CHECK(moves[4].kind == MoveKind::copy_to_pinned);
    // Copies out of T leave the sequence in the same GPU slot.
    CHECK(moves[2].t_slot == moves[1].t_slot);
    CHECK(c.open_block(7).t_slot == moves[4].t_slot);
    CHECK(regions_of(c, 7) ==
          std::vector<Region>{Region::G, Region::G, Region::U, Region::P, Region::U, Region::P});
    const KvSequenceStats st = c.sequence_stats(7);
    CHECK(st.tokens == 51);
    CHECK(st.open_tokens == 3);
    CHECK(st.spilled_tokens == 32);
    CHECK(st.u_tokens == 16);
    CHECK(st.u_share == 0.5);
    CHECK(c.check_invariants().empty());

    const std::string before = c.dump_state();
    CHECK_THROWS_AS(c.append(7, 1), std::length_error);  // 51 of 51 admitted tokens
    CHECK_THROWS_AS(c.append(8, 1), std::out_of_range);
    CHECK(c.dump_state() == before);
}

TEST_CASE("a prefill seals exactly what token-by-token decode seals", "[unit][kv][seal]") {
    const KvCacheConfig cfg = small_kv_config(8, 4, 3, 40, 40, 4, 0.3);
    KvCache one(cfg), bulk(cfg);
    REQUIRE(one.admit(1, 200).ok());
    REQUIRE(bulk.admit(1, 200).ok());
    for (int i = 0; i < 197; ++i)
        one.append(1, 1);
    const std::vector<SealMove> moves = bulk.append(1, 197);
    CHECK(moves.size() == 24);
    const auto a = one.block_table(1), b = bulk.block_table(1);
    CHECK(std::vector<BlockRef>(a.begin(), a.end()) == std::vector<BlockRef>(b.begin(), b.end()));
    CHECK(one.p_runs(1) == bulk.p_runs(1));
}

TEST_CASE("a freed G slot is taken before spilling and the spill reservation shrinks",
          "[unit][kv][seal]") {
    KvCache c(small_kv_config(8, 4, 2, 16, 16, 4, 1.0));
    REQUIRE(c.admit(1, 16).ok());     // takes both G slots
    REQUIRE(c.admit(2, 8 * 4).ok());  // 4 blocks, all U (r = 1)
    CHECK(c.sequence_stats(2).reserved[ridx(Region::U)] == 4);
    c.append(1, 16);
    REQUIRE(c.free(1));  // two G slots free again, unreserved
    const std::vector<SealMove> m = c.append(2, 8);
    REQUIRE(m.size() == 1);
    CHECK(m[0].kind == MoveKind::remap);
    CHECK(c.sequence_stats(2).reserved[ridx(Region::U)] == 3);  // the surplus went back
    CHECK(c.region_stats(Region::U).free_blocks == 13);
    CHECK(c.check_invariants().empty());
}

TEST_CASE("a spill region without room diverts the block to the other one", "[unit][kv][seal]") {
    // r = 1 but U holds only 2 blocks: admission shifts the rest to P, the router follows.
    KvCache c(small_kv_config(8, 4, 0, 16, 2, 4, 1.0));
    AdmissionTicket t = c.admit(1, 8 * 5);
    REQUIRE(t.ok());
    CHECK(t.reserved_u() == 2);
    CHECK(t.reserved_p_extents() == 1);
    const std::vector<SealMove> m = c.append(1, 8 * 5);
    REQUIRE(m.size() == 5);
    CHECK(regions_of(c, 1) ==
          std::vector<Region>{Region::U, Region::U, Region::P, Region::P, Region::P});
    CHECK_FALSE(m[1].diverted);
    CHECK(m[2].diverted);
    CHECK(c.diverted_seals() == 3);
    CHECK(c.check_invariants().empty());
}

TEST_CASE("P extents tile each slab and never straddle one", "[unit][kv][extent]") {
    // 25 P slots in slabs of 10, extents of 4: slabs [0,10) [10,20) [20,25) hold extents at
    // 0, 4 | 10, 14 | 20; the tails 8-9, 18-19, 24 are unused.
    const KvCacheConfig cfg = small_kv_config(8, 4, 0, 25, 0, 4, 0.0);
    KvCache c(cfg, 10);
    REQUIRE(c.p_extent_count() == 5);
    const std::vector<std::uint32_t> want{0, 4, 10, 14, 20};
    for (std::size_t i = 0; i < want.size(); ++i)
        CHECK(c.p_extent_first_slot(i) == want[i]);
    CHECK(c.region_stats(Region::P).capacity_blocks == 20);
    CHECK_THROWS_AS(KvCache(cfg, 3), std::invalid_argument);

    // One sequence, all P: 12 blocks fill extents 0, 1, 2 → runs [0,8) and [10,14).
    REQUIRE(c.admit(1, 8 * 12).ok());
    c.append(1, 8 * 12);
    CHECK(c.p_runs(1) == std::vector<SlotRun>{{0, 8}, {10, 4}});
    std::vector<std::uint32_t> slots;
    for (const BlockRef& ref : c.block_table(1))
        slots.push_back(ref.slot);
    CHECK(slots == std::vector<std::uint32_t>{0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12, 13});
}

TEST_CASE("interleaved sequences each fill their own extents", "[unit][kv][extent]") {
    KvCache c(small_kv_config(8, 4, 0, 64, 0, 4, 0.0));
    REQUIRE(c.admit(1, 8 * 10).ok());
    REQUIRE(c.admit(2, 8 * 10).ok());
    for (int i = 0; i < 10; ++i) {
        c.append(1, 8);
        c.append(2, 8);
    }
    for (std::uint64_t s : {1, 2}) {
        const std::vector<SlotRun> runs = c.p_runs(s);
        std::size_t total = 0;
        for (std::size_t i = 0; i < runs.size(); ++i) {
            CHECK(runs[i].first_slot % 4 == 0);
            if (i + 1 < runs.size()) CHECK(runs[i].count % 4 == 0);
            total += runs[i].count;
        }
        CHECK(total == 10);
        CHECK(c.sequence_stats(s).p_extents == 3);
        CHECK(c.sequence_stats(s).reserved[ridx(Region::P)] == 2);  // rest of the last extent
    }
    CHECK(c.check_invariants().empty());
}

TEST_CASE("free returns every slot and reservation, and r changes move nothing stored",
          "[unit][kv][free]") {
    KvCache c(small_kv_config(8, 4, 3, 16, 16, 4, 0.5));
    REQUIRE(c.admit(1, 8 * 10).ok());
    REQUIRE(c.admit(2, 8 * 9).ok());
    c.append(1, 8 * 7);
    c.append(2, 8 * 4 + 1);
    const auto before = c.block_table(1);
    const std::vector<BlockRef> table1(before.begin(), before.end());
    c.set_target_r(0.9);
    CHECK(std::vector<BlockRef>(c.block_table(1).begin(), c.block_table(1).end()) == table1);
    CHECK_THROWS_AS(c.set_target_r(-0.1), std::invalid_argument);
    CHECK_THROWS_AS(c.set_target_r(std::nan("")), std::invalid_argument);
    CHECK(c.target_r() == 0.9);

    CHECK(c.free(1));
    CHECK(c.free(2));
    CHECK_FALSE(c.free(2));
    for (const KvRegionStats& st : c.stats()) {
        INFO(region_name(st.region));
        CHECK(st.used_blocks == 0);
        CHECK(st.reserved_blocks == 0);
        CHECK(st.free_blocks == st.capacity_blocks);
    }
    // Everything is usable again: one sequence can take all of G, P and U, slot by slot.
    REQUIRE(c.admit(3, 8 * (3 + 16 + 16)).ok());
    c.append(3, 8 * (3 + 16 + 16));
    std::set<std::pair<int, std::uint32_t>> slots;
    for (const BlockRef& ref : c.block_table(3))
        CHECK(slots.insert({static_cast<int>(ref.region), ref.slot}).second);
    CHECK(slots.size() == 35);
    CHECK(c.region_stats(Region::G).used_blocks == 3);
    CHECK(c.region_stats(Region::P).used_blocks == 16);
    CHECK(c.region_stats(Region::U).used_blocks == 16);
    CHECK(c.check_invariants().empty());
}
