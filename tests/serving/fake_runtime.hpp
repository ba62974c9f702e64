// A stand-in for the model runtime, for the scheduler's tests: it keeps what the contract
// describes (admission within a KV budget counted in tokens, prompts in chunks, decode steps over
// admitted sequences, release) and records every call, without a model. Its "model" is a counter:
// the logits after token t peak at (t + 1) mod vocab, so greedy decoding of a prompt ending in t
// yields t+1, t+2, ...
#pragma once

#include <cstdlib>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "writescope/core/model/runtime.hpp"

namespace writescope::test {

class FakeRuntime final : public model::Runtime {
  public:
    // One call, as the scheduler made it.
    struct Call {
        enum class Kind { admit, prefill, decode, release } kind;
        std::vector<std::uint64_t> ids;  // prefill, admit, release: one id
        std::size_t tokens = 0;          // prefill: chunk size; admit: total tokens
    };

    FakeRuntime(std::size_t vocab = 16, std::size_t budget_tokens = 1000, std::size_t chunk = 4,
                std::size_t max_batch = 4, std::size_t context = 256)
        : budget_(budget_tokens), chunk_(chunk), batch_(max_batch), context_(context) {
        config_.name = "fake";
        config_.vocab_size = static_cast<int>(vocab);
        config_.eos_token_ids = {static_cast<int>(vocab) - 1};
    }

    const model::ModelConfig& config() const noexcept override { return config_; }
    std::size_t max_context() const noexcept override { return context_; }
    std::size_t prefill_chunk_tokens() const noexcept override { return chunk_; }
    std::size_t max_batch() const noexcept override { return batch_; }

    Admission admit(std::uint64_t id, std::size_t total) override {
        std::lock_guard lock(mu_);
        calls_.push_back({Call::Kind::admit, {id}, total});
        if (reserved_ + total > budget_)
            return {false, "host_kv_budget: " + std::to_string(total) + " tokens asked, " +
                               std::to_string(budget_ - reserved_) + " of " +
                               std::to_string(budget_) + " free"};
        reserved_ += total;
        live_[id] = {total, 0};
        return {true, {}};
    }

    void prefill(std::uint64_t id, std::span<const std::int32_t> tokens, float* logits,
                 bool all_positions) override {
        {
            std::lock_guard lock(mu_);
            calls_.push_back({Call::Kind::prefill, {id}, tokens.size()});
            const auto it = live_.find(id);
            if (it == live_.end()) throw std::out_of_range("prefill: unknown sequence");
            if (tokens.size() > chunk_) throw std::length_error("prefill: chunk too large");
            for (const auto t : tokens)
                if (t == fail_prefill_token) throw std::invalid_argument("prefill: poisoned token");
            it->second.held += tokens.size();
        }
        if (logits && all_positions) {
            for (std::size_t j = 0; j < tokens.size(); ++j)
                peak(logits + j * vocab_size(), tokens[j]);
        } else if (logits) {
            peak(logits, tokens.back());
        }
    }

    void decode(std::span<const std::uint64_t> ids, std::span<const std::int32_t> tokens,
                float* logits) override {
        {
            std::lock_guard lock(mu_);
            calls_.push_back({Call::Kind::decode, {ids.begin(), ids.end()}, 0});
            if (fail_decodes > 0) {
                --fail_decodes;
                throw std::runtime_error("decode: injected failure");
            }
            if (ids.size() > batch_) throw std::length_error("decode: batch too large");
            for (const auto id : ids) {
                const auto it = live_.find(id);
                if (it == live_.end()) throw std::out_of_range("decode: unknown sequence");
                if (++it->second.held > it->second.total)
                    throw std::length_error("decode: past the admitted maximum");
            }
        }
        for (std::size_t i = 0; i < ids.size(); ++i)
            peak(logits + i * vocab_size(), tokens[i]);
        if (step_delay.count()) std::this_thread::sleep_for(step_delay);
    }

    bool release(std::uint64_t id) override {
        std::lock_guard lock(mu_);
        calls_.push_back({Call::Kind::release, {id}, 0});
        const auto it = live_.find(id);
        if (it == live_.end()) return false;
        reserved_ -= it->second.total;
        live_.erase(it);
        return true;
    }

    std::size_t sequence_tokens(std::uint64_t id) const override {
        std::lock_guard lock(mu_);
        return live_.at(id).held;
    }

    Engine& engine() noexcept override { std::abort(); }

    // --- for the tests
    std::vector<Call> calls() const {
        std::lock_guard lock(mu_);
        return calls_;
    }
    std::size_t live() const {
        std::lock_guard lock(mu_);
        return live_.size();
    }
    std::size_t reserved() const {
        std::lock_guard lock(mu_);
        return reserved_;
    }
    void fail_next_decodes(int n) {
        std::lock_guard lock(mu_);
        fail_decodes = n;
    }

    // Set before the scheduler starts (read by its thread).
    std::int32_t fail_prefill_token = -1;
    std::chrono::milliseconds step_delay{1};

  private:
    struct Seq {
        std::size_t total = 0, held = 0;
    };
    void peak(float* logits, std::int32_t t) const {
        const auto v = vocab_size();
        for (std::size_t i = 0; i < v; ++i)
            logits[i] = -static_cast<float>(i % 7);  // not flat, so sampling has a shape
        logits[static_cast<std::size_t>(t + 1) % v] = 5.0f;
    }

    model::ModelConfig config_;
    const std::size_t budget_, chunk_, batch_, context_;
    mutable std::mutex mu_;
    std::vector<Call> calls_;
    std::map<std::uint64_t, Seq> live_;
    std::size_t reserved_ = 0;
    int fail_decodes = 0;
};

}  // namespace writescope::test
