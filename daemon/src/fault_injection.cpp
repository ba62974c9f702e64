#include "fault_injection.hpp"

#include <charconv>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <string_view>

#include "log.hpp"
#include "writescope/cuda/fault_injection.hpp"

namespace writescope::daemon {
namespace {

constexpr const char* kVariable = "WRITESCOPE_INJECT_GPU_FAULT";

class FaultInjectingRuntime final : public model::Runtime {
  public:
    FaultInjectingRuntime(std::unique_ptr<model::Runtime> inner, int device, std::size_t step)
        : inner_(std::move(inner)), device_(device), fault_step_(step) {}

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
        if (++steps_ == fault_step_) {
            log_warning("fault-injection.fault",
                        "{}: decode step {} faults GPU {} with an illegal address", kVariable,
                        steps_, device_);
            cuda::inject_illegal_address(device_);
        }
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
    const int device_;
    const std::size_t fault_step_;
    std::size_t steps_ = 0;  // the scheduler's thread alone calls decode
};

}  // namespace

std::unique_ptr<model::Runtime> with_fault_injection(std::unique_ptr<model::Runtime> runtime,
                                                     int device) {
    const char* v = std::getenv(kVariable);
    if (v == nullptr || *v == '\0') return runtime;
    const std::string_view s(v);
    std::size_t step = 0;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), step);
    if (ec != std::errc{} || end != s.data() + s.size() || step == 0)
        throw std::invalid_argument(std::string(kVariable) + "=\"" + std::string(s) +
                                    "\": not a decode step number (a positive integer)");
    if (device < 0)
        throw std::invalid_argument(std::string(kVariable) +
                                    " is set but the model's engine has no GPU to fault");
    log_warning("fault-injection.armed",
                "{}={}: decode step {} will fault GPU {} (a build for the fault test; no package "
                "has it)",
                kVariable, step, step, device);
    return std::make_unique<FaultInjectingRuntime>(std::move(runtime), device, step);
}

}  // namespace writescope::daemon
