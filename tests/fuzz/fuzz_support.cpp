#include "fuzz_target.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <unistd.h>

namespace kiln::fuzz {
namespace {

std::map<std::string, TargetFn, std::less<>>& targets() {
  static std::map<std::string, TargetFn, std::less<>> table;
  return table;
}

std::string& current_input() {
  static std::string name;
  return name;
}

}  // namespace

TargetRegistration::TargetRegistration(const char* name, TargetFn fn) { targets()[name] = fn; }

TargetFn find_target(std::string_view name) {
  const auto it = targets().find(name);
  return it == targets().end() ? nullptr : it->second;
}

void set_current_input(std::string name) { current_input() = std::move(name); }

void bug(std::string_view what, std::string_view detail) {
  std::fprintf(stderr, "kiln fuzz: bug: %.*s (%.*s)%s%s\n", static_cast<int>(what.size()), what.data(),
               static_cast<int>(detail.size()), detail.data(), current_input().empty() ? "" : " on input ",
               current_input().c_str());
  std::fflush(stderr);
  std::abort();
}

void check_one_line_error(const char* message) {
  const std::string_view m(message);
  if (m.find('\n') != std::string_view::npos) bug("an error of several lines", m);
  if (m.size() < 3 || m.front() != '[' || m.find("] ") == std::string_view::npos) bug("an error without [where]", m);
}

const std::string& scratch_dir() {
  static const std::string dir = [] {
    // Memory (tmpfs) unless TMPDIR says otherwise: every input is written as a file, and on
    // a disk the rewrite of one small file per input costs milliseconds (10x the parse).
    const char* tmp = std::getenv("TMPDIR");
    const char* base = tmp && *tmp ? tmp : access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
    std::string pattern = std::string(base) + "/kiln-fuzz-XXXXXX";
    if (mkdtemp(pattern.data()) == nullptr) bug("cannot make a scratch directory", pattern);
    static const std::string made = pattern;
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all(made, ec);
    });
    return pattern;
  }();
  return dir;
}

std::string scratch_file(const std::string& name, std::string_view bytes) {
  const std::string path = scratch_dir() + "/" + name;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) bug("cannot write a scratch file", path);
  return path;
}

std::string_view part(std::string_view input, size_t index) {
  for (size_t i = 0; i < index; ++i) {
    const size_t nul = input.find('\0');
    if (nul == std::string_view::npos) return {};
    input.remove_prefix(nul + 1);
  }
  return input.substr(0, input.find('\0'));
}

}  // namespace kiln::fuzz
