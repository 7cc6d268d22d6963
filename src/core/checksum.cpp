#include "core/checksum.h"

#include "core/error.h"

#include <fmt/format.h>

#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <vector>

namespace kiln {

namespace {

constexpr uint64_t P1 = 0x9E3779B185EBCA87ull, P2 = 0xC2B2AE3D27D4EB4Full, P3 = 0x165667B19E3779F9ull,
                   P4 = 0x85EBCA77C2B2AE63ull, P5 = 0x27D4EB2F165667C5ull;

uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
// Little-endian loads (memcpy: no alignment assumption; kiln only targets LE hosts).
uint64_t read64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
uint32_t read32(const unsigned char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
uint64_t round(uint64_t acc, uint64_t input) { return rotl(acc + input * P2, 31) * P1; }
uint64_t merge(uint64_t acc, uint64_t v) { return (acc ^ round(0, v)) * P1 + P4; }

}  // namespace

Xxh64::Xxh64(uint64_t seed) : v_{seed + P1 + P2, seed + P2, seed, seed - P1}, seed_(seed) {}

void Xxh64::update(const void* data, size_t bytes) {
  auto p = static_cast<const unsigned char*>(data);
  total_ += bytes;
  if (buffered_ + bytes < 32) {
    if (bytes) std::memcpy(buffer_ + buffered_, p, bytes);
    buffered_ += bytes;
    return;
  }
  if (buffered_) {  // complete the pending stripe first
    const size_t take = 32 - buffered_;
    std::memcpy(buffer_ + buffered_, p, take);
    for (int i = 0; i < 4; ++i) v_[i] = round(v_[i], read64(buffer_ + 8 * i));
    p += take;
    bytes -= take;
    buffered_ = 0;
  }
  for (; bytes >= 32; p += 32, bytes -= 32)
    for (int i = 0; i < 4; ++i) v_[i] = round(v_[i], read64(p + 8 * i));
  if (bytes) std::memcpy(buffer_, p, bytes);
  buffered_ = bytes;
}

uint64_t Xxh64::digest() const {
  uint64_t h;
  if (total_ >= 32) {
    h = rotl(v_[0], 1) + rotl(v_[1], 7) + rotl(v_[2], 12) + rotl(v_[3], 18);
    for (int i = 0; i < 4; ++i) h = merge(h, v_[i]);
  } else {
    h = seed_ + P5;
  }
  h += total_;
  const unsigned char* p = buffer_;
  size_t n = buffered_;
  for (; n >= 8; p += 8, n -= 8) h = rotl(h ^ round(0, read64(p)), 27) * P1 + P4;
  if (n >= 4) {
    h = rotl(h ^ (static_cast<uint64_t>(read32(p)) * P1), 23) * P2 + P3;
    p += 4;
    n -= 4;
  }
  for (; n > 0; ++p, --n) h = rotl(h ^ (*p * P5), 11) * P1;
  h ^= h >> 33;
  h *= P2;
  h ^= h >> 29;
  h *= P3;
  h ^= h >> 32;
  return h;
}

uint64_t xxh64(const void* data, size_t bytes, uint64_t seed) {
  Xxh64 h(seed);
  h.update(data, bytes);
  return h.digest();
}

FileDigest xxh64_file(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) fail("checksum", "{}: cannot open: {}", path, std::strerror(errno));
  std::vector<unsigned char> chunk(1 << 20);
  Xxh64 h;
  FileDigest d;
  size_t n;
  while ((n = std::fread(chunk.data(), 1, chunk.size(), f)) > 0) {
    h.update(chunk.data(), n);
    d.bytes += n;
  }
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  if (failed) fail("checksum", "{}: read error", path);
  d.hash = h.digest();
  return d;
}

std::string hex64(uint64_t value) { return fmt::format("{:016x}", value); }

uint64_t parse_hex64(std::string_view text, std::string_view where) {
  uint64_t v = 0;
  const auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), v, 16);
  KILN_CHECK(text.size() == 16 && ec == std::errc() && ptr == text.data() + text.size(), where,
             "'{}' is not a 16-digit hex value", text);
  return v;
}

}  // namespace kiln
