// Loading OpenBLAS with the right kernels.
//
// OpenBLAS (a DYNAMIC_ARCH build, as Debian's) picks its kernel family once, in its
// library constructor: from OPENBLAS_CORETYPE if set, else from the CPU's family and model
// numbers. Its table only knows the CPUs older than the release: 0.3.21 (Debian 12) sends
// an Intel family-6 model it does not list, e.g. Emerald Rapids (model 0xCF), through to
// the Pentium 4 case and runs SSE3 "Prescott" kernels on an AVX-512 machine, and
// hypervisors that hide the model make it worse. That halves the CPU path's training speed.
//
// kiln therefore chooses the core from the CPU's features (what the kernels need, not
// which product it is), and has to say so before OpenBLAS's constructor runs. A linked
// library's constructor runs before main and before the executable's own constructors.
// An ELF .preinit_array hook runs earlier still, but before libc has set up `environ`,
// and libc's initializer then resets `environ` to the original block, so a variable set
// there never reaches OpenBLAS (tried on glibc 2.36). Re-executing the process with the
// variable set would work, but costs a second start and surprises debuggers and callers.
// So kiln does not link OpenBLAS: on the first BLAS call it sets OPENBLAS_CORETYPE (only
// where the user has not), loads the library with dlopen (its constructor reads the
// variable then), and removes the variable again so child processes see the user's
// environment. The load happens once, on the first call, before the trainer starts any
// thread (setenv is not safe against a concurrent getenv).
#include "ops/blas.h"

#include "core/error.h"

#include <dlfcn.h>
#include <fmt/format.h>

#include <cstdlib>
#include <vector>

#ifndef KILN_OPENBLAS_DIR
#define KILN_OPENBLAS_DIR ""
#endif

namespace kiln {
namespace {

constexpr const char* kCoreTypeVariable = "OPENBLAS_CORETYPE";
constexpr const char* kSoname = "libopenblas.so.0";

struct LoadedBlas {
  BlasLibrary library;
  BlasInfo info;
};

template <typename Fn>
Fn resolve(void* handle, const char* name, const std::string& path) {
  void* symbol = dlsym(handle, name);
  KILN_CHECK(symbol != nullptr, "blas", "{} has no symbol {}", path, name);
  return reinterpret_cast<Fn>(symbol);
}

// The library kiln was built against (the OpenMP build that CMake found), else the soname
// through the loader's search path (LD_LIBRARY_PATH: scripts/gpu_stage.sh bundles it).
void* open_library(std::string& path) {
  std::vector<std::string> candidates;
  if (*KILN_OPENBLAS_DIR) candidates.push_back(std::string(KILN_OPENBLAS_DIR) + "/" + kSoname);
  candidates.push_back(kSoname);
  std::string errors;
  for (const std::string& candidate : candidates) {
    if (void* handle = dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL)) {
      path = candidate;
      return handle;
    }
    errors += fmt::format("; {}", dlerror());
  }
  fail("blas", "cannot load OpenBLAS (Debian: libopenblas0-openmp){}", errors);
}

// Puts the environment back as the user had it (unset, or set but empty).
void restore_core_variable(bool was_set) {
  if (was_set)
    setenv(kCoreTypeVariable, "", 1);
  else
    unsetenv(kCoreTypeVariable);
}

LoadedBlas load() {
  LoadedBlas loaded;
  const char* variable = std::getenv(kCoreTypeVariable);
  const bool variable_was_set = variable != nullptr;
  const bool user_chose = variable_was_set && *variable;
  const std::string kiln_core = user_chose ? std::string() : preferred_openblas_core();
  if (!kiln_core.empty()) setenv(kCoreTypeVariable, kiln_core.c_str(), 1);
  std::string path;
  void* handle = nullptr;
  try {
    handle = open_library(path);
  } catch (...) {
    if (!kiln_core.empty()) restore_core_variable(variable_was_set);
    throw;
  }
  if (!kiln_core.empty()) restore_core_variable(variable_was_set);
  // The handle stays open for the life of the process.

  loaded.library.sgemm = resolve<decltype(&cblas_sgemm)>(handle, "cblas_sgemm", path);
  loaded.library.dgemm = resolve<decltype(&cblas_dgemm)>(handle, "cblas_dgemm", path);
  loaded.library.set_num_threads =
      resolve<decltype(&openblas_set_num_threads)>(handle, "openblas_set_num_threads", path);
  const auto get_config = resolve<decltype(&openblas_get_config)>(handle, "openblas_get_config", path);
  const auto get_corename = resolve<decltype(&openblas_get_corename)>(handle, "openblas_get_corename", path);

  // "OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH ...": the name and the version.
  const std::string config = get_config();
  const size_t second_space = config.find(' ', config.find(' ') + 1);
  loaded.info.library = config.substr(0, second_space);
  loaded.info.core = get_corename();
  loaded.info.chosen_by = !kiln_core.empty() ? "kiln" : user_chose ? kCoreTypeVariable : "OpenBLAS";
  loaded.info.path = path;
  // A core name this OpenBLAS does not know leaves it to its own detection: say so.
  if (!kiln_core.empty() && loaded.info.core != kiln_core)
    warn("blas", fmt::format("{} did not take {}={} (it runs {})", loaded.info.library, kCoreTypeVariable,
                             kiln_core, loaded.info.core));
  return loaded;
}

const LoadedBlas& loaded_blas() {
  static const LoadedBlas loaded = load();
  return loaded;
}

}  // namespace

std::string preferred_openblas_core() {
  // These test the instruction sets and the OS's support for their registers (XSAVE
  // state). __builtin_cpu_init fills libgcc's CPU model, which its constructor does too:
  // called here in case the first BLAS call comes from another static initializer.
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
    return "SkylakeX";
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return "Haswell";
  return "";
}

const BlasLibrary& blas() { return loaded_blas().library; }

const BlasInfo& blas_info() { return loaded_blas().info; }

std::string blas_summary() {
  const BlasInfo& info = blas_info();
  const char* by = info.chosen_by == "kiln" ? "kiln's choice" : info.chosen_by == "OpenBLAS" ? "OpenBLAS's choice"
                                                                                           : "from OPENBLAS_CORETYPE";
  return fmt::format("{} {} kernels, {}", info.library, info.core, by);
}

}  // namespace kiln
