#include <catch2/catch.hpp>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <stdexcept>
#include <vector>

#include "kv_test_util.hpp"
#include "test_seed.hpp"
#include "writescope/core/host_kv_memory.hpp"
#include "writescope/core/host_region_memory.hpp"
#include "writescope/core/kv_cache.hpp"

using namespace writescope;
using test::ridx;

namespace {

// A distinct 16-bit value for every (sequence, token, layer, element of the token's K/V row).
std::uint16_t token_value(std::uint64_t seq, std::size_t token, std::size_t layer,
                          std::size_t elem) {
    std::uint64_t x = seq * 0x9E3779B97F4A7C15ull ^ (token << 20) ^ (layer << 12) ^ elem;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    return static_cast<std::uint16_t>(x);
}

// The elements of one token of one layer in the linear layout, in a fixed order:
// K of each head, then V of each head (dk = dv = 8 here).
std::vector<std::size_t> token_offsets(const LinearBlockLayout& lay, std::size_t t) {
    std::vector<std::size_t> off;
    for (std::size_t h = 0; h < lay.kv_heads; ++h)
        for (std::size_t d = 0; d < lay.dk; ++d)
            off.push_back(lay.k_offset(h, t) + d);
    for (std::size_t h = 0; h < lay.kv_heads; ++h)
        for (std::size_t d = 0; d < lay.dv; ++d)
            off.push_back(lay.v_offset(h, t) + d);
    return off;
}

// A stand-in for the CPU kernel's U layout: a 64-byte header naming the layer, then the linear
// elements in reverse order (so a plain copy would read back wrong).
constexpr std::size_t kPackHeader = 64;
void pack_block(std::span<const std::byte> linear, std::span<std::byte> packed, std::size_t layer) {
    REQUIRE(packed.size() == linear.size() + kPackHeader);
    std::memset(packed.data(), 0, kPackHeader);
    std::memcpy(packed.data(), &layer, sizeof layer);
    const std::size_t n = linear.size() / 2;
    auto* out = reinterpret_cast<std::uint16_t*>(packed.data() + kPackHeader);
    const auto* in = reinterpret_cast<const std::uint16_t*>(linear.data());
    for (std::size_t i = 0; i < n; ++i)
        out[n - 1 - i] = in[i];
}
std::uint16_t read_packed(const void* packed, std::size_t linear_elems, std::size_t elem) {
    const auto* p =
        reinterpret_cast<const std::uint16_t*>(static_cast<const std::byte*>(packed) + kPackHeader);
    return p[linear_elems - 1 - elem];
}

}  // namespace

TEST_CASE("host region memory is slabbed, layer-major and contiguous within a slab",
          "[unit][kv][memory]") {
    HostMemoryOptions opts;
    opts.slab_bytes = 4 * 3 * 1000;  // 4 slots of 1000 bytes over 3 layers
    opts.slot_alignment = 3;         // → slabs of 3 slots
    HostRegionMemory m("test", 3, 10, 1000, opts);
    CHECK(m.slab_slots() == 3);
    CHECK(m.slab_count() == 4);  // 3 + 3 + 3 + 1
    CHECK(m.host_accessible());
    CHECK(m.block(3, 0) == nullptr);
    CHECK(m.block(0, 10) == nullptr);
    const long page = sysconf(_SC_PAGESIZE);
    for (std::size_t slab = 0; slab < 4; ++slab)
        CHECK(reinterpret_cast<std::uintptr_t>(m.block(0, slab * 3)) % page == 0);
    for (std::size_t l = 0; l < 3; ++l)
        for (std::size_t s = 0; s < 10; ++s) {
            if (s % 3 != 2 && s + 1 < 10)
                CHECK(static_cast<std::byte*>(m.block(l, s + 1)) ==
                      static_cast<std::byte*>(m.block(l, s)) + 1000);
            std::memset(m.block(l, s), static_cast<int>(l * 10 + s), 1000);
        }
    // No two blocks overlap: each still holds its own byte.
    for (std::size_t l = 0; l < 3; ++l)
        for (std::size_t s = 0; s < 10; ++s) {
            const auto* p = static_cast<const unsigned char*>(m.block(l, s));
            CHECK(p[0] == l * 10 + s);
            CHECK(p[999] == l * 10 + s);
        }

    HostMemoryOptions big;
    big.slab_bytes = std::size_t{4} << 20;
    HostRegionMemory h("huge", 2, 16, std::size_t{256} << 10, big);  // 2 slabs of 4 MiB
    CHECK(h.slab_count() == 2);
    CHECK(reinterpret_cast<std::uintptr_t>(h.block(0, 0)) % (std::size_t{2} << 20) == 0);
    CHECK(h.mapped_bytes() == (std::size_t{8} << 20));
    CHECK_THROWS_AS(HostRegionMemory("bad", 0, 1, 1), std::invalid_argument);
}

