// ModelOps whose memory the runtime must treat as apart from the host's, on the CPU: a
// CpuModelOps underneath, host_memory() false, so the runtime takes the paths it takes on a GPU
// (inputs uploaded, the engine's side staged through host memory, logits downloaded, routing
// downloaded and split). It counts the crossings, and the expert calls of host ops it wraps.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "writescope/core/model/model.hpp"
#include "writescope/core/model/model_ops.hpp"
#include "writescope/cpu/model_ops.hpp"

namespace writescope::test {

// What a GPU's ops would add, emulated on the host (all optional): a stream token the engine
// must be handed back (Engine::attend_layer's device side), and recordings: while recording,
// every op is kept as a call to replay instead of run, and what a GPU could not record throws
// (a copy to or from the host, a wait, and moe over more than moe_record_max tokens, as the GEMM
// path's wait for its counts); and expert streaming: moe_streamed over experts of at most
// stream_bytes (0: the ops cannot stream), run at once, its copies reported at stream_rate
// bytes per second (the probe too).
struct DeviceEmulation {
    void* stream = nullptr;
    bool record = false;
    std::size_t moe_record_max = 64;
    std::size_t stream_bytes = 0;
    double stream_rate = 25e9;
    // Reading host experts in place (moe_in_place, for streaming ops): every host expert with
    // weights is readable, each call run at once and reported to take in_place_seconds.
    bool in_place = false;
    double in_place_seconds = 1e-4;
    // idle(): the work enqueued "runs" for this many polls after each wait (download,
    // synchronize) before the ops say they are idle (0: always idle, as ops that run at once).
    std::size_t busy_polls = 0;
};

class CountingOps final : public model::ModelOps {
  public:
    CountingOps(const cpu::CpuModelOpsOptions& o, bool host_memory, DeviceEmulation dev = {})
        : inner_(o), host_(host_memory), dev_(dev) {}

    std::size_t uploads = 0, downloads = 0, moe_calls = 0, moe_tokens = 0;
    std::size_t recorded_calls = 0, replays = 0, dropped_records = 0;
    std::size_t streamed_calls = 0, streamed_experts = 0;
    std::size_t in_place_calls = 0;
    model::MoeRouting last_in_place_routing;
    mutable std::size_t idle_polls = 0;
    std::size_t read_ahead_calls = 0;
    std::uint64_t read_ahead_bytes = 0;
    std::vector<std::int32_t> last_read_ahead;  // the experts of the last read_ahead (slot order)
    const model::FfnWeights* last_read_ahead_experts = nullptr;  // and its experts' span

