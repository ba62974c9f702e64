// Reading safetensors checkpoints: every header validated, the data mapped read-only.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <system_error>
#include <utility>

#include <nlohmann/json.hpp>

#include "writescope/core/model/safetensors.hpp"

namespace writescope::model {

// Tensor data is handed out as the file's bytes, and safetensors is little-endian.
static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr std::string_view kSingleFile = "model.safetensors";
constexpr std::string_view kIndexFile = "model.safetensors.index.json";

// The message is "<file>: <parts...>"; parts are anything a std::string_view takes.
template <class... Parts>
[[noreturn]] void fail(const fs::path& file, const Parts&... parts) {
    std::string message = file.string();
    message += ": ";
    (message.append(std::string_view(parts)), ...);
    throw ModelFileError(message);
}
template <class... Parts>
[[noreturn]] void fail_tensor(const fs::path& file, std::string_view tensor,
                              const Parts&... parts) {
    fail(file, "tensor ", tensor, ": ", parts...);
}

std::string errno_text(int e) {
    return std::system_category().message(e);
}

// "[a, b]" and "[d0, d1, ...]" as the messages print offsets and shapes.
std::string bracketed(std::uint64_t a, std::uint64_t b) {
    std::string s = "[";
    s += std::to_string(a);
    s += ", ";
    s += std::to_string(b);
    s += ']';
    return s;
}
std::string bracketed(const std::vector<std::int64_t>& v) {
    std::string s = "[";
    for (std::size_t i = 0; i < v.size(); ++i) {
        if (i) s += ", ";
        s += std::to_string(v[i]);
    }
    s += ']';
    return s;
}

class FileDescriptor {
  public:
    explicit FileDescriptor(int fd) noexcept : fd_(fd) {}
    ~FileDescriptor() {
        if (fd_ >= 0) ::close(fd_);
    }
    FileDescriptor(FileDescriptor&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
    FileDescriptor& operator=(FileDescriptor&&) = delete;
    int get() const noexcept { return fd_; }

  private:
    int fd_;
};

// An open regular file and its size.
struct OpenedFile {
    FileDescriptor fd;
    std::uint64_t size;
};

OpenedFile open_regular(const fs::path& path) {
    FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (fd.get() < 0) fail(path, "cannot open: ", errno_text(errno));
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) fail(path, "cannot stat: ", errno_text(errno));
    if (!S_ISREG(st.st_mode)) fail(path, "is not a regular file");
    return {std::move(fd), static_cast<std::uint64_t>(st.st_size)};
}

void read_exact(const fs::path& path, int fd, void* out, std::size_t n, std::uint64_t at,
                std::string_view what) {
    auto* p = static_cast<char*>(out);
    while (n > 0) {
        const ssize_t got = ::pread(fd, p, n, static_cast<off_t>(at));
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) fail(path, "cannot read the ", what, ": ", errno_text(errno));
        if (got == 0) fail(path, "the file ended while reading the ", what);
        p += got;
        n -= static_cast<std::size_t>(got);
        at += static_cast<std::uint64_t>(got);
    }
}

// A read-only private mapping of a whole file, unmapped on destruction. A checkpoint must not be
// truncated while it is open: reading a page past the new end raises SIGBUS (the sizes were
// validated against the file as it was when opened).
class MappedRegion {
  public:
    MappedRegion() = default;
    MappedRegion(const fs::path& path, int fd, std::uint64_t size) {
        if (size > std::numeric_limits<std::size_t>::max()) fail(path, "is too large to map");
        void* p = ::mmap(nullptr, static_cast<std::size_t>(size), PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED)
            fail(path, "cannot map ", std::to_string(size), " bytes: ", errno_text(errno));
        addr_ = p;
        len_ = static_cast<std::size_t>(size);
        // No madvise on the data: its reader knows its access pattern (a loader copying the
        // tensors in order gets the kernel's readahead anyway), and WILLNEED on a checkpoint
        // larger than memory would only evict what is already there.
    }
    MappedRegion(MappedRegion&& o) noexcept
        : addr_(std::exchange(o.addr_, nullptr)), len_(std::exchange(o.len_, 0)) {}
    MappedRegion& operator=(MappedRegion&& o) noexcept {
        if (this != &o) {
            release();
            addr_ = std::exchange(o.addr_, nullptr);
            len_ = std::exchange(o.len_, 0);
        }
        return *this;
    }
    ~MappedRegion() { release(); }
    const unsigned char* bytes() const noexcept { return static_cast<const unsigned char*>(addr_); }
    bool mapped() const noexcept { return addr_ != nullptr; }

  private:
    void release() noexcept {
        if (addr_) ::munmap(addr_, len_);
        addr_ = nullptr;
        len_ = 0;
    }
    void* addr_ = nullptr;
    std::size_t len_ = 0;
};

