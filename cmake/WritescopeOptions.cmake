# Compiler flags shared by every target of the project: warnings, sanitizers.
add_library(writescope_options INTERFACE)
target_compile_options(writescope_options INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wshadow -Wnon-virtual-dtor -Wpedantic>
  $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${WRITESCOPE_WERROR}>>:-Werror>)
if(WRITESCOPE_SANITIZE)
  target_compile_options(writescope_options INTERFACE
    $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=address,undefined -fno-omit-frame-pointer
                             -fno-sanitize-recover=undefined>)
  target_link_options(writescope_options INTERFACE -fsanitize=address,undefined)
endif()

find_package(Threads REQUIRED)