TEST_CASE("a region's blocks are read into host memory in the order asked, across slabs",
          "[unit][kv][memory]") {
    HostMemoryOptions opts;
    opts.slab_bytes = 2 * 2 * 64;  // slabs of 2 slots over 2 layers
    opts.slot_alignment = 1;
    HostRegionMemory m("read", 2, 5, 64, opts);
    REQUIRE(m.slab_slots() == 2);
    for (std::size_t l = 0; l < 2; ++l)
        for (std::size_t s = 0; s < 5; ++s)
            std::memset(m.block(l, s), static_cast<int>(16 * l + s + 1), 64);
    const std::vector<std::uint32_t> slots{4, 0, 1, 3};
    std::vector<unsigned char> out(slots.size() * 64, 0);
    m.read(1, slots, out.data());
    for (std::size_t i = 0; i < slots.size(); ++i)
        for (std::size_t b = 0; b < 64; ++b)
            REQUIRE(out[i * 64 + b] == 16 + slots[i] + 1);
    const std::vector<std::uint32_t> bad{5};
    CHECK_THROWS_AS(m.read(0, bad, out.data()), std::out_of_range);
}

TEST_CASE("an allocation the address space cannot hold fails with a message naming the slab",
          "[unit][kv][memory]") {
#if defined(__SANITIZE_ADDRESS__)
    WARN("skipped under AddressSanitizer (it needs an unlimited address space)");
#else
    const pid_t pid = fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
        // Child: cap the address space at what is mapped now plus 64 MiB, then ask for 1 GiB.
        long pages = 0;
        if (FILE* f = std::fopen("/proc/self/statm", "r")) {
            if (std::fscanf(f, "%ld", &pages) != 1) pages = 0;
            std::fclose(f);
        }
        const rlim_t cap = static_cast<rlim_t>(pages) * sysconf(_SC_PAGESIZE) + (64u << 20);
        rlimit lim{cap, cap};
        if (pages == 0 || setrlimit(RLIMIT_AS, &lim) != 0) _exit(3);
        try {
            HostMemoryOptions o;
            o.slab_bytes = std::size_t{256} << 20;
            HostRegionMemory m("U (unpinned)", 4, 1024, std::size_t{256} << 10, o);
            _exit(1);  // it should not have fit
        } catch (const std::runtime_error& e) {
            const std::string msg = e.what();
            const bool good = msg.find("slab 1 of 4") != std::string::npos &&
                              msg.find("U (unpinned)") != std::string::npos &&
                              msg.find("Cannot allocate memory") != std::string::npos;
            if (!good) std::fprintf(stderr, "unexpected message: %s\n", msg.c_str());
            _exit(good ? 0 : 2);
        } catch (...) {
            _exit(4);
        }
    }
    int status = 0;
    REQUIRE(waitpid(pid, &status, 0) == pid);
    REQUIRE(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 0);
#endif
}

