// Shared helpers for the test suites.
#pragma once

#include "core/rng.h"
#include "core/error.h"
#include "core/tensor.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace kiln::test {

// A host tensor filled from N(0, scale) with a fixed seed.
OwnedTensor random_tensor(DType dtype, Shape shape, uint64_t seed, double scale = 1.0);
// A fresh empty temporary directory, removed by the caller (or left for inspection).
std::string temp_dir(const std::string& prefix);
// Writes text to a file (creating directories).
void write_file(const std::string& path, const std::string& text);
std::string read_file(const std::string& path);
// Runs a shell command, returns its exit code, and captures stdout+stderr.
int run_command(const std::string& command, std::string* output);
// The repository root: $KILN_SOURCE_DIR when set (tests run from a copy of the tree, as on
// the GPU machine), else the source directory this build was configured from.
std::string source_dir();
// tests/data under source_dir().
std::string test_data_dir();
// The message of the kiln::Error that `fn` throws (fails the calling test if none).
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected kiln::Error";
  return "";
}

// The training losses a run logged, step by step (the "train" records of RUN_DIR/metrics.jsonl).
std::vector<double> train_losses(const std::string& run_dir);

// Path of the built `kiln` binary.
std::string kiln_binary();

// `kiln serve MODEL ARGS...` as a child process on an ephemeral port (--port 0), its output
// in a log file under `dir`. The destructor kills it if it still runs.
class ServeProcess {
 public:
  ServeProcess(const std::string& model, const std::vector<std::string>& args, const std::string& dir);
  ~ServeProcess();
  ServeProcess(const ServeProcess&) = delete;
  ServeProcess& operator=(const ServeProcess&) = delete;
  // The port it listens on, waiting up to `seconds` for it to be published; 0 if never.
  int wait_for_port(double seconds = 10);
  // SIGTERM, then up to 10 s for it to exit (SIGKILL after that); the exit code, -1 if it
  // did not exit by itself.
  int stop();
  std::string log() const;
  // Sends `sig` (SIGSTOP and SIGCONT, to hold the server still while a test fills its queue).
  void signal(int sig) const;
  int pid() const { return pid_; }

 private:
  int pid_ = -1;
  std::string port_file_, log_;
};
// The Python interpreter with the test oracles (tokenizers, safetensors, gguf), from
// scripts/python_env.sh via CMake's KILN_PYTHON. Fails the calling test if not configured.
std::string kiln_python();

}  // namespace kiln::test
