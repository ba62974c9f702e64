# writescope-tokenize: a model's tokenizer from the command line, like llama.cpp's llama-tokenize
# (daemon/src/writescope_tokenize.cpp). Included from the top-level CMakeLists.txt.
if(TARGET writescope_text)
  find_package(CLI11 REQUIRED)
  add_executable(writescope-tokenize ${CMAKE_CURRENT_LIST_DIR}/src/writescope_tokenize.cpp)
  target_link_libraries(writescope-tokenize PRIVATE writescope_text CLI11::CLI11)
  # Beside writescoped and writescopectl.
  set_target_properties(writescope-tokenize PROPERTIES RUNTIME_OUTPUT_DIRECTORY
                        ${CMAKE_BINARY_DIR}/daemon)
  install(TARGETS writescope-tokenize RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()
