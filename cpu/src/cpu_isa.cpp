#include "writescope/cpu/cpu_isa.hpp"

#include <cstdlib>
#include <fstream>
#include <stdexcept>

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace writescope::cpu {

std::string_view isa_name(Isa isa) noexcept {
    switch (isa) {
        case Isa::portable:
            return "portable";
        case Isa::avx2:
            return "avx2";
        case Isa::avx512:
            return "avx512";
    }
    return "?";
}

std::optional<Isa> parse_isa(std::string_view s) noexcept {
    if (s == "portable") return Isa::portable;
    if (s == "avx2") return Isa::avx2;
    if (s == "avx512") return Isa::avx512;
    return std::nullopt;
}

Isa detected_isa() noexcept {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                      __builtin_cpu_supports("f16c");
    // GCC 12 knows "avx512bf16" as a __builtin_cpu_supports feature name.
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                        __builtin_cpu_supports("avx512bf16");
    if (avx512) return Isa::avx512;
    if (avx2) return Isa::avx2;
#endif
    return Isa::portable;
}

std::vector<Isa> supported_isas() {
    std::vector<Isa> out;
    const Isa best = detected_isa();
    for (Isa i : {Isa::portable, Isa::avx2, Isa::avx512})
        if (static_cast<int>(i) <= static_cast<int>(best)) out.push_back(i);
    return out;
}

Isa select_isa(std::optional<Isa> forced) {
    const Isa best = detected_isa();
    Isa want = best;
    if (forced) {
        want = *forced;
    } else if (const char* env = std::getenv("WRITESCOPE_CPU_ISA"); env && *env) {
        const auto parsed = parse_isa(env);
        if (!parsed)
            throw std::runtime_error(std::string("WRITESCOPE_CPU_ISA=") + env +
                                     ": expected portable, avx2 or avx512");
        want = *parsed;
    }
    if (static_cast<int>(want) > static_cast<int>(best))
        throw std::runtime_error("CPU kernel level " + std::string(isa_name(want)) +
                                 " requested, but this CPU runs at most " +
                                 std::string(isa_name(best)));
    return want;
}

bool amx_bf16_available() noexcept {
    static const bool ok = [] {
#if defined(__x86_64__) && defined(__linux__)
        unsigned a = 0, b = 0, c = 0, d = 0;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
        const bool amx_bf16 = d & (1u << 22), amx_tile = d & (1u << 24);  // CPUID.(7,0):EDX
        if (!amx_bf16 || !amx_tile || detected_isa() != Isa::avx512) return false;
        constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // asm/prctl.h
        return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
        return false;
#endif
    }();
    return ok;
}

std::string cpu_model_name() {
    std::ifstream in("/proc/cpuinfo");
    std::string line;
    while (std::getline(in, line)) {
        if (line.rfind("model name", 0) == 0) {
            const auto colon = line.find(':');
            if (colon != std::string::npos) {
                auto start = line.find_first_not_of(" \t", colon + 1);
                return start == std::string::npos ? "unknown" : line.substr(start);
            }
        }
    }
    return "unknown";
}

}  // namespace writescope::cpu
