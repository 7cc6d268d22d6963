// Shared harness of the GPU test suites: copies between host and device, NaN poisoning of
// outputs, and relative-error comparison of fp32 GPU results against fp64 CPU references
// (the op table's measure, op_table/op_compare.h). Single ops are checked by the op table
// (test_gpu_op_table.cpp); these serve the model, decoder and attention suites.
#pragma once

#include "core/device_memory.h"
#include "core/tensor.h"
#include "op_table/op_compare.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

namespace kiln::gpu_test {

// ---- harness ---------------------------------------------------------------------------

// Elements smaller than this fraction of the output's scale are judged against it: see
// op_table/op_compare.h.
using op_test::kFloorFraction;

// fp32 kernels against an fp64 reference: the op table's f32 row.
inline const op_test::Tolerance kF32 = op_test::tolerance_of(DType::f32);

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
// error is a fraction of the terms' scale, not of each element). Returns the worst error.
inline double expect_close(const char* name, const Tensor& gpu_f32, const Tensor& ref_f64, double tolerance,
                           double scale = 0, double floor_fraction = kFloorFraction) {
  const float* a = gpu_f32.data<float>();
  const double* b = ref_f64.data<double>();
  const op_test::Comparison c =
      op_test::compare(std::vector<double>(a, a + gpu_f32.numel()), std::vector<double>(b, b + ref_f64.numel()), scale,
                       {}, floor_fraction);
  EXPECT_TRUE(c.within(tolerance)) << name << ": " << c.str() << ", tolerance " << tolerance;
  ::testing::Test::RecordProperty(std::string(name) + "_max_rel_err", fmt::format("{:.3e}", c.worst));
  return c.worst;
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
