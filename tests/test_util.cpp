#include "test_util.h"

#include <nlohmann/json.hpp>

#include <array>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

namespace kiln::test {

OwnedTensor random_tensor(DType dtype, Shape shape, uint64_t seed, double scale) {
  OwnedTensor t(dtype, Device::cpu, shape);
  Rng rng(seed);
  const int64_t n = t->numel();
  if (dtype == DType::f32) {
    for (int64_t i = 0; i < n; ++i) t->data<float>()[i] = static_cast<float>(rng.normal() * scale);
  } else if (dtype == DType::f64) {
    for (int64_t i = 0; i < n; ++i) t->data<double>()[i] = rng.normal() * scale;
  } else {
    fail("test", "random_tensor supports f32 and f64");
  }
  return t;
}

std::vector<double> train_losses(const std::string& run_dir) {
  std::vector<double> losses;
  std::ifstream in(run_dir + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j["kind"] == "train") losses.push_back(j["loss"].get<double>());
  }
  return losses;
}

std::string temp_dir(const std::string& prefix) {
  std::string pattern = (std::filesystem::temp_directory_path() / (prefix + "-XXXXXX")).string();
  if (!mkdtemp(pattern.data())) fail("test", "mkdtemp failed for {}", pattern);
  return pattern;
}

void write_file(const std::string& path, const std::string& text) {
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  std::ofstream out(path, std::ios::binary);
  out << text;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

int run_command(const std::string& command, std::string* output) {
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  if (!pipe) return -1;
  std::array<char, 4096> buffer;
  std::string text;
  size_t n;
  while ((n = fread(buffer.data(), 1, buffer.size(), pipe)) > 0) text.append(buffer.data(), n);
  const int status = pclose(pipe);
  if (output) *output = text;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

ServeProcess::ServeProcess(const std::string& model, const std::vector<std::string>& args, const std::string& dir)
    : port_file_(dir + "/serve.port"), log_(dir + "/serve.log") {
  std::vector<std::string> argv = {"kiln", "serve", model, "--port", "0", "--port-file", port_file_};
  argv.insert(argv.end(), args.begin(), args.end());
  std::filesystem::remove(port_file_);  // a file left by an earlier server in `dir`
  std::filesystem::remove(log_);
  const std::string binary = kiln_binary();
  std::vector<char*> cargv;  // built before fork: the child only redirects and execs
  for (std::string& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  const pid_t pid = fork();
  if (pid == 0) {  // the child: output to the log, then exec
    FILE* out = freopen(log_.c_str(), "w", stdout);
    (void)out;
    dup2(fileno(stdout), 2);
    execv(binary.c_str(), cargv.data());
    _exit(127);
  }
  pid_ = pid;
}

ServeProcess::~ServeProcess() {
  if (pid_ > 0) {
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
  }
}

int ServeProcess::wait_for_port(double seconds) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (pid_ > 0 && std::chrono::steady_clock::now() < deadline) {
    const std::string text = read_file(port_file_);
    if (!text.empty() && text.back() == '\n') return std::stoi(text);
    if (waitpid(pid_, nullptr, WNOHANG) == pid_) {  // it exited before listening
      pid_ = -1;
      return 0;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return 0;
}

int ServeProcess::stop() {
  if (pid_ <= 0) return -1;
  kill(pid_, SIGTERM);
  int status = -1;
  for (int i = 0; i < 200; ++i) {  // up to 10 s, then kill it
    if (waitpid(pid_, &status, WNOHANG) == pid_) {
      pid_ = -1;
      return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  kill(pid_, SIGKILL);
  waitpid(pid_, nullptr, 0);
  pid_ = -1;
  return -1;
}

std::string ServeProcess::log() const { return read_file(log_); }

void ServeProcess::signal(int sig) const {
  if (pid_ > 0) kill(pid_, sig);
}

std::string kiln_binary() {
  const char* env = std::getenv("KILN_BINARY");  // a staged binary (the GPU machine)
  return env && *env ? env : KILN_BINARY;
}

std::string source_dir() {
  const char* env = std::getenv("KILN_SOURCE_DIR");
  return env && *env ? env : KILN_SOURCE_DIR;
}

std::string test_data_dir() { return source_dir() + "/tests/data"; }

std::string kiln_python() {
  const std::string python = KILN_PYTHON;
  if (python.empty()) fail("test", "KILN_PYTHON is not configured: run scripts/setup.sh (it makes build/pyenv)");
  return python;
}

}  // namespace kiln::test
