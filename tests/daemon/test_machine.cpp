#include <catch2/catch.hpp>

#include "daemon_files.hpp"
#include "machine.hpp"
#include "temp_dir.hpp"

using namespace writescope::daemon;
using writescope::test::TempDir;

namespace {

// A fake /proc with the files probe_machine reads.
void fake_proc(const TempDir& dir, const std::string& version_line) {
    namespace fs = std::filesystem;
    writescope::test::put_file(dir / "cpuinfo",
                               "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) "
                               "Xeon(R) Platinum 8480+\nflags\t\t: fpu avx512f\n\nprocessor\t: 1\n"
                               "model name\t: Intel(R) Xeon(R) Platinum 8480+\n");
    writescope::test::put_file(dir / "meminfo",
                               "MemTotal:       131522700 kB\nMemFree:        1000 kB\n");
    fs::create_directories(dir / "driver/nvidia/gpus/0000:41:00.0");
    fs::create_directories(dir / "driver/nvidia/gpus/0000:01:00.0");
    writescope::test::put_file(dir / "driver/nvidia/version", version_line);
    writescope::test::put_file(dir / "driver/nvidia/gpus/0000:41:00.0/information",
                               "Model: \t\t NVIDIA H100\nIRQ:   \t\t 41\nGPU UUID: \t "
                               "GPU-bbbb\nBus Location: \t 0000:41:00.0\n");
    writescope::test::put_file(dir / "driver/nvidia/gpus/0000:01:00.0/information",
                               "Model: \t\t NVIDIA H200\nGPU UUID: \t GPU-aaaa\n");
}

}  // namespace

TEST_CASE("machine facts are read from /proc", "[unit][daemon][machine]") {
    SECTION("the proprietary module's version line") {
        TempDir dir;
        fake_proc(dir,
                  "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Sun Jul 27 "
                  "06:54:38 UTC 2025\nGCC version:  gcc version 12.2.0\n");
        const auto m = probe_machine(dir.path());
        CHECK(m.gpu_driver == "580.65.06");
        CHECK(m.gpu_driver_loaded);
        CHECK(m.cpu_model == "Intel(R) Xeon(R) Platinum 8480+");
        CHECK(m.memory_bytes == 131522700ull * 1024);
        REQUIRE(m.gpus.size() == 2);
        CHECK(m.gpus[0].bus_id == "0000:01:00.0");  // PCI bus order
        CHECK(m.gpus[0].model == "NVIDIA H200");
        CHECK(m.gpus[0].uuid == "GPU-aaaa");
        CHECK(m.gpus[1].model == "NVIDIA H100");
        CHECK(m.online_cores >= 1);
        const auto f = fingerprint_of(m, 1, 0);
        CHECK(f.text() ==
              "gpu=NVIDIA H100;uuid=GPU-bbbb;driver=580.65.06;cpu=Intel(R) Xeon(R) "
              "Platinum 8480+;cores=" +
                  std::to_string(m.online_cores) + ";threads=" + std::to_string(m.online_cores) +
                  ";mem_gib=125");
        CHECK(fingerprint_of(m, -1, 8).text().starts_with("gpu=none;uuid=none;driver=none;"));
    }
    SECTION("the open module's version line (seen on the lent H200)") {
        TempDir dir;
        fake_proc(dir,
                  "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  "
                  "Release Build  (nixbld@)  \n");
        CHECK(probe_machine(dir.path()).gpu_driver == "580.159.04");
    }
    SECTION("a driver that lists no GPU") {
        TempDir dir;
        writescope::test::put_file(dir / "driver/nvidia/version", "NVRM version: garbled\n");
        const auto m = probe_machine(dir.path());
        CHECK(m.gpu_driver_loaded);
        CHECK(m.gpus.empty());
        CHECK(m.gpu_driver.empty());
    }
    SECTION("no NVIDIA driver") {
        TempDir dir;
        writescope::test::put_file(dir / "cpuinfo", "model name\t: Some CPU\n");
        const auto m = probe_machine(dir.path());
        CHECK(m.gpus.empty());
        CHECK(m.gpu_driver.empty());
        CHECK_FALSE(m.gpu_driver_loaded);  // the GPUs cannot be counted
        CHECK(m.memory_bytes == 0);
    }
}
