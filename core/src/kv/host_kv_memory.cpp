#include "writescope/core/host_kv_memory.hpp"

#include <cstring>
#include <stdexcept>
#include <string>

namespace writescope {

HostKvMemory HostKvMemory::create(const KvCacheConfig& cfg, HostMemoryOptions opts) {
    const KvCapacity cap = kv_capacity(cfg);
    HostKvMemory m;
    HostMemoryOptions plain = opts;
    plain.slot_alignment = 1;
    m.gpu_pool = std::make_unique<HostRegionMemory>(
        "T+G (GPU pool, host)", cap.layers, cap.gpu_pool_slots(), cap.linear_block_bytes, plain);
    HostMemoryOptions p = opts;
    p.slot_alignment = cap.extent_slots;
    m.pinned = std::make_unique<HostRegionMemory>("P (pinned)", cap.layers,
                                                  cap.slots[static_cast<std::size_t>(Region::P)],
                                                  cap.linear_block_bytes, p);
    m.unpinned = std::make_unique<HostRegionMemory>("U (unpinned)", cap.layers,
                                                    cap.slots[static_cast<std::size_t>(Region::U)],
                                                    cap.u_block_bytes, plain);
    return m;
}

void perform_seal_move(const SealMove& move, RegionMemory& gpu_pool, RegionMemory& pinned,
                       RegionMemory& unpinned, const PackBlockFn& pack) {
    if (move.kind == MoveKind::remap) return;  // the slot is relabelled; the bytes stay
    RegionMemory& dst = move.kind == MoveKind::copy_to_pinned ? pinned : unpinned;
    auto bad = [&](const std::string& why) {
        throw std::invalid_argument("seal move of sequence " + std::to_string(move.seq_id) +
                                    " block " + std::to_string(move.block_index) + " (" +
                                    std::string(move_kind_name(move.kind)) + "): " + why);
    };
    if (!gpu_pool.host_accessible() || !dst.host_accessible())
        bad("needs host-accessible memory (" + gpu_pool.name() + ", " + dst.name() + ")");
    if (move.t_slot >= gpu_pool.slots()) bad("T slot out of range");
    if (move.dest.slot >= dst.slots()) bad(dst.name() + " slot out of range");
    if (gpu_pool.layers() != dst.layers()) bad("layer counts differ");
    const std::size_t src_bytes = gpu_pool.slot_bytes();
    const std::size_t dst_bytes = dst.slot_bytes();
    const bool copy = move.kind == MoveKind::copy_to_pinned || !pack;
    if (copy && src_bytes != dst_bytes)
        bad("block sizes differ (" + std::to_string(src_bytes) + " vs " +
            std::to_string(dst_bytes) + " bytes) and there is no pack function");
    for (std::size_t layer = 0; layer < gpu_pool.layers(); ++layer) {
        const void* src = gpu_pool.block(layer, move.t_slot);
        void* out = dst.block(layer, move.dest.slot);
        if (copy) {
            std::memcpy(out, src, src_bytes);
        } else {
            pack(std::span<const std::byte>(static_cast<const std::byte*>(src), src_bytes),
                 std::span<std::byte>(static_cast<std::byte*>(out), dst_bytes), layer);
        }
    }
}

}  // namespace writescope
