#include "io/durable_io.h"

#include "core/error.h"

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <unistd.h>

namespace kiln::io {

namespace fs = std::filesystem;

void write_file_synced(const std::string& path, std::string_view bytes, std::string_view where) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(where, "{}: cannot create: {}", path, std::strerror(errno));
  size_t done = 0;
  int err = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      err = n < 0 ? errno : EIO;
      break;
    }
    done += static_cast<size_t>(n);
  }
  // fsync reports write-back errors (EIO, ENOSPC on some file systems) that write() did not.
  if (err == 0 && ::fsync(fd) != 0) err = errno;
  if (::close(fd) != 0 && err == 0) err = errno;
  if (err != 0) fail(where, "{}: write failed: {}", path, std::strerror(err));
}

void fsync_path(const std::string& path, std::string_view where) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(where, "{}: cannot open to sync: {}", path, std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  // Some file systems do not support fsync on directories (EINVAL); nothing to do there.
  if (rc != 0 && err != EINVAL) fail(where, "{}: fsync failed: {}", path, std::strerror(err));
}

void rename_synced(const std::string& from, const std::string& to, std::string_view where) {
  if (::rename(from.c_str(), to.c_str()) != 0)
    fail(where, "{}: cannot rename {} into place: {}", to, from, std::strerror(errno));
  const fs::path parent = fs::path(to).parent_path();
  fsync_path(parent.empty() ? "." : parent.string(), where);
}

void replace_file_atomically(const std::string& path, std::string_view bytes, std::string_view where) {
  const std::string tmp = path + ".tmp";
  try {
    write_file_synced(tmp, bytes, where);
  } catch (const Error&) {
    ::unlink(tmp.c_str());
    throw;
  }
  rename_synced(tmp, path, where);
}

void ensure_writable_dir(const std::string& dir, std::string_view key) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail(key, "{}: cannot create: {}", dir, ec.message());
  KILN_CHECK(fs::is_directory(dir, ec), key, "{}: not a directory", dir);
  const std::string probe = (fs::path(dir) / ".kiln-write-test").string();
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail(key, "{}: not writable: {}", dir, std::strerror(errno));
  ::close(fd);
  ::unlink(probe.c_str());
}

std::string read_file_bytes(const std::string& path, std::string_view where) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(where, "{}: cannot read: {}", path, std::strerror(errno));
  std::ostringstream ss;
  ss << in.rdbuf();
  KILN_CHECK(!in.bad(), where, "{}: read error", path);
  return ss.str();
}

}  // namespace kiln::io
