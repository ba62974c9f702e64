// The runtime's GPU decode path without a GPU: ops apart from host memory with a stream token
// (tests/model/apart_ops.hpp's device emulation) over a hybrid engine whose GPU side is the host
// backend (hybrid_host_engine.hpp), so that decode steps hand the engine "device" memory through
// Engine::attend_layer's device-side contract; and with recordings, so that the ops' work
// between the engine's layers is recorded at a batch size's second step and replayed, and a
// batch whose experts cannot be recorded runs them instead. The logits must be transformers'
// and, bit for bit, those of the same runtime launching every call. And prompt chunks attended
// on that side (Engine::attend_prompt with the stream): the GPU side over the chunk, T, G and P,
// the CPU over U, merged.
#include <catch2/catch.hpp>

#include <cstdio>

#include "device_side_runtime.hpp"

using namespace writescope;
using namespace writescope::test;

namespace {

// A batch of two waits for its expert counts, as on a GPU: it cannot be recorded.
DeviceSideOptions device_side(bool record, std::size_t prompt_tokens = 0) {
    DeviceSideOptions o;
    o.record = record;
    o.moe_record_max = 1;
    o.prompt_tokens = prompt_tokens;
    return o;
}

// The prompt, then its greedy continuation teacher-forced one token per step: the logits of
// every position.
std::vector<float> forced_logits(model::Runtime& rt, const ReferencePrompt& p) {
    std::vector<std::int32_t> forced = p.ids;
    forced.insert(forced.end(), p.greedy.begin(), p.greedy.end() - 1);
    return all_logits(rt, forced, p.greedy.size() - 1);
}

// Two sequences of the prompt's tokens decoded together for three steps: every step's logits.
std::vector<float> batch_of_two(model::Runtime& rt, const ReferencePrompt& p) {
    const std::size_t V = rt.vocab_size();
    const std::vector<std::int32_t> a(p.ids.begin(), p.ids.begin() + 3),
        b(p.ids.begin() + 1, p.ids.begin() + 5);
    REQUIRE(rt.admit(7, 16).ok);
    REQUIRE(rt.admit(8, 16).ok);
    std::vector<float> scratch(4 * V), out(2 * V), all;
    rt.prefill(7, a, scratch.data());
    rt.prefill(8, b, scratch.data());
    const std::uint64_t ids[] = {7, 8};
    for (int step = 0; step < 3; ++step) {
        const std::int32_t toks[] = {p.greedy[step], p.greedy[step + 1]};
        rt.decode(ids, toks, out.data());
        all.insert(all.end(), out.begin(), out.end());
    }
    REQUIRE(rt.release(7));
    REQUIRE(rt.release(8));
    return all;
}

// Their largest relative error against transformers'.
double reference_error(const std::vector<float>& logits, const ReferencePrompt& p,
                       std::size_t vocab) {
    Errors err;
    for (std::size_t r = 0; r < logits.size() / vocab; ++r)
        err.add(logits.data() + r * vocab, p.logits, r);
    return err.rel();
}

}  // namespace

TEST_CASE("the runtime's device-side decode, recorded and replayed, keeps transformers' logits",
          "[model]") {
    for (const std::string name : {"qwen3-moe-tiny", "deepseek-v2-tiny-yarn", "mixtral-tiny"}) {
        const auto dir = models_dir() / name;
        const Reference ref = read_reference(dir);
        const auto m = model::load_model_dir(dir);
        const std::size_t V = static_cast<std::size_t>(m->config().vocab_size);
        DeviceSideRuntime rec(*m, device_side(true)), plain(*m, device_side(false));
        INFO(name);
        REQUIRE(rec.runtime->device_attention());
        REQUIRE(plain.runtime->device_attention());
        CHECK(rec.runtime->records_decode());
        CHECK_FALSE(plain.runtime->records_decode());
        const ReferencePrompt& p = ref.prompts[0];
        REQUIRE(p.greedy.size() >= 4);  // a first step run, a second recorded, then replays
        const std::vector<float> ours = forced_logits(*rec.runtime, p);
        const std::vector<float> launched = forced_logits(*plain.runtime, p);
        REQUIRE(rec.runtime->release(1));
        REQUIRE(plain.runtime->release(1));
        CHECK(ours == launched);
        const double err = reference_error(ours, p, V);
        CHECK(err <= tolerance(ref));
        CHECK(rec.runtime->decode_recordings() == 1);
        CHECK(rec.ops->replays > 0);
        CHECK(plain.ops->replays == 0);

        // Two sequences at once: their experts wait for their counts, so the batch of two
        // cannot be recorded; it runs (the same logits as launching), and is not tried again.
        CHECK(batch_of_two(*rec.runtime, p) == batch_of_two(*plain.runtime, p));
        CHECK(rec.runtime->decode_recordings() == 1);  // batch 1 still; batch 2 not recorded
        std::fprintf(stderr,
                     "%-22s device-side decode, recorded: relative logit error %.3g, %zu "
                     "replays of %zu recorded calls\n",
                     name.c_str(), err, rec.ops->replays, rec.ops->recorded_calls);
    }
}

