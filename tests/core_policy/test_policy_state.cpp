#include <catch2/catch.hpp>

#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "test_seed.hpp"
#include "writescope/core/policy_state.hpp"

using namespace writescope;
using Catch::Matchers::Contains;

namespace {

PolicyState sample_state() {
    PolicyState s;
    s.key = make_workload_key("qwen3-30b-a3b", DType::bf16, 12, 30000);
    s.a = {2.345678901234567e-8, 0.0412, 1234};
    s.b = {1.0 / 3.0 * 1e-8, 0.0173, 1200};
    s.delta = {2.1e-4, 0.09, 17};
    s.cpu_fixed = 3.5e-5;
    s.r_deployed = 0.4375;
    for (double t : {1.1e-3, 1.3e-3, 0.9e-3, 1.7e-3, 1.2e-3})
        s.step_seconds.add(t);
    return s;
}

// Replaces the line starting with `key=` by `line`.
std::string with_line(std::string text, const std::string& key, const std::string& line) {
    const std::size_t at = text.find("\n" + key + "=");
    REQUIRE(at != std::string::npos);
    const std::size_t end = text.find('\n', at + 1);
    return text.replace(at + 1, end - at - 1, line);
}

// The 1-based line number of the line starting with `key=`.
std::size_t line_of(const std::string& text, const std::string& key) {
    const std::size_t at = text.find("\n" + key + "=");
    std::size_t n = 1;
    for (std::size_t i = 0; i <= at; ++i)
        n += text[i] == '\n';
    return n;
}

}  // namespace

TEST_CASE("workload buckets are powers of two", "[unit][policy][state]") {
    CHECK(batch_size_bucket(0) == 1);
    CHECK(batch_size_bucket(1) == 1);
    CHECK(batch_size_bucket(3) == 4);
    CHECK(batch_size_bucket(16) == 16);
    CHECK(batch_size_bucket(17) == 32);
    CHECK(context_length_bucket(0) == 1024);
    CHECK(context_length_bucket(1024) == 1024);
    CHECK(context_length_bucket(1025) == 2048);
    CHECK(context_length_bucket(32768) == 32768);
    CHECK(context_length_bucket(32769) == 65536);
    const WorkloadKey k = make_workload_key("mixtral-8x7b", DType::f16, 5, 9000);
    CHECK(k.batch_bucket == 8);
    CHECK(k.context_bucket == 16384);
    CHECK(format_workload_key(k) == "mixtral-8x7b/fp16/b8/c16384");
}

TEST_CASE("policy state round-trips through its text form", "[unit][policy][state]") {
    const PolicyState s = sample_state();
    const std::string text = format_policy_state(s);
    CHECK_THAT(text, Contains("version=1\n"));
    CHECK_THAT(text, Contains("model=qwen3-30b-a3b\n"));
    CHECK_THAT(text, Contains("batch_bucket=16\n"));
    CHECK_THAT(text, Contains("context_bucket=32768\n"));
    const PolicyState r = parse_policy_state(text);
    CHECK(r.key == s.key);
    CHECK(r.a == s.a);  // exact: numbers are written in their shortest exact form
    CHECK(r.b == s.b);
    CHECK(r.delta == s.delta);
    CHECK(r.cpu_fixed == s.cpu_fixed);
    CHECK(r.r_deployed == s.r_deployed);
    CHECK(r.step_seconds.count == s.step_seconds.count);
    CHECK(r.step_seconds.mean == s.step_seconds.mean);
    CHECK(r.step_seconds.min == s.step_seconds.min);
    CHECK(r.step_seconds.max == s.step_seconds.max);
    CHECK(r.step_seconds.stddev() == Approx(s.step_seconds.stddev()).epsilon(1e-12));
    CHECK(format_policy_state(r) == text);

    // Tolerated: comments, blank lines, CRLF, spaces around '=' and keys in another order.
    std::string loose = "\r\n# stored 2025\r\nversion = 1\r\n";
    std::vector<std::string> lines;
    std::size_t pos = text.find("version=1\n") + 10;
    while (pos < text.size()) {
        const std::size_t nl = text.find('\n', pos);
        lines.push_back(text.substr(pos, nl - pos));
        pos = nl + 1;
    }
    std::reverse(lines.begin(), lines.end());
    for (const auto& l : lines)
        loose += "  " + l.substr(0, l.find('=')) + " = " + l.substr(l.find('=') + 1) + "\r\n\n";
    const PolicyState r2 = parse_policy_state(loose);
    CHECK(r2.key == s.key);
    CHECK(r2.a == s.a);
    CHECK(r2.r_deployed == s.r_deployed);
}

