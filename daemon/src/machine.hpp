// What the daemon knows of the machine it runs on, read from /proc (no GPU library needed):
// the facts that key a stored calibration, and the GPUs that "auto" may pick.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace writescope::daemon {

struct GpuInfo {
    std::string bus_id;  // PCI address, "0000:01:00.0"
    std::string model;   // "NVIDIA H200"
    std::string uuid;    // "GPU-…"
};

struct MachineInfo {
    std::string cpu_model;           // /proc/cpuinfo "model name" (or the best the arch offers)
    int online_cores = 0;            // CPUs this process may run on (its affinity mask)
    std::uint64_t memory_bytes = 0;  // physical memory, /proc/meminfo MemTotal
    std::string gpu_driver;          // NVIDIA kernel module version; empty without one
    // /proc/driver/nvidia exists: the NVIDIA kernel module is loaded, so `gpus` is the whole
    // list. Without it nothing is known (no driver, or one /proc does not show, as under WSL).
    bool gpu_driver_loaded = false;
    // NVIDIA GPUs in PCI bus order, which is CUDA's order under CUDA_DEVICE_ORDER=PCI_BUS_ID
    // (the order the daemon documents for hardware.gpu indices).
    std::vector<GpuInfo> gpus;
};

// Reads the machine's facts from proc_root (a fake tree in tests).
MachineInfo probe_machine(const std::filesystem::path& proc_root = "/proc");

// The hardware half of a calibration's key. Memory is rounded to whole GiB because MemTotal moves
// by a few MiB between boots (kernel reservations) and that should not force a recalibration.
struct HardwareFingerprint {
    std::string gpu_model = "none";
    std::string gpu_uuid = "none";
    std::string gpu_driver = "none";
    std::string cpu_model;
    int cores = 0;
    int attention_threads = 0;
    std::uint64_t memory_gib = 0;

    // Canonical one-line text, stable across releases ("gpu=…;uuid=…;driver=…;cpu=…;…").
    std::string text() const;
};

// gpu_index < 0: no GPU. attention_threads as the engine resolved them.
HardwareFingerprint fingerprint_of(const MachineInfo& m, int gpu_index, int attention_threads);

}  // namespace writescope::daemon
