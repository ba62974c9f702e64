#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "test_seed.hpp"
#include "writescope/core/dtype.hpp"
#include "writescope/core/kv_geometry.hpp"

using namespace writescope;

TEST_CASE("fp16 round trip is exact for every fp16 bit pattern", "[unit][dtype]") {
    for (std::uint32_t h = 0; h < 0x10000u; ++h) {
        const auto bits = static_cast<std::uint16_t>(h);
        const float f = f16_to_f32(bits);
        if (std::isnan(f)) {
            REQUIRE(std::isnan(f16_to_f32(f32_to_f16(f))));
            continue;
        }
        REQUIRE(f32_to_f16(f) == bits);
    }
}

TEST_CASE("fp16 and bf16 conversion round to nearest", "[unit][dtype]") {
    auto rng = test::seeded_rng("dtype rounding");
    std::uniform_real_distribution<float> u(-70000.0f, 70000.0f);
    for (int i = 0; i < 200000; ++i) {
        const float f = u(rng) * (i % 7 == 0 ? 1e-6f : 1.0f);
        const float h = f16_to_f32(f32_to_f16(f));
        if (std::fabs(f) >= 65520.0f) {
            REQUIRE(std::isinf(h));
            continue;
        }
        // Half an ulp of fp16 relative (2^-11), or half the smallest subnormal (2^-25).
        REQUIRE(std::fabs(h - f) <= std::max(std::fabs(f) * 0x1p-11f, 0x1p-25f));
        const float b = bf16_to_f32(f32_to_bf16(f));
        REQUIRE(std::fabs(b - f) <= std::fabs(f) * 0x1p-8f);
    }
    REQUIRE(f32_to_bf16(1.0f) == 0x3f80);
    REQUIRE(std::isnan(bf16_to_f32(f32_to_bf16(std::numeric_limits<float>::quiet_NaN()))));
    REQUIRE(parse_dtype("bf16") == DType::bf16);
    REQUIRE_FALSE(parse_dtype("int4").has_value());
}

TEST_CASE(
    "the GPU's attention takes 16-bit KV of any group and width it reads, and says why not "
    "otherwise",
    "[unit][geometry]") {
    for (const std::string& name : kv_geometry_preset_names())
        for (const DType t : {DType::bf16, DType::f16}) {
            INFO(name << " " << dtype_name(t));
            const KvGeometry g = kv_geometry_preset(name, t).value();
            CHECK(gpu_attention_supports(g));
            CHECK(gpu_attention_refusal(g).empty());
        }
    KvGeometry g = kv_geometry_preset("qwen3-30b-a3b", DType::f32).value();
    CHECK_FALSE(gpu_attention_supports(g));
    CHECK_THAT(gpu_attention_refusal(g), Catch::Contains("KV is fp32"));
    CHECK_THAT(gpu_attention_refusal(g), Catch::Contains("kv.dtype"));
    g.dtype = DType::bf16;
    // Any width that is a multiple of 8 up to the MLA latent's, any group.
    for (const int dim : {8, 16, 32, 64, 96, 128, 256, 576})
        for (const int group : {1, 2, 3, 4, 6, 7, 8, 12, 16, 24, 32}) {
            g.head_dim_k = dim;
            g.head_dim_v = std::min(dim, kGpuMaxHeadDimV);
            g.num_q_heads = 2 * group;
            g.num_kv_heads = 2;
            INFO(dim << " wide, group " << group);
            CHECK(gpu_attention_supports(g));
            CHECK(gpu_attention_refusal(g).empty());
        }
    g.num_q_heads = 8;
    g.head_dim_k = g.head_dim_v = 100;  // not a multiple of 8: no 16-byte loads
    CHECK_FALSE(gpu_attention_supports(g));
    CHECK_THAT(gpu_attention_refusal(g), Catch::Contains("heads are 100/100 wide"));
    CHECK_THAT(gpu_attention_refusal(g), Catch::Contains("a multiple of 8"));
    g.head_dim_k = g.head_dim_v = 640;  // wider than the kernels' rows
    CHECK_FALSE(gpu_attention_supports(g));
    CHECK_THAT(gpu_attention_refusal(g), Catch::Contains("up to 576"));
    g.head_dim_k = 128;
    g.head_dim_v = 514;
    CHECK_FALSE(gpu_attention_supports(g));
    CHECK_THAT(gpu_attention_refusal(g), Catch::Contains("V rows up to 512"));
    g.head_dim_v = 128;
    g.num_q_heads = 9;  // not a multiple of the KV heads
    CHECK_FALSE(gpu_attention_supports(g));
    CHECK_THAT(gpu_attention_refusal(g), Catch::Contains("geometry is bad"));
    KvGeometry d = kv_geometry_preset("deepseek-v2-lite").value();
    for (const int heads : {1, 4, 16, 20, 32, 128}) {  // any number of heads over the latent
        d.num_q_heads = heads;
        CHECK(gpu_attention_supports(d));
    }
    d.head_dim_k = 96;  // a small latent (64 + 32) and its value part
    d.head_dim_v = 64;
    CHECK(gpu_attention_supports(d));
    d.head_dim_k = 1024;
    CHECK_FALSE(gpu_attention_supports(d));
    CHECK_THAT(gpu_attention_refusal(d), Catch::Contains("MLA latent is 1024/64 wide"));
}

TEST_CASE("KV geometry presets have the published bytes per token", "[unit][geometry]") {
    auto q = kv_geometry_preset("qwen3-30b-a3b").value();
    auto m = kv_geometry_preset("mixtral-8x7b").value();
    auto d = kv_geometry_preset("deepseek-v2-lite").value();
    CHECK(q.bytes_per_token_layer() == 2048);
    CHECK(m.bytes_per_token_layer() == 4096);
    CHECK(d.bytes_per_token_layer() == 1152);
    CHECK(q.group_size() == 8);
    CHECK(m.group_size() == 4);
    CHECK(d.group_size() == 16);
    // 1/sqrt(192) times DeepSeek-V2-Lite's yarn mscale squared (factor 40, mscale_all_dim 0.707):
    // (0.1·0.707·ln 40 + 1)² / √192, worked out apart from the code.
    CHECK(d.scale() == Approx(0.11472139).epsilon(1e-6));
    CHECK(yarn_mscale(40.0, 0.707) == Approx(1.26080378).epsilon(1e-7));
    CHECK(yarn_mscale(1.0, 0.707) == 1.0);  // no scaling, no factor
    CHECK(yarn_mscale(0.5, 0.707) == 1.0);
    CHECK(d.scale() > 0.114);
    CHECK(d.scale() < 0.115);
    CHECK(q.validate().empty());
    CHECK(d.validate().empty());
    CHECK(kv_geometry_preset("qwen3-30b-a3b", DType::f32)->bytes_per_token_layer() == 4096);
    CHECK_FALSE(kv_geometry_preset("llama-7b").has_value());
    auto bad = q;
    bad.num_kv_heads = 5;
    CHECK_THAT(bad.validate(), Catch::Contains("multiple of num_kv_heads"));
}