TEST_CASE("policy state restores the trackers", "[unit][policy][state]") {
    auto rng = test::seeded_rng("policy state trackers");
    std::uniform_real_distribution<double> noise(0.9, 1.1);
    PolicyTrackers live;
    live.seed({2e-8, 1e-8, 2e-4, 3e-5});
    StepTimeStats stats;
    for (int i = 0; i < 50; ++i) {
        StepMeasurement m;
        m.cpu_u_tokens = 30000;
        m.cpu_seconds = 3e-5 + 2e-8 * 30000 * noise(rng);
        m.gpu_p_tokens = 70000;
        m.gpu_seconds = 2e-4 + 1e-8 * 70000 * noise(rng);
        live.observe(m);
        stats.add(std::max(m.cpu_seconds, m.gpu_seconds));
    }
    const WorkloadKey key = make_workload_key("deepseek-v2-lite", DType::bf16, 4, 60000);
    const PolicyState saved = capture_policy_state(key, live, 0.3, stats);
    const PolicyState loaded = parse_policy_state(format_policy_state(saved));

    PolicyTrackers fresh;
    restore_policy_state(loaded, fresh);
    CHECK(fresh.a().estimate() == live.a().estimate());
    CHECK(fresh.b().estimate() == live.b().estimate());
    CHECK(fresh.delta().estimate() == live.delta().estimate());
    CHECK(fresh.a().relative_deviation() == live.a().relative_deviation());
    CHECK(fresh.a().samples() == live.a().samples());
    CHECK(fresh.cpu_fixed() == live.cpu_fixed());
    CHECK(fresh.costs().a == live.costs().a);
    CHECK(loaded.r_deployed == 0.3);
    CHECK(loaded.step_seconds.count == 50);
}

TEST_CASE("corrupt policy state is rejected naming the line", "[unit][policy][state]") {
    const std::string good = format_policy_state(sample_state());
    const auto expect_error = [](const std::string& text, const std::string& what) {
        INFO(text);
        CHECK_THROWS_WITH(parse_policy_state(text), Contains(what));
    };
    const auto at = [&](const std::string& key) {
        return "policy state line " + std::to_string(line_of(good, key)) + ": ";
    };
    expect_error(with_line(good, "a", "a=abc"), at("a") + "'a=abc': not a number");
    expect_error(with_line(good, "b", "b=1e-8x"), at("b") + "'b=1e-8x': not a number");
    expect_error(with_line(good, "delta", "delta=-1"), at("delta") + "'delta=-1': must be");
    expect_error(with_line(good, "a", "a=inf"), at("a") + "'a=inf': must be a finite");
    expect_error(with_line(good, "r_deployed", "r_deployed=1.5"), at("r_deployed"));
    expect_error(with_line(good, "r_deployed", "r_deployed=1.5"), "must be in [0,1]");
    expect_error(with_line(good, "steps", "steps=-3"),
                 at("steps") + "'steps=-3': not a non-negative");
    expect_error(with_line(good, "batch_bucket", "batch_bucket=12"), at("batch_bucket"));
    expect_error(with_line(good, "context_bucket", "context_bucket=512"), at("context_bucket"));
    expect_error(with_line(good, "kv_dtype", "kv_dtype=int4"), at("kv_dtype") + "'kv_dtype=int4'");
    expect_error(with_line(good, "model", "model="), at("model") + "'model=': empty model name");
    expect_error(with_line(good, "a_samples", "a_samples 12"),
                 at("a_samples") + "'a_samples 12': expected key=value");
    expect_error(with_line(good, "cpu_fixed", "cpu_fixd=1"),
                 at("cpu_fixed") + "'cpu_fixd=1': unknown key");
    expect_error(with_line(good, "b_rel_dev", "a=1e-8"),
                 at("b_rel_dev") + "'a=1e-8': key 'a' already given on line " +
                     std::to_string(line_of(good, "a")));
    expect_error(with_line(good, "step_seconds_min", "step_seconds_min=1"),
                 at("step_seconds_min") + "step_seconds_min exceeds");
    // Version: first, and the one this build reads.
    std::string v2 = good;
    v2.replace(v2.find("version=1"), 9, "version=2");
    expect_error(v2, "policy state line 2: 'version=2': unsupported version");
    expect_error("model=x\nversion=1\n",
                 "policy state line 1: 'model=x': expected 'version=1' first");
    expect_error("", "policy state: empty");
    expect_error("# nothing\n\n", "policy state: empty");
    // Truncated: the missing key is named, with the line where the text ended.
    const std::string cut = good.substr(0, good.find("\nb="));
    expect_error(cut, "end of text: missing key 'b'");
    expect_error(cut, "policy state line " + std::to_string(line_of(good, "b") - 1) + ":");
    // Unwritable states are refused when formatting.
    PolicyState bad = sample_state();
    bad.key.model = "two\nlines";
    CHECK_THROWS_AS(format_policy_state(bad), std::invalid_argument);
    bad = sample_state();
    bad.a.estimate = NAN;
    CHECK_THROWS_WITH(format_policy_state(bad), Contains("a = nan"));
}
