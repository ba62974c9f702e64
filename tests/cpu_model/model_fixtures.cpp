#include "model_fixtures.hpp"

#include <cmath>
#include <cstring>

namespace writescope::test {

RandomMatrix::RandomMatrix(std::size_t rows, std::size_t cols, DType dtype, std::size_t misalign,
                           std::mt19937_64& rng) {
    const std::size_t es = dtype_bytes(dtype);
    storage_.resize(rows * cols * es + 64 + misalign);
    auto base = reinterpret_cast<std::uintptr_t>(storage_.data());
    auto* p = storage_.data() + ((64 - base % 64) % 64) + misalign;
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    for (std::size_t i = 0; i < rows * cols; ++i) {
        const float v = u(rng);
        if (dtype == DType::f32) {
            std::memcpy(p + i * 4, &v, 4);
        } else {
            const std::uint16_t h = dtype == DType::bf16 ? f32_to_bf16(v) : f32_to_f16(v);
            std::memcpy(p + i * 2, &h, 2);
        }
    }
    m_ = {p, dtype, rows, cols};
}

double RandomMatrix::at(std::size_t r, std::size_t c) const noexcept {
    const auto* p = static_cast<const std::byte*>(m_.data);
    const std::size_t i = r * m_.cols + c;
    if (m_.dtype == DType::f32) {
        float f;
        std::memcpy(&f, p + i * 4, 4);
        return f;
    }
    std::uint16_t h;
    std::memcpy(&h, p + i * 2, 2);
    return m_.dtype == DType::bf16 ? bf16_to_f32(h) : f16_to_f32(h);
}

std::vector<float> random_floats(std::size_t n, float lo, float hi, std::mt19937_64& rng) {
    std::uniform_real_distribution<float> u(lo, hi);
    std::vector<float> v(n);
    for (auto& f : v)
        f = u(rng);
    return v;
}

double round_to(double v, DType d) noexcept {
    const float f = static_cast<float>(v);  // exact for fp32 inputs; else one fp32 rounding
    switch (d) {
        case DType::f32:
            return f;
        case DType::bf16:
            return bf16_to_f32(f32_to_bf16(f));
        case DType::f16:
            return f16_to_f32(f32_to_f16(f));
    }
    return f;
}

double dot_bound(std::size_t cols, bool amx) noexcept {
    return (static_cast<double>(cols) / (amx ? 2 : 8) + 8) * std::ldexp(1.0, -24);
}

LinearRef reference_linear(const RandomMatrix& w, const std::vector<float>& x, std::size_t n) {
    const model::Matrix m = w.view();
    LinearRef ref{std::vector<double>(n * m.rows), std::vector<double>(n * m.rows)};
    std::vector<double> xr(m.cols);
    for (std::size_t t = 0; t < n; ++t) {
        for (std::size_t c = 0; c < m.cols; ++c)
            xr[c] = round_to(x[t * m.cols + c], m.dtype);
        for (std::size_t r = 0; r < m.rows; ++r) {
            double s = 0, a = 0;
            for (std::size_t c = 0; c < m.cols; ++c) {
                const double p = w.at(r, c) * xr[c];
                s += p;
                a += std::fabs(p);
            }
            ref.y[t * m.rows + r] = s;
            ref.scale[t * m.rows + r] = a;
        }
    }
    return ref;
}

}  // namespace writescope::test
