#include "reasoning.hpp"

#include <algorithm>

#include "tag_scan.hpp"

namespace writescope::daemon {
namespace {

constexpr std::string_view kOpen = "<think>";
constexpr std::string_view kClose = "</think>";

}  // namespace

void ReasoningReader::run(Out& out, bool last) {
    for (;;) {
        switch (state_) {
            case State::start: {
                // Leading whitespace, then <think> or not.
                std::size_t at = 0;
                while (at < pending_.size() && is_space(pending_[at]))
                    ++at;
                const std::string_view rest = std::string_view(pending_).substr(at);
                if (rest.size() < kOpen.size() && kOpen.substr(0, rest.size()) == rest) {
                    if (!last) return;  // it may still begin so
                    state_ = State::content;
                    continue;
                }
                if (rest.starts_with(kOpen)) {
                    pending_.erase(0, at + kOpen.size());
                    state_ = State::reasoning;
                } else {
                    state_ = State::content;
                }
                continue;
            }
            case State::reasoning: {
                const std::size_t close = pending_.find(kClose);
                if (close == std::string::npos) {
                    const std::size_t give =
                        last ? pending_.size()
                             : pending_.size() - tag_prefix_at_end(pending_, kClose);
                    out.reasoning.append(pending_, 0, give);
                    pending_.erase(0, give);
                    return;
                }
                out.reasoning.append(pending_, 0, close);
                pending_.erase(0, close + kClose.size());
                state_ = State::content_start;
                continue;
            }
            case State::content_start: {
                const auto first = std::find_if_not(pending_.begin(), pending_.end(), is_space);
                pending_.erase(pending_.begin(), first);
                if (pending_.empty()) return;
                state_ = State::content;
                continue;
            }
            case State::content:
                out.content += pending_;
                pending_.clear();
                return;
        }
    }
}

ReasoningReader::Out ReasoningReader::push(std::string_view piece) {
    Out out;
    pending_ += piece;
    run(out, false);
    return out;
}

ReasoningReader::Out ReasoningReader::finish() {
    Out out;
    run(out, true);
    return out;
}

ReasoningReader::Out read_reasoning(std::string_view text) {
    ReasoningReader r;
    ReasoningReader::Out out = r.push(text);
    ReasoningReader::Out rest = r.finish();
    out.reasoning += rest.reasoning;
    out.content += rest.content;
    return out;
}

}  // namespace writescope::daemon
