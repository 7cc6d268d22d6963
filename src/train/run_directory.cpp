#include "train/run_directory.h"

#include "core/error.h"
#include "core/printable.h"
#include "core/small_file.h"
#include "io/durable_io.h"
#include "train/checkpoint.h"
#include "train/run_paths.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <random>
#include <sys/file.h>
#include <unistd.h>

namespace kiln {

namespace fs = std::filesystem;

namespace {

constexpr std::string_view kKey = "train.out_dir";

// Exists, and is a file or a directory with something in it.
bool holds_something(const fs::path& p) {
  std::error_code ec;
  if (!fs::exists(p, ec)) return false;
  if (!fs::is_directory(p, ec)) return true;
  return fs::directory_iterator(p, ec) != fs::directory_iterator();
}

// What a checkpoint directory holds that a run made: checkpoints, `latest`, `best` and
// leftovers of saves.
bool is_checkpoint_entry(const std::string& name) {
  return name.starts_with("step-") || name.starts_with(".tmp-") || name.starts_with(".trash-") || name == "latest" ||
         name == "best" || name == "latest.tmp" || name == "best.tmp";
}

}  // namespace

RunDirectory::RunDirectory(const Config& config) : config_(config) {
  const std::string path = (fs::path(config.train.out_dir) / kRunLockFile).string();
  lock_fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock_fd_ < 0) fail(kKey, "{}: cannot open: {}", path, std::strerror(errno));
  if (::flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    char holder[32] = {};
    const ssize_t n = ::pread(lock_fd_, holder, sizeof(holder) - 1, 0);
    std::string pid = n > 0 ? std::string(holder, static_cast<size_t>(n)) : "";
    while (!pid.empty() && (pid.back() == '\n' || pid.back() == ' ')) pid.pop_back();
    ::close(lock_fd_);
    lock_fd_ = -1;
    if (error != EWOULDBLOCK) fail(kKey, "{}: cannot lock: {}", path, std::strerror(error));
    fail(kKey, "{}: in use by another kiln run (pid {}, which holds {}); wait for it to end or choose another "
         "train.out_dir", config.train.out_dir, pid.empty() ? "unknown" : printable(pid), path);
  }
  const std::string pid = fmt::format("{}\n", ::getpid());
  // Who holds it, for the message of a run refused; the lock itself is the flock.
  if (::ftruncate(lock_fd_, 0) != 0 || ::pwrite(lock_fd_, pid.data(), pid.size(), 0) < 0)
    warn(kKey, fmt::format("{}: cannot record this process's pid: {}", path, std::strerror(errno)));
}

RunDirectory::~RunDirectory() {
  if (lock_fd_ >= 0) ::close(lock_fd_);  // releases the lock
}

std::vector<std::string> RunDirectory::earlier_run_files() const {
  std::vector<std::string> found;
  for (const RunOutput& output : run_outputs(config_)) {
    if (fs::path(output.path).filename() == kRunLockFile) continue;
    if (holds_something(output.path)) found.push_back(output.path);
  }
  // What a restart set aside. Not the other ranks' rank-N.log: this run's ranks opened
  // theirs before rank 0 got here (each start rewrites its own).
  const fs::path out = config_.train.out_dir;
  for (const std::string& name : {config_.log.metrics_file + ".previous", config_.log.tensorboard_dir + ".previous"})
    if (holds_something(out / name)) found.push_back((out / name).string());
  return found;
}

void RunDirectory::check_fresh_start(bool overwrite) const {
  if (overwrite) return;
  const std::vector<std::string> found = earlier_run_files();
  if (found.empty()) return;
  std::string named = found[0];
  if (found.size() > 1) named += fmt::format(" and {} more", found.size() - 1);
  fail(kKey, "{} holds an earlier run ({}): pass --resume to continue it, --overwrite to replace it, or choose "
       "another train.out_dir", config_.train.out_dir, named);
}

void RunDirectory::remove_earlier_run() const {
  const std::string root = checkpoint_root(config_);
  for (const std::string& path : earlier_run_files()) {
    std::error_code ec;
    if (path == root) {  // only what runs put there: checkpoint.dir may be the user's own directory
      for (const auto& entry : fs::directory_iterator(root, ec))
        if (is_checkpoint_entry(entry.path().filename().string())) fs::remove_all(entry.path(), ec);
    } else {
      fs::remove_all(path, ec);
    }
    if (ec) fail(kKey, "{}: cannot remove (--overwrite): {}", path, ec.message());
  }
  fmt::print("overwrite: removed the earlier run's files from {}\n", config_.train.out_dir);
}

void RunDirectory::check_restart_without_checkpoint() const {
  const std::string summary = (fs::path(config_.train.out_dir) / "summary.json").string();
  KILN_CHECK(!fs::exists(summary), kKey,
             "{} holds a finished run ({}) and no checkpoint to resume: pass --overwrite (without --resume) to "
             "replace it, or choose another train.out_dir", config_.train.out_dir, summary);
}

std::string RunDirectory::run_id() const {
  const std::string path = (fs::path(config_.train.out_dir) / kRunIdFile).string();
  if (!fs::exists(path)) return "";
  std::string id = read_small_file(path, 256, "run id file", kKey);
  while (!id.empty() && (id.back() == '\n' || id.back() == '\r')) id.pop_back();
  return id;
}

void RunDirectory::write_run_id(const std::string& id) const {
  io::replace_file_atomically((fs::path(config_.train.out_dir) / kRunIdFile).string(), id + "\n", kKey);
}

std::string new_run_id() {
  std::random_device device;  // /dev/urandom: two runs started in one instant still differ
  const uint64_t id = (static_cast<uint64_t>(device()) << 32) ^ device();
  return fmt::format("{:016x}", id);
}

void check_same_run(const std::string& checkpoint, const std::string& checkpoint_run, const std::string& out_dir,
                    const std::string& dir_run) {
  if (checkpoint_run.empty() || dir_run.empty() || checkpoint_run == dir_run) return;
  fail("checkpoint", "{}: belongs to run {}, but {} holds run {} ({}/{}): --resume continues a run directory's own "
       "checkpoints only; choose the checkpoint of this run, or another train.out_dir for that one",
       checkpoint, printable(checkpoint_run), out_dir, printable(dir_run), out_dir, kRunIdFile);
}

}  // namespace kiln
