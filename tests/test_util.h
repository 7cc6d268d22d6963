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

// Path of the built `kiln` binary.
std::string kiln_binary();
// The Python interpreter with the test oracles (tokenizers, safetensors, gguf), from
// scripts/python_env.sh via CMake's KILN_PYTHON. Fails the calling test if not configured.
std::string kiln_python();

}  // namespace kiln::test