    void linear(const model::Matrix& w, const float* x, std::size_t n, float* y) override {
        op([=, this] { inner_.linear(w, x, n, y); });
    }
    void moe(std::span<const model::FfnWeights> experts, const float* x, std::size_t n,
             const model::MoeRouting& routing, float* y) override {
        if (cur_ && n > dev_.moe_record_max)
            throw std::runtime_error("CountingOps: moe over " + std::to_string(n) +
                                     " tokens waits for its counts: it cannot be recorded");
        op([=, this] {
            ++moe_calls;
            moe_tokens += n;
            inner_.moe(experts, x, n, routing, y);
        });
    }
    std::size_t stream_expert_bytes() const noexcept override { return dev_.stream_bytes; }
    void moe_streamed(std::span<const model::FfnWeights> host_experts, const float* x,
                      std::size_t n, const model::MoeRouting& routing, float* y) override {
        if (dev_.stream_bytes == 0) throw std::logic_error("CountingOps: streaming is off");
        not_recording("moe_streamed");
        std::vector<std::uint8_t> seen(host_experts.size(), 0);
        StreamStats s;
        for (std::size_t i = 0; i < n * routing.k; ++i) {
            const std::int32_t e = routing.expert[i];
            if (e < 0 || seen.at(static_cast<std::size_t>(e))) continue;
            seen[static_cast<std::size_t>(e)] = 1;
            const std::uint64_t b = host_experts[static_cast<std::size_t>(e)].bytes();
            if (b > dev_.stream_bytes)
                throw std::length_error("CountingOps: an expert beyond the stream's slot");
            s.bytes += b;
            ++s.experts;
        }
        s.seconds = static_cast<double>(s.bytes) / dev_.stream_rate;
        ++streamed_calls;
        streamed_experts += s.experts;
        inner_.moe(host_experts, x, n, routing, y);
        last_stream_ = s;
    }
    std::size_t in_place_tokens() const noexcept override { return dev_.in_place ? 64 : 0; }
    bool reads_in_place(const model::FfnWeights& e) const noexcept override {
        return dev_.in_place && e.gate.data && e.up.data && e.down.data;
    }
    void moe_in_place(std::span<const model::FfnWeights> host_experts, const float* x,
                      std::size_t n, const model::MoeRouting& routing, float* y) override {
        if (!dev_.in_place) throw std::logic_error("CountingOps: no in-place reads");
        if (n > 64) throw std::length_error("CountingOps: moe_in_place over more than 64 tokens");
        not_recording("moe_in_place");
        ++in_place_calls;
        last_in_place_routing = routing;
        inner_.moe(host_experts, x, n, routing, y);
    }
    double last_in_place_seconds() const noexcept override {
        return in_place_calls > 1 ? dev_.in_place_seconds : 0;
    }
    StreamStats last_stream() const noexcept override {
        if (last_stream_.bytes) return last_stream_;
        const std::uint64_t probe = std::uint64_t{32} << 20;
        return {probe, static_cast<double>(probe) / dev_.stream_rate, 0};
    }
    void embed(const model::Matrix& t, const std::int32_t* ids, std::size_t n,
               float* out) override {
        op([=, this] { inner_.embed(t, ids, n, out); });
    }
    void rms_norm(const model::Vector& w, const float* x, std::size_t rows, std::size_t dim,
                  float eps, float* y) override {
        op([=, this] { inner_.rms_norm(w, x, rows, dim, eps, y); });
    }
    void rotary(const model::RotaryTable& t, float* x, std::size_t tokens, std::size_t heads,
                std::size_t stride, std::size_t offset, const std::int64_t* pos) override {
        op([=, this] { inner_.rotary(t, x, tokens, heads, stride, offset, pos); });
    }
    void finish_rows(std::span<const model::RowFinish> parts, float eps,
                     const std::int64_t* pos) override {
        model::check_row_finish(parts, "CountingOps::finish_rows");
        // The parts by value: a recording replays them after the caller's span is gone.
        op([v = std::vector<model::RowFinish>(parts.begin(), parts.end()), eps, pos, this] {
            inner_.finish_rows(v, eps, pos);
        });
    }
    void add(float* y, const float* x, std::size_t n) override {
        op([=, this] { inner_.add(y, x, n); });
    }
    void add_bias(float* y, const model::Vector& b, std::size_t rows) override {
        op([=, this] { inner_.add_bias(y, b, rows); });
    }
    void route(const model::RoutingParams& p, const float* logits, std::size_t n,
               std::int32_t* experts, float* weights) override {
        op([=, this] { inner_.route(p, logits, n, experts, weights); });
    }
    void to_dtype(const float* x, std::size_t n, DType t, void* y) override {
        op([=, this] { inner_.to_dtype(x, n, t, y); });
    }
    void copy_2d(const float* src, std::size_t ss, float* dst, std::size_t ds, std::size_t rows,
                 std::size_t cols) override {
        op([=, this] { inner_.copy_2d(src, ss, dst, ds, rows, cols); });
    }
    void linear_heads(const model::Matrix& w, const model::HeadsLayout& l, const float* x,
                      std::size_t n, float* y) override {
        op([=, this] { inner_.linear_heads(w, l, x, n, y); });
    }
    void count_ids(const std::int32_t* ids, std::size_t n, std::size_t bins,
                   std::uint32_t* counts) override {
        op([=, this] { inner_.count_ids(ids, n, bins, counts); });
    }
    bool host_memory() const noexcept override { return host_; }
    void* allocate(std::size_t bytes) override { return inner_.allocate(bytes); }
    void deallocate(void* p) noexcept override { inner_.deallocate(p); }
    void upload(void* dst, const void* src, std::size_t bytes) override {
        not_recording("upload");
        ++uploads;
        inner_.upload(dst, src, bytes);
    }
    void download(void* dst, const void* src, std::size_t bytes) override {
        not_recording("download");
        ++downloads;
        inner_.download(dst, src, bytes);
        busy_left_ = dev_.busy_polls;
    }
    void synchronize() const override {
        not_recording("synchronize");
        busy_left_ = dev_.busy_polls;
    }
    bool idle() const override {
        ++idle_polls;
        if (busy_left_ == 0) return true;
        --busy_left_;
        return false;
    }
    std::uint64_t read_ahead(std::span<const model::FfnWeights> experts, std::size_t n,
                             const model::MoeRouting& routing, FunctionRef<bool()> stop) override {
        ++read_ahead_calls;
        last_read_ahead.assign(routing.expert, routing.expert + n * routing.k);
        last_read_ahead_experts = experts.data();
        const std::uint64_t b = inner_.read_ahead(experts, n, routing, stop);
        read_ahead_bytes += b;
        return b;
    }
    void* stream_handle() const noexcept override { return dev_.stream; }
    bool can_record() const noexcept override { return dev_.record; }
    void begin_record() override {
        if (!dev_.record || cur_) throw std::logic_error("CountingOps: cannot begin a recording");
        cur_ = &recordings_.emplace_back();
    }
    std::size_t end_record() override {
        if (!cur_) throw std::logic_error("CountingOps: not recording");
        cur_ = nullptr;
        dropped_.push_back(0);
        return recordings_.size() - 1;
    }
    void cancel_record() noexcept override {
        if (!cur_) return;
        cur_ = nullptr;
        recordings_.pop_back();
    }
    void replay(std::size_t recording) override {
        if (recording >= recordings_.size() || dropped_.at(recording))
            throw std::out_of_range("CountingOps: no recording " + std::to_string(recording));
        ++replays;
        for (const auto& call : recordings_[recording])
            call();
    }
    void drop_record(std::size_t recording) noexcept override {
        if (recording >= recordings_.size() || dropped_[recording]) return;
        dropped_[recording] = 1;
        recordings_[recording].clear();
        ++dropped_records;
    }
    // Recordings held now (made and not dropped).
    std::size_t live_records() const noexcept {
        std::size_t n = 0;
        for (const std::uint8_t d : dropped_)
            n += d == 0;
        return n;
    }
    std::size_t max_tokens() const noexcept override { return inner_.max_tokens(); }
    const char* kernel_name() const noexcept override { return inner_.kernel_name(); }
    int threads() const noexcept override { return inner_.threads(); }

