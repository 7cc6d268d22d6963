// Shared harness of the GPU test suites: copies between host and device, NaN poisoning of
// outputs, and relative-error comparison of fp32 GPU results against fp64 CPU references.
#pragma once

#include "core/device_memory.h"
#include "core/tensor.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

namespace kiln::gpu_test {

// ---- harness ---------------------------------------------------------------------------

// Tolerances for fp32 kernels against an fp64 reference, by output.
struct Tolerance {
  double forward = 1e-5;   // y, rstd: a row sum, then elementwise products
  double backward = 1e-4;  // dx (cancellation in g - x*coef), dw (long column sums)
};
inline constexpr Tolerance kF32;
// Elements smaller than this fraction of the output's scale are judged against it (an
// absolute error scaled to the magnitudes the kernel computes with), so rounding near
// zero crossings and in cancelling differences does not count as relative error, while a
// wrong element (off by O(scale)) still fails by orders of magnitude. The scale is the
// largest |ref| unless an op knows its terms are larger (a sum's sum of |terms|).
inline constexpr double kFloorFraction = 1e-2;

inline OwnedTensor to_device(const Tensor& host) {
  OwnedTensor dev(host.dtype(), Device::cuda, host.shape());
  copy_tensor(host, *dev);
  return dev;
}

inline OwnedTensor to_host(const Tensor& dev) {
  OwnedTensor host(dev.dtype(), Device::cpu, dev.shape());
  copy_tensor(dev, *host);
  return host;
}

// Fills a device tensor with 0xFF bytes (a NaN in every float).
inline void poison(const Tensor& dev) {
  std::vector<unsigned char> bytes(dev.nbytes(), 0xFF);
  copy_tensor(Tensor(bytes.data(), dev.dtype(), Device::cpu, dev.shape()), dev);
}

inline OwnedTensor to_f64(const Tensor& f32) {
  OwnedTensor out(DType::f64, Device::cpu, f32.shape());
  for (int64_t i = 0; i < f32.numel(); ++i) out->data<double>()[i] = f32.data<float>()[i];
  return out;
}

inline OwnedTensor to_f32(const Tensor& f64) {
  OwnedTensor out(DType::f32, Device::cpu, f64.shape());
  for (int64_t i = 0; i < f64.numel(); ++i) out->data<float>()[i] = static_cast<float>(f64.data<double>()[i]);
  return out;
}

// Checks a GPU result (copied to the host, f32) against an f64 reference; `scale` (when
// larger than the largest |ref|) sets the floor of the relative error's denominator.
// floor_fraction: see kFloorFraction; bf16 results use a wider floor (their absolute
// error is a fraction of the terms' scale, not of each element).
inline double expect_close(const char* name, const Tensor& gpu_f32, const Tensor& ref_f64, double tolerance,
                           double scale = 0, double floor_fraction = kFloorFraction) {
  EXPECT_EQ(gpu_f32.numel(), ref_f64.numel()) << name;
  if (gpu_f32.numel() != ref_f64.numel()) return INFINITY;
  const float* a = gpu_f32.data<float>();
  const double* b = ref_f64.data<double>();
  const int64_t n = ref_f64.numel();
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_TRUE(std::isfinite(b[i])) << name << ": reference is not finite at " << i;
    if (!std::isfinite(b[i])) return INFINITY;
    scale = std::max(scale, std::fabs(b[i]));
  }
  const double floor = std::max(floor_fraction * scale, 1e-30);
  double worst = 0;
  int64_t worst_at = 0;
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_TRUE(std::isfinite(a[i])) << name << "[" << i << "] = " << a[i] << " (unwritten or overflow), ref "
                                     << b[i];
    if (!std::isfinite(a[i])) return INFINITY;
    const double err = std::fabs(a[i] - b[i]) / std::max(std::fabs(b[i]), floor);
    if (err > worst) worst = err, worst_at = i;
  }
  EXPECT_LE(worst, tolerance) << name << ": max relative error " << worst << " at " << worst_at << " (gpu "
                              << a[worst_at] << ", ref " << b[worst_at] << ")";
  ::testing::Test::RecordProperty(std::string(name) + "_max_rel_err", fmt::format("{:.3e}", worst));
  return worst;
}

inline bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

class GpuTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_available()) GTEST_SKIP() << "no CUDA device (kiln built with CUDA, but none is visible)";
  }
};

}  // namespace kiln::gpu_test