TEST_CASE("seal moves on host memory put every token where the block table says",
          "[unit][kv][memory]") {
    auto rng = test::seeded_rng("host kv memory round trip");
    // B = 8; linear block 512 B per layer, the U layout 64 B larger. Small slabs so P spans
    // several of them.
    const std::size_t b = 8;
    const std::size_t linear_bytes = b * 2 * 16 * 2;
    const KvCacheConfig cfg =
        test::small_kv_config(b, 6, 10, 48, 40, 4, 0.5, linear_bytes + kPackHeader);
    HostMemoryOptions opts;
    opts.slab_bytes = 3 * linear_bytes * 12;  // 12 slots per slab (a multiple of E = 4)
    HostKvMemory mem = HostKvMemory::create(cfg, opts);
    REQUIRE(mem.pinned->slab_slots() == 12);
    KvCache cache(cfg, mem.pinned->slab_slots());
    const LinearBlockLayout lay = LinearBlockLayout::of(cfg.geometry, b);
    const std::size_t layers = 3;

    auto write_token = [&](std::uint64_t seq, std::size_t token, std::uint32_t t_slot) {
        const auto offs = token_offsets(lay, token % b);
        for (std::size_t l = 0; l < layers; ++l) {
            auto* blk = static_cast<std::uint16_t*>(mem.gpu_pool->block(l, t_slot));
            for (std::size_t i = 0; i < offs.size(); ++i)
                blk[offs[i]] = token_value(seq, token, l, i);
        }
    };
    // Appends n tokens the way a backend would: each sealed block is filled in its T slot, then
    // moved, before the next block reuses that slot.
    auto append = [&](std::uint64_t seq, std::size_t n) {
        const std::size_t t0 = cache.sequence_stats(seq).tokens;
        const std::uint32_t open_slot = cache.open_block(seq).t_slot;
        const std::vector<SealMove> moves = cache.append(seq, n);
        std::size_t mi = 0;
        for (std::size_t t = t0; t < t0 + n; ++t) {
            const std::size_t blk = t / b;
            const bool sealed = mi < moves.size() && moves[mi].block_index == blk;
            write_token(seq, t, sealed ? moves[mi].t_slot : cache.open_block(seq).t_slot);
            if (sealed && t % b == b - 1) perform_seal_move(moves[mi++], mem, pack_block);
        }
        REQUIRE(mi == moves.size());
        if (moves.empty()) REQUIRE(cache.open_block(seq).t_slot == open_slot);
    };
    auto verify = [&](std::uint64_t seq) {
        const KvSequenceStats st = cache.sequence_stats(seq);
        const auto table = cache.block_table(seq);
        const std::size_t elems = lay.elems();
        std::size_t checked = 0;
        for (std::size_t t = 0; t < st.tokens; ++t) {
            const std::size_t blk = t / b;
            const auto offs = token_offsets(lay, t % b);
            for (std::size_t l = 0; l < layers; ++l) {
                for (std::size_t i = 0; i < offs.size(); ++i) {
                    std::uint16_t got = 0;
                    if (blk >= table.size()) {
                        got = static_cast<const std::uint16_t*>(
                            mem.gpu_pool->block(l, cache.open_block(seq).t_slot))[offs[i]];
                    } else if (table[blk].region == Region::G) {
                        got = static_cast<const std::uint16_t*>(
                            mem.gpu_pool->block(l, table[blk].slot))[offs[i]];
                    } else if (table[blk].region == Region::P) {
                        got = static_cast<const std::uint16_t*>(
                            mem.pinned->block(l, table[blk].slot))[offs[i]];
                    } else {
                        const void* u = mem.unpinned->block(l, table[blk].slot);
                        std::size_t hdr_layer = 0;
                        std::memcpy(&hdr_layer, u, sizeof hdr_layer);
                        REQUIRE(hdr_layer == l);
                        got = read_packed(u, elems, offs[i]);
                    }
                    if (got != token_value(seq, t, l, i)) {
                        FAIL("sequence "
                             << seq << " token " << t << " layer " << l << " element " << i
                             << " in "
                             << region_name(blk < table.size() ? table[blk].region : Region::T));
                    }
                    ++checked;
                }
            }
        }
        return checked;
    };

    std::map<std::uint64_t, std::size_t> live;  // sequence → max tokens
    std::uint64_t next = 1;
    std::size_t checked = 0;
    std::array<std::size_t, kNumRegions> seen{};
    for (int round = 0; round < 60; ++round) {
        if (live.size() < 4) {
            const std::size_t max_tokens = std::uniform_int_distribution<std::size_t>(1, 120)(rng);
            if (cache.admit(next, max_tokens).ok()) live[next] = max_tokens;
            ++next;
        }
        cache.set_target_r(std::uniform_real_distribution<double>(0, 1)(rng));
        for (auto& [seq, max_tokens] : live) {
            const std::size_t room = max_tokens - cache.sequence_stats(seq).tokens;
            if (room == 0) continue;
            const std::size_t n = std::min(
                room, std::uniform_int_distribution<std::size_t>(1, round % 5 == 0 ? 64 : 9)(rng));
            append(seq, n);
        }
        for (const auto& [seq, max_tokens] : live) {
            checked += verify(seq);
            for (const BlockRef& ref : cache.block_table(seq))
                ++seen[ridx(ref.region)];
            // Each P run is one contiguous byte range per layer.
            for (const SlotRun& run : cache.p_runs(seq))
                for (std::size_t l = 0; l < layers; ++l)
                    REQUIRE(static_cast<std::byte*>(
                                mem.pinned->block(l, run.first_slot + run.count - 1)) ==
                            static_cast<std::byte*>(mem.pinned->block(l, run.first_slot)) +
                                (run.count - 1) * linear_bytes);
        }
        // Retire a finished (or random) sequence; its slots are reused by later ones.
        if (!live.empty() && std::uniform_int_distribution<int>(0, 2)(rng) == 0) {
            auto it = live.begin();
            std::advance(it, std::uniform_int_distribution<std::size_t>(0, live.size() - 1)(rng));
            REQUIRE(cache.free(it->first));
            live.erase(it);
        }
    }
    INFO("tokens x layers x elements checked: " << checked);
    CHECK(checked > 0);
    CHECK(seen[ridx(Region::G)] > 0);
    CHECK(seen[ridx(Region::P)] > 0);
    CHECK(seen[ridx(Region::U)] > 0);
}

