// train.precision = "fp8_blockwise" on the GPU (ops/fp8/fp8_blockwise_linear.h):
//
//   One linear layer's forward and backward (bf16 x, W, dy; f32 bias and weight gradient)
//   against the CPU emulation fed the same bf16 values, held to test_gpu_fp8_linear.cpp's
//   bound (the codes and scales are the same bits on both sides: test_gpu_fp8.cpp checks
//   the kernels, the column tiles included). The weight gradient's product comes out of
//   cuBLASLt in bf16 before it is added in f32, so it is held to the bf16 output's bound.
//   A call with a dimension that is not a multiple of 128 runs the bf16 GEMM: bit for bit
//   ops::linear.
//   A small model whose every projection is whole 128-blocks trains on the GPU in
//   fp8_blockwise, in captured step graphs: it learns, stays near its bf16 run without
//   equalling it, and two runs give the same bits.
#include "core/arena.h"
#include "core/exec_context.h"
#include "gpu/bf16_tensors.h"
#include "gpu/fp8_linear_checks.h"
#include "gpu/gpu_harness.h"
#include "grad_check.h"
#include "ops/elementwise/elementwise.h"
#include "ops/fp8/fp8_blockwise_linear.h"
#include "ops/linear/linear.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

namespace kiln {
namespace {

using gpu_test::bf16_values;
using gpu_test::download_f32;
using gpu_test::to_device;
using gpu_test::to_host;
using namespace gpu_test::fp8_linear;
namespace fp8 = ops::fp8;

struct Layer {
  Layer(int64_t n, int64_t in, int64_t out) {
    for (Workspace* ws : {&cpu_ws, &gpu_ws}) {
      const Device device = ws == &cpu_ws ? Device::cpu : Device::cuda;
      ws->reserve_peak(fp8::fp8_blockwise_linear_scratch_bytes(device, n, in, out, true), Workspace::Level::gemm);
      ws->allocate();
    }
  }
  ExecContext exec;
  Workspace cpu_ws{Device::cpu}, gpu_ws{Device::cuda};
};

// `vector`: the quantize's vector kernels (train.fp8_blockwise_kernels = "vector").
void expect_layer_matches_cpu_emulation(bool vector) {
  SCOPED_TRACE(vector ? "vector quantize kernels" : "scalar quantize kernels");
  // Two tiles along in, three blocks along n: every product's K is whole 128-blocks.
  const int64_t n = 384, in = 256, out = 128;
  ASSERT_TRUE(fp8::fp8_blockwise_linear_runs_fp8(Device::cuda, n, in, out));
  Layer layer(n, in, out);
  const OwnedTensor x = bf16_values(Shape{n, in}, 31, 1.0), w = bf16_values(Shape{out, in}, 32, 0.05);
  const OwnedTensor dy = bf16_values(Shape{n, out}, 33, 1e-3), dx0 = bf16_values(Shape{n, in}, 34, 1e-4);
  const OwnedTensor bias = bf16_values(Shape{out}, 35, 0.1), db0 = bf16_values(Shape{out}, 37, 1e-2);
  // An outlier in one tile of x and of dy: blockwise scaling keeps it to its own tile.
  x->data<float>()[5] = 48.0f, dy->data<float>()[7] = 0.25f;

  // The CPU emulation, in f32; dW from zero, so the bound's |reference| is the product's.
  const OwnedTensor y_cpu(DType::f32, Device::cpu, Shape{n, out});
  fp8::fp8_blockwise_linear_forward(layer.exec, layer.cpu_ws, *x, *w, *bias, *y_cpu);
  const OwnedTensor dx_cpu(DType::f32, Device::cpu, Shape{n, in}), g_cpu(DType::f32, Device::cpu, Shape{out, in});
  const OwnedTensor db_cpu(DType::f32, Device::cpu, Shape{out});
  copy_tensor(*dx0, *dx_cpu), zero_tensor(*g_cpu), copy_tensor(*db0, *db_cpu);
  fp8::fp8_blockwise_linear_backward(layer.exec, layer.cpu_ws, *x, *w, *dy, *dx_cpu, true, *g_cpu, *db_cpu);

  // The GPU: bf16 activations and weight, f32 bias and gradients.
  const OwnedTensor x_d = gpu_test::upload(*x, DType::bf16), w_d = gpu_test::upload(*w, DType::bf16);
  const OwnedTensor dy_d = gpu_test::upload(*dy, DType::bf16), dx_d = gpu_test::upload(*dx0, DType::bf16);
  const OwnedTensor bias_d = to_device(*bias), g_d = to_device(*g_cpu), db_d = to_device(*db0);
  ops::zero(layer.exec, *g_d);
  const OwnedTensor y_d = gpu_test::poisoned(DType::bf16, Shape{n, out});
  fp8::fp8_blockwise_linear_forward(layer.exec, layer.gpu_ws, *x_d, *w_d, *bias_d, *y_d, vector);
  fp8::fp8_blockwise_linear_backward(layer.exec, layer.gpu_ws, *x_d, *w_d, *dy_d, *dx_d, true, *g_d, *db_d, vector);

  expect_within_bound(*download_f32(*y_d), *y_cpu,
                      abs_products(n, out, in, x->data<float>(), in, 1, w->data<float>(), in, 1), in, true, "y");
  expect_within_bound(*download_f32(*dx_d), *dx_cpu,
                      abs_products(n, in, out, dy->data<float>(), out, 1, w->data<float>(), 1, in), out, true, "dx");
  expect_within_bound(*download_f32(*g_d), *g_cpu,
                      abs_products(out, in, n, dy->data<float>(), 1, out, x->data<float>(), 1, in), n, true, "dW");
  const OwnedTensor db_gpu = to_host(*db_d);
  for (int64_t j = 0; j < out; ++j)
    EXPECT_NEAR(db_gpu->data<float>()[j], db_cpu->data<float>()[j], 1e-6) << "dbias " << j;

  // The halves: dx alone, and dW alone into a bf16 gradient (cuBLASLt's own accumulation
  // instead of the f32 add: within the same bound).
  const OwnedTensor dx_alone = gpu_test::poisoned(DType::bf16, Shape{n, in});
  fp8::fp8_blockwise_linear_backward(layer.exec, layer.gpu_ws, Tensor(), *w_d, *dy_d, *dx_alone, false, Tensor(),
                                     Tensor(), vector);
  const OwnedTensor dx_plain_cpu(DType::f32, Device::cpu, Shape{n, in});
  fp8::fp8_blockwise_linear_backward(layer.exec, layer.cpu_ws, Tensor(), *w, *dy, *dx_plain_cpu, false, Tensor(),
                                     Tensor());
  expect_within_bound(*download_f32(*dx_alone), *dx_plain_cpu,
                      abs_products(n, in, out, dy->data<float>(), out, 1, w->data<float>(), 1, in), out, true,
                      "dx alone");
  const OwnedTensor g_bf16 = gpu_test::upload(*g_cpu, DType::bf16);
  ops::zero(layer.exec, *g_bf16);
  fp8::fp8_blockwise_linear_backward(layer.exec, layer.gpu_ws, *x_d, *w_d, *dy_d, Tensor(), false, *g_bf16, Tensor(),
                                     vector);
  expect_within_bound(*download_f32(*g_bf16), *g_cpu,
                      abs_products(out, in, n, dy->data<float>(), 1, out, x->data<float>(), 1, in), n, true,
                      "dW in bf16");
}

TEST(GpuFp8BlockwiseLinear, ForwardAndBackwardMatchTheCpuEmulation) {
  expect_layer_matches_cpu_emulation(false);
  expect_layer_matches_cpu_emulation(true);
}

// A dimension that is not a multiple of 128: the bf16 GEMM, bit for bit.
TEST(GpuFp8BlockwiseLinear, PartialBlocksRunTheBf16Gemm) {
  const int64_t n = 64, in = 256, out = 128;
  EXPECT_FALSE(fp8::fp8_blockwise_linear_runs_fp8(Device::cuda, n, in, out));
  Layer layer(n, in, out);
  expect_bf16_gemm_bit_for_bit(
      [&](const Tensor& x, const Tensor& w, const Tensor& y) {
        fp8::fp8_blockwise_linear_forward(layer.exec, layer.gpu_ws, x, w, Tensor(), y);
      },
      n, in, out, 41);
}

TEST(GpuFp8BlockwiseLinear, ASmallModelTrainsInCapturedGraphsNearItsBf16Run) {
  // hidden 128, q|k|v 256 rows, gate|up 512, 256 tokens a micro-batch: whole blocks.
  const std::vector<std::string> blocks = {"model.hidden=128", "model.head_dim=32", "model.ffn_hidden=256"};
  const std::string dir = test::temp_dir("kiln-gpu-fp8-blockwise-train");
  const gpu_test::TrainingRun bf16 = train(dir + "/bf16", "bf16", blocks);
  const gpu_test::TrainingRun a = train(dir + "/fp8a", "fp8_blockwise", blocks);
  const gpu_test::TrainingRun b = train(dir + "/fp8b", "fp8_blockwise", blocks);
  const auto [mean, most] = gaps_to_bf16(a, bf16, 40);
  // fp8_tensorwise's bars (test_gpu_fp8_linear.cpp).
  EXPECT_LT(mean, 0.01);
  EXPECT_LT(most, 0.05);
  EXPECT_GT(most, 0.0) << "fp8_blockwise logged the bf16 run's losses exactly";
  RecordProperty("mean_gap", std::to_string(mean));
  RecordProperty("largest_gap", std::to_string(most));
  EXPECT_EQ(a.lines, b.lines);
  EXPECT_EQ(a.weights, b.weights);
  // The scalar quantize kernels give the vector ones' (the default's) codes and scales, so
  // the same run bit for bit.
  std::vector<std::string> scalar_blocks = blocks;
  scalar_blocks.push_back("train.fp8_blockwise_kernels=scalar");
  const gpu_test::TrainingRun s = train(dir + "/fp8s", "fp8_blockwise", scalar_blocks);
  EXPECT_EQ(a.lines, s.lines);
  EXPECT_EQ(a.weights, s.weights);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kiln
