// Helpers for the checkpoint, resume and fault suites: a tiny corpus and model that
// train in a fraction of a second, runs of the real `kiln` binary (in the foreground, or
// in the background to signal it), and readers for what a run leaves behind.
#pragma once

#include "test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <string>
#include <sys/wait.h>
#include <unistd.h>
#include <utility>
#include <vector>

namespace kiln::test {

// `documents` short pseudo-text documents separated by blank lines; lengths vary so
// packing and piece splitting (max_seq_len 64) are exercised.
inline std::string write_tiny_corpus(const std::string& dir, int documents) {
  static const char* words[] = {"the", "king", "sword", "river", "of", "night", "a", "crown", "stone", "and",
                                "wind", "speaks", "to", "fire", "old", "light"};
  std::string text;
  uint64_t x = 12345;
  for (int d = 0; d < documents; ++d) {
    const int n = 4 + d * 7 % 23;
    for (int w = 0; w < n; ++w) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      text += words[(x >> 33) % 16];
      text += w + 1 < n ? " " : ".";
    }
    text += "\n\n";
  }
  const std::string path = dir + "/corpus.txt";
  write_file(path, text);
  return path;
}

// A `kiln train` command line for a tiny run on `corpus` into `out_dir` (2 threads:
// bitwise results need a fixed thread count). `extra` is appended (more --set, flags).
inline std::string tiny_train(const std::string& corpus, const std::string& out_dir, const std::string& extra = "") {
  return kiln_binary() + " train " KILN_SOURCE_DIR "/configs/default.toml --set data.path=" + corpus +
         " --set train.out_dir=" + out_dir +
         " --set data.val_fraction=0 --set model.hidden=32 --set model.layers=1 --set model.heads=2"
         " --set model.kv_heads=1 --set model.head_dim=16 --set model.ffn_hidden=64 --set model.max_seq_len=64"
         " --set train.micro_batch_tokens=256 --set train.grad_accum=2 --set train.steps=12"
         " --set optim.warmup_steps=3 --set optim.lr=1e-2 --set train.eval_every=0 --set train.eval_batches=0"
         " --set train.sample_every=0 --set train.sample_tokens=0 --set log.every=1 --set train.threads=2"
         " --set checkpoint.every=4 --set checkpoint.keep_last=0 " +
         extra;
}

// `command` (a kiln command line, as tiny_train's) run on `nproc` local ranks by `kiln launch`.
inline std::string launched(int nproc, const std::string& command) {
  return kiln_binary() + " launch --nproc " + std::to_string(nproc) + " --grace 20 -- " +
         command.substr(kiln_binary().size() + 1);
}

// Runs `command` with KILN_FAULT_INJECT=`fault` (none when empty); returns the exit
// code (-SIGNAL when killed by a signal) and captures the output.
inline int run_with_fault(const std::string& command, const std::string& fault, std::string* output) {
  const std::string line = (fault.empty() ? "" : "KILN_FAULT_INJECT=" + fault + " ") + command + " 2>&1";
  FILE* pipe = popen(line.c_str(), "r");
  if (!pipe) return -1000;
  std::string text;
  char buffer[4096];
  size_t n;
  while ((n = fread(buffer, 1, sizeof(buffer), pipe)) > 0) text.append(buffer, n);
  const int status = pclose(pipe);
  if (output) *output = text;
  // popen runs `sh -c`: a child killed by SIGKILL shows as exit code 128 + 9.
  if (WIFEXITED(status)) return WEXITSTATUS(status) > 128 ? -(WEXITSTATUS(status) - 128) : WEXITSTATUS(status);
  return WIFSIGNALED(status) ? -WTERMSIG(status) : -1000;
}

// Runs `command` in the background (its output to `log`); returns its pid, for a signal.
inline pid_t spawn(const std::string& command, const std::string& log) {
  const pid_t pid = fork();
  if (pid == 0) {
    const std::string line = "exec " + command + " > " + log + " 2>&1";
    execl("/bin/sh", "sh", "-c", line.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  return pid;
}

// One `kind == "train"` record of metrics.jsonl, the fields a resumed run must repeat
// exactly (timings are left out).
struct TrainRecord {
  int64_t step = 0;
  nlohmann::json loss, grad_norm, lr, tokens;
  bool operator==(const TrainRecord&) const = default;
};

inline std::vector<TrainRecord> train_records(const std::string& out_dir) {
  std::vector<TrainRecord> out;
  std::ifstream in(out_dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j["kind"] == "train") out.push_back({j["step"], j["loss"], j["grad_norm"], j["lr"], j["tokens"]});
  }
  return out;
}

inline std::vector<nlohmann::json> metrics_of_kind(const std::string& out_dir, const std::string& kind) {
  std::vector<nlohmann::json> out;
  std::ifstream in(out_dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j["kind"] == kind) out.push_back(j);
  }
  return out;
}

// A test's own directory with a tiny corpus in it (corpus_); the directory is kept when the
// test fails, to look at, and removed when it passes.
class TinyRunTest : public ::testing::Test {
 protected:
  explicit TinyRunTest(std::string name, int documents = 60) : name_(std::move(name)), documents_(documents) {}
  void SetUp() override {
    dir_ = temp_dir(name_);
    corpus_ = write_tiny_corpus(dir_, documents_);
  }
  void TearDown() override {
    if (!HasFailure()) std::filesystem::remove_all(dir_);
  }
  std::string dir_, corpus_;

 private:
  std::string name_;
  int documents_;
};

// The "step" of each record, in order.
inline std::vector<int64_t> steps_of(const std::vector<nlohmann::json>& records) {
  std::vector<int64_t> steps;
  for (const auto& r : records) steps.push_back(r["step"].get<int64_t>());
  return steps;
}

inline std::string checkpoint_path(const std::string& out_dir, int64_t step) {
  char name[32];
  std::snprintf(name, sizeof(name), "step-%08lld", static_cast<long long>(step));
  return out_dir + "/checkpoints/" + name;
}

inline std::string latest_of(const std::string& out_dir) {
  std::string s = read_file(out_dir + "/checkpoints/latest");
  while (!s.empty() && s.back() == '\n') s.pop_back();
  return s;
}

// Leftovers of interrupted saves in a checkpoint directory.
inline int count_leftovers(const std::string& out_dir) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(out_dir + "/checkpoints")) {
    const std::string name = e.path().filename().string();
    if (name.rfind(".tmp-", 0) == 0 || name.rfind(".trash-", 0) == 0 || name == "latest.tmp") ++n;
  }
  return n;
}

#define EXPECT_CONTAINS(haystack, needle) \
  EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << "missing '" << (needle) << "' in:\n" << (haystack)

// Runs `command`, which must fail within `seconds` with exit code 1 and one line,
// "kiln: error: ..."; returns the output.
inline std::string one_line_error(const std::string& command, double seconds = 10) {
  std::string output;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(run_with_fault(command, "", &output), 1) << command << "\n" << output;
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_LT(took, seconds) << command;
  EXPECT_EQ(output.rfind("kiln: error: ", 0), 0u) << output;
  EXPECT_EQ(std::count(output.begin(), output.end(), '\n'), 1) << "not one line:\n" << output;
  return output;
}

// The run's last output line (an error line ends the output).
inline std::string last_line(const std::string& output) {
  std::string s = output;
  while (!s.empty() && s.back() == '\n') s.pop_back();
  const size_t nl = s.rfind('\n');
  return nl == std::string::npos ? s : s.substr(nl + 1);
}

}  // namespace kiln::test
