// The CPU path's BLAS: OpenBLAS, loaded on first use with the kernel family ("core") that
// the CPU's features allow. Why it is loaded at run time rather than linked: blas.cpp.
#pragma once

#include <cblas.h>

#include <string>

namespace kiln {

// OpenBLAS's entry points that kiln calls, resolved once.
struct BlasLibrary {
  decltype(&cblas_sgemm) sgemm = nullptr;
  decltype(&cblas_dgemm) dgemm = nullptr;
  decltype(&openblas_set_num_threads) set_num_threads = nullptr;
};

// What the CPU path runs, for the training banner and the tests.
struct BlasInfo {
  std::string library;    // "OpenBLAS 0.3.21" (the head of openblas_get_config())
  std::string core;       // the kernels in use (openblas_get_corename()): "SkylakeX", "Haswell", ...
  std::string chosen_by;  // "kiln" (from the CPU's features), "OPENBLAS_CORETYPE" (the user's) or
                          // "OpenBLAS" (its own detection: kiln knows no better core for this CPU)
  std::string path;       // the file loaded
};

// Loads OpenBLAS on the first call (thread-safe); throws kiln::Error if it cannot be loaded.
const BlasLibrary& blas();
const BlasInfo& blas_info();
// "OpenBLAS 0.3.21 SkylakeX kernels, kiln's choice" (or "from OPENBLAS_CORETYPE", or
// "OpenBLAS's choice"): one phrase for banners.
std::string blas_summary();

// The OpenBLAS core kiln asks for on this CPU, or "" where it leaves the choice to OpenBLAS:
// "SkylakeX" with AVX-512 F/CD/BW/DQ/VL, else "Haswell" with AVX2 and FMA.
std::string preferred_openblas_core();

}  // namespace kiln
