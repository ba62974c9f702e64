# writescope_engine: the step executor and the engine, written against the backend interfaces
# (step_backends.hpp); the backends themselves live in cpu/ and cuda/.
add_library(writescope_engine STATIC
  ${CMAKE_CURRENT_LIST_DIR}/src/engine/step_executor.cpp
  ${CMAKE_CURRENT_LIST_DIR}/src/engine/engine_impl.cpp
  ${CMAKE_CURRENT_LIST_DIR}/src/engine/host_seal_mover.cpp
)
target_link_libraries(writescope_engine PUBLIC writescope_kv writescope_policy writescope_core_base)
set_target_properties(writescope_engine PROPERTIES POSITION_INDEPENDENT_CODE ON)