namespace {

// Layer 0's experts all in the ops, the other layers' split with the host (split_keeps).
bool keeps_layer_0(std::size_t layer, std::size_t e) {
    return layer == 0 || split_keeps(layer, e);
}

}  // namespace

TEST_CASE("a split model's decode replays the ops' work around its host experts", "[model]") {
    // The layers whose experts are all in the ops are recorded whole; a split layer's work
    // before its routing comes down and after its sum goes up is recorded, its host part runs.
    for (const std::string name : {"qwen3-moe-tiny", "deepseek-v2-tiny-yarn", "mixtral-tiny"}) {
        const auto dir = models_dir() / name;
        const Reference ref = read_reference(dir);
        const auto m = model::load_model_dir(dir);
        const std::size_t V = static_cast<std::size_t>(m->config().vocab_size);
        DeviceSideOptions o;
        o.split = true;
        o.keeps = keeps_layer_0;
        o.record = true;
        o.moe_record_max = 1;  // a batch of two cannot be recorded (below)
        DeviceSideRuntime rec(*m, o);
        o.record = false;
        DeviceSideRuntime plain(*m, o);
        INFO(name);
        REQUIRE(rec.runtime->device_attention());
        CHECK(rec.runtime->records_decode());
        // The pieces of a step: the embedding with layer 0's projections, then per layer one,
        // and one more after a split layer's host part where a layer follows.
        const auto& layers = rec.weights.layers;
        std::size_t pieces = 1, split = 0;
        for (std::size_t l = 0; l < layers.size(); ++l) {
            bool host = false;
            for (const auto& e : layers[l].experts)
                host |= layers[l].moe && e.gate.data == nullptr;
            split += host;
            pieces += 1 + (host && l + 1 < layers.size());
        }
        REQUIRE(split > 0);
        REQUIRE(split < layers.size());
        const ReferencePrompt& p = ref.prompts[0];
        REQUIRE(p.greedy.size() >= 4);  // a first step run, a second recorded, then replays
        const std::size_t steps = p.greedy.size() - 1;
        const std::vector<float> ours = forced_logits(*rec.runtime, p);
        const std::vector<float> launched = forced_logits(*plain.runtime, p);
        CHECK(ours == launched);
        const double err = reference_error(ours, p, V);
        CHECK(err <= tolerance(ref));
        CHECK(rec.runtime->decode_recordings() == 1);
        // Every step after the first replays each piece once (the recording step replays what
        // it recorded), and the host's experts ran at every step, recorded or not.
        CHECK(rec.ops->replays == pieces * (steps - 1));
        CHECK(plain.ops->replays == 0);
        CHECK(rec.host_ops->moe_calls == plain.host_ops->moe_calls);
        CHECK(rec.host_ops->moe_calls > 0);
        REQUIRE(rec.runtime->release(1));
        REQUIRE(plain.runtime->release(1));
        // A batch of two: layer 0's experts wait for their counts, so its recording fails after
        // the first piece was recorded; the step runs every piece instead (the same logits as
        // launching), and the size is not recorded again.
        const std::size_t replays = rec.ops->replays;
        CHECK(batch_of_two(*rec.runtime, p) == batch_of_two(*plain.runtime, p));
        CHECK(rec.runtime->decode_recordings() == 1);
        CHECK(rec.ops->replays == replays + 1);  // the first piece, replayed as it was recorded
        std::fprintf(stderr,
                     "%-22s split decode, recorded: %zu pieces per step, %zu split layers of %zu, "
                     "relative logit error %.3g\n",
                     name.c_str(), pieces, split, layers.size(), err);
    }
}

