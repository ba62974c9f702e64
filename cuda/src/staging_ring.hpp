// The staging ring of a GPU step backend (gpu_step_backend.cpp) as its options size it: chunks
// of whole blocks of at least one block, at least two slots. The decode step's P stream and a
// prompt's (prompt_attention.cpp) share the ring. Internal to cuda/.
#pragma once

#include <algorithm>
#include <cstddef>

#include "writescope/cuda/gpu_step_backend.hpp"

namespace writescope::cuda {

struct StagingRing {
    std::size_t chunk_blocks, slots;
};

inline StagingRing staging_ring(const GpuStepOptions& o, std::size_t block_bytes) noexcept {
    return {std::max(o.staging_chunk_bytes, block_bytes) / block_bytes,
            std::max<std::size_t>(o.staging_slots, 2)};
}

}  // namespace writescope::cuda