// JSON text parsed into an object, each top-level key at most once (nlohmann keeps the last of
// a repeated key, which would silently drop a tensor).
json parse_json_object(const fs::path& path, const char* text, std::size_t n,
                       std::string_view what) {
    std::set<std::string, std::less<>> keys;
    std::string repeated;
    const auto note_key = [&](int depth, json::parse_event_t event, json& parsed) {
        if (event == json::parse_event_t::key && depth == 1 && repeated.empty()) {
            const auto& k = parsed.get_ref<const std::string&>();
            if (!keys.insert(k).second) repeated = k;
        }
        return true;
    };
    json doc;
    try {
        doc = json::parse(text, text + n, note_key);
    } catch (const json::exception& e) {
        fail(path, what, " is not valid JSON: ", e.what());
    }
    if (!doc.is_object()) fail(path, what, " is not a JSON object (it is ", doc.type_name(), ")");
    if (!repeated.empty()) fail(path, what, " has the key ", repeated, " twice");
    return doc;
}

bool is_index(const json& v) noexcept {
    return v.is_number_unsigned();
}

// The header of one file, validated against the file's size.
struct ParsedFile {
    std::vector<TensorEntry> tensors;  // sorted by offset
    std::map<std::string, std::string> metadata;
    MappedRegion region;  // unmapped when the data is not mapped
};

std::map<std::string, std::string> read_metadata(const fs::path& path, const json& m) {
    if (!m.is_object()) fail(path, "__metadata__ is not an object (it is ", m.type_name(), ")");
    std::map<std::string, std::string> out;
    for (const auto& [k, v] : m.items()) {
        if (!v.is_string())
            fail(path, "__metadata__ value of ", k, " is not a string (it is ", v.type_name(), ")");
        out.emplace(k, v.get<std::string>());
    }
    return out;
}

TensorEntry read_entry(const fs::path& path, const std::string& name, const json& e,
                       std::uint64_t data_start, std::uint64_t data_bytes) {
    if (!e.is_object())
        fail_tensor(path, name, "entry is not an object (it is ", e.type_name(), ")");
    TensorEntry t;
    t.name = name;

    const auto dtype = e.find("dtype");
    if (dtype == e.end()) fail_tensor(path, name, "dtype is missing");
    if (!dtype->is_string()) fail_tensor(path, name, "dtype ", dtype->dump(), " is not a string");
    const auto& dtype_text = dtype->get_ref<const std::string&>();
    const auto dt = safetensors_dtype_from_name(dtype_text);
    if (!dt) fail_tensor(path, name, "dtype ", dtype_text, " is not supported (BF16, F16, F32)");
    t.dtype = *dt;

    const auto shape = e.find("shape");
    if (shape == e.end()) fail_tensor(path, name, "shape is missing");
    const auto bad_shape = [&] {
        fail_tensor(path, name, "shape ", shape->dump(), " is not a list of non-negative integers");
    };
    if (!shape->is_array()) bad_shape();
    for (const auto& d : *shape) {
        if (!is_index(d) ||
            d.get<std::uint64_t>() > std::uint64_t{std::numeric_limits<std::int64_t>::max()})
            bad_shape();
        t.shape.push_back(static_cast<std::int64_t>(d.get<std::uint64_t>()));
    }

    const auto offsets = e.find("data_offsets");
    if (offsets == e.end()) fail_tensor(path, name, "data_offsets is missing");
    if (!offsets->is_array() || offsets->size() != 2 || !is_index((*offsets)[0]) ||
        !is_index((*offsets)[1]))
        fail_tensor(path, name, "data_offsets ", offsets->dump(),
                    " is not two non-negative integers");
    const auto begin = (*offsets)[0].get<std::uint64_t>();
    const auto end = (*offsets)[1].get<std::uint64_t>();
    const std::string span = std::string("data_offsets ").append(bracketed(begin, end));
    if (begin > end) fail_tensor(path, name, span, ": begin is after end");

    const std::string type_shape =
        std::string("dtype ").append(dtype_text).append(" × shape ").append(bracketed(t.shape));
    std::uint64_t bytes = dtype_bytes(t.dtype);
    for (const auto d : t.shape)
        if (__builtin_mul_overflow(bytes, static_cast<std::uint64_t>(d), &bytes))
            fail_tensor(path, name, type_shape, " overflows 64 bits");
    if (bytes != end - begin)
        fail_tensor(path, name, span, " span ", std::to_string(end - begin), " bytes but ",
                    type_shape, " is ", std::to_string(bytes), " bytes");
    if (end > data_bytes)
        fail_tensor(path, name, span, " end beyond the data section (", std::to_string(data_bytes),
                    " bytes after the ", std::to_string(data_start), "-byte header)");
    t.offset = data_start + begin;
    t.bytes = bytes;
    return t;
}

