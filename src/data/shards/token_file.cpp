#include "data/shards/token_file.h"

#include "core/checksum.h"
#include "core/error.h"

#include <fmt/format.h>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <exception>
#include <filesystem>

namespace kiln {

std::shared_ptr<const MappedFile> MappedFile::open(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) fail("data", "cannot open '{}' (a directory)", path);
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("data", "cannot open '{}'", path);
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    fail("data", "cannot stat '{}'", path);
  }
  std::shared_ptr<MappedFile> m(new MappedFile());
  m->path_ = path;
  m->size_ = static_cast<size_t>(st.st_size);
  if (m->size_ > 0) {
    void* p = ::mmap(nullptr, m->size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      fail("data", "cannot map '{}' ({} bytes)", path, m->size_);
    }
    m->data_ = static_cast<const unsigned char*>(p);
  }
  ::close(fd);
  return m;
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<unsigned char*>(data_), size_);
}

std::string TokenFile::where(uint64_t token_index) const {
  return fmt::format("{}:offset {}", path, token_offset + token_index * static_cast<uint64_t>(tokens.width()));
}

namespace {

template <typename T>
void split_typed(TokenFile& file, std::span<const T> t, int32_t delimiter, int64_t vocab_size, BadInputLog& log) {
  const auto delim = static_cast<T>(delimiter);
  const auto limit = static_cast<uint64_t>(vocab_size);
  // Most files are clean: one vectorized pass for the largest id, then the split needs
  // no per-token range check.
  uint64_t largest = 0;
  for (const T v : t) largest = std::max<uint64_t>(largest, static_cast<uint32_t>(v));
  const bool check = largest >= limit;
  const uint64_t n = t.size();
  uint64_t begin = 0;
  while (begin <= n) {
    uint64_t end = static_cast<uint64_t>(std::find(t.begin() + static_cast<ptrdiff_t>(begin), t.end(), delim) - t.begin());
    bool keep = end > begin;
    if (keep && check) {
      for (uint64_t i = begin; i < end; ++i) {
        const uint64_t id = static_cast<uint32_t>(t[i]);
        if (id >= limit) {
          log.report(BadInput::token_out_of_range, file.where(i), fmt::format("token {} >= vocab {}", id, vocab_size));
          keep = false;
          break;
        }
      }
    }
    if (keep) file.docs.push_back(DocRange{begin, end});
    begin = end + 1;
  }
}

template <typename T>
void check_typed(TokenFile& file, std::span<const T> t, int64_t vocab_size, BadInputLog& log) {
  const auto limit = static_cast<uint64_t>(vocab_size);
  size_t kept = 0;
  for (const DocRange& d : file.docs) {
    bool keep = true;
    if (d.end == d.begin) {
      log.report(BadInput::empty_document, file.where(d.begin), "empty document (no tokens)");
      keep = false;
    } else {
      uint64_t largest = 0;
      for (uint64_t i = d.begin; i < d.end; ++i) largest = std::max<uint64_t>(largest, static_cast<uint32_t>(t[i]));
      if (largest >= limit) {
        uint64_t i = d.begin;
        while (static_cast<uint32_t>(t[i]) < limit) ++i;
        log.report(BadInput::token_out_of_range, file.where(i),
                   fmt::format("token {} >= vocab {}", static_cast<uint32_t>(t[i]), vocab_size));
        keep = false;
      }
    }
    if (keep) file.docs[kept++] = d;
  }
  file.docs.resize(kept);
}

}  // namespace

void split_at_delimiter(TokenFile& file, int32_t delimiter, int64_t vocab_size, BadInputLog& log) {
  file.docs.clear();
  if (file.tokens.width() == 2) {
    split_typed(file, std::span(static_cast<const uint16_t*>(file.tokens.data()), file.tokens.size()), delimiter,
                vocab_size, log);
  } else {
    split_typed(file, std::span(static_cast<const uint32_t*>(file.tokens.data()), file.tokens.size()), delimiter,
                vocab_size, log);
  }
}

void check_documents(TokenFile& file, int64_t vocab_size, BadInputLog& log) {
  if (file.tokens.width() == 2) {
    check_typed(file, std::span(static_cast<const uint16_t*>(file.tokens.data()), file.tokens.size()), vocab_size, log);
  } else {
    check_typed(file, std::span(static_cast<const uint32_t*>(file.tokens.data()), file.tokens.size()), vocab_size, log);
  }
}

std::vector<TokenFile> open_token_files(const std::vector<std::string>& paths, const OpenTokenFile& open_one,
                                        BadInputLog& log) {
  const auto n = static_cast<int64_t>(paths.size());
  std::vector<TokenFile> files(paths.size());
  std::vector<std::unique_ptr<BadInputLog>> logs(paths.size());
  std::vector<std::exception_ptr> errors(paths.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < n; ++i) {
    const auto k = static_cast<size_t>(i);
    logs[k] = std::make_unique<BadInputLog>(log.lenient());
    try {
      files[k] = open_one(paths[k], *logs[k]);
    } catch (...) {
      errors[k] = std::current_exception();
    }
  }
  for (size_t k = 0; k < paths.size(); ++k) {
    if (errors[k]) std::rethrow_exception(errors[k]);
    log.merge(*logs[k]);
  }
  return files;
}

uint64_t hash_bytes(const void* data, size_t bytes, uint64_t seed) {
  Xxh64 h(seed);
  h.update(data, bytes);
  return h.digest();
}

uint32_t load_u32(const unsigned char* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;  // kiln runs on little-endian hosts (x86-64, aarch64)
}

uint64_t load_u64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

}  // namespace kiln
