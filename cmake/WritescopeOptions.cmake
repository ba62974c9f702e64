# Compiler flags shared by every target of the project: warnings, sanitizers.
add_library(writescope_options INTERFACE)
target_compile_options(writescope_options INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wshadow -Wnon-virtual-dtor -Wpedantic>
  $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${WRITESCOPE_WERROR}>>:-Werror>)
# Debian's hardening for what we ship: fortified libc calls (they need optimisation, so not in
# Debug), a stack protector, and full RELRO with immediate binding.
if(NOT WRITESCOPE_SANITIZE)
  target_compile_options(writescope_options INTERFACE
    "$<$<AND:$<COMPILE_LANGUAGE:CXX>,$<NOT:$<CONFIG:Debug>>>:-U_FORTIFY_SOURCE;-D_FORTIFY_SOURCE=2>"
    $<$<COMPILE_LANGUAGE:CXX>:-fstack-protector-strong>)
  target_link_options(writescope_options INTERFACE -Wl,-z,relro -Wl,-z,now)
endif()
if(WRITESCOPE_SANITIZE)
  target_compile_options(writescope_options INTERFACE
    $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=address,undefined -fno-omit-frame-pointer
                             -fno-sanitize-recover=undefined>
    # g++ 12 reports std::function inside <regex> (Catch2's matchers) as maybe-uninitialized
    # only when instrumented: a known false positive of the sanitizer builds.
    $<$<COMPILE_LANGUAGE:CXX>:-Wno-maybe-uninitialized>)
  target_link_options(writescope_options INTERFACE -fsanitize=address,undefined)
endif()

find_package(Threads REQUIRED)
