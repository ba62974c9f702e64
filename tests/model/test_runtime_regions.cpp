// The runtime with the KV in all four regions, without a GPU: the engine's hybrid path over host
// memory, its GPU side the host backend of the engine tests (fp64 attention over T, G and the
// streamed P blocks), its CPU side the real kernels over U (and planned P). A prompt longer than
// G's few blocks fills G, then P and U by the policy's split; the logits stay transformers'.
#include <catch2/catch.hpp>

#include <cstring>
#include <vector>

#include "hybrid_host_engine.hpp"
#include "reference_model.hpp"
#include "writescope/core/block_router.hpp"
#include "writescope/core/roofline_policy.hpp"

using namespace writescope;
using namespace writescope::test;

TEST_CASE("the runtime with the KV in T, G, P and U reproduces transformers' logits", "[model]") {
    for (const std::string name : {"qwen3-moe-tiny", "deepseek-v2-tiny-yarn", "mixtral-tiny"}) {
        const auto dir = models_dir() / name;
        const Reference ref = read_reference(dir);
        const auto m = model::load_model_dir(dir);
        const std::size_t V = static_cast<std::size_t>(m->config().vocab_size);
        const DType kv = m->config().dtype;
        const std::size_t B = 8;
        auto engine = hybrid_host_engine(m->config().kv_geometry(kv), B, /*g_slots=*/3, 0.5, 2);
        cpu::CpuModelOpsOptions co;
        co.threads = 2;
        co.max_tokens = 32;
        const model::OpLimits lim = model::op_limits(m->config());
        co.fit(lim);
        cpu::CpuModelOps ops(co);
        model::RuntimeOptions ro;
        ro.prefill_chunk_tokens = 32;
        ro.max_batch = 2;
        ro.kv_dtype = kv;
        // attend_prompt reads T and G with the CPU (host memory here); then decode steps run the
        // hybrid path: the host GPU side attends T, G and streams P, the CPU attends U.
        const auto rt = model::make_runtime(*m, ops, *engine, ro);
        const ReferencePrompt& p = ref.prompts[0];
        REQUIRE(rt->admit(1, p.ids.size() + p.greedy.size()).ok);
        std::vector<float> logits(p.ids.size() * V);
        rt->prefill(1, p.ids, logits.data(), true);
        double err = 0, scale = 0;
        const auto add = [&](const float* ours, std::size_t row) {
            for (std::size_t v = 0; v < V; ++v) {
                err = std::max(err, std::abs(static_cast<double>(ours[v]) - p.logits.at(row, v)));
                scale = std::max(scale, std::abs(static_cast<double>(p.logits.at(row, v))));
            }
        };
        for (std::size_t r = 0; r < p.ids.size(); ++r)
            add(logits.data() + r * V, r);
        const std::uint64_t id = 1;
        for (std::size_t g = 0; g + 1 < p.greedy.size(); ++g) {
            rt->decode(std::span<const std::uint64_t>(&id, 1),
                       std::span<const std::int32_t>(&p.greedy[g], 1), logits.data());
            add(logits.data(), p.ids.size() + g);
        }
        const EngineStatus st = engine->status();
        std::fprintf(stderr, "%-22s blocks G %zu, P %zu, U %zu (+ T): relative logit error %.3g\n",
                     name.c_str(), st.regions[1].used_blocks, st.regions[2].used_blocks,
                     st.regions[3].used_blocks, err / scale);
        INFO(name);
        CHECK(st.regions[1].used_blocks == 3);
        CHECK(st.regions[2].used_blocks > 0);
        CHECK(st.regions[3].used_blocks > 0);
        CHECK(err / scale <= 1e-4);
        CHECK(rt->release(1));
    }
}

TEST_CASE("a prompt that spills goes at the share of the length it makes, not of none", "[model]") {
    // The roofline's share at no spilled tokens is all or nothing (Δ > c0: every block to the
    // CPU). A prompt's blocks are placed at once, so the first prompt to spill in a fresh engine
    // went there whole; it now goes at the share of the spilled length it brings.
    const auto m = model::load_model_dir(models_dir() / "mixtral-tiny");
    const KvGeometry g = m->config().kv_geometry(m->config().dtype);
    const std::size_t B = 8, g_slots = 3, blocks = 64, n = blocks * B;
    auto e = hybrid_host_engine(g, B, g_slots, 0.5, 1);
    e->set_mode("writescope");
    Calibration c;
    c.has_gpu = true;
    c.a = 3e-9;  // s/token: B/(A + B) = 0.4
    c.b = 2e-9;
    c.delta = 1.1e-6;  // Δ > c0
    c.cpu_intercept = 1e-6;
    e->set_calibration(c);
    const RooflineCosts costs{c.a, c.b, c.delta, c.cpu_intercept};
    REQUIRE(roofline_share(costs, 0) == 1.0);
    CHECK(e->status().r_target == 1.0);
    REQUIRE(e->admit(1, n + 1).ok);
    const std::size_t es = dtype_bytes(g.dtype), L = static_cast<std::size_t>(g.num_layers);
    std::vector<std::byte> k(L * n * static_cast<std::size_t>(g.num_kv_heads * g.head_dim_k) * es),
        v(L * n * static_cast<std::size_t>(g.num_kv_heads * g.head_dim_v) * es);
    e->prefill(1, n, k.data(), v.data());
    const EngineStatus st = e->status();
    const std::size_t in_g = st.regions[static_cast<int>(Region::G)].used_blocks,
                      in_p = st.regions[static_cast<int>(Region::P)].used_blocks,
                      in_u = st.regions[static_cast<int>(Region::U)].used_blocks;
    INFO("G " << in_g << ", P " << in_p << ", U " << in_u);
    REQUIRE(in_g == g_slots);
    REQUIRE(in_p + in_u == blocks - g_slots);
    // Routed at the share of the prompt's own length (an upper bound on its spill), as the
    // deficit rule rounds it.
    const double r = roofline_share(costs, static_cast<double>(n));
    CHECK(r == Approx(0.4 + 0.1e-6 / (5e-9 * static_cast<double>(n))));
    CHECK(in_u == deficit_u_blocks(in_p + in_u, r));
    CHECK(in_p > 0);
    // Afterwards the target follows the length held.
    CHECK(e->status().r_target ==
          Approx(roofline_share(costs, static_cast<double>((in_p + in_u) * B))));
    e->release(1);
}
