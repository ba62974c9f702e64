// config.json: parse_model_config on arbitrary text. ModelConfigError is the expected refusal.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "writescope/core/model/model_config.hpp"

using namespace writescope::model;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
    const std::string_view text(reinterpret_cast<const char*>(data), size);
    try {
        const ModelConfig c = parse_model_config(text, "config.json", "fuzz");
        (void)c.validate();
        (void)model_config_json(c);
    } catch (const ModelConfigError&) {
    }
    return 0;
}
