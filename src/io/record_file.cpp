#include "io/record_file.h"

#include "core/error.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <unistd.h>
#include <utility>

namespace kiln::io {

RecordFile::RecordFile(std::string where, std::string path, bool stop_on_error)
    : where_(std::move(where)), path_(std::move(path)), stop_on_error_(stop_on_error) {
  fd_ = ::open(path_.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) fail(where_, "{}: cannot open for writing: {}", path_, std::strerror(errno));
}

RecordFile::~RecordFile() {
  if (fd_ >= 0) ::close(fd_);
}

void RecordFile::append(std::string_view bytes) {
  if (failed_) return;
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd_, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string cause = n < 0 ? std::strerror(errno) : "nothing written";
      if (stop_on_error_) fail(where_, "{}: write failed: {} (checkpoint.on_save_error = stop)", path_, cause);
      failed_ = true;
      warn(where_, fmt::format("{}: write failed: {}; checkpoint.on_save_error = continue: training goes on, "
                               "without further {} records",
                               path_, cause, where_));
      return;
    }
    done += static_cast<size_t>(n);
  }
}

}  // namespace kiln::io
