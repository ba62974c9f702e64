// Random weights and activations for the CpuModelOps tests, and the fp64 reference of the
// numerics contract (model_ops.hpp) with its error bounds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "writescope/core/dtype.hpp"
#include "writescope/core/model/weights.hpp"

namespace writescope::test {

// A weight matrix with random values in [−1, 1) of its dtype, stored `misalign` bytes past an
// aligned address (checkpoint data need not be aligned: an odd offset is allowed).
class RandomMatrix {
  public:
    RandomMatrix(std::size_t rows, std::size_t cols, DType dtype, std::size_t misalign,
                 std::mt19937_64& rng);
    model::Matrix view() const noexcept { return m_; }
    double at(std::size_t r, std::size_t c) const noexcept;  // element (r, c) as fp64

  private:
    std::vector<std::byte> storage_;
    model::Matrix m_;
};

std::vector<float> random_floats(std::size_t n, float lo, float hi, std::mt19937_64& rng);

// v rounded to dtype d (nearest even) and back, as fp64.
double round_to(double v, DType d) noexcept;

// A bound on the error of an fp32 dot product over `cols` products, relative to Σ|w||x|: the
// vector kernels keep at least 8 partial sums, each of at most cols/8 + 1 terms, combined in a
// tree; an AMX tile product adds the column pairs one after the other into one fp32 element
// (amx: cols/2 additions).
double dot_bound(std::size_t cols, bool amx = false) noexcept;

// The reference of one linear: y(n, rows) = round(x) · wᵀ in fp64 and, per element, the scale
// Σ|w||round(x)| the error is measured against.
struct LinearRef {
    std::vector<double> y, scale;
};
LinearRef reference_linear(const RandomMatrix& w, const std::vector<float>& x, std::size_t n);

}  // namespace writescope::test