  private:
    template <class F>
    void op(F&& f) {
        if (!cur_) {
            f();
            return;
        }
        cur_->emplace_back(std::forward<F>(f));
        ++recorded_calls;
    }
    void not_recording(const char* what) const {
        if (cur_)
            throw std::runtime_error(std::string("CountingOps: ") + what +
                                     " crosses to the host: it cannot be recorded");
    }

    cpu::CpuModelOps inner_;
    bool host_;
    DeviceEmulation dev_;
    mutable std::size_t busy_left_ = 0;  // idle()'s polls until idle (DeviceEmulation)
    StreamStats last_stream_;
    std::vector<std::vector<std::function<void()>>> recordings_;
    std::vector<std::uint8_t> dropped_;  // per recording made
    std::vector<std::function<void()>>* cur_ = nullptr;
};

// The model's weights with the routed experts where keep(layer, expert) is false left out (null
// views): they are host-resident for a runtime given these as its RuntimeWeights.
template <class Keep>
model::ModelWeights without_experts(const model::Model& m, Keep keep) {
    model::ModelWeights w = m.weights();
    for (std::size_t l = 0; l < w.layers.size(); ++l)
        for (std::size_t e = 0; e < w.layers[l].experts.size(); ++e)
            if (!keep(l, e)) w.layers[l].experts[e] = {};
    return w;
}

}  // namespace writescope::test
