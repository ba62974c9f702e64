// The InplaceKVCache bookkeeping: regions, block tables, sealing, the deficit router, admission.
//
// This is metadata only: it hands out slots and says what data must move; backends own the
// memory (RegionMemory) and move the bytes. It is not thread-safe: the engine serialises calls.
//
// Slots. T and G share one GPU pool of t_slots + g_slots slots (so sealing into G is a remap:
// the slot the block was filled in is relabelled G); BlockRef{T, s} and BlockRef{G, s} index the
// same pool. P and U have their own slot spaces. T and G capacities are accounting limits on the
// pool: at most t_slots open blocks and g_slots sealed ones.
//
// P extents. P slots are handed out in extents of E consecutive slots (E·linear block bytes
// ≥ 1 MiB by default) that never straddle a slab of the P memory; a sequence fills its current
// extent before it takes another, so one layer's P blocks of a sequence are a few long runs.
//
// Budgets are hard. admit() reserves, for the sequence's whole life, its T slot and every sealed
// block it can ever need (ceil(max_tokens / B)), split over G, P and U; a refused request leaves
// the cache bit-for-bit unchanged, and no seal of an admitted sequence can fail.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "writescope/core/block_router.hpp"
#include "writescope/core/kv_block.hpp"
#include "writescope/core/kv_geometry.hpp"
#include "writescope/core/seal_move.hpp"

namespace writescope {

struct KvCacheConfig {
    KvGeometry geometry;
    std::size_t block_tokens = 128;  // B: tokens per block
    std::size_t t_slots = 0;         // open blocks: most sequences admitted at once (VRAM budget)
    std::size_t g_slots = 0;         // sealed blocks resident on the GPU (VRAM budget)
    std::uint64_t pinned_bytes = 0;  // P budget, bytes over all layers
    std::uint64_t host_bytes = 0;    // U budget, bytes over all layers
    // Bytes of one U block of one layer in the CPU kernel's packed layout (the CPU backend knows
    // it); 0: the linear block size.
    std::size_t u_block_bytes = 0;
    // E, the P extent in slots; 0: ceil(1 MiB / linear block bytes), so a run is ≥ 1 MiB.
    std::size_t p_extent_slots = 0;
    double target_r = 1.0;  // initial U share of spilled tokens, in [0, 1]
};

// Slot counts and sizes that follow from a config.
struct KvCapacity {
    std::size_t linear_block_bytes = 0;  // one block of one layer, linear layout (T, G, P)
    std::size_t u_block_bytes = 0;       // one block of one layer, U layout
    std::size_t layers = 0;
    std::size_t extent_slots = 0;  // E
    // Slots to allocate per region memory: T and G (their sum is the GPU pool), P (before the
    // rounding to whole extents within slabs), U.
    std::array<std::size_t, kNumRegions> slots{};
    std::size_t gpu_pool_slots() const noexcept { return slots[0] + slots[1]; }
};

// Validates cfg and converts its budgets to slots. Throws std::invalid_argument naming the field.
KvCapacity kv_capacity(const KvCacheConfig& cfg);

// Occupancy of one region. used + reserved + free == capacity, always.
struct KvRegionStats {
    Region region = Region::T;
    std::size_t capacity_blocks = 0;  // P: whole extents only
    std::size_t used_blocks = 0;      // holding a block (T: open blocks, one per sequence)
    // Promised to admitted sequences but not yet holding a block (P: reserved extents and the
    // unfilled rest of sequences' current extents).
    std::size_t reserved_blocks = 0;
    std::size_t free_blocks = 0;       // neither: what admission can still hand out
    std::uint64_t block_bytes = 0;     // one block over all layers
    std::uint64_t capacity_bytes = 0;  // capacity_blocks · block_bytes
    std::uint64_t used_bytes = 0;      // used_blocks · block_bytes
    std::uint64_t reserved_bytes = 0;  // reserved_blocks · block_bytes
};

struct KvSequenceStats {
    std::uint64_t seq_id = 0;
    std::size_t tokens = 0;       // appended so far
    std::size_t max_tokens = 0;   // admitted maximum
    std::size_t open_tokens = 0;  // tokens in the open (T) block
    std::uint32_t t_slot = 0;     // its open block's GPU pool slot
    // Blocks per region: T is always 1 (the open block, possibly empty); G, P, U sealed blocks.
    std::array<std::size_t, kNumRegions> blocks{};
    // Reserved sealed blocks not yet used, per region (T: 0). P counts reserved extents and the
    // unfilled rest of the current extent. Their sum covers every block the sequence can still
    // seal.
    std::array<std::size_t, kNumRegions> reserved{};
    std::size_t p_extents = 0;       // extents taken
    std::size_t spilled_tokens = 0;  // in P and U
    std::size_t u_tokens = 0;        // in U
    double u_share = 0.0;            // u_tokens / spilled_tokens; 0 while nothing is spilled
};

// A run of consecutive P slots of one sequence, contiguous in every layer's memory.
struct SlotRun {
    std::uint32_t first_slot = 0;
    std::uint32_t count = 0;
    friend bool operator==(const SlotRun&, const SlotRun&) = default;
};

// The open block of a sequence: where its next token goes.
struct OpenBlock {
    std::uint32_t t_slot = 0;
    std::size_t block_index = 0;  // block k of the sequence
    std::size_t tokens = 0;       // tokens already in it (the next one goes to this offset)
};

enum class AdmitRefusal : std::uint8_t {
    none,
    duplicate_id,  // the sequence is already admitted
    bad_request,   // max_tokens is 0
    no_open_slot,  // T is full: as many sequences as T slots are admitted
    no_room,       // G, P and U together cannot reserve the sealed blocks
};

// Per-sequence bookkeeping (internal to the cache; declared here so a ticket can carry
// it).
struct KvSequenceState {
    std::size_t max_tokens = 0;
    std::size_t max_blocks = 0;  // ceil(max_tokens / B)
    std::size_t tokens = 0;
    std::uint32_t t_slot = 0;
    std::vector<BlockRef> table;           // sealed blocks in token order; capacity max_blocks
    std::vector<std::uint32_t> p_extents;  // extent indices, in the order taken
    std::size_t p_open = 0;                // unfilled slots left in the last extent
    std::size_t res_g = 0, res_u = 0, res_p_ext = 0;  // reservations not yet used
    std::array<std::size_t, kNumRegions> blocks{};    // sealed blocks per region
};

class KvCache;

// The result of prepare_admit: a reservation to apply, or why there is none. Move-only; valid
// until the next change to the cache it came from.
class AdmissionTicket {
  public:
    bool ok() const noexcept { return refusal_ == AdmitRefusal::none; }
    AdmitRefusal refusal() const noexcept { return refusal_; }
    // The refusal, naming the region, what was asked and what is free.
    const std::string& error() const noexcept { return error_; }
    // What the reservation holds (sealed blocks per region; P in whole extents).
    std::size_t reserved_g() const noexcept { return g_; }
    std::size_t reserved_u() const noexcept { return u_; }
    std::size_t reserved_p_extents() const noexcept { return p_ext_; }

