# writescope_text: Hugging Face tokenizers (tokenizer.json) and chat templates (core/src/text).
# Every source in core/src/text belongs to it (a glob, so the tokenizer and the chat-template
# sources are added without editing each other's lists).
# PCRE2 and ICU are required wherever the daemon is built; a build without the daemon (the GPU
# machine's, which lacks them) skips the text layer and its tests with a message.
find_package(PkgConfig REQUIRED)
if(WRITESCOPE_BUILD_DAEMON)
  pkg_check_modules(PCRE2 REQUIRED IMPORTED_TARGET libpcre2-8)
  pkg_check_modules(ICU_UC REQUIRED IMPORTED_TARGET icu-uc)
else()
  pkg_check_modules(PCRE2 IMPORTED_TARGET libpcre2-8)
  pkg_check_modules(ICU_UC IMPORTED_TARGET icu-uc)
  if(NOT PCRE2_FOUND OR NOT ICU_UC_FOUND)
    message(STATUS "writescope_text is not built: PCRE2 (libpcre2-dev) or ICU (libicu-dev) is "
                   "missing; the daemon, which needs it, is off in this build")
    return()
  endif()
endif()
find_package(nlohmann_json 3 REQUIRED)
file(GLOB _ws_text_sources CONFIGURE_DEPENDS ${CMAKE_CURRENT_SOURCE_DIR}/src/text/*.cpp)
add_library(writescope_text STATIC ${_ws_text_sources})
target_include_directories(writescope_text PUBLIC ${CMAKE_CURRENT_SOURCE_DIR}/include
                           PRIVATE ${CMAKE_CURRENT_SOURCE_DIR}/src/text)
target_link_libraries(writescope_text PUBLIC writescope_options nlohmann_json::nlohmann_json
                      PRIVATE PkgConfig::PCRE2 PkgConfig::ICU_UC)
set_target_properties(writescope_text PROPERTIES POSITION_INDEPENDENT_CODE ON)
