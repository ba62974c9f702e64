// One pause in a spin-wait loop: the pause instruction where there is one (it eases the
// sibling hyperthread and the memory order machine while a thread polls), else nothing.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace writescope::cpu {

inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#endif
}

}  // namespace writescope::cpu
