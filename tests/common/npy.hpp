// A float32 C-order .npy file (the reference logits transformers wrote, tests/data/models),
// for every test that reads them.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace writescope::test {

// A float32 C-order .npy file.
struct Npy {
    std::vector<std::size_t> shape;
    std::vector<float> data;
    float at(std::size_t r, std::size_t c) const { return data[r * shape[1] + c]; }
};

inline Npy read_npy(const std::filesystem::path& file) {
    std::ifstream in(file, std::ios::binary);
    if (!in) throw std::runtime_error(file.string() + ": cannot be read");
    char magic[8];
    in.read(magic, 8);
    std::uint16_t hlen = 0;
    if (magic[6] == 1) {
        in.read(reinterpret_cast<char*>(&hlen), 2);
    } else {
        std::uint32_t l = 0;
        in.read(reinterpret_cast<char*>(&l), 4);
        hlen = static_cast<std::uint16_t>(l);
    }
    std::string header(hlen, '\0');
    in.read(header.data(), hlen);
    if (header.find("'<f4'") == std::string::npos ||
        header.find("'fortran_order': False") == std::string::npos)
        throw std::runtime_error(file.string() + ": not a C-order float32 array: " + header);
    Npy n;
    const auto open = header.find('(', header.find("'shape'"));
    const auto close = header.find(')', open);
    std::string dims = header.substr(open + 1, close - open - 1);
    std::size_t total = 1;
    for (std::size_t p = 0; p < dims.size();) {
        const auto q = dims.find(',', p);
        const std::string d = dims.substr(p, q == std::string::npos ? std::string::npos : q - p);
        if (d.find_first_not_of(' ') != std::string::npos) {
            n.shape.push_back(std::stoul(d));
            total *= n.shape.back();
        }
        if (q == std::string::npos) break;
        p = q + 1;
    }
    n.data.resize(total);
    in.read(reinterpret_cast<char*>(n.data.data()), static_cast<std::streamsize>(total * 4));
    if (!in) throw std::runtime_error(file.string() + ": truncated");
    return n;
}

}  // namespace writescope::test
