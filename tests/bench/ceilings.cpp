#include "ceilings.hpp"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>

#include "copy_rate.hpp"
#include "read_bandwidth.hpp"
#include "writescope/core/host_region_memory.hpp"
#include "writescope/core/step_executor.hpp"
#include "writescope/cuda/device.hpp"

namespace writescope::bench {
namespace {
double now() {
    return steady_seconds();
}
}  // namespace

Ceilings measure_ceilings(cpu::WorkerPool& pool, cpu::Isa isa) {
    Ceilings c;
    const std::size_t bytes = std::size_t{1} << 30;
    cuda::PinnedSlabs host(bytes, bytes);
    std::memset(host.slab(0), 0x5a, bytes);
    cuda::DeviceBuffer dev(bytes), dev2(bytes);
    cuda::Stream s;
    c.pinned_h2d = copy_rate_gbps(dev.data(), host.slab(0), bytes, 1.0, s);
    c.hbm = copy_rate_gbps(dev2.data(), dev.data(), bytes, 2.0, s);
    c.hbm_read = cuda::device_read_rate_gbps(dev.data(), bytes, s);

    const std::size_t cpu_bytes = std::size_t{4} << 30;
    HostRegionMemory buf("bandwidth", 1, 1, cpu_bytes);
    std::memset(buf.block(0, 0), 0x33, cpu_bytes);
    c.cpu_read = measure_read_bandwidth(pool, buf.block(0, 0), cpu_bytes, isa, 5);

    // Both at once: a thread keeps the copy engine busy while the CPU threads read.
    std::atomic<bool> stop{false};
    std::atomic<std::uint64_t> copied{0};
    std::thread copier([&] {
        cuda::Stream cs;
        while (!stop.load()) {
            cuda::copy_async(dev.data(), host.slab(0), bytes, cs);
            cs.synchronize();
            copied += bytes;
        }
    });
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    const std::uint64_t c0 = copied.load();
    const double t0 = now();
    c.agg_cpu = measure_read_bandwidth(pool, buf.block(0, 0), cpu_bytes, isa, 8);
    const double t1 = now();
    const std::uint64_t c1 = copied.load();
    stop = true;
    copier.join();
    c.agg_copy = static_cast<double>(c1 - c0) / (t1 - t0) / 1e9;
    return c;
}

}  // namespace writescope::bench
