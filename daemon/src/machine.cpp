#include "machine.hpp"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

namespace writescope::daemon {
namespace {

std::string trim(std::string s) {
    const auto b = s.find_first_not_of(" \t\r\n");
    if (b == std::string::npos) return {};
    const auto e = s.find_last_not_of(" \t\r\n");
    return s.substr(b, e - b + 1);
}

// The value of the first "key: value" line whose key is `key` (keys compared after trimming).
std::string field(const std::filesystem::path& file, std::string_view key) {
    std::ifstream in(file);
    std::string line;
    while (std::getline(in, line)) {
        const auto colon = line.find(':');
        if (colon == std::string::npos) continue;
        if (trim(line.substr(0, colon)) == key) return trim(line.substr(colon + 1));
    }
    return {};
}

// "580.159.04": digits in groups separated by single dots, at least two groups.
bool is_version(const std::string& w) {
    if (w.empty() || !std::isdigit(static_cast<unsigned char>(w.front())) ||
        !std::isdigit(static_cast<unsigned char>(w.back())))
        return false;
    bool dot = false;
    for (std::size_t i = 0; i < w.size(); ++i) {
        if (w[i] == '.') {
            if (w[i - 1] == '.') return false;
            dot = true;
        } else if (!std::isdigit(static_cast<unsigned char>(w[i]))) {
            return false;
        }
    }
    return dot;
}

int online_cores() {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
    const long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 ? static_cast<int>(n) : 1;
}

}  // namespace

MachineInfo probe_machine(const std::filesystem::path& proc_root) {
    MachineInfo m;
    const auto cpuinfo = proc_root / "cpuinfo";
    for (const auto* key : {"model name", "Model", "Hardware", "cpu model", "cpu"}) {
        m.cpu_model = field(cpuinfo, key);
        if (!m.cpu_model.empty()) break;
    }
    if (m.cpu_model.empty()) m.cpu_model = "unknown";
    m.online_cores = online_cores();

    const auto mem = field(proc_root / "meminfo", "MemTotal");  // "131072000 kB"
    if (!mem.empty()) m.memory_bytes = std::stoull(mem) * 1024;

    // "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.65.06  Sun Jul 27 …" or, for the open
    // modules, "… NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build …": the
    // version is the first word after "Kernel Module" made of digits and dots.
    {
        std::ifstream in(proc_root / "driver/nvidia/version");
        std::string line;
        if (std::getline(in, line)) {
            const auto at = line.find("Kernel Module");
            if (at != std::string::npos) {
                std::istringstream rest(line.substr(at + 13));
                std::string word;
                while (rest >> word) {
                    if (is_version(word)) {
                        m.gpu_driver = word;
                        break;
                    }
                }
            }
        }
    }
    std::error_code ec;
    m.gpu_driver_loaded = std::filesystem::is_directory(proc_root / "driver/nvidia", ec);
    const auto gpus_dir = proc_root / "driver/nvidia/gpus";
    for (const auto& entry : std::filesystem::directory_iterator(gpus_dir, ec)) {
        const auto info = entry.path() / "information";
        GpuInfo g;
        g.bus_id = entry.path().filename().string();
        g.model = field(info, "Model");
        g.uuid = field(info, "GPU UUID");
        m.gpus.push_back(std::move(g));
    }
    std::sort(m.gpus.begin(), m.gpus.end(),
              [](const GpuInfo& a, const GpuInfo& b) { return a.bus_id < b.bus_id; });
    return m;
}

std::string HardwareFingerprint::text() const {
    return fmt::format("gpu={};uuid={};driver={};cpu={};cores={};threads={};mem_gib={}", gpu_model,
                       gpu_uuid, gpu_driver, cpu_model, cores, attention_threads, memory_gib);
}

HardwareFingerprint fingerprint_of(const MachineInfo& m, int gpu_index, int attention_threads) {
    HardwareFingerprint f;
    if (gpu_index >= 0) {
        f.gpu_driver = m.gpu_driver.empty() ? "unknown" : m.gpu_driver;
        if (static_cast<std::size_t>(gpu_index) < m.gpus.size()) {
            const auto& g = m.gpus[static_cast<std::size_t>(gpu_index)];
            f.gpu_model = g.model.empty() ? "unknown" : g.model;
            f.gpu_uuid = g.uuid.empty() ? "unknown" : g.uuid;
        } else {
            f.gpu_model = f.gpu_uuid = "unknown";
        }
    }
    f.cpu_model = m.cpu_model;
    f.cores = m.online_cores;
    f.attention_threads = attention_threads > 0 ? attention_threads : m.online_cores;
    f.memory_gib = (m.memory_bytes + (1ull << 29)) >> 30;
    return f;
}

}  // namespace writescope::daemon
