// The copy ceilings the GPU benchmarks measure in their own runs.
#pragma once

#include <cstddef>
#include <vector>

#include "bench_util.hpp"
#include "writescope/cuda/device.hpp"

namespace writescope::bench {

// GB/s of one copy_async of `bytes` from src to dst on s: the median of 5 after a warm-up,
// counting `factor` × bytes (2 for a device → device copy: read and written).
inline double copy_rate_gbps(void* dst, const void* src, std::size_t bytes, double factor,
                             const cuda::Stream& s) {
    cuda::Event e0, e1;
    std::vector<double> r;
    for (int i = 0; i < 6; ++i) {
        e0.record(s);
        cuda::copy_async(dst, src, bytes, s);
        e1.record(s);
        e1.synchronize();
        if (i)
            r.push_back(factor * static_cast<double>(bytes) / (e1.elapsed_ms_since(e0) * 1e-3) /
                        1e9);
    }
    return median(r);
}

}  // namespace writescope::bench
