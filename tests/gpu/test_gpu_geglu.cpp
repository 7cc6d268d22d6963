// GeGLU on the GPU through the ops:: front end, in fp32 and bf16, against the f64 CPU
// reference run on the same inputs (bf16 inputs rounded to bf16 first, so both sides read
// identical numbers). Outputs are poisoned (NaN bytes) before each run; NaN/Inf never pass.
// Sizes: one row, F a multiple of 8 (vector path) and not (scalar path), offset views.
//
// Tolerances: max over elements of |gpu - ref| / max(|ref|, 1% of the largest |ref|):
//   fp32 out            1e-5   tanhf (~2 ulp) and a few products
//   fp32 dgate_up       1e-4   gelu' = 0.5 (1 + t) + ... cancels for gates below -3
//   bf16 out, dgate_up  1e-2   one bf16 rounding (<= 2^-8 relative) over fp32 math
// Measured on the H200: bf16 out and dgate_up 3.9e-3 (one rounding), the scalar and vector
// paths the same bits. The backward that rewrites its dout buffer with the forward's output must reproduce the
// forward's bits and the plain backward's gradient bits.
#include "core/device_memory.h"
#include "core/tensor.h"
#include "gpu/bf16_tensors.h"
#include "gpu/gpu_harness.h"
#include "ops/geglu/geglu.h"
#include "test_util.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>

namespace kiln {
namespace {

using namespace gpu_test;

class GegluGpu : public GpuTest {};

TEST_F(GegluGpu, ForwardAndBackwardMatchTheReference) {
  for (DType dtype : {DType::f32, DType::bf16})
    for (auto [n, f] : {std::pair<int64_t, int64_t>{1, 64}, {37, 768}, {1000, 1000}, {3, 2048}, {37, 13}, {5, 1001},
                        {45, 77}}) {
      SCOPED_TRACE(fmt::format("{} n={} f={}", dtype_name(dtype), n, f));
      OwnedTensor gu = test::random_tensor(DType::f32, Shape{n, 2 * f}, 80 + static_cast<uint64_t>(n * f), 2.0);
      OwnedTensor dout = test::random_tensor(DType::f32, Shape{n, f}, 81 + static_cast<uint64_t>(n * f));
      gu->data<float>()[0] = 7.0f;  // saturated gates on both sides
      if (f > 1) gu->data<float>()[1] = -6.5f;
      if (dtype == DType::bf16) round_to_bf16(*gu), round_to_bf16(*dout);

      OwnedTensor gu64 = to_f64(*gu), dout64 = to_f64(*dout);
      OwnedTensor out64(DType::f64, Device::cpu, Shape{n, f}), dgu64(DType::f64, Device::cpu, Shape{n, 2 * f});
      ops::geglu_forward(process_exec(), *gu64, *out64);
      ops::geglu_backward(process_exec(), *gu64, *dout64, *dgu64);

      OwnedTensor gud = upload(*gu, dtype), doutd = upload(*dout, dtype);
      OwnedTensor outd = poisoned(dtype, Shape{n, f}), dgud = poisoned(dtype, Shape{n, 2 * f});
      ops::geglu_forward(process_exec(), *gud, *outd);
      ops::geglu_backward(process_exec(), *gud, *doutd, *dgud);
      const bool bf16 = dtype == DType::bf16;
      expect_close("out", *download_f32(*outd), *out64, bf16 ? 1e-2 : kF32.forward);
      expect_close("dgate_up", *download_f32(*dgud), *dgu64, bf16 ? 1e-2 : kF32.backward);

      // The MLP's form: the backward rewrites dout with the forward's output.
      OwnedTensor dout_then_out = upload(*dout, dtype), dgu2 = poisoned(dtype, Shape{n, 2 * f});
      ops::geglu_backward(process_exec(), *gud, *dout_then_out, *dgu2, *dout_then_out);
      EXPECT_TRUE(same_bytes(*to_host(*dgu2), *to_host(*dgud))) << "dgate_up differs when out is rebuilt";
      EXPECT_TRUE(same_bytes(*to_host(*dout_then_out), *to_host(*outd))) << "the rebuilt out is not the forward's";
    }
}

// Views one element into their buffers (not 16-byte aligned; F = 64 would take the vector
// path otherwise) give the aligned views' results and write nothing before their start.
TEST_F(GegluGpu, UnalignedViewsTakeTheScalarPath) {
  const int64_t n = 9, f = 64;
  for (DType dtype : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dtype));
    const size_t elem = dtype_size(dtype);
    OwnedTensor gu = test::random_tensor(DType::f32, Shape{n * 2 * f + 1}, 90, 2.0);
    OwnedTensor gud = upload(*gu, dtype), outd = poisoned(dtype, Shape{n * f + 1});
    const Tensor gate_up(static_cast<char*>(gud->raw()) + elem, dtype, Device::cuda, Shape{n, 2 * f});
    const Tensor out(static_cast<char*>(outd->raw()) + elem, dtype, Device::cuda, Shape{n, f});
    ops::geglu_forward(process_exec(), gate_up, out);
    // The same values, aligned.
    OwnedTensor aligned_in(dtype, Device::cuda, Shape{n, 2 * f}), aligned_out = poisoned(dtype, Shape{n, f});
    copy_tensor(gate_up, *aligned_in);
    ops::geglu_forward(process_exec(), *aligned_in, *aligned_out);
    OwnedTensor got = download_f32(*outd), want = download_f32(*aligned_out);
    EXPECT_TRUE(std::isnan(got->data<float>()[0])) << "wrote before the start";
    const Tensor got_values(got->data<float>() + 1, DType::f32, Device::cpu, Shape{n, f});
    // The same formula per element; only the compiler's contraction of the unrolled loop
    // could differ (an fp32 ulp, or one bf16 rounding step).
    expect_close("out (scalar path vs vector path)", got_values, *to_f64(*want), dtype == DType::bf16 ? 1e-2 : 1e-6);
  }
}

}  // namespace
}  // namespace kiln
