# writescope_kv: the InplaceKVCache bookkeeping (regions, block tables, sealing, the deficit
# router, admission) and its host-memory backing. Included by core/CMakeLists.txt.
add_library(writescope_kv STATIC
  src/kv/block_router.cpp
  src/kv/kv_cache.cpp
  src/kv/host_region_memory.cpp
  src/kv/host_kv_memory.cpp
)
target_include_directories(writescope_kv PUBLIC ${CMAKE_CURRENT_SOURCE_DIR}/include)
target_link_libraries(writescope_kv PUBLIC writescope_core_base)
set_target_properties(writescope_kv PROPERTIES POSITION_INDEPENDENT_CODE ON)
