#include "writescope/core/model/placement.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <tuple>

namespace writescope::model {
namespace {

std::string size_text(std::uint64_t b) {
    char buf[64];
    const double v = static_cast<double>(b);
    if (v >= 1024.0 * 1024 * 1024)
        std::snprintf(buf, sizeof buf, "%.2f GiB", v / (1024.0 * 1024 * 1024));
    else if (v >= 1024.0 * 1024)
        std::snprintf(buf, sizeof buf, "%.1f MiB", v / (1024.0 * 1024));
    else
        std::snprintf(buf, sizeof buf, "%.0f KiB", v / 1024.0);
    return buf;
}

std::uint64_t bytes_of(const Matrix& m) {
    return m.bytes();
}
std::uint64_t bytes_of(const Vector& v) {
    return v.n * dtype_bytes(v.dtype);
}

}  // namespace

ExpertHeat ExpertHeat::zeros(const Model& m) {
    ExpertHeat h;
    for (const LayerWeights& L : m.weights().layers)
        h.counts.emplace_back(L.moe ? L.experts.size() : 0, 0);
    return h;
}

void ExpertHeat::add(const ExpertHeat& o) {
    if (counts.size() < o.counts.size()) counts.resize(o.counts.size());
    for (std::size_t l = 0; l < o.counts.size(); ++l) {
        if (counts[l].size() < o.counts[l].size()) counts[l].resize(o.counts[l].size(), 0);
        for (std::size_t e = 0; e < o.counts[l].size(); ++e)
            counts[l][e] += o.counts[l][e];
    }
}

std::uint64_t ExpertHeat::total() const noexcept {
    std::uint64_t n = 0;
    for (const auto& layer : counts)
        for (const std::uint64_t c : layer)
            n += c;
    return n;
}

std::uint64_t Placement::hits(const ExpertHeat& heat) const noexcept {
    std::uint64_t hit = 0;
    for (std::size_t l = 0; l < heat.counts.size() && l < on_gpu.size(); ++l)
        for (std::size_t e = 0; e < heat.counts[l].size() && e < on_gpu[l].size(); ++e)
            if (on_gpu[l][e]) hit += heat.counts[l][e];
    return hit;
}

double Placement::hit_rate(const ExpertHeat& heat) const noexcept {
    const std::uint64_t all = heat.total();
    return all ? static_cast<double>(hits(heat)) / static_cast<double>(all) : 0.0;
}

std::string Placement::summary() const {
    std::string s = "weights " + size_text(always_gpu_bytes) + " always on the GPU, T " +
                    size_text(kv_t_bytes) + ", G " + size_text(kv_g_bytes) + ", workspace " +
                    size_text(workspace_bytes) + ", ";
    s += std::to_string(gpu_experts) + " of " + std::to_string(gpu_experts + host_experts) +
         " experts (" + size_text(gpu_expert_bytes) + ") on the GPU, " +
         std::to_string(host_experts) + " (" + size_text(host_expert_bytes) + ") in host memory";
    return s;
}

Placement plan_placement(const Model& m, const PlacementBudget& b, const ExpertHeat* heat) {
    const ModelWeights& w = m.weights();
    Placement p;
    p.always_gpu_bytes = bytes_of(w.embed) + bytes_of(w.final_norm);
    if (!m.config().tie_word_embeddings) p.always_gpu_bytes += bytes_of(w.lm_head);
    std::vector<std::tuple<std::uint64_t, std::size_t, std::size_t, std::uint64_t>> experts;
    for (std::size_t l = 0; l < w.layers.size(); ++l) {
        const LayerWeights& L = w.layers[l];
        for (const Matrix* x : {&L.q_proj, &L.k_proj, &L.v_proj, &L.o_proj, &L.q_a_proj,
                                &L.q_b_proj, &L.kv_a_proj, &L.kv_b_proj, &L.router, &L.shared_gate})
            p.always_gpu_bytes += bytes_of(*x);
        for (const Vector* x :
             {&L.input_norm, &L.post_attention_norm, &L.q_norm, &L.k_norm, &L.q_a_norm,
              &L.kv_a_norm, &L.q_bias, &L.k_bias, &L.v_bias, &L.o_bias, &L.router_bias})
            p.always_gpu_bytes += bytes_of(*x);
        p.always_gpu_bytes += L.mlp.bytes() + L.shared.bytes();
        p.on_gpu.emplace_back(L.moe ? L.experts.size() : 0, 0);
        for (std::size_t e = 0; L.moe && e < L.experts.size(); ++e) {
            const std::uint64_t h = heat && l < heat->counts.size() && e < heat->counts[l].size()
                                        ? heat->counts[l][e]
                                        : 0;
            experts.emplace_back(h, l, e, L.experts[e].bytes());
        }
    }
    p.kv_t_bytes = b.kv_t_bytes;
    p.workspace_bytes = b.workspace_bytes;
    const std::uint64_t fixed = p.always_gpu_bytes + p.kv_t_bytes + p.workspace_bytes;
    if (fixed > b.vram_bytes)
        throw PlacementError("the VRAM budget of " + size_text(b.vram_bytes) +
                             " cannot hold the weights that stay on the GPU (" +
                             size_text(p.always_gpu_bytes) +
                             ": embeddings, attention, routers, "
                             "norms, head, shared experts), T (" +
                             size_text(p.kv_t_bytes) + ") and the workspace (" +
                             size_text(p.workspace_bytes) + "): " + size_text(fixed) + " in all");
    std::uint64_t left = b.vram_bytes - fixed;
    const double share = std::clamp(b.kv_g_share, 0.0, 1.0);
    const auto g_reserve =
        static_cast<std::uint64_t>(std::floor(static_cast<double>(left) * share));
    left -= g_reserve;
    // Hottest first; equal heat in layer, then index order (deterministic).
    std::stable_sort(experts.begin(), experts.end(),
                     [](const auto& a, const auto& c) { return std::get<0>(a) > std::get<0>(c); });
    for (const auto& [h, l, e, bytes] : experts) {
        (void)h;
        if (bytes <= left) {
            left -= bytes;
            p.on_gpu[l][e] = 1;
            p.gpu_expert_bytes += bytes;
            ++p.gpu_experts;
        } else {
            p.host_expert_bytes += bytes;
            ++p.host_experts;
        }
    }
    p.kv_g_bytes = g_reserve + left;  // G takes back what the experts leave
    p.gpu_experts_per_layer.resize(p.on_gpu.size());
    for (std::size_t l = 0; l < p.on_gpu.size(); ++l)
        p.gpu_experts_per_layer[l] =
            static_cast<std::size_t>(std::count(p.on_gpu[l].begin(), p.on_gpu[l].end(), 1));
    return p;
}

}  // namespace writescope::model
