#include "core/small_file.h"

#include "core/error.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>

namespace kiln {

std::string read_small_file(const std::string& path, size_t max_bytes, std::string_view what, std::string_view where) {
  std::error_code ec;
  KILN_CHECK(!std::filesystem::is_directory(path, ec), where, "{}: is a directory, not a {}", path, what);
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(where, "{}: cannot open file: {}", path, std::strerror(errno));
  // One byte past the cap tells "exactly max_bytes" from "more".
  std::string bytes(max_bytes + 1, '\0');
  in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  KILN_CHECK(!in.bad(), where, "{}: read error: {}", path, std::strerror(errno));
  bytes.resize(static_cast<size_t>(in.gcount()));
  KILN_CHECK(bytes.size() <= max_bytes, where, "{}: larger than {} bytes: not a {}", path, max_bytes, what);
  return bytes;
}

}  // namespace kiln
