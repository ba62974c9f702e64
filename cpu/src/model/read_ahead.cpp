#include "read_ahead.hpp"

#include <algorithm>
#include <cstring>

#include "writescope/core/dtype.hpp"

namespace writescope::cpu::detail {
namespace {

constexpr std::size_t kLine = 64;

// One contiguous range as pieces of at most kReadPieceBytes.
void plan_range(const std::byte* p, std::size_t bytes, std::vector<ReadPiece>& out) {
    for (std::size_t at = 0; at < bytes; at += kReadPieceBytes)
        out.push_back({p + at, std::min(kReadPieceBytes, bytes - at), 0, 1});
}

}  // namespace

void plan_expert_read(const model::FfnWeights& f, std::size_t f0, std::size_t f1,
                      std::vector<ReadPiece>& out) {
    const std::size_t es = dtype_bytes(f.gate.dtype);
    const std::size_t hidden = f.gate.cols, ffn = f.gate.rows;
    const std::size_t rows_bytes = (f1 - f0) * hidden * es;
    plan_range(static_cast<const std::byte*>(f.gate.data) + f0 * hidden * es, rows_bytes, out);
    plan_range(static_cast<const std::byte*>(f.up.data) + f0 * hidden * es, rows_bytes, out);
    const auto* down = static_cast<const std::byte*>(f.down.data);
    if (f0 == 0 && f1 == ffn) {
        plan_range(down, f.down.rows * ffn * es, out);
        return;
    }
    // A row range: columns [f0, f1) of each of down's rows, as many rows per piece as fill it.
    const std::size_t run = (f1 - f0) * es, stride = ffn * es;
    const std::size_t per_piece = std::max<std::size_t>(1, kReadPieceBytes / run);
    for (std::size_t r = 0; r < f.down.rows; r += per_piece)
        out.push_back(
            {down + r * stride + f0 * es, run, stride, std::min(per_piece, f.down.rows - r)});
}

std::uint64_t read_piece(const ReadPiece& piece) noexcept {
    std::uint64_t acc = 0;
    for (std::size_t i = 0; i < piece.count; ++i) {
        const std::byte* run = piece.p + i * piece.stride;
        // One word of every line the run touches: the line's first word inside the run, and
        // the run's last word (for the line it ends in).
        std::uint64_t w;
        for (std::size_t at = 0; at + sizeof w <= piece.len; at += kLine) {
            std::memcpy(&w, run + at, sizeof w);
            acc += w;
        }
        if (piece.len >= sizeof w) {
            std::memcpy(&w, run + piece.len - sizeof w, sizeof w);
            acc ^= w;
        }
    }
    return acc;
}

}  // namespace writescope::cpu::detail