namespace {
// Memory the CPU cannot address, like a device allocation.
class OpaqueMemory final : public RegionMemory {
  public:
    const std::string& name() const noexcept override { return name_; }
    std::size_t layers() const noexcept override { return 1; }
    std::size_t slots() const noexcept override { return 4; }
    std::size_t slot_bytes() const noexcept override { return 64; }
    std::size_t slab_slots() const noexcept override { return 4; }
    bool host_accessible() const noexcept override { return false; }
    void* block(std::size_t, std::size_t) noexcept override { return nullptr; }

  private:
    std::string name_ = "device";
};
}  // namespace

TEST_CASE("seal moves refuse memory the CPU cannot address and mismatched sizes",
          "[unit][kv][memory]") {
    OpaqueMemory dev;
    HostRegionMemory p("P", 1, 4, 64), u("U", 1, 4, 128);
    SealMove copy{1, 0, 0, {Region::P, 0}, MoveKind::copy_to_pinned, false};
    CHECK_THROWS_AS(perform_seal_move(copy, dev, p, u), std::invalid_argument);
    HostRegionMemory pool("T+G", 1, 4, 64);
    CHECK_NOTHROW(perform_seal_move(copy, pool, p, u));
    SealMove pack{1, 0, 0, {Region::U, 0}, MoveKind::pack_to_unpinned, false};
    CHECK_THROWS_WITH(perform_seal_move(pack, pool, p, u), Catch::Contains("block sizes differ"));
    SealMove out_of_range{1, 0, 0, {Region::P, 9}, MoveKind::copy_to_pinned, false};
    CHECK_THROWS_AS(perform_seal_move(out_of_range, pool, p, u), std::invalid_argument);
    SealMove remap{1, 0, 0, {Region::G, 0}, MoveKind::remap, false};
    CHECK_NOTHROW(perform_seal_move(remap, dev, dev, dev));
}