ParsedFile read_file(const fs::path& path, std::size_t file_index, const WeightFilesOptions& opts) {
    OpenedFile f = open_regular(path);
    if (f.size < 8)
        fail(path, "the file is ", std::to_string(f.size),
             " bytes, shorter than the 8-byte header length");
    ParsedFile out;
    unsigned char length_bytes[8];
    if (opts.map_data) {
        out.region = MappedRegion(path, f.fd.get(), f.size);
        std::memcpy(length_bytes, out.region.bytes(), 8);
    } else {
        read_exact(path, f.fd.get(), length_bytes, 8, 0, "header length");
    }
    std::uint64_t header_bytes = 0;
    for (int i = 7; i >= 0; --i)
        header_bytes = (header_bytes << 8) | length_bytes[i];
    if (header_bytes == 0) fail(path, "header length is 0");
    if (header_bytes > f.size - 8)
        fail(path, "header length ", std::to_string(header_bytes),
             " goes beyond the end of the file (", std::to_string(f.size), " bytes)");
    if (header_bytes > opts.max_header_bytes)
        fail(path, "header length ", std::to_string(header_bytes), " is above the limit of ",
             std::to_string(opts.max_header_bytes), " bytes");

    // Parsed in place from the mapping; only the header-only path copies the header.
    std::string header_copy;
    const char* header_text = nullptr;
    if (opts.map_data) {
        header_text = reinterpret_cast<const char*>(out.region.bytes()) + 8;
    } else {
        header_copy.resize(static_cast<std::size_t>(header_bytes));
        read_exact(path, f.fd.get(), header_copy.data(), header_copy.size(), 8, "header");
        header_text = header_copy.data();
    }
    const json header =
        parse_json_object(path, header_text, static_cast<std::size_t>(header_bytes), "header");

    const std::uint64_t data_start = 8 + header_bytes;
    const std::uint64_t data_bytes = f.size - data_start;
    out.tensors.reserve(header.size());
    for (const auto& [key, value] : header.items()) {
        if (key == "__metadata__") {
            out.metadata = read_metadata(path, value);
            continue;
        }
        out.tensors.push_back(read_entry(path, key, value, data_start, data_bytes));
    }

    std::sort(out.tensors.begin(), out.tensors.end(),
              [](const TensorEntry& a, const TensorEntry& b) {
                  return std::tie(a.offset, a.bytes, a.name) < std::tie(b.offset, b.bytes, b.name);
              });
    // Sorted by start, a tensor overlaps an earlier one iff it starts before the furthest end
    // so far. Zero-size tensors occupy nothing and may sit anywhere.
    const TensorEntry* furthest = nullptr;
    for (const auto& t : out.tensors) {
        if (t.bytes == 0) continue;
        if (furthest && t.offset < furthest->offset + furthest->bytes) {
            const auto b = t.offset - data_start, fb = furthest->offset - data_start;
            fail_tensor(path, t.name, "data_offsets ", bracketed(b, b + t.bytes),
                        " overlap tensor ", furthest->name, " at ",
                        bracketed(fb, fb + furthest->bytes));
        }
        if (!furthest || t.offset + t.bytes > furthest->offset + furthest->bytes) furthest = &t;
    }
    for (auto& t : out.tensors) {
        t.file = file_index;
        if (out.region.mapped()) t.data = out.region.bytes() + t.offset;
    }
    return out;
}

std::string read_small_file(const fs::path& path, std::uint64_t limit) {
    OpenedFile f = open_regular(path);
    if (f.size > limit)
        fail(path, "the file is ", std::to_string(f.size), " bytes, above the limit of ",
             std::to_string(limit), " bytes");
    std::string text(static_cast<std::size_t>(f.size), '\0');
    read_exact(path, f.fd.get(), text.data(), text.size(), 0, "file");
    return text;
}

// A shard named by the index must be a file of the index's own directory.
bool plain_file_name(const std::string& s) noexcept {
    return !s.empty() && s.find('/') == std::string::npos && s.find('\0') == std::string::npos &&
           s.find("..") == std::string::npos && s != ".";
}

}  // namespace

struct WeightFiles::Mapping {
    MappedRegion region;
};

std::uint64_t TensorEntry::elements() const noexcept {
    std::uint64_t n = 1;
    for (const auto d : shape)
        n *= static_cast<std::uint64_t>(d);
    return n;
}

std::string_view safetensors_dtype_name(DType t) noexcept {
    switch (t) {
        case DType::bf16:
            return "BF16";
        case DType::f16:
            return "F16";
        case DType::f32:
            return "F32";
    }
    return "?";
}

