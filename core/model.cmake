# writescope_model: the model runtime (docs/design.md section 9): configs, checkpoint files, the
# per-architecture forward pass over ModelOps and the engine, sampling and the scheduler.
find_package(nlohmann_json 3 REQUIRED)
file(GLOB WRITESCOPE_MODEL_SOURCES CONFIGURE_DEPENDS ${CMAKE_CURRENT_LIST_DIR}/src/model/*.cpp)
add_library(writescope_model STATIC ${WRITESCOPE_MODEL_SOURCES})
target_link_libraries(writescope_model PUBLIC writescope_engine writescope_core_base
                                               PRIVATE nlohmann_json::nlohmann_json)
set_target_properties(writescope_model PROPERTIES POSITION_INDEPENDENT_CODE ON)
