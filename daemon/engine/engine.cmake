# writescope_runtime: Engine::create, which picks the backends (CPU always, CUDA when built)
# and hands them to the core engine. It sits above core, cpu and cuda, below the daemon.
add_library(writescope_runtime STATIC
  ${CMAKE_CURRENT_LIST_DIR}/engine_factory.cpp
)
target_include_directories(writescope_runtime PUBLIC ${CMAKE_CURRENT_LIST_DIR})
target_link_libraries(writescope_runtime PUBLIC writescope_core writescope_engine writescope_cpu)
if(WRITESCOPE_HAVE_CUDA)
  target_link_libraries(writescope_runtime PUBLIC writescope_cuda)
  target_compile_definitions(writescope_runtime PRIVATE WRITESCOPE_HAVE_CUDA=1)
else()
  target_compile_definitions(writescope_runtime PRIVATE WRITESCOPE_HAVE_CUDA=0)
endif()
set_target_properties(writescope_runtime PROPERTIES POSITION_INDEPENDENT_CODE ON)
