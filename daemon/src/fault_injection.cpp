#include "fault_injection.hpp"

#include <charconv>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace writescope::daemon {
namespace {

class FaultInjectingRuntime final : public model::Runtime {
  public:
    FaultInjectingRuntime(std::unique_ptr<model::Runtime> inner, std::size_t step,
                          std::function<void()> fault)
        : inner_(std::move(inner)), fault_step_(step), fault_(std::move(fault)) {}

    const model::ModelConfig& config() const noexcept override { return inner_->config(); }
    std::size_t max_context() const noexcept override { return inner_->max_context(); }
    std::size_t prefill_chunk_tokens() const noexcept override {
        return inner_->prefill_chunk_tokens();
    }
    std::size_t max_batch() const noexcept override { return inner_->max_batch(); }
    Admission admit(std::uint64_t seq_id, std::size_t total_tokens) override {
        return inner_->admit(seq_id, total_tokens);
    }
    void prefill(std::uint64_t seq_id, std::span<const std::int32_t> tokens, float* logits,
                 bool all_positions) override {
        inner_->prefill(seq_id, tokens, logits, all_positions);
    }
    void decode(std::span<const std::uint64_t> seq_ids, std::span<const std::int32_t> tokens,
                float* logits) override {
        if (++steps_ == fault_step_) fault_();
        inner_->decode(seq_ids, tokens, logits);
    }
    bool release(std::uint64_t seq_id) override { return inner_->release(seq_id); }
    std::size_t sequence_tokens(std::uint64_t seq_id) const override {
        return inner_->sequence_tokens(seq_id);
    }
    Engine& engine() noexcept override { return inner_->engine(); }
    std::uint64_t last_weight_bytes() const noexcept override {
        return inner_->last_weight_bytes();
    }
    StepReport last_step() const override { return inner_->last_step(); }
    bool device_attention() const noexcept override { return inner_->device_attention(); }
    bool device_prompts() const noexcept override { return inner_->device_prompts(); }
    bool last_step_in_parts() const noexcept override { return inner_->last_step_in_parts(); }
    std::vector<model::StepTrialResult> step_trials() const override {
        return inner_->step_trials();
    }
    bool records_decode() const noexcept override { return inner_->records_decode(); }
    std::size_t decode_recordings() const noexcept override { return inner_->decode_recordings(); }
    model::LayerTimes last_layer_times() const override { return inner_->last_layer_times(); }
    void profile_layers(bool on) override { inner_->profile_layers(on); }
    model::ExpertHeat take_expert_heat() override { return inner_->take_expert_heat(); }
    model::ExpertStreamStats expert_streaming() const override {
        return inner_->expert_streaming();
    }

  private:
    std::unique_ptr<model::Runtime> inner_;
    const std::size_t fault_step_;
    const std::function<void()> fault_;
    std::size_t steps_ = 0;  // the scheduler's thread alone calls decode
};

}  // namespace

std::optional<std::size_t> injected_fault_step(const char* value) {
    if (value == nullptr || *value == '\0') return std::nullopt;
    const std::string_view s(value);
    std::size_t step = 0;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), step);
    if (ec != std::errc{} || end != s.data() + s.size() || step == 0)
        throw std::invalid_argument(std::string(kInjectGpuFault) + "=\"" + std::string(s) +
                                    "\": not a decode step number (a positive integer)");
    return step;
}

std::unique_ptr<model::Runtime> with_fault_at_step(std::unique_ptr<model::Runtime> runtime,
                                                   std::size_t step, std::function<void()> fault) {
    return std::make_unique<FaultInjectingRuntime>(std::move(runtime), step, std::move(fault));
}

}  // namespace writescope::daemon
