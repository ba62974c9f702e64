// Reading host experts ahead (ModelOps::read_ahead): the bytes a moe() call would read of its
// routed experts, cut into pieces the expert threads read one at a time, so that they land in
// the CPU's caches (L2, then the shared L3) before the call that computes with them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "writescope/core/model/model_ops.hpp"

namespace writescope::cpu::detail {

// `count` runs of `len` bytes, the first at `p`, each `stride` bytes after the one before.
struct ReadPiece {
    const std::byte* p = nullptr;
    std::size_t len = 0, stride = 0, count = 1;
    std::uint64_t bytes() const noexcept { return std::uint64_t{len} * count; }
};

// About this many bytes per piece: enough to amortise taking it, few enough that a stop
// request waits for little (a piece at ~10 GB/s per thread is ~25 µs).
inline constexpr std::size_t kReadPieceBytes = std::size_t{32} << 10;

// The pieces of rows [f0, f1) of `f` (gate's and up's rows, down's columns: what moe() reads of
// a row range), appended to `out`.
void plan_expert_read(const model::FfnWeights& f, std::size_t f0, std::size_t f1,
                      std::vector<ReadPiece>& out);

// Reads every cache line of the piece; returns a value computed from what it read (the caller
// keeps it, so that the loads are not optimised away).
std::uint64_t read_piece(const ReadPiece& piece) noexcept;

}  // namespace writescope::cpu::detail
