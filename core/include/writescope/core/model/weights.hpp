// Views of model weights: plain pointers into memory-mapped checkpoint files (or the buffers of a
// built-in model's random weights), with their dtype and shape. Nothing here owns memory.
#pragma once

#include <cstddef>
#include <cstdint>

#include "writescope/core/dtype.hpp"

namespace writescope::model {

// A row-major matrix as torch.nn.Linear stores its weight: (rows = out features, cols = in
// features), dense, `dtype` elements.
struct Matrix {
    const void* data = nullptr;
    DType dtype = DType::f32;
    std::size_t rows = 0, cols = 0;
    std::size_t bytes() const noexcept { return rows * cols * dtype_bytes(dtype); }
    explicit operator bool() const noexcept { return data != nullptr; }
};

// A vector (a norm's weight, a bias): n elements of `dtype`.
struct Vector {
    const void* data = nullptr;
    DType dtype = DType::f32;
    std::size_t n = 0;
    explicit operator bool() const noexcept { return data != nullptr; }
};

// One SwiGLU feed-forward network, as the MoE experts and the dense MLPs of all three families
// have it: FFN(x) = down · (silu(gate · x) ⊙ (up · x)). gate and up: (ffn, hidden); down:
// (hidden, ffn). Mixtral's w1 is gate, w3 up, w2 down.
struct FfnWeights {
    Matrix gate, up, down;
    std::size_t bytes() const noexcept { return gate.bytes() + up.bytes() + down.bytes(); }
};

}  // namespace writescope::model
