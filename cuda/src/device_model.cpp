#include "writescope/cuda/device_model.hpp"

#include <string>

namespace writescope::cuda {

DeviceModelWeights::DeviceModelWeights(const model::Model& m,
                                       const std::vector<std::vector<std::uint8_t>>* on_gpu) {
    const model::ModelWeights& h = m.weights();
    weights_.embed = store_.upload(h.embed);
    weights_.lm_head = h.lm_head.data == h.embed.data ? weights_.embed : store_.upload(h.lm_head);
    weights_.final_norm = store_.upload(h.final_norm);
    weights_.layers.resize(h.layers.size());
    for (std::size_t l = 0; l < h.layers.size(); ++l) {
        const model::LayerWeights& s = h.layers[l];
        model::LayerWeights& d = weights_.layers[l];
        d.input_norm = store_.upload(s.input_norm);
        d.post_attention_norm = store_.upload(s.post_attention_norm);
        for (auto [src, dst] : {std::pair{&s.q_proj, &d.q_proj},
                                {&s.k_proj, &d.k_proj},
                                {&s.v_proj, &d.v_proj},
                                {&s.o_proj, &d.o_proj},
                                {&s.q_a_proj, &d.q_a_proj},
                                {&s.q_b_proj, &d.q_b_proj},
                                {&s.kv_a_proj, &d.kv_a_proj},
                                {&s.kv_b_proj, &d.kv_b_proj}})
            *dst = store_.upload(*src);
        for (auto [src, dst] : {std::pair{&s.q_bias, &d.q_bias},
                                {&s.k_bias, &d.k_bias},
                                {&s.v_bias, &d.v_bias},
                                {&s.o_bias, &d.o_bias},
                                {&s.q_norm, &d.q_norm},
                                {&s.k_norm, &d.k_norm},
                                {&s.q_a_norm, &d.q_a_norm},
                                {&s.kv_a_norm, &d.kv_a_norm}})
            *dst = store_.upload(*src);
        d.moe = s.moe;
        d.mlp = store_.upload(s.mlp);
        d.router = s.router;            // shape only: the runtime places its fp32 copy
        d.router_bias = s.router_bias;  // the same
        d.shared = store_.upload(s.shared);
        d.shared_gate = s.shared_gate;  // shape only: the runtime places its fp32 copy
        d.experts.resize(s.experts.size());
        for (std::size_t e = 0; e < s.experts.size(); ++e) {
            const bool gpu =
                !on_gpu || (l < on_gpu->size() && e < (*on_gpu)[l].size() && (*on_gpu)[l][e]);
            if (gpu) {
                d.experts[e] = store_.upload(s.experts[e]);
                ++gpu_experts_;
            } else {
                ++host_experts_;
            }
        }
    }
}

std::vector<CudaModelOps::HostRange> host_expert_ranges(
    const model::Model& m, const std::vector<std::vector<std::uint8_t>>* on_gpu) {
    std::vector<CudaModelOps::HostRange> ranges;
    const auto& layers = m.weights().layers;
    for (std::size_t l = 0; l < layers.size(); ++l)
        for (std::size_t e = 0; e < layers[l].experts.size(); ++e) {
            if (on_gpu && l < on_gpu->size() && e < (*on_gpu)[l].size() && (*on_gpu)[l][e])
                continue;
            const model::FfnWeights& f = layers[l].experts[e];
            for (const model::Matrix* mx : {&f.gate, &f.up, &f.down})
                if (mx->data) ranges.push_back({mx->data, mx->bytes()});
        }
    return ranges;
}

}  // namespace writescope::cuda
