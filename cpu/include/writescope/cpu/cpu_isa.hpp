// Instruction-set levels of the CPU kernels, their detection and the forcing of a lower one.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace writescope::cpu {

// What a kernel uses. avx512: AVX-512 F/BW/VL with AVX512_BF16 (vdpbf16ps) and FMA/F16C;
// avx2: AVX2 + FMA + F16C; portable: plain C++ at the build's baseline.
enum class Isa { portable = 0, avx2 = 1, avx512 = 2 };

std::string_view isa_name(Isa isa) noexcept;
std::optional<Isa> parse_isa(std::string_view s) noexcept;  // "portable" | "avx2" | "avx512"

// The best level this CPU runs (cpuid through __builtin_cpu_supports).
Isa detected_isa() noexcept;
// Every level this CPU runs, lowest first (portable is always there).
std::vector<Isa> supported_isas();
// The level a kernel should use: `forced` when given, else WRITESCOPE_CPU_ISA from the
// environment when set, else detected_isa(). Throws std::runtime_error when the requested level
// is above what the CPU runs, or when the environment variable is not a level's name.
Isa select_isa(std::optional<Isa> forced = std::nullopt);

// Whether AMX-BF16 tiles can be used: the CPU has AMX-TILE and AMX-BF16 and the kernel granted
// this process the tile data state (Linux >= 5.16: arch_prctl(ARCH_REQ_XCOMP_PERM), asked once,
// on the first call).
bool amx_bf16_available() noexcept;

// The CPU's model name (from /proc/cpuinfo; "unknown" when unreadable), for reports.
std::string cpu_model_name();

}  // namespace writescope::cpu
