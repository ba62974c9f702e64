// The runtime's GPU decode path without a GPU: ops apart from host memory with a stream token
// (tests/model/apart_ops.hpp's device emulation) over a hybrid engine whose GPU side is the host
// backend (hybrid_host_engine.hpp), so that decode steps hand the engine "device" memory through
// Engine::attend_layer's device-side contract; and with recordings, so that the ops' work
// between the engine's layers is recorded at a batch size's second step and replayed, and a
// batch whose experts cannot be recorded runs them instead. The logits must be transformers'
// and, bit for bit, those of the same runtime launching every call.
#include <catch2/catch.hpp>

#include <cstdio>

#include "apart_ops.hpp"
#include "hybrid_host_engine.hpp"
#include "reference_model.hpp"

using namespace writescope;
using namespace writescope::test;

namespace {

struct DeviceSide {
    int stream_token = 0;
    std::unique_ptr<Engine> engine;
    std::unique_ptr<CountingOps> ops;
    std::unique_ptr<model::Runtime> runtime;

    DeviceSide(const model::Model& m, bool record) {
        const DType kv = m.config().dtype;
        engine =
            hybrid_host_engine(m.config().kv_geometry(kv), 8, /*g_slots=*/3, 0.5, 2, &stream_token);
        DeviceEmulation dev;
        dev.stream = &stream_token;
        dev.record = record;
        dev.moe_record_max = 1;  // a batch of two waits for its expert counts, as on a GPU
        ops = std::make_unique<CountingOps>(cpu_ops_options(m.config(), 32), false, dev);
        model::RuntimeOptions ro;
        ro.prefill_chunk_tokens = 32;
        ro.max_batch = 2;
        ro.kv_dtype = kv;
        runtime = model::make_runtime(m, *ops, *engine, ro);
    }
};

}  // namespace

TEST_CASE("the runtime's device-side decode, recorded and replayed, keeps transformers' logits",
          "[model]") {
    for (const std::string name : {"qwen3-moe-tiny", "deepseek-v2-tiny-yarn", "mixtral-tiny"}) {
        const auto dir = models_dir() / name;
        const Reference ref = read_reference(dir);
        const auto m = model::load_model_dir(dir);
        const std::size_t V = static_cast<std::size_t>(m->config().vocab_size);
        DeviceSide rec(*m, /*record=*/true), plain(*m, /*record=*/false);
        INFO(name);
        REQUIRE(rec.runtime->device_attention());
        REQUIRE(plain.runtime->device_attention());
        CHECK(rec.runtime->records_decode());
        CHECK_FALSE(plain.runtime->records_decode());
        const ReferencePrompt& p = ref.prompts[0];
        REQUIRE(p.greedy.size() >= 4);  // a first step run, a second recorded, then replays
        // The prompt, then its greedy continuation teacher-forced one token per step.
        std::vector<std::int32_t> forced = p.ids;
        forced.insert(forced.end(), p.greedy.begin(), p.greedy.end() - 1);
        const std::vector<float> ours = all_logits(*rec.runtime, forced, p.greedy.size() - 1);
        const std::vector<float> launched = all_logits(*plain.runtime, forced, p.greedy.size() - 1);
        REQUIRE(rec.runtime->release(1));
        REQUIRE(plain.runtime->release(1));
        CHECK(ours == launched);
        double err = 0, scale = 0;
        for (std::size_t r = 0; r < ours.size() / V; ++r)
            for (std::size_t v = 0; v < V; ++v) {
                err = std::max(err,
                               std::abs(static_cast<double>(ours[r * V + v]) - p.logits.at(r, v)));
                scale = std::max(scale, std::abs(static_cast<double>(p.logits.at(r, v))));
            }
        CHECK(err / scale <= tolerance(ref));
        CHECK(rec.runtime->decode_recordings() == 1);
        CHECK(rec.ops->replays > 0);
        CHECK(plain.ops->replays == 0);

        // Two sequences at once: their experts wait for their counts, so the batch of two
        // cannot be recorded; it runs (the same logits as launching), and is not tried again.
        const std::vector<std::int32_t> a(p.ids.begin(), p.ids.begin() + 3),
            b(p.ids.begin() + 1, p.ids.begin() + 5);
        std::vector<float> la(2 * V), lb(2 * V);
        for (DeviceSide* s : {&rec, &plain}) {
            model::Runtime& rt = *s->runtime;
            REQUIRE(rt.admit(7, 16).ok);
            REQUIRE(rt.admit(8, 16).ok);
            std::vector<float> scratch(4 * V);
            rt.prefill(7, a, scratch.data());
            rt.prefill(8, b, scratch.data());
            const std::uint64_t ids[] = {7, 8};
            std::vector<float>& out = s == &rec ? la : lb;
            for (int step = 0; step < 3; ++step) {
                const std::int32_t toks[] = {p.greedy[step], p.greedy[step + 1]};
                rt.decode(ids, toks, out.data());
            }
            REQUIRE(rt.release(7));
            REQUIRE(rt.release(8));
        }
        CHECK(la == lb);
        CHECK(rec.runtime->decode_recordings() == 1);  // batch 1 still; batch 2 not recorded
        std::fprintf(stderr,
                     "%-22s device-side decode, recorded: relative logit error %.3g, %zu "
                     "replays of %zu recorded calls\n",
                     name.c_str(), err / scale, rec.ops->replays, rec.ops->recorded_calls);
    }
}
