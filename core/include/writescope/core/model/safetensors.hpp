// Hugging Face safetensors checkpoints: reading (validated headers, memory-mapped data) and
// writing.
//
// A file is: an 8-byte little-endian header length N, N bytes of JSON
//   {"__metadata__": {string: string}, "<tensor name>": {"dtype": "BF16", "shape": [..],
//    "data_offsets": [begin, end]}, ...}
// then the data section; offsets are relative to the data section's start.
//
// A model directory holds model.safetensors, or shards listed in model.safetensors.index.json
// ({"metadata": {...}, "weight_map": {"<tensor name>": "<shard file>"}}).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "writescope/core/dtype.hpp"

namespace writescope::model {

// Anything wrong with a model directory or its files. The message names the file, the tensor
// (where there is one) and what is wrong.
class ModelFileError : public std::runtime_error {
  public:
    using std::runtime_error::runtime_error;
};

// One tensor of a checkpoint.
struct TensorEntry {
    std::string name;
    DType dtype = DType::f32;
    std::vector<std::int64_t> shape;  // empty: a scalar
    std::uint64_t offset = 0;         // byte offset in the file (header included)
    std::uint64_t bytes = 0;
    std::size_t file = 0;  // index into WeightFiles::files()
    // The mapped bytes (little-endian elements, row-major); null when opened without data. Not
    // necessarily aligned to the element size (a file may place a tensor at any offset): read
    // through memcpy, not by casting to uint16_t* / float*.
    const void* data = nullptr;
    std::uint64_t elements() const noexcept;
};

struct WeightFilesOptions {
    // Map the files' data (false: read and validate the headers only, as --check-config does).
    bool map_data = true;
    // Largest header accepted (a safetensors header is JSON; real ones are a few MiB).
    std::uint64_t max_header_bytes = std::uint64_t{100} << 20;
};

// The tensors of a model directory, validated: every header well-formed JSON; every dtype BF16,
// F16 or F32 (others are refused, naming the tensor and its dtype); shape × dtype size equal to
// the offsets' span; offsets inside the file and no two tensors overlapping; a tensor name in at
// most one file; with an index, every tensor it lists found in the shard it names, and every
// shard's tensors listed. Shape checks against a model's config are the model's (model_spec).
class WeightFiles {
  public:
    // Reads <dir>/model.safetensors.index.json when it exists, else <dir>/model.safetensors.
    // Throws ModelFileError.
    static WeightFiles open_dir(const std::filesystem::path& dir,
                                const WeightFilesOptions& opts = {});
    // One file.
    static WeightFiles open_file(const std::filesystem::path& file,
                                 const WeightFilesOptions& opts = {});

    WeightFiles(WeightFiles&&) noexcept;
    WeightFiles& operator=(WeightFiles&&) noexcept;
    ~WeightFiles();

    // Null when there is no such tensor.
    const TensorEntry* find(std::string_view name) const noexcept;
    const std::vector<TensorEntry>& tensors() const noexcept { return tensors_; }
    const std::vector<std::filesystem::path>& files() const noexcept { return files_; }
    const std::filesystem::path& file_of(const TensorEntry& t) const { return files_.at(t.file); }
    // The first file's __metadata__ (string values).
    const std::map<std::string, std::string>& metadata() const noexcept { return metadata_; }
    bool data_mapped() const noexcept { return mapped_; }
    std::uint64_t total_bytes() const noexcept;  // of all tensors' data

  private:
    WeightFiles();
    struct Mapping;
    // Reads and validates one file's header, maps it (opts.map_data) and appends its tensors.
    void add_file(const std::filesystem::path& file, const WeightFilesOptions& opts);
    std::vector<std::filesystem::path> files_;
    std::vector<std::unique_ptr<Mapping>> maps_;
    std::vector<TensorEntry> tensors_;  // in file order, then offset order
    std::map<std::string, std::size_t, std::less<>> by_name_;
    std::map<std::string, std::string> metadata_;
    bool mapped_ = false;
};

// The safetensors dtype name ("BF16", "F16", "F32") of a dtype, and back (nullopt otherwise).
std::string_view safetensors_dtype_name(DType t) noexcept;
std::optional<DType> safetensors_dtype_from_name(std::string_view name) noexcept;

// A tensor to write: data is shape's product × dtype size bytes, dense, row-major.
struct TensorToWrite {
    std::string name;
    DType dtype = DType::f32;
    std::vector<std::int64_t> shape;
    const void* data = nullptr;
};

// Writes one safetensors file (tensors in the given order, data 8-byte aligned as the reference
// writer pads its header). Throws ModelFileError naming the file on an I/O error or a bad entry.
void write_safetensors(const std::filesystem::path& file, std::span<const TensorToWrite> tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace writescope::model
