# Finds CUDA per WRITESCOPE_CUDA (AUTO/ON/OFF) and sets WRITESCOPE_HAVE_CUDA.
# With nvcc present the CUDA code compiles even where no GPU exists (CI); GPU tests run only
# on a machine with one (label "gpu", excluded from the default test preset).
set(WRITESCOPE_HAVE_CUDA OFF)
if(NOT WRITESCOPE_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT CMAKE_CUDA_ARCHITECTURES)
      # Hopper first (the lent H200 and the H100); Ampere for A100/RTX 30 workstations.
      set(CMAKE_CUDA_ARCHITECTURES 90 80)
    endif()
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(CMAKE_CUDA_STANDARD 20)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    set(WRITESCOPE_HAVE_CUDA ON)
  elseif(WRITESCOPE_CUDA STREQUAL "ON")
    message(FATAL_ERROR "WRITESCOPE_CUDA=ON but no CUDA compiler was found (set CUDACXX)")
  endif()
endif()
