// The bytes a decode step read from host-resident experts: what the benchmarks divide by the
// host's read rate.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "writescope/core/model/model.hpp"
#include "writescope/core/model/placement.hpp"

namespace writescope::bench {

// The bytes of every expert `heat` routed to at least once that on_gpu[layer][expert] leaves in
// host memory (each read once per step, however many tokens it serves).
inline double host_expert_bytes(const model::Model& m,
                                const std::vector<std::vector<std::uint8_t>>& on_gpu,
                                const model::ExpertHeat& heat) {
    double bytes = 0;
    const auto& layers = m.weights().layers;
    for (std::size_t l = 0; l < heat.counts.size() && l < on_gpu.size(); ++l)
        for (std::size_t e = 0; e < heat.counts[l].size() && e < on_gpu[l].size(); ++e)
            if (heat.counts[l][e] && !on_gpu[l][e])
                bytes += static_cast<double>(layers[l].experts[e].bytes());
    return bytes;
}

}  // namespace writescope::bench
