// The device-memory read ceiling a benchmark compares a GPU-resident step with (device.hpp).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernel_check.hpp"
#include "writescope/cuda/device.hpp"

namespace writescope::cuda {
namespace {

constexpr int kThreads = 512;
constexpr int kUnroll = 4;  // 16-byte loads in flight per thread

// Reads n 16-byte words once, grid-strided, with kUnroll loads issued before any is used;
// their XOR is written only if it equals a value no input of ours makes (so the compiler keeps
// the loads and the kernel writes nothing).
__global__ void read_kernel(const uint4* __restrict__ src, std::size_t n,
                            unsigned* __restrict__ sink) {
    const std::size_t stride = static_cast<std::size_t>(gridDim.x) * blockDim.x;
    std::size_t i = static_cast<std::size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    unsigned acc = 0;
    for (; i + (kUnroll - 1) * stride < n; i += kUnroll * stride) {
        uint4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            v[u] = __ldcs(src + i + u * stride);  // streaming: no reuse, evict first
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
            acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < n; i += stride) {
        const uint4 v = __ldcs(src + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) *sink = acc;
}

}  // namespace

double device_read_rate_gbps(const void* src, std::size_t bytes, const Stream& s) {
    const std::size_t n = bytes / sizeof(uint4);
    if (n == 0 || reinterpret_cast<std::uintptr_t>(src) % alignof(uint4) != 0)
        throw std::invalid_argument(
            "device_read_rate_gbps: needs at least 16 bytes at a "
            "16-byte aligned address");
    int dev = 0, sms = 0, per_sm = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, read_kernel, kThreads, 0) !=
            cudaSuccess)
        throw std::runtime_error(std::string("device_read_rate_gbps: the device's SMs: ") +
                                 cudaGetErrorString(cudaGetLastError()));
    const auto blocks = static_cast<unsigned>(std::max(1, sms * std::max(1, per_sm)));
    DeviceBuffer sink(sizeof(unsigned));
    const auto st = static_cast<cudaStream_t>(s.handle());
    Event e0, e1;
    std::vector<double> rates;
    for (int rep = 0; rep < 6; ++rep) {  // the first is a warm-up
        e0.record(s);
        read_kernel<<<blocks, kThreads, 0, st>>>(static_cast<const uint4*>(src), n,
                                                 static_cast<unsigned*>(sink.data()));
        detail::check_launch("device_read_rate_gbps: read kernel");
        e1.record(s);
        e1.synchronize();
        if (rep)
            rates.push_back(static_cast<double>(n * sizeof(uint4)) /
                            (static_cast<double>(e1.elapsed_ms_since(e0)) * 1e-3) / 1e9);
    }
    std::sort(rates.begin(), rates.end());
    return rates[rates.size() / 2];
}

}  // namespace writescope::cuda
