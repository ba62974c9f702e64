// cuda::device_fault, the daemon's check after a failed step (model::SchedulerOptions::
// fault_probe): empty on a healthy device and after an error that is not sticky; the error's
// name once a kernel's illegal address has left the context unusable. Its own binary: the
// fault ends every later CUDA call of the process.
#include <catch2/catch.hpp>

#include <cuda_runtime.h>

#include <cstdio>
#include <string>

#include "fault_kernel.hpp"
#include "writescope/cuda/device.hpp"
#include "writescope/cuda/fault_injection.hpp"

using Catch::Matchers::Contains;
using namespace writescope;

TEST_CASE("device_fault names a sticky error and nothing else", "[gpu]") {
    if (cuda::device_count() == 0) FAIL("no GPU");
    CHECK(cuda::device_fault(0).empty());
    // An error that is not sticky: the launch is refused, the context goes on.
    const cudaError_t refused = launch_bad_config();
    std::printf("[gpu] a launch of 4096 threads per block: %s\n", cudaGetErrorName(refused));
    REQUIRE(refused != cudaSuccess);
    CHECK(cuda::device_fault(0).empty());
    CHECK(cudaGetLastError() == cudaSuccess);  // cleared by the check
    void* p = nullptr;
    REQUIRE(cudaMalloc(&p, 256) == cudaSuccess);
    REQUIRE(cudaFree(p) == cudaSuccess);
    // An illegal address: sticky.
    cuda::inject_illegal_address(0);
    const std::string why = cuda::device_fault(0);
    std::printf("[gpu] device_fault after an illegal address: %s\n", why.c_str());
    CHECK_THAT(why, Contains("cudaErrorIllegalAddress"));
    CHECK(cuda::device_fault(0) == why);  // it stays
    CHECK(cudaMalloc(&p, 256) != cudaSuccess);
}
