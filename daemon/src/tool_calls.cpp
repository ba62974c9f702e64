#include "tool_calls.hpp"

#include <algorithm>
#include <mutex>
#include <random>

#include <nlohmann/json.hpp>

#include "tag_scan.hpp"

namespace writescope::daemon {
namespace {

using json = nlohmann::json;

constexpr std::string_view kOpen = "<tool_call>";
constexpr std::string_view kClose = "</tool_call>";

bool all_space(std::string_view s) {
    return std::all_of(s.begin(), s.end(), is_space);
}

std::string call_id() {
    static std::mutex mu;
    static std::mt19937_64 rng{std::random_device{}()};
    static constexpr char kChars[] =
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    std::string id = "call_";
    std::lock_guard lock(mu);
    for (int i = 0; i < 24; ++i)
        id += kChars[rng() % (sizeof kChars - 1)];
    return id;
}

// A block's JSON as a call, or false. "parameters" is read as "arguments" where a model wrote
// that instead (some Hermes fine-tunes do).
bool as_call(std::string_view body, ToolCall& call) {
    const json j = json::parse(body, nullptr, false);
    if (j.is_discarded() || !j.is_object()) return false;
    const auto name = j.find("name");
    if (name == j.end() || !name->is_string() || name->get<std::string>().empty()) return false;
    auto args = j.find("arguments");
    if (args == j.end()) args = j.find("parameters");
    if (args != j.end() && !args->is_object() && !args->is_string()) return false;
    call.name = name->get<std::string>();
    if (args == j.end())
        call.arguments = "{}";
    else
        call.arguments = args->is_string()
                             ? args->get<std::string>()
                             : args->dump(-1, ' ', false, json::error_handler_t::replace);
    call.id = call_id();
    return true;
}

}  // namespace

ToolFormat tool_format_of(std::string_view template_source) {
    return template_source.find(kOpen) != std::string_view::npos ? ToolFormat::hermes
                                                                 : ToolFormat::none;
}

void ToolCallReader::close_block(Out& out, std::string_view block, bool closed) {
    ToolCall call;
    if (as_call(block, call)) {
        out.calls.push_back(std::move(call));
        ++calls_;
        after_call_ = true;
        return;
    }
    // Not a call: the block stays in the content as the model wrote it.
    after_call_ = false;
    out.content += kOpen;
    out.content += block;
    if (closed) out.content += kClose;
}

// Gives out the content of pending_ up to a block's start (entering it) or up to what could
// still begin one; right after a call, whitespace waits for text that is not (and is dropped
// before the next block or at the end).
void ToolCallReader::outside(Out& out, bool last) {
    const std::size_t open = pending_.find(kOpen);
    std::size_t give = open != std::string::npos ? open
                       : last                    ? pending_.size()
                              : pending_.size() - tag_prefix_at_end(pending_, kOpen);
    const std::string_view text = std::string_view(pending_).substr(0, give);
    if (after_call_ && all_space(text)) {
        // Whitespace right after a call: dropped before a block or at the end, held while
        // text may still follow.
        if (open == std::string::npos && !last) give = 0;
    } else {
        out.content += text;
        if (!text.empty()) after_call_ = false;
    }
    if (open != std::string::npos) {
        pending_.erase(0, open + kOpen.size());
        inside_ = true;
    } else {
        pending_.erase(0, give);
    }
}

ToolCallReader::Out ToolCallReader::push(std::string_view piece) {
    Out out;
    pending_ += piece;
    for (;;) {
        if (!inside_) {
            const bool entering = pending_.find(kOpen) != std::string::npos;
            outside(out, false);
            if (!entering) return out;
            continue;
        }
        const std::size_t close = pending_.find(kClose);
        if (close == std::string::npos) return out;
        close_block(out, std::string_view(pending_).substr(0, close), true);
        pending_.erase(0, close + kClose.size());
        inside_ = false;
    }
}

ToolCallReader::Out ToolCallReader::finish() {
    Out out = push({});
    if (inside_) {
        close_block(out, pending_, false);
        pending_.clear();
        inside_ = false;
    } else {
        outside(out, true);
    }
    return out;
}

ToolCallReader::Out read_tool_calls(std::string_view text) {
    ToolCallReader r;
    ToolCallReader::Out out = r.push(text);
    ToolCallReader::Out rest = r.finish();
    out.content += rest.content;
    for (auto& c : rest.calls)
        out.calls.push_back(std::move(c));
    return out;
}

}  // namespace writescope::daemon
