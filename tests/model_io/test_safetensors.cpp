#include <catch2/catch.hpp>

#include <stdlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <random>
#include <string>
#include <system_error>
#include <vector>

#include "test_seed.hpp"
#include "writescope/core/model/safetensors.hpp"

using namespace writescope;
using namespace writescope::model;
namespace fs = std::filesystem;
using namespace std::string_literals;

namespace {

// A temporary directory, removed with everything in it at the end of its scope.
class TempDir {
  public:
    TempDir() {
        std::string tmpl = fs::temp_directory_path() / "writescope-st-XXXXXX";
        if (!mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
        path_ = tmpl;
    }
    ~TempDir() {
        std::error_code ec;
        fs::remove_all(path_, ec);
    }
    TempDir(const TempDir&) = delete;
    TempDir& operator=(const TempDir&) = delete;
    const fs::path& path() const noexcept { return path_; }
    fs::path operator/(const std::string& name) const { return path_ / name; }

  private:
    fs::path path_;
};

std::string read_all(const fs::path& p) {
    std::ifstream in(p, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_all(const fs::path& p, const std::string& bytes) {
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    REQUIRE(out.good());
}

std::string le64(std::uint64_t v) {
    std::string s(8, '\0');
    for (int i = 0; i < 8; ++i)
        s[i] = static_cast<char>((v >> (8 * i)) & 0xff);
    return s;
}

// A file of the given header text and data_bytes bytes of data; the length field is the
// header's size unless given.
void write_raw(const fs::path& p, const std::string& header, std::size_t data_bytes,
               std::optional<std::uint64_t> length = std::nullopt) {
    write_all(p, le64(length.value_or(header.size())) + header + std::string(data_bytes, '\x5a'));
}

// One tensor's header entry.
std::string entry(const std::string& name, const std::string& dtype, const std::string& shape,
                  std::uint64_t begin, std::uint64_t end) {
    return "\""s + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape +
           ",\"data_offsets\":[" + std::to_string(begin) + "," + std::to_string(end) + "]}";
}

class ContainsAll : public Catch::MatcherBase<std::string> {
  public:
    explicit ContainsAll(std::vector<std::string> parts) : parts_(std::move(parts)) {}
    bool match(const std::string& s) const override {
        for (const auto& p : parts_)
            if (s.find(p) == std::string::npos) return false;
        return true;
    }
    std::string describe() const override {
        std::string d = "contains all of:";
        for (const auto& p : parts_)
            d += " \""s + p + "\"";
        return d;
    }

  private:
    std::vector<std::string> parts_;
};

// Opening the file fails, with the data mapped and with headers only, naming the file and
// every phrase.
void require_rejected(const fs::path& file, std::vector<std::string> phrases,
                      WeightFilesOptions opts = {}) {
    phrases.insert(phrases.begin(), file.string() + ": ");
    for (const bool map : {true, false}) {
        INFO("map_data " << map);
        opts.map_data = map;
        REQUIRE_THROWS_AS(WeightFiles::open_file(file, opts), ModelFileError);
        REQUIRE_THROWS_WITH(WeightFiles::open_file(file, opts), ContainsAll(phrases));
    }
}

void require_dir_rejected(const fs::path& dir, const std::vector<std::string>& phrases) {
    for (const bool map : {true, false}) {
        INFO("map_data " << map);
        WeightFilesOptions opts;
        opts.map_data = map;
        REQUIRE_THROWS_AS(WeightFiles::open_dir(dir, opts), ModelFileError);
        REQUIRE_THROWS_WITH(WeightFiles::open_dir(dir, opts), ContainsAll(phrases));
    }
}

std::vector<unsigned char> random_bytes(std::mt19937_64& rng, std::size_t n) {
    std::vector<unsigned char> v(n);
    for (auto& b : v)
        b = static_cast<unsigned char>(rng());
    return v;
}

std::uint64_t byte_size(DType t, const std::vector<std::int64_t>& shape) {
    std::uint64_t n = dtype_bytes(t);
    for (const auto d : shape)
        n *= static_cast<std::uint64_t>(d);
    return n;
}

// Tensors with their bytes, for writing.
struct Sample {
    std::string name;
    DType dtype;
    std::vector<std::int64_t> shape;
    std::vector<unsigned char> bytes;
};

std::vector<Sample> make_samples(
    std::mt19937_64& rng,
    std::initializer_list<std::tuple<const char*, DType, std::vector<std::int64_t>>> specs) {
    std::vector<Sample> out;
    for (const auto& [name, dtype, shape] : specs)
        out.push_back({name, dtype, shape, random_bytes(rng, byte_size(dtype, shape))});
    return out;
}

std::vector<TensorToWrite> to_write(const std::vector<Sample>& samples) {
    std::vector<TensorToWrite> out;
    for (const auto& s : samples)
        out.push_back({s.name, s.dtype, s.shape, s.bytes.empty() ? nullptr : s.bytes.data()});
    return out;
}

void require_same_data(const TensorEntry& t, const Sample& s) {
    INFO("tensor " << s.name);
    REQUIRE(t.name == s.name);
    REQUIRE(t.dtype == s.dtype);
    REQUIRE(t.shape == s.shape);
    REQUIRE(t.bytes == s.bytes.size());
    REQUIRE(t.elements() * dtype_bytes(t.dtype) == t.bytes);
    REQUIRE(t.data != nullptr);
    REQUIRE(std::memcmp(t.data, s.bytes.data(), s.bytes.size()) == 0);
}

std::vector<std::string> dir_entries(const fs::path& dir) {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir))
        names.push_back(e.path().filename());
    std::sort(names.begin(), names.end());
    return names;
}

}  // namespace

TEST_CASE("safetensors dtype names", "[unit][safetensors]") {
    for (const DType t : {DType::bf16, DType::f16, DType::f32})
        REQUIRE(safetensors_dtype_from_name(safetensors_dtype_name(t)) == t);
    REQUIRE(safetensors_dtype_name(DType::bf16) == "BF16");
    REQUIRE(safetensors_dtype_name(DType::f16) == "F16");
    REQUIRE(safetensors_dtype_name(DType::f32) == "F32");
    REQUIRE_FALSE(safetensors_dtype_from_name("I8"));
    REQUIRE_FALSE(safetensors_dtype_from_name("bf16"));
}

TEST_CASE("safetensors round trip: bytes, order, offsets and metadata", "[unit][safetensors]") {
    auto rng = test::seeded_rng("safetensors round trip");
    TempDir dir;
    const fs::path file = dir / "model.safetensors";
    // bf16 [3, 5] is 30 bytes, so the f32 tensors after it start unaligned.
    const auto samples = make_samples(rng, {{"model.embed_tokens.weight", DType::bf16, {3, 5}},
                                            {"f32.unaligned", DType::f32, {4, 4}},
                                            {"scale", DType::bf16, {}},
                                            {"half.vector", DType::f16, {7}},
                                            {"empty", DType::f16, {2, 0, 3}},
                                            {"f32.cube", DType::f32, {1, 3, 2}},
                                            {"f32.scalar", DType::f32, {}},
                                            {"bf16.long", DType::bf16, {1000}},
                                            {"f16.matrix", DType::f16, {5, 3}}});
    const std::map<std::string, std::string> metadata{{"format", "pt"},
                                                      {"note", "a \"quoted\" é\n"}};
    write_safetensors(file, to_write(samples), metadata);
    REQUIRE(dir_entries(dir.path()) == std::vector<std::string>{"model.safetensors"});

    // The raw layout: data starts at 8 + header length, a multiple of 8; metadata first.
    const std::string raw = read_all(file);
    std::uint64_t header_len = 0;
    for (int i = 7; i >= 0; --i)
        header_len = (header_len << 8) | static_cast<unsigned char>(raw[i]);
    REQUIRE((8 + header_len) % 8 == 0);
    REQUIRE(raw.compare(8, 16, "{\"__metadata__\":") == 0);
    std::uint64_t total = 0;
    for (const auto& s : samples)
        total += s.bytes.size();
    REQUIRE(raw.size() == 8 + header_len + total);

    for (const bool via_dir : {false, true}) {
        INFO("via_dir " << via_dir);
        const WeightFiles w =
            via_dir ? WeightFiles::open_dir(dir.path()) : WeightFiles::open_file(file);
        REQUIRE(w.data_mapped());
        REQUIRE(w.files() == std::vector<fs::path>{file});
        REQUIRE(w.metadata() == metadata);
        REQUIRE(w.total_bytes() == total);
        REQUIRE(w.tensors().size() == samples.size());
        std::uint64_t offset = 8 + header_len;
        for (std::size_t i = 0; i < samples.size(); ++i) {
            const TensorEntry& t = w.tensors()[i];
            require_same_data(t, samples[i]);
            REQUIRE(t.offset == offset);
            REQUIRE(raw.compare(t.offset, t.bytes,
                                std::string(samples[i].bytes.begin(), samples[i].bytes.end())) ==
                    0);
            REQUIRE(t.file == 0);
            REQUIRE(w.file_of(t) == file);
            REQUIRE(w.find(samples[i].name) == &t);
            offset += t.bytes;
        }
        REQUIRE(w.find("scale")->elements() == 1);
        REQUIRE(w.find("empty")->elements() == 0);
        REQUIRE(w.find("absent") == nullptr);
        // Unaligned data read the documented way.
        const TensorEntry* u = w.find("f32.unaligned");
        REQUIRE(u->offset % 4 != 0);
        float first = 0;
        std::memcpy(&first, u->data, sizeof first);
        float expected = 0;
        std::memcpy(&expected, samples[1].bytes.data(), sizeof expected);
        REQUIRE(std::memcmp(&first, &expected, sizeof first) == 0);
    }

    SECTION("no __metadata__ without metadata; rewriting replaces the file") {
        const auto fewer = make_samples(rng, {{"only", DType::f32, {2}}});
        write_safetensors(file, to_write(fewer));
        REQUIRE(read_all(file).find("__metadata__") == std::string::npos);
        const auto w = WeightFiles::open_file(file);
        REQUIRE(w.metadata().empty());
        REQUIRE(w.tensors().size() == 1);
        require_same_data(w.tensors()[0], fewer[0]);
        REQUIRE(w.tensors()[0].offset % 8 == 0);
        REQUIRE(dir_entries(dir.path()) == std::vector<std::string>{"model.safetensors"});
    }
    SECTION("a file of no tensors") {
        write_safetensors(file, {});
        const auto w = WeightFiles::open_file(file);
        REQUIRE(w.tensors().empty());
        REQUIRE(w.total_bytes() == 0);
    }
}

TEST_CASE("safetensors headers only: validated, data left null", "[unit][safetensors]") {
    auto rng = test::seeded_rng("safetensors headers only");
    TempDir dir;
    const fs::path file = dir / "model.safetensors";
    const auto samples = make_samples(rng, {{"a", DType::bf16, {4, 2}}, {"b", DType::f32, {3}}});
    write_safetensors(file, to_write(samples), {{"k", "v"}});
    WeightFilesOptions opts;
    opts.map_data = false;
    const auto w = WeightFiles::open_file(file, opts);
    REQUIRE_FALSE(w.data_mapped());
    REQUIRE(w.tensors().size() == 2);
    REQUIRE(w.metadata() == std::map<std::string, std::string>{{"k", "v"}});
    const auto mapped = WeightFiles::open_file(file);
    for (std::size_t i = 0; i < 2; ++i) {
        REQUIRE(w.tensors()[i].data == nullptr);
        REQUIRE(w.tensors()[i].name == mapped.tensors()[i].name);
        REQUIRE(w.tensors()[i].offset == mapped.tensors()[i].offset);
        REQUIRE(w.tensors()[i].bytes == mapped.tensors()[i].bytes);
        REQUIRE(w.tensors()[i].shape == mapped.tensors()[i].shape);
    }
    // Still validates the offsets against the file's size.
    fs::resize_file(file, fs::file_size(file) - 1);
    REQUIRE_THROWS_WITH(WeightFiles::open_file(file, opts),
                        Catch::Contains(file.string()) && Catch::Contains("tensor b") &&
                            Catch::Contains("end beyond the data section"));
}

TEST_CASE("safetensors moves keep the mapped data", "[unit][safetensors]") {
    auto rng = test::seeded_rng("safetensors move");
    TempDir dir;
    const fs::path file = dir / "x.safetensors";
    const auto samples = make_samples(rng, {{"a", DType::f16, {9}}});
    write_safetensors(file, to_write(samples));
    auto w = WeightFiles::open_file(file);
    const void* data = w.tensors()[0].data;
    WeightFiles moved = std::move(w);
    REQUIRE(moved.tensors()[0].data == data);
    require_same_data(*moved.find("a"), samples[0]);
    moved = WeightFiles::open_file(file);
    require_same_data(*moved.find("a"), samples[0]);
}

TEST_CASE("safetensors: a sharded directory with an index", "[unit][safetensors]") {
    auto rng = test::seeded_rng("safetensors shards");
    TempDir dir;
    const std::string s1 = "model-00001-of-00002.safetensors",
                      s2 = "model-00002-of-00002.safetensors";
    const auto first = make_samples(rng, {{"model.embed_tokens.weight", DType::bf16, {6, 4}},
                                          {"model.layers.0.mlp.gate.weight", DType::f32, {2, 3}}});
    const auto second = make_samples(rng, {{"model.norm.weight", DType::f16, {4}},
                                           {"lm_head.weight", DType::bf16, {6, 4}},
                                           {"model.layers.1.scale", DType::f32, {}}});
    write_safetensors(dir / s2, to_write(second), {{"shard", "two"}});
    write_safetensors(dir / s1, to_write(first), {{"format", "pt"}});
    std::string index = "{\"metadata\": {\"total_size\": 1234}, \"weight_map\": {";
    for (const auto& s : first)
        index += "\""s + s.name + "\": \"" + s1 + "\", ";
    for (const auto& s : second)
        index += "\""s + s.name + "\": \"" + s2 + "\", ";
    index.resize(index.size() - 2);
    index += "}}";
    write_all(dir / "model.safetensors.index.json", index);
    // A stray single file is ignored when the index exists.
    write_all(dir / "model.safetensors", "garbage");

    for (const bool map : {true, false}) {
        INFO("map_data " << map);
        WeightFilesOptions opts;
        opts.map_data = map;
        const auto w = WeightFiles::open_dir(dir.path(), opts);
        REQUIRE(w.files() == std::vector<fs::path>{dir / s1, dir / s2});
        REQUIRE(w.metadata() == std::map<std::string, std::string>{{"format", "pt"}});
        REQUIRE(w.tensors().size() == 5);
        std::uint64_t total = 0;
        for (std::size_t f = 0; f < 2; ++f) {
            const auto& samples = f == 0 ? first : second;
            for (const auto& s : samples) {
                const TensorEntry* t = w.find(s.name);
                REQUIRE(t != nullptr);
                REQUIRE(t->file == f);
                REQUIRE(w.file_of(*t) == (f == 0 ? dir / s1 : dir / s2));
                if (map) {
                    require_same_data(*t, s);
                } else {
                    REQUIRE(t->data == nullptr);
                }
                total += s.bytes.size();
            }
        }
        REQUIRE(w.total_bytes() == total);
        // In file order, then offset order.
        REQUIRE(w.tensors()[0].name == first[0].name);
        REQUIRE(w.tensors()[2].name == second[0].name);
        REQUIRE(w.tensors()[4].name == second[2].name);
    }
}

TEST_CASE("safetensors validation errors name the file, the tensor and the problem",
          "[unit][safetensors]") {
    TempDir dir;
    const fs::path f = dir / "model-00002-of-00003.safetensors";
    const std::string w8 = entry("w", "F32", "[2]", 0, 8);

    SECTION("a file shorter than 8 bytes") {
        write_all(f, "abcde");
        require_rejected(f, {"5 bytes, shorter than the 8-byte header length"});
    }
    SECTION("a header length of 0") {
        write_raw(f, "", 16);
        require_rejected(f, {"header length is 0"});
    }
    SECTION("a header length bigger than the file") {
        write_raw(f, "{"s + w8 + "}", 8, 1000);
        require_rejected(f, {"header length 1000 goes beyond the end of the file"});
    }
    SECTION("a header above max_header_bytes") {
        write_raw(f, "{"s + w8 + "}", 8);
        WeightFilesOptions opts;
        opts.max_header_bytes = 16;
        require_rejected(f, {"is above the limit of 16 bytes"}, opts);
    }
    SECTION("a header that is not JSON") {
        write_raw(f, "{\"w\": {\"dtype\": ", 8);
        require_rejected(f, {"header is not valid JSON"});
    }
    SECTION("a header that is not an object") {
        write_raw(f, "[1, 2]  ", 8);
        require_rejected(f, {"header is not a JSON object"});
    }
    SECTION("a tensor defined twice in one header") {
        write_raw(f, "{"s + w8 + "," + w8 + "}", 8);
        require_rejected(f, {"has the key w twice"});
    }
    SECTION("a tensor entry that is not an object") {
        write_raw(f, "{\"blk.0.w\": [0, 8]}", 8);
        require_rejected(f, {"tensor blk.0.w: ", "entry is not an object"});
    }
    SECTION("dtype missing") {
        write_raw(f, "{\"w\": {\"shape\": [2], \"data_offsets\": [0, 8]}}", 8);
        require_rejected(f, {"tensor w: ", "dtype is missing"});
    }
    SECTION("dtype not a string") {
        write_raw(f, "{\"w\": {\"dtype\": 4, \"shape\": [2], \"data_offsets\": [0, 8]}}", 8);
        require_rejected(f, {"tensor w: ", "dtype 4 is not a string"});
    }
    SECTION("dtype not supported") {
        write_raw(f, "{"s + entry("model.layers.0.q_proj.qweight", "I8", "[8]", 0, 8) + "}", 8);
        require_rejected(f, {"tensor model.layers.0.q_proj.qweight: ",
                             "dtype I8 is not supported (BF16, F16, F32)"});
    }
    SECTION("shape missing") {
        write_raw(f, "{\"w\": {\"dtype\": \"F32\", \"data_offsets\": [0, 8]}}", 8);
        require_rejected(f, {"tensor w: ", "shape is missing"});
    }
    SECTION("shape with a negative dimension") {
        write_raw(f, "{"s + entry("w", "F32", "[-2]", 0, 8) + "}", 8);
        require_rejected(f, {"tensor w: ", "shape [-2] is not a list of non-negative integers"});
    }
    SECTION("shape with a fractional dimension") {
        write_raw(f, "{"s + entry("w", "F32", "[2.5]", 0, 8) + "}", 8);
        require_rejected(f, {"tensor w: ", "is not a list of non-negative integers"});
    }
    SECTION("shape not a list") {
        write_raw(f, "{"s + entry("w", "F32", "2", 0, 8) + "}", 8);
        require_rejected(f, {"tensor w: ", "shape 2 is not a list of non-negative integers"});
    }
    SECTION("data_offsets missing") {
        write_raw(f, "{\"w\": {\"dtype\": \"F32\", \"shape\": [2]}}", 8);
        require_rejected(f, {"tensor w: ", "data_offsets is missing"});
    }
    SECTION("data_offsets not two integers") {
        write_raw(f, "{\"w\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [8]}}", 8);
        require_rejected(f, {"tensor w: ", "data_offsets [8] is not two non-negative integers"});
    }
    SECTION("data_offsets negative") {
        write_raw(f, "{\"w\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [-1, 7]}}", 8);
        require_rejected(f, {"tensor w: ", "data_offsets [-1,7] is not two non-negative integers"});
    }
    SECTION("data_offsets begin after end") {
        write_raw(f, "{"s + entry("w", "F32", "[0]", 8, 4) + "}", 8);
        require_rejected(f, {"tensor w: ", "data_offsets [8, 4]: begin is after end"});
    }
    SECTION("shape × dtype size not the offsets' span") {
        write_raw(f,
                  "{"s + entry("model.layers.3.mlp.gate.weight", "BF16", "[8, 16]", 100, 228) + "}",
                  300);
        require_rejected(f, {"tensor model.layers.3.mlp.gate.weight: ",
                             "data_offsets [100, 228] span 128 bytes but dtype BF16 × shape [8, "
                             "16] is 256 bytes"});
    }
    SECTION("shape × dtype size overflowing") {
        write_raw(f, "{"s + entry("huge", "F32", "[4294967296, 4294967296, 2]", 0, 8) + "}", 8);
        require_rejected(f, {"tensor huge: ", "overflows 64 bits"});
    }
    SECTION("data past the end of the data section") {
        write_raw(f, "{"s + entry("w", "F32", "[4]", 0, 16) + "}", 12);
        require_rejected(
            f, {"tensor w: ", "data_offsets [0, 16] end beyond the data section (12 bytes"});
    }
    SECTION("overlapping tensors") {
        write_raw(
            f, "{"s + entry("a", "F32", "[4]", 0, 16) + "," + entry("b", "F32", "[4]", 8, 24) + "}",
            24);
        require_rejected(f, {"tensor b: ", "data_offsets [8, 24] overlap tensor a at [0, 16]"});
    }
    SECTION("a tensor inside a longer one overlaps it") {
        write_raw(f,
                  "{"s + entry("a", "F32", "[8]", 0, 32) + "," + entry("b", "F32", "[1]", 16, 20) +
                      "," + entry("c", "F32", "[1]", 24, 28) + "}",
                  32);
        require_rejected(f, {"tensor b: ", "overlap tensor a"});
    }
    SECTION("zero-size tensors overlap nothing") {
        write_raw(f,
                  "{"s + entry("a", "F32", "[4]", 0, 16) + "," + entry("z", "F32", "[0, 3]", 8, 8) +
                      "," + entry("y", "BF16", "[0]", 16, 16) + "}",
                  16);
        const auto w = WeightFiles::open_file(f);
        REQUIRE(w.tensors().size() == 3);
        REQUIRE(w.find("z")->bytes == 0);
    }
    SECTION("__metadata__ not an object") {
        write_raw(f, "{\"__metadata__\": [\"pt\"], "s + w8 + "}", 8);
        require_rejected(f, {"__metadata__ is not an object"});
    }
    SECTION("__metadata__ with a value that is not a string") {
        write_raw(f, "{\"__metadata__\": {\"format\": \"pt\", \"step\": 3}, "s + w8 + "}", 8);
        require_rejected(f, {"__metadata__ value of step is not a string"});
    }
    SECTION("a truncated file") {
        const std::vector<float> a(4, 1.0f), b(6, 2.0f);
        const std::vector<TensorToWrite> t{{"a", DType::f32, {4}, a.data()},
                                           {"b", DType::f32, {2, 3}, b.data()}};
        write_safetensors(f, t);
        REQUIRE_NOTHROW(WeightFiles::open_file(f));
        fs::resize_file(f, fs::file_size(f) - 4);
        require_rejected(f, {"tensor b: ", "end beyond the data section"});
    }
    SECTION("a file that does not exist") {
        require_rejected(f, {"cannot open: ", std::system_category().message(ENOENT)});
    }
    SECTION("a directory as the file") {
        fs::create_directory(f);
        require_rejected(f, {"is not a regular file"});
    }
}

TEST_CASE("safetensors model directory errors", "[unit][safetensors]") {
    TempDir dir;
    const fs::path index = dir / "model.safetensors.index.json";
    const std::string s1 = "model-00001-of-00002.safetensors",
                      s2 = "model-00002-of-00002.safetensors";
    const std::vector<float> x(4, 0.5f);
    // Shard 1 holds a and b, shard 2 holds c.
    write_safetensors(dir / s1, std::vector<TensorToWrite>{{"a", DType::f32, {4}, x.data()},
                                                           {"b", DType::f32, {2}, x.data()}});
    write_safetensors(dir / s2, std::vector<TensorToWrite>{{"c", DType::f32, {1}, x.data()}});
    const auto weight_map = [&](const std::string& body) {
        write_all(index, "{\"weight_map\": {"s + body + "}}");
    };
    const std::string good = "\"a\": \""s + s1 + "\", \"b\": \"" + s1 + "\", \"c\": \"" + s2 + "\"";

    SECTION("the good index opens") {
        weight_map(good);
        REQUIRE(WeightFiles::open_dir(dir.path()).tensors().size() == 3);
    }
    SECTION("neither model.safetensors nor the index") {
        TempDir empty;
        require_dir_rejected(empty.path(), {empty.path().string() + ": ", "model.safetensors ",
                                            "model.safetensors.index.json"});
    }
    SECTION("the index not JSON") {
        write_all(index, "{\"weight_map\": ");
        require_dir_rejected(dir.path(), {index.string() + ": ", "the index is not valid JSON"});
    }
    SECTION("the index not an object") {
        write_all(index, "[]");
        require_dir_rejected(dir.path(), {index.string() + ": ", "the index is not a JSON object"});
    }
    SECTION("weight_map missing") {
        write_all(index, "{\"metadata\": {}}");
        require_dir_rejected(dir.path(), {index.string() + ": ", "weight_map is missing"});
    }
    SECTION("weight_map not an object") {
        write_all(index, "{\"weight_map\": [\"a\"]}");
        require_dir_rejected(dir.path(), {index.string() + ": ", "weight_map is not an object"});
    }
    SECTION("a weight_map value not a string") {
        weight_map(good + ", \"d\": 2");
        require_dir_rejected(dir.path(),
                             {index.string() + ": ", "tensor d: ", "is not a shard file name"});
    }
    SECTION("a shard outside the directory") {
        weight_map(good + ", \"d\": \"../" + s1 + "\"");
        require_dir_rejected(
            dir.path(),
            {index.string() + ": ", "tensor d: ", "is not a plain file name inside the directory"});
    }
    SECTION("a shard in a subdirectory") {
        weight_map(good + ", \"d\": \"sub/x.safetensors\"");
        require_dir_rejected(
            dir.path(),
            {index.string() + ": ", "tensor d: ", "is not a plain file name inside the directory"});
    }
    SECTION("a shard that does not exist") {
        weight_map(good + ", \"d\": \"model-00003-of-00003.safetensors\"");
        require_dir_rejected(dir.path(), {index.string() + ": ", "tensor d: ",
                                          "shard model-00003-of-00003.safetensors does not exist"});
    }
    SECTION("a tensor in another shard than the index says") {
        weight_map("\"a\": \""s + s1 + "\", \"b\": \"" + s2 + "\", \"c\": \"" + s2 + "\"");
        require_dir_rejected(dir.path(), {index.string() + ": ", "tensor b: ",
                                          "listed in shard "s + s2 + " but found in shard " + s1});
    }
    SECTION("a tensor the index lists but no shard has") {
        weight_map(good + ", \"zz\": \"" + s2 + "\"");
        require_dir_rejected(dir.path(), {index.string() + ": ", "tensor zz: ",
                                          "listed in shard "s + s2 + " but not found in it"});
    }
    SECTION("a shard's tensor the index does not list") {
        weight_map("\"a\": \""s + s1 + "\", \"c\": \"" + s2 + "\"");
        require_dir_rejected(dir.path(), {(dir / s1).string() + ": ",
                                          "tensor b: ", "not listed in "s + index.string()});
    }
    SECTION("a tensor defined in two shards") {
        write_safetensors(dir / s2, std::vector<TensorToWrite>{{"b", DType::f32, {2}, x.data()},
                                                               {"c", DType::f32, {1}, x.data()}});
        weight_map(good);
        require_dir_rejected(dir.path(), {(dir / s2).string() + ": ", "tensor b: ",
                                          "is defined in both "s + (dir / s1).string() + " and " +
                                              (dir / s2).string()});
    }
    SECTION("a bad shard is reported with its own path") {
        write_raw(dir / s2, "{"s + entry("c", "I8", "[4]", 0, 4) + "}", 4);
        weight_map(good);
        require_dir_rejected(
            dir.path(), {(dir / s2).string() + ": ", "tensor c: ", "dtype I8 is not supported"});
    }
}

TEST_CASE("write_safetensors errors name the file and leave nothing behind",
          "[unit][safetensors]") {
    TempDir dir;
    const fs::path file = dir / "out.safetensors";
    const std::vector<float> x(4, 1.0f);

    SECTION("a name given twice") {
        const std::vector<TensorToWrite> t{{"a", DType::f32, {4}, x.data()},
                                           {"a", DType::f32, {2}, x.data()}};
        REQUIRE_THROWS_AS(write_safetensors(file, t), ModelFileError);
        REQUIRE_THROWS_WITH(write_safetensors(file, t),
                            ContainsAll({file.string() + ": ", "tensor a: ", "given twice"}));
    }
    SECTION("null data for a tensor of nonzero size") {
        const std::vector<TensorToWrite> t{{"a", DType::f32, {4}, x.data()},
                                           {"b", DType::bf16, {3}, nullptr}};
        REQUIRE_THROWS_AS(write_safetensors(file, t), ModelFileError);
        REQUIRE_THROWS_WITH(write_safetensors(file, t),
                            ContainsAll({file.string() + ": ", "tensor b: ", "data is null"}));
    }
    SECTION("a negative dimension") {
        const std::vector<TensorToWrite> t{{"a", DType::f32, {-4}, x.data()}};
        REQUIRE_THROWS_WITH(
            write_safetensors(file, t),
            ContainsAll({file.string() + ": ", "tensor a: ", "negative dimension"}));
    }
    SECTION("a name that is not UTF-8") {
        const std::vector<TensorToWrite> t{{"bad\xff", DType::f32, {4}, x.data()}};
        REQUIRE_THROWS_WITH(write_safetensors(file, t),
                            ContainsAll({file.string() + ": ", "cannot be encoded"}));
    }
    SECTION("a directory that does not exist") {
        const fs::path missing = dir / "nope" / "out.safetensors";
        const std::vector<TensorToWrite> t{{"a", DType::f32, {4}, x.data()}};
        REQUIRE_THROWS_AS(write_safetensors(missing, t), ModelFileError);
        REQUIRE_THROWS_WITH(
            write_safetensors(missing, t),
            ContainsAll({missing.string() + ": ", "cannot create the temporary file",
                         std::system_category().message(ENOENT)}));
    }
    SECTION("a destination that cannot be replaced") {
        fs::create_directory(file);
        const std::vector<TensorToWrite> t{{"a", DType::f32, {4}, x.data()}};
        REQUIRE_THROWS_AS(write_safetensors(file, t), ModelFileError);
        REQUIRE_THROWS_WITH(write_safetensors(file, t),
                            ContainsAll({file.string() + ": ", "cannot rename"}));
        REQUIRE(dir_entries(dir.path()) == std::vector<std::string>{"out.safetensors"});
        REQUIRE(fs::is_directory(file));
        return;
    }
    REQUIRE(dir_entries(dir.path()).empty());
}