std::optional<DType> safetensors_dtype_from_name(std::string_view name) noexcept {
    for (const DType t : {DType::bf16, DType::f16, DType::f32})
        if (name == safetensors_dtype_name(t)) return t;
    return std::nullopt;
}

WeightFiles::WeightFiles() = default;
WeightFiles::WeightFiles(WeightFiles&&) noexcept = default;
WeightFiles& WeightFiles::operator=(WeightFiles&&) noexcept = default;
WeightFiles::~WeightFiles() = default;

void WeightFiles::add_file(const fs::path& file, const WeightFilesOptions& opts) {
    ParsedFile parsed = read_file(file, files_.size(), opts);
    for (const auto& t : parsed.tensors) {
        const auto seen = by_name_.find(t.name);
        if (seen != by_name_.end())
            fail_tensor(file, t.name, "is defined in both ",
                        files_[tensors_[seen->second].file].string(), " and ", file.string());
    }
    if (files_.empty()) metadata_ = std::move(parsed.metadata);
    files_.push_back(file);
    if (parsed.region.mapped())
        maps_.push_back(std::make_unique<Mapping>(Mapping{std::move(parsed.region)}));
    for (auto& t : parsed.tensors) {
        by_name_.emplace(t.name, tensors_.size());
        tensors_.push_back(std::move(t));
    }
}

WeightFiles WeightFiles::open_file(const fs::path& file, const WeightFilesOptions& opts) {
    WeightFiles w;
    w.mapped_ = opts.map_data;
    w.add_file(file, opts);
    return w;
}

WeightFiles WeightFiles::open_dir(const fs::path& dir, const WeightFilesOptions& opts) {
    const fs::path index_path = dir / kIndexFile;
    std::error_code ec;
    if (!fs::exists(index_path, ec)) {
        const fs::path single = dir / kSingleFile;
        if (fs::exists(single, ec)) return open_file(single, opts);
        fail(dir, "neither ", std::string(kSingleFile), " nor ", std::string(kIndexFile),
             " exists");
    }

    // An index is JSON of about a header's size, so the header limit bounds it too.
    const std::string text = read_small_file(index_path, opts.max_header_bytes);
    const json index = parse_json_object(index_path, text.data(), text.size(), "the index");
    const auto weight_map = index.find("weight_map");
    if (weight_map == index.end()) fail(index_path, "weight_map is missing");
    if (!weight_map->is_object())
        fail(index_path, "weight_map is not an object (it is ", weight_map->type_name(), ")");
    // tensor → shard, and shard → the first tensor listed in it (to name in an error).
    std::map<std::string, std::string, std::less<>> listed;
    std::map<std::string, std::string> shards;
    for (const auto& [name, shard] : weight_map->items()) {
        if (!shard.is_string())
            fail_tensor(index_path, name, "weight_map value ", shard.dump(),
                        " is not a shard file name");
        const auto& shard_name = shard.get_ref<const std::string&>();
        if (!plain_file_name(shard_name))
            fail_tensor(index_path, name, "shard ", shard.dump(),
                        " is not a plain file name inside the directory");
        listed.emplace(name, shard_name);
        shards.emplace(shard_name, name);
    }
    if (shards.empty()) fail(index_path, "weight_map lists no tensors");

    WeightFiles w;
    w.mapped_ = opts.map_data;
    for (const auto& [shard_name, first_tensor] : shards) {
        const fs::path shard = dir / shard_name;
        if (!fs::exists(shard, ec))
            fail_tensor(index_path, first_tensor, "shard ", shard_name, " does not exist (",
                        shard.string(), ")");
        w.add_file(shard, opts);
    }
    for (const auto& [name, shard_name] : listed) {
        const TensorEntry* t = w.find(name);
        if (!t)
            fail_tensor(index_path, name, "listed in shard ", shard_name, " but not found in it");
        const std::string found_in = w.files_[t->file].filename().string();
        if (found_in != shard_name)
            fail_tensor(index_path, name, "listed in shard ", shard_name, " but found in shard ",
                        found_in);
    }
    for (const auto& t : w.tensors_)
        if (listed.find(t.name) == listed.end())
            fail_tensor(w.files_[t.file], t.name, "is in the shard but not listed in ",
                        index_path.string());
    return w;
}

const TensorEntry* WeightFiles::find(std::string_view name) const noexcept {
    const auto it = by_name_.find(name);
    return it == by_name_.end() ? nullptr : &tensors_[it->second];
}

std::uint64_t WeightFiles::total_bytes() const noexcept {
    return std::accumulate(tensors_.begin(), tensors_.end(), std::uint64_t{0},
                           [](std::uint64_t s, const TensorEntry& t) { return s + t.bytes; });
}

}  // namespace writescope::model
