#include "data/readers/compressed.h"

#include <zlib.h>
#include <zstd.h>

#include <cstdio>
#include <filesystem>
#include <vector>

namespace kiln {

namespace {

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

constexpr size_t kChunk = size_t{1} << 20;

// Plain file reads, large chunks.
class FileStream final : public ByteStream {
 public:
  explicit FileStream(const std::string& path) : path_(path) {
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec)) fail("data", "cannot open '{}' (a directory)", path);
    file_ = std::fopen(path.c_str(), "rb");
    if (file_ == nullptr) fail("data", "cannot open '{}'", path);
  }
  ~FileStream() override {
    if (file_ != nullptr) std::fclose(file_);
  }
  FileStream(const FileStream&) = delete;
  FileStream& operator=(const FileStream&) = delete;

  size_t read(char* buffer, size_t size) override {
    const size_t got = std::fread(buffer, 1, size, file_);
    if (got < size && std::ferror(file_)) fail("data", "cannot read '{}'", path_);
    offset_ += got;
    return got;
  }
  size_t file_offset() const override { return offset_; }

 private:
  std::string path_;
  std::FILE* file_ = nullptr;
  size_t offset_ = 0;
};

// What the decoders share: the compressed file and its input buffer, and how a defect is
// reported: the bytes decoded before it are returned first, the next read() throws.
class DecompressingStream : public ByteStream {
 public:
  DecompressingStream(const std::string& path, size_t in_size) : path_(path), file_(path), in_(in_size) {}
  size_t file_offset() const override { return file_.file_offset(); }

 protected:
  void throw_if_failed() const {
    if (!error_.empty()) throw CorruptStream(error_);
  }
  // `got` bytes decoded before the defect: returned now (the error kept for the next read),
  // or none: thrown at once.
  size_t defer(size_t got, std::string error) {
    if (got == 0) throw CorruptStream(error);
    error_ = std::move(error);
    return got;
  }

  std::string path_;
  FileStream file_;
  std::vector<char> in_;

 private:
  std::string error_;
};

// gzip (and zlib) members, one after another (concatenated .gz files are valid gzip).
class GzipStream final : public DecompressingStream {
 public:
  explicit GzipStream(const std::string& path) : DecompressingStream(path, kChunk) {
    if (inflateInit2(&z_, 15 + 32) != Z_OK) fail("data", "{}: cannot start gzip decoder", path_);
  }
  ~GzipStream() override { inflateEnd(&z_); }

  size_t read(char* buffer, size_t size) override {
    throw_if_failed();
    z_.next_out = reinterpret_cast<Bytef*>(buffer);
    z_.avail_out = static_cast<uInt>(std::min(size, size_t{1} << 30));
    while (z_.avail_out > 0) {
      if (z_.avail_in == 0) {
        const size_t got = file_.read(in_.data(), in_.size());
        if (got == 0) {
          if (in_member_)
            return defer(size - z_.avail_out,
                         fmt::format("gzip stream ends mid-member at offset {}", file_.file_offset()));
          break;
        }
        z_.next_in = reinterpret_cast<Bytef*>(in_.data());
        z_.avail_in = static_cast<uInt>(got);
      }
      in_member_ = true;
      const int rc = inflate(&z_, Z_NO_FLUSH);
      if (rc == Z_STREAM_END) {
        in_member_ = false;
        inflateReset(&z_);
      } else if (rc != Z_OK && rc != Z_BUF_ERROR) {
        return defer(size - z_.avail_out, fmt::format("corrupt gzip data near offset {} ({})", file_.file_offset(),
                                                      z_.msg != nullptr ? z_.msg : "inflate error"));
      }
    }
    return size - z_.avail_out;
  }

 private:
  z_stream z_{};
  bool in_member_ = false;
};

// zstd frames, one after another.
class ZstdStream final : public DecompressingStream {
 public:
  explicit ZstdStream(const std::string& path) : DecompressingStream(path, ZSTD_DStreamInSize()) {
    stream_ = ZSTD_createDStream();
    if (stream_ == nullptr) fail("data", "{}: cannot start zstd decoder", path_);
  }
  ~ZstdStream() override { ZSTD_freeDStream(stream_); }

  size_t read(char* buffer, size_t size) override {
    throw_if_failed();
    ZSTD_outBuffer out{buffer, size, 0};
    while (out.pos < out.size) {
      if (input_.pos == input_.size) {
        const size_t got = file_.read(in_.data(), in_.size());
        if (got == 0) {
          if (frame_open_) return defer(out.pos, fmt::format("zstd stream ends mid-frame at offset {}", file_.file_offset()));
          break;
        }
        input_ = ZSTD_inBuffer{in_.data(), got, 0};
      }
      const size_t rc = ZSTD_decompressStream(stream_, &out, &input_);
      if (ZSTD_isError(rc))
        return defer(out.pos, fmt::format("corrupt zstd data near offset {} ({})", file_.file_offset(), ZSTD_getErrorName(rc)));
      frame_open_ = rc != 0;
    }
    return out.pos;
  }

 private:
  ZSTD_inBuffer input_{nullptr, 0, 0};
  ZSTD_DStream* stream_ = nullptr;
  bool frame_open_ = false;
};

}  // namespace

Compression compression_of(std::string_view path) {
  if (ends_with(path, ".zst") || ends_with(path, ".zstd")) return Compression::zstd;
  if (ends_with(path, ".gz")) return Compression::gzip;
  return Compression::none;
}

std::string_view strip_compression_extension(std::string_view path) {
  for (const std::string_view ext : {".zst", ".zstd", ".gz"})
    if (ends_with(path, ext)) return path.substr(0, path.size() - ext.size());
  return path;
}

std::unique_ptr<ByteStream> open_byte_stream(const std::string& path) {
  switch (compression_of(path)) {
    case Compression::zstd: return std::make_unique<ZstdStream>(path);
    case Compression::gzip: return std::make_unique<GzipStream>(path);
    case Compression::none: break;
  }
  return std::make_unique<FileStream>(path);
}

std::string read_all_bytes(const std::string& path) {
  const auto stream = open_byte_stream(path);
  std::string bytes;
  std::vector<char> chunk(kChunk);
  try {
    for (size_t got; (got = stream->read(chunk.data(), chunk.size())) > 0;) bytes.append(chunk.data(), got);
  } catch (const CorruptStream& e) {
    fail("data", "{}: {}", path, e.what());
  }
  return bytes;
}

}  // namespace kiln
