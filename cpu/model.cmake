# writescope_cpu_model: the CPU's model compute operations (CpuModelOps: dense GEMM/GEMV and the
# expert FFNs), on a worker pool of their own. Included from cpu/CMakeLists.txt.
add_library(writescope_cpu_model STATIC
  ${CMAKE_CURRENT_LIST_DIR}/src/model/model_ops.cpp
  ${CMAKE_CURRENT_LIST_DIR}/src/model/elementwise.cpp
  ${CMAKE_CURRENT_LIST_DIR}/src/model/gemm_portable.cpp
  ${CMAKE_CURRENT_LIST_DIR}/src/model/read_ahead.cpp
)
target_link_libraries(writescope_cpu_model PUBLIC writescope_cpu writescope_core_base
                                                  writescope_options)
set_target_properties(writescope_cpu_model PROPERTIES POSITION_INDEPENDENT_CODE ON)

# One translation unit per ISA with its own -m flags (as the attention kernels): the rest of the
# build keeps the baseline, and a kernel is entered only after the cpuid check of select_isa().
if(CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64|amd64")
  target_sources(writescope_cpu_model PRIVATE
    ${CMAKE_CURRENT_LIST_DIR}/src/model/gemm_avx2.cpp
    ${CMAKE_CURRENT_LIST_DIR}/src/model/gemm_avx512.cpp)
  set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/src/model/gemm_avx2.cpp PROPERTIES
    COMPILE_OPTIONS "-mavx2;-mfma;-mf16c")
  set_source_files_properties(${CMAKE_CURRENT_LIST_DIR}/src/model/gemm_avx512.cpp PROPERTIES
    COMPILE_OPTIONS "-mavx512f;-mavx512bw;-mavx512vl;-mavx512bf16;-mavx2;-mfma;-mf16c;-mamx-tile;-mamx-bf16")
  target_compile_definitions(writescope_cpu_model PRIVATE WRITESCOPE_CPU_X86=1)
endif()
