// The ceilings a GPU benchmark compares itself with, measured in its own run: pinned host →
// device copies, HBM, every CPU thread reading host memory, and both host paths at once (what
// the CPU reads while the copy engine streams pinned memory).
#pragma once

#include "writescope/cpu/cpu_isa.hpp"
#include "writescope/cpu/worker_pool.hpp"

namespace writescope::bench {

struct Ceilings {
    double pinned_h2d = 0;  // GB/s, pinned host → device, large copies
    double hbm = 0;         // GB/s, device → device copy counting bytes read + written
    double hbm_read = 0;    // GB/s, a kernel on every SM reading device memory
    double cpu_read = 0;    // GB/s, every pool thread streaming host memory
    double agg_cpu = 0;     // GB/s read by the CPU while pinned copies run
    double agg_copy = 0;    // GB/s copied by the DMA engine meanwhile
    double aggregate() const { return agg_cpu + agg_copy; }
};

// About 2 s: 1 GiB pinned and on the device, 4 GiB of host memory read by `pool`.
Ceilings measure_ceilings(cpu::WorkerPool& pool, cpu::Isa isa);

}  // namespace writescope::bench