TEST_CASE("decode recordings go to the batch sizes stepped lately, and back to the ops",
          "[model]") {
    // One place for recordings, given up after 3 steps idle: batch 1 is recorded, batch 2 waits
    // until batch 1 has been idle that long, then takes the place (batch 1's graphs dropped);
    // the logits are those of launching every call throughout.
    const auto dir = models_dir() / "mixtral-tiny";
    const Reference ref = read_reference(dir);
    const auto m = model::load_model_dir(dir);
    const ReferencePrompt& p = ref.prompts[0];
    DeviceSideOptions o;
    o.record = true;
    o.graph_sizes = 1;
    o.graph_idle_steps = 3;
    DeviceSideRuntime rec(*m, o);
    o.record = false;
    DeviceSideRuntime plain(*m, o);
    const std::size_t V = static_cast<std::size_t>(m->config().vocab_size);
    // Batch 1 for 4 steps, batch 2 for 6, batch 1 again for 2; the recordings after each.
    const std::size_t sizes[] = {1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 1, 1};
    std::vector<std::size_t> recorded, live, dropped;
    std::vector<float> logits[2];
    for (DeviceSideRuntime* s : {&rec, &plain}) {
        model::Runtime& rt = *s->runtime;
        const std::uint64_t ids[] = {7, 8};
        std::vector<float> scratch(p.ids.size() * V), out(2 * V);
        for (const std::uint64_t id : ids) {
            REQUIRE(rt.admit(id, p.ids.size() + std::size(sizes)).ok);
            rt.prefill(id, p.ids, scratch.data());
        }
        for (std::size_t step = 0; step < std::size(sizes); ++step) {
            const std::int32_t toks[] = {static_cast<std::int32_t>((7 * step + 3) % V),
                                         static_cast<std::int32_t>((5 * step + 1) % V)};
            const std::size_t n = sizes[step];
            rt.decode(std::span<const std::uint64_t>(ids, n),
                      std::span<const std::int32_t>(toks, n), out.data());
            logits[s == &plain].insert(logits[s == &plain].end(), out.begin(),
                                       out.begin() + static_cast<std::ptrdiff_t>(n * V));
            if (s == &rec) {
                recorded.push_back(rt.decode_recordings());
                live.push_back(s->ops->live_records());
                dropped.push_back(s->ops->dropped_records);
            }
        }
    }
    CHECK(logits[0] == logits[1]);
    const std::size_t pieces = static_cast<std::size_t>(m->config().num_layers) + 1;
    // Batch 1: its first step runs, its second records.
    CHECK(recorded[0] == 0);
    CHECK(recorded[1] == 1);
    CHECK(live[3] == pieces);
    // Batch 2's first two steps find the place held (batch 1 ran 1 and 2 steps before); at
    // its third batch 1 has been idle for 3 steps: dropped, and batch 2 runs its first step
    // with a recording of its own, records at its fourth, replays at its fifth and sixth.
    CHECK(dropped[5] == 0);
    CHECK(dropped[6] == pieces);
    CHECK(recorded[6] == 0);
    CHECK(recorded[7] == 1);
    CHECK(live[9] == pieces);
    // Batch 1 again: the place is batch 2's, used a step ago; batch 1 launches every call.
    CHECK(dropped[11] == pieces);
    CHECK(recorded[11] == 1);
    // The runtime gives its recordings back when it goes.
    rec.runtime.reset();
    CHECK(rec.ops->live_records() == 0);
}

