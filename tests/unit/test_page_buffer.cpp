// PageBuffer: page-aligned pageable memory that only grows.
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>

#include "writescope/core/page_buffer.hpp"

using writescope::PageBuffer;

TEST_CASE("PageBuffer is page-aligned and grows only when asked for more", "[unit]") {
    PageBuffer b;
    CHECK(b.data() == nullptr);
    CHECK(b.size() == 0);
    b.reserve(100);
    REQUIRE(b.data() != nullptr);
    CHECK(reinterpret_cast<std::uintptr_t>(b.data()) % PageBuffer::kAlign == 0);
    CHECK(b.size() == 100);
    std::memset(b.data(), 0x5a, b.size());  // writable over its whole size
    void* first = b.data();
    b.reserve(64);  // smaller: kept as is
    CHECK(b.data() == first);
    CHECK(b.size() == 100);
    b.reserve(1 << 20);
    CHECK(b.size() == (1u << 20));
    CHECK(reinterpret_cast<std::uintptr_t>(b.data()) % PageBuffer::kAlign == 0);
    std::memset(b.data(), 0x5a, b.size());
    const PageBuffer sized(5000);
    CHECK(sized.size() == 5000);
}
