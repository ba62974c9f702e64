// The CPU's per-element model operations (ModelOps: embed, rms_norm, rotary, add, add_bias,
// route, to_dtype, copy_2d): O(hidden) per token, plain C++ on the calling thread. They are the
// reference the GPU kernels are tested against.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "writescope/core/model/model_ops.hpp"

namespace writescope::cpu::detail {

void embed(const model::Matrix& table, const std::int32_t* ids, std::size_t n, float* out) noexcept;
void rms_norm(const model::Vector& w, const float* x, std::size_t rows, std::size_t dim, float eps,
              float* y) noexcept;
void rotary(const model::RotaryTable& t, float* x, std::size_t tokens, std::size_t heads,
            std::size_t stride, std::size_t offset, const std::int64_t* pos) noexcept;
// ModelOps::finish_rows (the parts already checked), with the arithmetic of rms_norm, rotary
// and to_dtype above.
void finish_rows(std::span<const model::RowFinish> parts, float eps,
                 const std::int64_t* pos) noexcept;
void add(float* y, const float* x, std::size_t n) noexcept;
void add_bias(float* y, const model::Vector& b, std::size_t rows) noexcept;
void to_dtype(const float* x, std::size_t n, DType t, void* y) noexcept;
void copy_2d(const float* src, std::size_t src_stride, float* dst, std::size_t dst_stride,
             std::size_t rows, std::size_t cols) noexcept;

// Routing computes in scratch sized once for the most experts and groups.
class Router {
  public:
    Router(std::size_t max_experts, std::size_t max_groups);
    // Throws std::length_error past the sizes it was made for, std::invalid_argument for
    // parameters that do not describe a routing (k = 0 or above the experts, groups that do not
    // divide them).
    void route(const model::RoutingParams& p, const float* logits, std::size_t n,
               std::int32_t* experts, float* weights);

  private:
    std::vector<float> p_, score_, group_score_;
    std::vector<std::int32_t> order_;
    std::vector<std::size_t> group_order_;
    std::vector<std::uint8_t> keep_;
};

}  // namespace writescope::cpu::detail