    AdmissionTicket(AdmissionTicket&&) noexcept = default;
    AdmissionTicket& operator=(AdmissionTicket&&) noexcept = default;

  private:
    friend class KvCache;
    AdmissionTicket() = default;

    const KvCache* cache_ = nullptr;
    std::uint64_t generation_ = 0;
    AdmitRefusal refusal_ = AdmitRefusal::none;
    std::string error_;
    std::size_t g_ = 0, u_ = 0, p_ext_ = 0;
    // The sequence's entry, built (allocated) in prepare so that apply allocates nothing.
    std::map<std::uint64_t, KvSequenceState>::node_type node_;
};

class KvCache {
  public:
    // p_slab_slots: slots per slab of the P memory (RegionMemory::slab_slots()); 0 means one
    // slab. Throws std::invalid_argument naming the problem (bad config, a slab smaller than an
    // extent, more than 2^32 slots).
    explicit KvCache(const KvCacheConfig& cfg, std::size_t p_slab_slots = 0);

    const KvCacheConfig& config() const noexcept { return cfg_; }
    const KvCapacity& capacity() const noexcept { return cap_; }
    std::size_t block_tokens() const noexcept { return cfg_.block_tokens; }
    std::size_t extent_slots() const noexcept { return cap_.extent_slots; }
    std::size_t p_slab_slots() const noexcept { return p_slab_slots_; }

