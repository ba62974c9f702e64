// writescope-generate, the real program: the reference greedy ids and a .npy of every
// position's logits equal to transformers'.
#include <catch2/catch.hpp>

#include <array>
#include <cstdio>
#include <string>

#include "reference_model.hpp"

using namespace writescope::test;

namespace {

std::string run_command(const std::string& cmd, int& status) {
    std::string out;
    FILE* p = popen(cmd.c_str(), "r");
    REQUIRE(p);
    std::array<char, 4096> buf{};
    std::size_t n;
    while ((n = fread(buf.data(), 1, buf.size(), p)) > 0)
        out.append(buf.data(), n);
    status = pclose(p);
    return out;
}

std::string join(const std::vector<std::int32_t>& ids) {
    std::string s;
    for (std::size_t i = 0; i < ids.size(); ++i) {
        if (i) s += ',';
        s += std::to_string(ids[i]);
    }
    return s;
}

}  // namespace

TEST_CASE("writescope-generate prints transformers' greedy ids and writes its logits",
          "[model][integration]") {
    for (const std::string name : {"deepseek-v2-tiny-yarn", "qwen3-moe-tiny"}) {
        const auto dir = models_dir() / name;
        const Reference ref = read_reference(dir);
        const ReferencePrompt& p = ref.prompts[0];
        std::string npy = "/tmp/writescope-generate-test-";
        npy += name;
        npy += ".npy";
        int status = 0;
        const std::string out = run_command(
            std::string(WRITESCOPE_GENERATE) + " --model " + dir.string() + " --prompt-ids " +
                join(p.ids) + " --max-tokens " + std::to_string(p.greedy.size()) +
                " --ignore-eos --json --logits " + npy + " 2>/dev/null",
            status);
        INFO(name << ": " << out);
        REQUIRE(status == 0);
        const auto j = nlohmann::json::parse(out);
        CHECK(j.at("token_ids").get<std::vector<std::int32_t>>() == p.greedy);
        CHECK(j.at("finish_reason") == "length");
        const Npy ours = read_npy(npy);
        REQUIRE(ours.shape == p.logits.shape);
        double err = 0, scale = 0;
        for (std::size_t i = 0; i < ours.data.size(); ++i) {
            err = std::max(err, static_cast<double>(std::abs(ours.data[i] - p.logits.data[i])));
            scale = std::max(scale, static_cast<double>(std::abs(p.logits.data[i])));
        }
        CHECK(err / scale <= 1e-4);
        std::remove(npy.c_str());
    }
    int status = 0;
    run_command(std::string(WRITESCOPE_GENERATE) + " --model " +
                    (models_dir() / "mixtral-tiny").string() + " --prompt-ids 1,x,3 2>&1",
                status);
    CHECK(status != 0);
}
