# writescope-generate: one generation without the daemon (daemon/src/writescope_generate.cpp).
# It builds what the daemon builds from a profile, so it links the daemon's library and the
# runtime layer. Included from the top-level CMakeLists.txt after the daemon.
if(TARGET writescope_daemon AND TARGET writescope_runtime AND TARGET writescope_cpu_model)
  find_package(CLI11 REQUIRED)
  find_package(mimalloc REQUIRED)
  add_executable(writescope-generate ${CMAKE_CURRENT_LIST_DIR}/src/writescope_generate.cpp)
  target_link_libraries(writescope-generate PRIVATE writescope_daemon writescope_runtime
                        writescope_model writescope_cpu_model CLI11::CLI11 mimalloc)
  install(TARGETS writescope-generate RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
endif()
if(TARGET writescope-generate)
  # Beside writescoped and writescopectl.
  set_target_properties(writescope-generate PROPERTIES RUNTIME_OUTPUT_DIRECTORY
                        ${CMAKE_BINARY_DIR}/daemon)
endif()