TEST_CASE("device-side prompt chunks over T, G, P and U keep transformers' logits", "[model]") {
    // U attended by the CPU and merged, or laid out linear by the engine in pieces of one and of
    // two blocks for the GPU side.
    for (const std::size_t piece : {0, 1, 2})
        for (const std::string name : {"qwen3-moe-tiny", "deepseek-v2-tiny-yarn", "mixtral-tiny"}) {
            const auto dir = models_dir() / name;
            const Reference ref = read_reference(dir);
            const auto m = model::load_model_dir(dir);
            const std::size_t V = static_cast<std::size_t>(m->config().vocab_size);
            // Chunks of 7 tokens on blocks of 8: every chunk after the first sees stored blocks,
            // and the later ones blocks in G, P and U (3 G slots, the rest split toward r = 0.5).
            DeviceSideRuntime dev(*m, device_side(false, /*prompt_tokens=*/7));
            dev.gpu->prompt_u_piece_size = piece;
            INFO(name << ", U pieces of " << piece << " blocks");
            REQUIRE(dev.runtime->device_prompts());
            CHECK(dev.runtime->prefill_chunk_tokens() == 7);
            const ReferencePrompt& p = ref.prompts[0];
            const std::vector<float> ours = forced_logits(*dev.runtime, p);
            REQUIRE(dev.runtime->release(1));
            const std::size_t layers = static_cast<std::size_t>(m->config().num_layers);
            const std::size_t chunks = (p.ids.size() + 6) / 7;
            CHECK(dev.gpu->prompt_launches == chunks * layers);
            CHECK(dev.gpu->prompt_finishes == chunks * layers);
            if (piece == 0) {
                CHECK(dev.gpu->prompt_cpu_parts > 0);  // U blocks: the CPU's share, merged
                CHECK(dev.gpu->prompt_u_blocks == 0);
            } else {
                CHECK(dev.gpu->prompt_cpu_parts == 0);  // U blocks on the GPU side: no CPU share
                CHECK(dev.gpu->prompt_u_blocks > 0);
                CHECK(dev.gpu->prompt_u_pieces >= (dev.gpu->prompt_u_blocks + piece - 1) / piece);
                if (piece == 1) CHECK(dev.gpu->prompt_u_pieces == dev.gpu->prompt_u_blocks);
            }
            CHECK(dev.gpu->prompt_q_downs == dev.gpu->prompt_cpu_parts);
            CHECK(dev.gpu->prompt_p_blocks > 0);
            Errors err;
            for (std::size_t r = 0; r < ours.size() / V; ++r)
                err.add(ours.data() + r * V, p.logits, r);
            CHECK(err.rel() <= tolerance(ref));
            std::fprintf(stderr,
                         "%-22s device-side prompts: relative logit error %.3g over %zu chunks, "
                         "%zu with a CPU share, %zu P blocks, %zu U blocks on the GPU side in %zu "
                         "pieces\n",
                         name.c_str(), err.rel(), chunks, dev.gpu->prompt_cpu_parts / layers,
                         dev.gpu->prompt_p_blocks, dev.gpu->prompt_u_blocks,
                         dev.gpu->prompt_u_pieces);
        }
}

TEST_CASE("device-side prompt chunks are refused where the engine cannot attend them", "[model]") {
    const auto m = model::load_model_dir(models_dir() / "qwen3-moe-tiny");
    const KvGeometry g = m->config().kv_geometry(m->config().dtype);
    int token = 0;
    const std::size_t qh = static_cast<std::size_t>(g.num_q_heads);
    const std::size_t dv = static_cast<std::size_t>(g.head_dim_v);
    std::vector<std::byte> q(8 * qh * g.head_dim_k * dtype_bytes(g.dtype)),
        kv(8 * g.bytes_per_token_layer());
    std::vector<float> o(8 * qh * dv), lse(8 * qh);
    const auto out = [&](std::size_t n) { return StateView{o.data(), lse.data(), n * qh, dv}; };
    // Sized for chunks of 7 on the device: 7 go, 8 are refused naming both numbers.
    HostGpuBackend* gpu = nullptr;
    auto sized = hybrid_host_engine(g, 8, 3, 0.5, 2, &token, 7, &gpu);
    REQUIRE(sized->device_prompt_tokens() == 7);
    REQUIRE(sized->admit(1, 64).ok);
    sized->attend_prompt(1, 0, 7, q.data(), kv.data(), kv.data(), out(7), &token);
    CHECK(gpu->prompt_launches == 1);
    CHECK_THROWS_WITH(sized->attend_prompt(1, 0, 8, q.data(), kv.data(), kv.data(), out(8), &token),
                      Catch::Contains("a chunk of 8 tokens on the device, sized for 7"));
    CHECK(gpu->prompt_launches == 1);
    // A device-side engine sized for no device prompts, and a CPU engine: refused, nothing run.
    auto unsized = hybrid_host_engine(g, 8, 3, 0.5, 2, &token, 0, &gpu);
    REQUIRE(unsized->device_side());
    CHECK(unsized->device_prompt_tokens() == 0);
    REQUIRE(unsized->admit(1, 64).ok);
    CHECK_THROWS_WITH(
        unsized->attend_prompt(1, 0, 1, q.data(), kv.data(), kv.data(), out(1), &token),
        Catch::Contains("sized for 0"));
    CHECK(gpu->prompt_launches == 0);
    auto cpu = small_engine(*m, 16, 2);
    REQUIRE(cpu->admit(1, 64).ok);
    CHECK(cpu->device_prompt_tokens() == 0);
    CHECK_THROWS_WITH(cpu->attend_prompt(1, 0, 1, q.data(), kv.data(), kv.data(), out(1), &token),
                      Catch::Contains("this engine attends in host memory"));
    // The host path of the same engines still attends.
    cpu->attend_prompt(1, 0, 1, q.data(), kv.data(), kv.data(), out(1));
    CHECK(std::isfinite(lse[0]));
}