    // --- Admission: prepare (no side effects) then apply (cannot fail). ---
    AdmissionTicket prepare_admit(std::uint64_t seq_id, std::size_t max_tokens) const;
    // Applies an ok ticket from this cache with no change in between; throws std::logic_error
    // (changing nothing) for a refused, foreign or stale ticket. Otherwise does not throw.
    void apply(AdmissionTicket&& ticket);
    // prepare + apply. Returns the ticket (refused: nothing changed; ok: applied, now empty).
    AdmissionTicket admit(std::uint64_t seq_id, std::size_t max_tokens);

    // Appends n tokens to the sequence's open block, sealing each block that fills, in order,
    // and returns the moves for the backend. Throws (changing nothing) std::out_of_range for an
    // unknown sequence and std::length_error past its admitted max_tokens.
    std::vector<SealMove> append(std::uint64_t seq_id, std::size_t n);

    // Returns every slot and reservation of the sequence. False when it was not admitted.
    bool free(std::uint64_t seq_id) noexcept;

    // U's target share of spilled tokens for blocks sealed from now on; throws
    // std::invalid_argument outside [0, 1]. Nothing stored moves.
    void set_target_r(double r);
    double target_r() const noexcept { return r_; }

    // --- Queries. Unknown sequences throw std::out_of_range. ---
    bool contains(std::uint64_t seq_id) const noexcept { return seqs_.count(seq_id) != 0; }
    std::size_t sequence_count() const noexcept { return seqs_.size(); }
    std::vector<std::uint64_t> sequences() const;
    // Sealed blocks in token order: block k holds tokens [k·B, (k+1)·B) of every layer.
    std::span<const BlockRef> block_table(std::uint64_t seq_id) const;
    OpenBlock open_block(std::uint64_t seq_id) const;
    // The sequence's P blocks as runs of consecutive slots within one slab, in token order.
    std::vector<SlotRun> p_runs(std::uint64_t seq_id) const;
    KvSequenceStats sequence_stats(std::uint64_t seq_id) const;
    KvRegionStats region_stats(Region r) const noexcept;
    std::array<KvRegionStats, kNumRegions> stats() const noexcept;
    std::size_t p_extent_count() const noexcept { return extent_first_.size(); }
    std::uint32_t p_extent_first_slot(std::size_t extent) const { return extent_first_.at(extent); }
    // Seals whose wanted spill region had no room (statistics of the router).
    std::uint64_t diverted_seals() const noexcept { return diverted_; }
    // Bumped by every change; a ticket is valid only for the generation it was prepared at.
    std::uint64_t generation() const noexcept { return generation_; }

    // Every piece of state as deterministic text (for tests comparing before and after, and for
    // debugging).
    std::string dump_state() const;
    // Empty when every internal invariant holds; otherwise the first violation found.
    std::string check_invariants() const;

  private:
    using Sequence = KvSequenceState;

    std::size_t g_free() const noexcept { return cap_.slots[1] - used_g_ - res_g_; }
    std::size_t u_free() const noexcept { return cap_.slots[3] - used_u_ - res_u_; }
    std::size_t p_free_extents() const noexcept {
        return extent_first_.size() - p_alloc_ext_ - res_p_ext_;
    }
    Sequence& find(std::uint64_t seq_id);
    const Sequence& find(std::uint64_t seq_id) const;
    SealMove seal(std::uint64_t seq_id, Sequence& s) noexcept;
    std::uint32_t take_extent(const Sequence& s) noexcept;
    void trim_reservation(Sequence& s) noexcept;

    KvCacheConfig cfg_;
    KvCapacity cap_;
    std::size_t p_slab_slots_ = 0;
    double r_ = 1.0;

    // Free slots as stacks (capacity reserved up front, so returning a slot never allocates).
    std::vector<std::uint32_t> gpu_free_;      // GPU pool (T and G)
    std::vector<std::uint32_t> u_free_;        // U
    std::vector<std::uint32_t> extent_first_;  // first P slot of each extent
    std::vector<std::uint8_t> extent_taken_;   // per extent: held by a sequence
    std::size_t used_g_ = 0, used_p_ = 0, used_u_ = 0;
    std::size_t res_g_ = 0, res_u_ = 0, res_p_ext_ = 0;  // sums of the sequences' reservations
    std::size_t p_alloc_ext_ = 0;                        // extents held by sequences
    std::size_t p_open_ = 0;  // unfilled slots of held extents (sum of the sequences' p_open)
    std::uint64_t diverted_ = 0;
    std::uint64_t generation_ = 0;
    std::map<std::uint64_t, Sequence> seqs_;
};

}  // namespace writescope
