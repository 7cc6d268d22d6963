#include "core/small_file.h"

#include "core/error.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace kiln {

namespace {

std::string_view file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

// Closes the descriptor on every way out, errors included.
struct FdCloser {
  int fd;
  ~FdCloser() { ::close(fd); }
};

void check_regular_file(int fd, const std::string& path, std::string_view what, std::string_view where) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) fail(where, "{}: cannot stat: {}", path, std::strerror(errno));
  KILN_CHECK(S_ISREG(st.st_mode), where, "{}: is {}, not a {}", path, file_kind(st.st_mode), what);
}

}  // namespace

int open_regular_file(const std::string& path, std::string_view what, std::string_view where) {
  // O_NONBLOCK: opening a FIFO with no writer would otherwise wait forever, before fstat
  // could refuse it. It changes nothing for a regular file.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) fail(where, "{}: cannot open file: {}", path, std::strerror(errno));
  try {
    check_regular_file(fd, path, what, where);
  } catch (...) {
    ::close(fd);
    throw;
  }
  return fd;
}

std::string read_small_file(const std::string& path, size_t max_bytes, std::string_view what, std::string_view where) {
  const FdCloser file{open_regular_file(path, what, where)};
  // One byte past the cap tells "exactly max_bytes" from "more"; the buffer grows with
  // what is read, so the cap is never allocated for a small file.
  std::string bytes;
  char chunk[65536];
  for (;;) {
    const ssize_t n = ::read(file.fd, chunk, sizeof(chunk));
    if (n < 0 && errno == EINTR) continue;
    KILN_CHECK(n >= 0, where, "{}: read error: {}", path, std::strerror(errno));
    if (n == 0) break;
    bytes.append(chunk, static_cast<size_t>(n));
    KILN_CHECK(bytes.size() <= max_bytes, where, "{}: larger than {} bytes: not a {}", path, max_bytes, what);
  }
  return bytes;
}

}  // namespace kiln
