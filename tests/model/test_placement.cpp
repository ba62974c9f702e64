// Placement under one VRAM budget: the always-GPU weights, T and the workspace first (a budget
// too small for them is refused naming the sizes), the G share, then routed experts hottest
// first; and the routing frequencies the runtime measures.
#include <catch2/catch.hpp>

#include "reference_model.hpp"
#include "writescope/core/model/placement.hpp"

using namespace writescope;
using namespace writescope::test;

TEST_CASE("experts go to the GPU hottest first within the budget", "[model]") {
    model::ModelLoadOptions o;
    o.max_layers = 4;
    o.headers_only = true;
    const auto m = model::make_builtin_model("qwen3-30b-a3b", o);
    const std::uint64_t expert = m->weights().layers[0].experts[0].bytes();
    REQUIRE(expert == 3ull * 2048 * 768 * 2);  // gate, up, down in bf16: 9 MiB

    model::PlacementBudget b;
    b.kv_t_bytes = 64ull << 20;
    b.workspace_bytes = 256ull << 20;
    b.kv_g_share = 0.0;
    // Everything but the routed experts, plus room for exactly 100 of them.
    const model::Placement none =
        model::plan_placement(*m, {~0ull >> 1, b.kv_t_bytes, b.workspace_bytes, 0.0});
    CHECK(none.host_experts == 0);
    CHECK(none.gpu_experts == 4 * 128);
    b.vram_bytes =
        none.always_gpu_bytes + b.kv_t_bytes + b.workspace_bytes + 100 * expert + expert / 2;

    // Heat: layer 2's experts are the hottest, then layer 0's first 40.
    model::ExpertHeat heat = model::ExpertHeat::zeros(*m);
    for (std::size_t e = 0; e < 128; ++e)
        heat.counts[2][e] = 1000 + e;
    for (std::size_t e = 0; e < 40; ++e)
        heat.counts[0][e] = 10;
    const model::Placement p = model::plan_placement(*m, b, &heat);
    CHECK(p.gpu_experts == 100);
    CHECK(p.host_experts == 4 * 128 - 100);
    CHECK(p.gpu_experts_per_layer[2] == 100);  // the 100 hottest of layer 2
    CHECK(p.on_gpu[2][127]);
    CHECK(!p.on_gpu[2][0]);  // its coldest 28 stay on the host
    CHECK(p.gpu_experts_per_layer[0] == 0);
    CHECK(p.kv_g_bytes == expert / 2);  // G takes what the experts leave
    CHECK(p.gpu_expert_bytes + p.always_gpu_bytes + p.kv_t_bytes + p.workspace_bytes +
              p.kv_g_bytes ==
          b.vram_bytes);
    // 100 of layer 2's hottest hold most of the routed pairs.
    CHECK(p.hit_rate(heat) > 0.7);
    CHECK_THAT(p.summary(), Catch::Contains("100 of 512 experts"));

    // Without heat: layer order.
    const model::Placement cold = model::plan_placement(*m, b);
    CHECK(cold.gpu_experts_per_layer[0] == 100);

    // A G share is kept before the experts.
    b.kv_g_share = 0.5;
    const model::Placement half = model::plan_placement(*m, b, &heat);
    CHECK(half.gpu_experts == 50);
    CHECK(half.kv_g_bytes >= 50 * expert);

    // Too small: refused naming the sizes.
    b.vram_bytes = none.always_gpu_bytes;
    CHECK_THROWS_WITH(model::plan_placement(*m, b), Catch::Contains("VRAM budget") &&
                                                        Catch::Contains("T (64.0 MiB)") &&
                                                        Catch::Contains("workspace (256.0 MiB)"));
}

TEST_CASE("the runtime counts the tokens routed to each expert", "[model]") {
    const auto m = model::load_model_dir(models_dir() / "qwen3-moe-tiny");
    CpuRuntime rt(*m, 16);
    const Reference ref = read_reference(models_dir() / "qwen3-moe-tiny");
    const auto& p = ref.prompts[1];
    REQUIRE(rt.runtime->admit(1, p.ids.size() + 1).ok);
    std::vector<float> logits(static_cast<std::size_t>(m->config().vocab_size));
    rt.runtime->prefill(1, p.ids, logits.data());
    const model::ExpertHeat heat = rt.runtime->take_expert_heat();
    REQUIRE(heat.counts.size() == 4);
    CHECK(heat.counts[2].empty());  // mlp_only_layers = [2]: dense
    for (std::size_t l : {0u, 1u, 3u}) {
        std::uint64_t sum = 0;
        for (auto c : heat.counts[l])
            sum += c;
        CHECK(sum == p.ids.size() * 2);  // every token to its top-2
    }
    // Taken: the next take starts from zero.
    const model::ExpertHeat again = rt.runtime->take_expert_heat();
    for (const auto& layer : again.counts)
        for (auto c : layer)
            CHECK(c == 0);
}
