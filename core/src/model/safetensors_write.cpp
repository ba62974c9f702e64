// Writing safetensors files: the header built entry by entry, the file written beside its
// destination and renamed over it, so a reader never sees half a file.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <string>
#include <system_error>
#include <unordered_set>
#include <vector>

#include <nlohmann/json.hpp>

#include "writescope/core/model/safetensors.hpp"

namespace writescope::model {

// The tensors' bytes are written as they are in memory, and safetensors is little-endian.
static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");

namespace fs = std::filesystem;

namespace {

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

// A JSON string literal (escaped as JSON requires).
std::string json_string(const fs::path& file, const std::string& s) {
    try {
        return nlohmann::json(s).dump();
    } catch (const nlohmann::json::exception& e) {  // invalid UTF-8
        fail(file, "a tensor name or metadata string cannot be encoded: ", e.what());
    }
}

// The header text: tensors in the given order, built entry by entry (a JSON object built
// whole would sort its keys, or cost a linear search per insertion in nlohmann's ordered_json).
std::string build_header(const fs::path& file, std::span<const TensorToWrite> tensors,
                         const std::map<std::string, std::string>& metadata) {
    std::string out(1, '{');
    if (!metadata.empty()) {
        out += "\"__metadata__\":{";
        bool first = true;
        for (const auto& [k, v] : metadata) {
            if (!first) out += ',';
            first = false;
            out += json_string(file, k);
            out += ':';
            out += json_string(file, v);
        }
        out += '}';
    }
    std::unordered_set<std::string_view> names;
    std::uint64_t offset = 0;
    for (const auto& t : tensors) {
        if (t.name.empty()) fail(file, "a tensor has an empty name");
        if (t.name == "__metadata__")
            fail_tensor(file, t.name, "the name is reserved for the header's metadata");
        if (!names.insert(t.name).second) fail_tensor(file, t.name, "the name is given twice");
        std::uint64_t bytes = dtype_bytes(t.dtype);
        for (const auto d : t.shape) {
            if (d < 0) fail_tensor(file, t.name, "shape has a negative dimension");
            if (__builtin_mul_overflow(bytes, static_cast<std::uint64_t>(d), &bytes))
                fail_tensor(file, t.name, "the tensor's size overflows 64 bits");
        }
        if (!t.data && bytes != 0)
            fail_tensor(file, t.name, "data is null but the tensor is ", std::to_string(bytes),
                        " bytes");
        std::uint64_t end = 0;
        if (__builtin_add_overflow(offset, bytes, &end))
            fail_tensor(file, t.name, "the data section's size overflows 64 bits");
        if (out.size() > 1) out += ',';
        out += json_string(file, t.name);
        out += ":{\"dtype\":\"";
        out += safetensors_dtype_name(t.dtype);
        out += "\",\"shape\":[";
        for (std::size_t i = 0; i < t.shape.size(); ++i) {
            if (i) out += ',';
            out += std::to_string(t.shape[i]);
        }
        out += "],\"data_offsets\":[";
        out += std::to_string(offset);
        out += ',';
        out += std::to_string(end);
        out += "]}";
        offset = end;
    }
    out += '}';
    // The data section starts at 8 + header length; spaces (valid JSON whitespace) make that a
    // multiple of 8, as the reference writer does, so 8-byte-sized tensors stay aligned.
    out.append((8 - out.size() % 8) % 8, ' ');
    return out;
}

// The temporary file beside the destination; removed unless committed.
class TempFile {
  public:
    explicit TempFile(const fs::path& dest) : dest_(dest) {
        static std::atomic<unsigned> counter{0};
        std::string base = ".";
        base += dest.filename().string();
        base += ".tmp.";
        base += std::to_string(::getpid());
        base += '.';
        for (int attempt = 0; attempt < 100; ++attempt) {
            std::string name = base;
            name += std::to_string(counter++);
            path_ = dest.parent_path() / name;
            // 0666 less the umask: the file gets the permissions a plain create would give.
            fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
            if (fd_ >= 0) return;
            if (errno != EEXIST) break;
        }
        fail(dest_, "cannot create the temporary file ", path_.string(), ": ", errno_text(errno));
    }
    ~TempFile() {
        if (fd_ >= 0) ::close(fd_);
        if (!committed_) ::unlink(path_.c_str());
    }
    TempFile(const TempFile&) = delete;
    TempFile& operator=(const TempFile&) = delete;

    void write(const void* data, std::size_t n) {
        const auto* p = static_cast<const char*>(data);
        while (n > 0) {
            const ssize_t put = ::write(fd_, p, n);
            if (put < 0 && errno == EINTR) continue;
            if (put < 0) fail(dest_, "cannot write ", path_.string(), ": ", errno_text(errno));
            p += put;
            n -= static_cast<std::size_t>(put);
        }
    }
    // Syncs, closes and renames over the destination.
    void commit() {
        if (::fsync(fd_) != 0) fail(dest_, "cannot sync ", path_.string(), ": ", errno_text(errno));
        const int fd = std::exchange(fd_, -1);
        if (::close(fd) != 0) fail(dest_, "cannot close ", path_.string(), ": ", errno_text(errno));
        if (std::rename(path_.c_str(), dest_.c_str()) != 0)
            fail(dest_, "cannot rename ", path_.string(), " to it: ", errno_text(errno));
        committed_ = true;
        // The rename lasts a crash only once the directory is synced; best effort, the file
        // itself is complete either way.
        const fs::path dir = dest_.parent_path().empty() ? fs::path(".") : dest_.parent_path();
        const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (dfd >= 0) {
            (void)::fsync(dfd);
            ::close(dfd);
        }
    }

  private:
    fs::path dest_;
    fs::path path_;
    int fd_ = -1;
    bool committed_ = false;
};

}  // namespace

void write_safetensors(const fs::path& file, std::span<const TensorToWrite> tensors,
                       const std::map<std::string, std::string>& metadata) {
    if (file.filename().empty()) fail(file, "is not a file name");
    const std::string header = build_header(file, tensors, metadata);

    TempFile out(file);
    unsigned char length[8];
    for (int i = 0; i < 8; ++i)
        length[i] =
            static_cast<unsigned char>(static_cast<std::uint64_t>(header.size()) >> (8 * i));
    out.write(length, sizeof length);
    out.write(header.data(), header.size());
    for (const auto& t : tensors) {
        std::uint64_t bytes = dtype_bytes(t.dtype);
        for (const auto d : t.shape)
            bytes *= static_cast<std::uint64_t>(d);  // checked above
        if (bytes != 0) out.write(t.data, static_cast<std::size_t>(bytes));
    }
    out.commit();
}

}  // namespace writescope::model
