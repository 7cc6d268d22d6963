// Byte streams over files, decompressing .zst (zstd) and .gz (gzip) on the fly, so the
// text readers see plain bytes and never hold a whole compressed file in memory.
#pragma once

#include "core/error.h"

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

namespace kiln {

enum class Compression { none, gzip, zstd };

// By extension: ".zst"/".zstd" -> zstd, ".gz" -> gzip, anything else -> none.
Compression compression_of(std::string_view path);
// The path without a compression extension ("a.jsonl.zst" -> "a.jsonl"), for format
// detection by the inner extension.
std::string_view strip_compression_extension(std::string_view path);

// A compressed stream that is corrupt or ends mid-frame. Readers catch it and report
// BadInput::truncated (strict: an error naming the file; lenient: the rest of the file
// is skipped and counted).
class CorruptStream : public Error {
 public:
  using Error::Error;
};

class ByteStream {
 public:
  virtual ~ByteStream() = default;
  // Up to `size` bytes into `buffer`; 0 only at the end of the stream. Throws
  // kiln::Error on an I/O error and CorruptStream on corrupt or truncated data.
  virtual size_t read(char* buffer, size_t size) = 0;
  // Bytes consumed from the file so far (compressed bytes for a compressed file).
  virtual size_t file_offset() const = 0;
};

// Opens `path` for streaming; throws "[data] cannot open 'PATH'" (also for a directory).
std::unique_ptr<ByteStream> open_byte_stream(const std::string& path);
// The whole decompressed content (tests, small files).
std::string read_all_bytes(const std::string& path);

}  // namespace kiln
