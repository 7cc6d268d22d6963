// XXH64: a fast 64-bit checksum for checkpoint files (our own ~80-line implementation
// of the public xxHash64 algorithm, so no dependency; test vectors in test_checkpoint).
//
// It detects corruption (a flipped byte, a truncated or garbled file), not tampering:
// it is not a cryptographic hash. Streaming, so files of any size hash in chunks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kiln {

class Xxh64 {
 public:
  explicit Xxh64(uint64_t seed = 0);
  void update(const void* data, size_t bytes);
  uint64_t digest() const;

 private:
  uint64_t v_[4];
  uint64_t seed_;
  uint64_t total_ = 0;
  unsigned char buffer_[32];
  size_t buffered_ = 0;
};

uint64_t xxh64(const void* data, size_t bytes, uint64_t seed = 0);
inline uint64_t xxh64_bytes(const void* data, size_t bytes, uint64_t seed = 0) { return xxh64(data, bytes, seed); }
// A separate name: an xxh64(string_view, seed) overload would lose to the one above for
// xxh64("abc", 7), which reads 7 bytes.
inline uint64_t xxh64_string(std::string_view s, uint64_t seed = 0) { return xxh64(s.data(), s.size(), seed); }

// XXH64 of a whole file and its size, read in chunks. Throws "[checksum] PATH: ..." when
// the file cannot be read.
struct FileDigest {
  uint64_t hash = 0;
  uint64_t bytes = 0;
};
FileDigest xxh64_file(const std::string& path);

// 16 lowercase hex digits, and back (throws on anything else).
std::string hex64(uint64_t value);
uint64_t parse_hex64(std::string_view text, std::string_view where);

}  // namespace kiln
