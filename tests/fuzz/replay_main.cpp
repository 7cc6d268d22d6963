// The corpus replay test: `kiln_fuzz_replay TARGET PATH...` runs the fuzz target TARGET
// (the same function libFuzzer calls) on every file of each PATH (a file, or a folder
// read in name order), so the seeds and every regression input a fuzzer once crashed on
// are checked by every build, with gcc and without libFuzzer. A bug aborts naming the
// input; a run with no input at all fails, so a missing corpus cannot pass.
#include "fuzz_target.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

namespace fs = std::filesystem;

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s TARGET PATH...\n", argv[0]);
    return 2;
  }
  const kiln::fuzz::TargetFn target = kiln::fuzz::find_target(argv[1]);
  if (target == nullptr) {
    std::fprintf(stderr, "kiln_fuzz_replay: no target '%s'\n", argv[1]);
    return 2;
  }
  std::vector<fs::path> inputs;
  for (int i = 2; i < argc; ++i) {
    if (fs::is_directory(argv[i])) {
      for (const auto& entry : fs::directory_iterator(argv[i]))
        if (entry.is_regular_file()) inputs.push_back(entry.path());
    } else {
      inputs.emplace_back(argv[i]);
    }
  }
  std::sort(inputs.begin(), inputs.end());
  if (inputs.empty()) {
    std::fprintf(stderr, "kiln_fuzz_replay: no inputs for '%s'\n", argv[1]);
    return 1;
  }
  for (const fs::path& input : inputs) {
    std::ifstream in(input, std::ios::binary);
    if (!in) {
      std::fprintf(stderr, "kiln_fuzz_replay: cannot read %s\n", input.c_str());
      return 1;
    }
    std::stringstream bytes;
    bytes << in.rdbuf();
    kiln::fuzz::set_current_input(input.string());
    target(bytes.str());
  }
  std::printf("%s: %zu inputs replayed, no bug\n", argv[1], inputs.size());
  return 0;
}
