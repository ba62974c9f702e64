// A stand-in for the engine, for the daemon's unit tests only: it keeps the state the contract
// describes (regions within the budgets, mode, tracker, calibration) without running kernels,
// and lets a test control calibration (its length, failure) and see what the daemon called.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

#include "writescope/core/engine.hpp"
#include "writescope/core/policy_state.hpp"

namespace writescope::test {

// What every FakeEngine built by one factory shares with the test.
struct FakeEngineLog {
    std::atomic<int> created{0};
    std::atomic<int> calibrations{0};
    std::atomic<int> imports{0};
    std::atomic<int> calibrate_ms{0};  // how long calibrate() takes
    std::atomic<bool> fail_calibration{false};
    std::atomic<bool> fail_create{false};
    std::atomic<bool> hold_calibration{false};  // calibrate() waits while set (or until cancelled)
    std::mutex mu;
    std::string last_import;
    std::string last_mode;
    std::string refuse_mode;  // set_mode() refuses this mode (as the engine refuses one it cannot
                              // run); empty: none. Guarded by mu.
};

class FakeEngine final : public Engine {
  public:
    FakeEngine(const EngineOptions& o, std::shared_ptr<FakeEngineLog> log)
        : opts_(o),
          log_(std::move(log)),
          mode_(o.mode),
          alpha_(o.tracker_alpha),
          clamp_(o.tracker_clamp) {
        ++log_->created;
    }

    Calibration calibrate(const std::function<void(double, std::string_view)>& progress,
                          const std::atomic<bool>* cancel) override {
        const int steps = 10;
        for (int i = 0; i < steps; ++i) {
            if (cancel && cancel->load()) throw std::runtime_error("calibration cancelled");
            progress(static_cast<double>(i) / steps, "measuring the CPU");
            std::this_thread::sleep_for(std::chrono::milliseconds(log_->calibrate_ms / steps));
        }
        while (log_->hold_calibration) {
            if (cancel && cancel->load()) throw std::runtime_error("calibration cancelled");
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        if (log_->fail_calibration) throw std::runtime_error("synthetic failure");
        progress(1.0, "fitting");
        ++log_->calibrations;
        Calibration c;
        c.a = 1e-8 * (1 + log_->calibrations);
        c.b = opts_.gpu_index >= 0 ? 5e-9 : 0;
        c.delta = opts_.gpu_index >= 0 ? 2e-5 : 0;
        c.a_r2 = 0.999;
        c.has_gpu = opts_.gpu_index >= 0;
        c.points = {{1024, 1024 * c.a, 0}, {4096, 4096 * c.a, 0}};
        return c;
    }
    void set_calibration(const Calibration& c) override {
        std::lock_guard lock(mu_);
        cal_ = c;
    }
    const EngineOptions& options() const noexcept override { return opts_; }
    EngineStatus status() const override {
        std::lock_guard lock(mu_);
        EngineStatus s;
        const auto per_block = opts_.geometry.bytes_per_token() * opts_.block_tokens;
        const std::uint64_t budgets[] = {opts_.vram_kv_bytes / 4, opts_.vram_kv_bytes * 3 / 4,
                                         opts_.pinned_kv_bytes, opts_.host_kv_bytes};
        for (int i = 0; i < kNumRegions; ++i) {
            s.regions[static_cast<std::size_t>(i)].region = static_cast<Region>(i);
            s.regions[static_cast<std::size_t>(i)].capacity_bytes = budgets[i];
            s.regions[static_cast<std::size_t>(i)].capacity_blocks =
                per_block ? budgets[i] / per_block : 0;
        }
        s.sequences = sequences_;
        s.mode = mode_;
        s.a = cal_.a;
        s.b = cal_.b;
        s.delta = cal_.delta;
        s.r_target = s.r_deployed = 1.0;
        s.steps = steps_;
        s.cpu_isa = "fake";
        s.attention_threads = opts_.attention_threads ? opts_.attention_threads : 2;
        s.gpu = opts_.gpu_index >= 0;
        return s;
    }
    void set_mode(std::string_view mode) override {
        if (mode == "gpu-only" && opts_.gpu_index < 0)
            throw std::invalid_argument("gpu-only needs a GPU, and this engine has none");
        {
            std::lock_guard l(log_->mu);
            if (!log_->refuse_mode.empty() && mode == log_->refuse_mode)
                throw std::invalid_argument("policy mode '" + std::string(mode) +
                                            "' is refused by this (fake) engine");
        }
        std::lock_guard lock(mu_);
        mode_ = std::string(mode);
        std::lock_guard l2(log_->mu);
        log_->last_mode = mode_;
    }
    void set_tracker(double alpha, double clamp) override {
        std::lock_guard lock(mu_);
        alpha_ = alpha;
        clamp_ = clamp;
    }
    // The real text form (docs/policy.md), so the daemon's parsing of it is exercised.
    std::string export_policy_state() const override {
        std::lock_guard lock(mu_);
        PolicyState st;
        st.key = make_workload_key(opts_.geometry.name, opts_.geometry.dtype, sequences_, 0);
        st.a.estimate = cal_.a;
        st.b.estimate = cal_.b;
        st.delta.estimate = cal_.delta;
        st.cpu_fixed = cal_.cpu_intercept;
        for (std::uint64_t i = 0; i < steps_; ++i)
            st.step_seconds.add(1e-3 * static_cast<double>(i + 1));
        return format_policy_state(st);
    }
    void import_policy_state(std::string_view text) override {
        (void)parse_policy_state(text);  // throws std::invalid_argument, as the engine does
        ++log_->imports;
        std::lock_guard lock(log_->mu);
        log_->last_import = std::string(text);
    }
    Admission admit(std::uint64_t, std::size_t) override {
        std::lock_guard lock(mu_);
        ++sequences_;
        ++steps_;
        return {true, {}};
    }
    void release(std::uint64_t) override {
        std::lock_guard lock(mu_);
        if (sequences_) --sequences_;
    }
    // The daemon runs no decode steps yet (no model runtime): these are never called.
    void begin_step(std::span<const std::uint64_t>) override {
        throw std::logic_error("FakeEngine: no decode steps");
    }
    using Engine::attend_prompt;
    void attend_prompt(std::uint64_t, std::size_t, std::size_t, const void*, const void*,
                       const void*, StateView, void*) override {
        throw std::logic_error("the fake engine attends nothing");
    }
    using Engine::attend_layer;
    void attend_layer(std::size_t, const void*, NewTokens, StateView, void*) override {
        throw std::logic_error("FakeEngine: no decode steps");
    }
    StepReport end_step() override { throw std::logic_error("FakeEngine: no decode steps"); }
    void prefill(std::uint64_t, std::size_t, const void*, const void*) override {
        throw std::logic_error("FakeEngine: no prefill");
    }
    void abort_step() override { throw std::logic_error("FakeEngine: no decode steps"); }

  private:
    EngineOptions opts_;
    std::shared_ptr<FakeEngineLog> log_;
    mutable std::mutex mu_;
    std::string mode_;
    double alpha_, clamp_;
    Calibration cal_;
    std::size_t sequences_ = 0;
    std::uint64_t steps_ = 0;
};

}  // namespace writescope::test
