// train.fp8_experts on the GPU (ops/moe/moe.h's moe_grouped_linear_fp8_*: the quantize steps
// of grouped_gemm_fp8_cuda.h and CUTLASS's FP8 grouped GEMM, grouped_gemm_fp8_sm90.h):
//
//   The three grouped products against the CPU emulation fed the same bf16 values. Both
//   sides quantize the same values with the same scales (the quantize kernels are
//   test_gpu_fp8's, bit for bit), so what is left is the order of fp32 sums, Hopper's
//   in-MMA accumulation, the alpha = sA sB_e product and the output's rounding, bounded per
//   element by test_gpu_fp8's GEMM bound taken over the dequantized operands themselves:
//     |gpu - cpu| <= ((min(k, 128) + 4) 2^-14 + (k + 4) 2^-24) sum_p |qa_ip qb_jp| + 2^-8 |cpu| + 2^-24 |cpu|
//   (2^-8 for a bf16 output). Groupings: an expert without rows, an expert with all of them,
//   row offsets that are not multiples of 16 (the weight gradient's padded transposes), and
//   stale rows past the live ones holding large values (the scales must not read them).
//   The backward's fused cast + padded transpose (grouped_fp8_quantize_padded) bit for bit:
//   its amax, scale_inv and codes are the CPU emulation's tensorwise quantize of the live
//   rows, each at its padded place, padding zero, stale rows neither read nor written.
//   Widths that are not multiples of 16 run the bf16 grouped products, bit for bit.
//   The same bits run to run, and from a captured CUDA graph replayed on new routings.
//   A small MoE model trains in captured step graphs with train.fp8_experts: near its bf16
//   run, not equal to the dense-only FP8 run, and the same bits twice.
#include "core/arena.h"
#include "core/exec_context.h"
#include "gpu/bf16_tensors.h"
#include "gpu/fp8_linear_checks.h"
#include "gpu/gpu_harness.h"
#include "gpu/training_run.h"
#include "grad_check.h"
#include "ops/fp8/fp8_scaling.h"
#include "ops/moe/grouped_gemm_fp8_cuda.h"
#include "ops/moe/grouped_gemm_fp8_sm90.h"
#include "ops/moe/moe.h"
#include "test_util.h"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

namespace kiln {
namespace {

using gpu_test::bf16_values;
using gpu_test::download_f32;
using gpu_test::to_device;
using gpu_test::to_host;
namespace fp8 = ops::fp8;

// A dispatch over `rows` grouped rows with these offsets, on a device.
struct Grouping {
  Grouping(const std::vector<int32_t>& o, int64_t rows, Device device)
      : experts(static_cast<int64_t>(o.size()) - 1),
        counts(DType::i32, device, Shape{experts}),
        offsets(DType::i32, device, Shape{experts + 1}),
        pair_of_row(DType::i32, device, Shape{rows}),
        row_of_pair(DType::i32, device, Shape{rows}) {
    OwnedTensor host(DType::i32, Device::cpu, Shape{experts + 1});
    std::copy(o.begin(), o.end(), host->data<int32_t>());
    copy_tensor(*host, *offsets);
    d = {experts, 1, 0, *counts, *offsets, *pair_of_row, *row_of_pair, Tensor()};
  }
  int64_t experts;
  OwnedTensor counts, offsets, pair_of_row, row_of_pair;
  ops::MoeDispatch d;
};

void set_offsets(const Grouping& g, const std::vector<int32_t>& o) {
  OwnedTensor host(DType::i32, Device::cpu, Shape{g.experts + 1});
  std::copy(o.begin(), o.end(), host->data<int32_t>());
  copy_tensor(*host, *g.offsets);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

std::vector<float> dequantized(const Tensor& t, int64_t rows, int64_t cols, fp8::Format format) {
  return fp8::dequantize(fp8::quantize_tensorwise({t.data<float>(), static_cast<size_t>(rows * cols)}, rows, cols, format));
}

void expect_within_bound(const Tensor& gpu_f32, const Tensor& cpu, const std::vector<double>& abs_sums,
                         const std::vector<int64_t>& ks, bool bf16_output, int64_t first_row, int64_t last_row,
                         const std::string& what) {
  const int64_t cols = cpu.size(1);
  int64_t outside = 0, first = -1;
  double worst = 0;
  for (int64_t i = first_row * cols; i < last_row * cols; ++i) {
    const int64_t k = ks[i];
    const double gemm = (std::min<int64_t>(k, 128) + 4) * std::ldexp(1.0, -14) + (k + 4) * std::ldexp(1.0, -24);
    const double ref = cpu.data<float>()[i], got = gpu_f32.data<float>()[i];
    const double bound = gemm * abs_sums[i] + (bf16_output ? std::ldexp(1.0, -8) : 0.0) * std::fabs(ref) +
                         std::ldexp(1.0, -24) * std::fabs(ref) + 1e-30;
    const double excess = std::fabs(got - ref) / bound;
    if (!(excess <= 1.0)) outside += 1, first = first < 0 ? i : first;
    worst = std::max(worst, excess);
  }
  EXPECT_EQ(outside, 0) << what << ": " << outside << " elements outside the bound (first at " << first
                        << "); worst |error| / bound " << worst;
}

struct Case {
  std::vector<int32_t> offsets;
  int64_t rows;  // >= offsets.back(): the rest are stale
};

// Forward, input gradient and weight gradient (+= onto f32) against the CPU emulation.
void check_against_emulation(const Case& c, int64_t in, int64_t out) {
  const int64_t experts = static_cast<int64_t>(c.offsets.size()) - 1, rows = c.rows, live = c.offsets.back();
  SCOPED_TRACE(fmt::format("experts {}, rows {}, live {}, in {}, out {}", experts, rows, live, in, out));
  const OwnedTensor x = bf16_values(Shape{rows, in}, 21, 1.0), w = bf16_values(Shape{experts * out, in}, 22, 0.05);
  const OwnedTensor dy = bf16_values(Shape{rows, out}, 23, 1e-3), g0 = bf16_values(Shape{experts * out, in}, 24, 1e-2);
  for (int64_t r = live; r < rows; ++r) {  // stale rows: large, so a scale that read them would show
    for (int64_t j = 0; j < in; ++j) x->data<float>()[r * in + j] = 3e4f;
    for (int64_t j = 0; j < out; ++j) dy->data<float>()[r * out + j] = -3e4f;
  }
  for (int64_t e = 0; e < experts; ++e)  // each expert's weight at its own magnitude
    for (int64_t i = 0; i < out * in; ++i) w->data<float>()[e * out * in + i] *= std::ldexp(1.0f, static_cast<int>(e) * 2 - 3);

  const ExecContext exec;
  Workspace cpu_ws{Device::cpu}, gpu_ws{Device::cuda};
  for (Workspace* ws : {&cpu_ws, &gpu_ws}) {
    ws->reserve_peak(ops::moe_grouped_linear_fp8_scratch_bytes(ws == &cpu_ws ? Device::cpu : Device::cuda, rows, experts,
                                                               in, out, true),
                     Workspace::Level::gemm);
    ws->allocate();
  }
  // CPU emulation.
  const Grouping cpu_g(c.offsets, rows, Device::cpu);
  const OwnedTensor y_cpu(DType::f32, Device::cpu, Shape{rows, out}), dx_cpu(DType::f32, Device::cpu, Shape{rows, in});
  const OwnedTensor g_cpu(DType::f32, Device::cpu, Shape{experts * out, in});
  zero_tensor(*y_cpu), zero_tensor(*dx_cpu), copy_tensor(*g0, *g_cpu);
  ops::moe_grouped_linear_fp8_forward(exec, cpu_ws, *x, *w, cpu_g.d, *y_cpu);
  ops::moe_grouped_linear_fp8_backward(exec, cpu_ws, *x, *w, *dy, cpu_g.d, *dx_cpu, *g_cpu);
  // GPU.
  const Grouping gpu_g(c.offsets, rows, Device::cuda);
  const OwnedTensor x_d = gpu_test::upload(*x, DType::bf16), w_d = gpu_test::upload(*w, DType::bf16);
  const OwnedTensor dy_d = gpu_test::upload(*dy, DType::bf16), g_d = to_device(*g0);
  const OwnedTensor y_d = gpu_test::poisoned(DType::bf16, Shape{rows, out}), dx_d = gpu_test::poisoned(DType::bf16, Shape{rows, in});
  ops::moe_grouped_linear_fp8_forward(exec, gpu_ws, *x_d, *w_d, gpu_g.d, *y_d);
  ops::moe_grouped_linear_fp8_backward(exec, gpu_ws, *x_d, *w_d, *dy_d, gpu_g.d, *dx_d, *g_d);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);

  // The dequantized operands the emulation multiplied, for the bound's sum |a b|.
  const std::vector<float> qx = dequantized(*x, live, in, fp8::Format::e4m3);
  const std::vector<float> qdy = dequantized(*dy, live, out, fp8::Format::e5m2);
  std::vector<double> sy(rows * out, 0.0), sdx(rows * in, 0.0), sdw(experts * out * in, 0.0);
  std::vector<int64_t> ky(rows * out, in), kdx(rows * in, out), kdw(experts * out * in, 0);
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t first = c.offsets[e], n = c.offsets[e + 1] - first;
    const std::vector<float> qw = fp8::dequantize(fp8::quantize_tensorwise(
        {w->data<float>() + e * out * in, static_cast<size_t>(out * in)}, out, in, fp8::Format::e4m3));
    for (int64_t r = first; r < first + n; ++r) {
      for (int64_t j = 0; j < out; ++j)
        for (int64_t p = 0; p < in; ++p) sy[r * out + j] += std::fabs(double(qx[r * in + p]) * qw[j * in + p]);
      for (int64_t j = 0; j < in; ++j)
        for (int64_t p = 0; p < out; ++p) sdx[r * in + j] += std::fabs(double(qdy[r * out + p]) * qw[p * in + j]);
    }
    for (int64_t m = 0; m < out; ++m)
      for (int64_t j = 0; j < in; ++j) {
        kdw[(e * out + m) * in + j] = n;
        for (int64_t r = first; r < first + n; ++r)
          sdw[(e * out + m) * in + j] += std::fabs(double(qdy[r * out + m]) * qx[r * in + j]);
      }
  }
  expect_within_bound(*download_f32(*y_d), *y_cpu, sy, ky, true, 0, live, "y");
  expect_within_bound(*download_f32(*dx_d), *dx_cpu, sdx, kdx, true, 0, live, "dx");
  expect_within_bound(*download_f32(*g_d), *g_cpu, sdw, kdw, false, 0, experts * out, "dW");
  // An expert without rows keeps its dW bit for bit.
  const OwnedTensor g_host = to_host(*g_d);
  for (int64_t e = 0; e < experts; ++e) {
    if (c.offsets[e + 1] != c.offsets[e]) continue;
    EXPECT_TRUE(std::equal(g_host->data<float>() + e * out * in, g_host->data<float>() + (e + 1) * out * in,
                           g0->data<float>() + e * out * in))
        << "expert " << e << "'s dW changed";
  }
}

TEST(GpuFp8Experts, GroupedProductsMatchTheCpuEmulation) {
  if (!cuda::sm90::grouped_gemm_fp8_available()) GTEST_SKIP() << "no sm_90a CUTLASS FP8 grouped GEMM on this device/build";
  // Offsets 37, 99: not multiples of 16; three stale rows; expert 0 and 3 without rows.
  check_against_emulation({{0, 0, 37, 99, 99}, 102}, 96, 48);
  // One expert with every row; K of the weight gradient 200 (two promotion intervals).
  check_against_emulation({{0, 0, 200, 200}, 200}, 128, 64);
  // Many small experts, rows 1..9 each.
  std::vector<int32_t> o{0};
  for (int e = 0; e < 9; ++e) o.push_back(o.back() + e + 1);
  check_against_emulation({o, o.back() + 5}, 64, 32);
}

// grouped_fp8_quantize_padded against the CPU emulation's quantize_tensorwise of the live
// rows: the same amax and scale_inv bits, the same codes row-major (live rows only: stale
// rows keep the poison) and at padded[e] + r - offsets[e] of the transpose [cols, ld],
// every other byte of it 0 (the poison replaced). Stale rows hold 3e4 and NaN: an amax or a
// cast that read them would show.
void check_padded_quantize(const Case& c, int64_t cols, fp8::Format format) {
  const int64_t experts = static_cast<int64_t>(c.offsets.size()) - 1, rows = c.rows, live = c.offsets.back();
  SCOPED_TRACE(fmt::format("experts {}, rows {}, live {}, cols {}, {}", experts, rows, live, cols,
                           format == fp8::Format::e4m3 ? "e4m3" : "e5m2"));
  const OwnedTensor x = bf16_values(Shape{rows, cols}, 61, 3.0);
  for (int64_t r = live; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) x->data<float>()[r * cols + j] = j % 2 ? 3e4f : std::nanf("");
  const fp8::ScaledMatrix ref =
      fp8::quantize_tensorwise({x->data<float>(), static_cast<size_t>(live * cols)}, live, cols, format);
  float amax = 0;
  for (int64_t i = 0; i < live * cols; ++i) amax = std::max(amax, std::fabs(x->data<float>()[i]));
  std::vector<int32_t> padded{0};
  for (int64_t e = 0; e < experts; ++e)
    padded.push_back(padded.back() + (c.offsets[e + 1] - c.offsets[e] + 15) / 16 * 16);

  const ExecContext exec;
  const Grouping g(c.offsets, rows, Device::cuda);
  const int64_t ld = cuda::grouped_fp8_padded_ld(rows, experts);
  const OwnedTensor x_d = gpu_test::upload(*x, DType::bf16), padded_d(DType::i32, Device::cuda, Shape{experts + 1});
  const OwnedTensor codes(DType::u8, Device::cuda, Shape{rows, cols});
  const OwnedTensor codes_t(DType::u8, Device::cuda, Shape{cols, ld});
  const OwnedTensor scalars(DType::f32, Device::cuda, Shape{2});
  cuda::grouped_fp8_padded_offsets(exec, g.offsets->data<int32_t>(), experts, padded_d->data<int32_t>());
  for (const bool with_codes : {true, false}) {
    SCOPED_TRACE(with_codes ? "with row-major codes" : "transposed codes only");
    ASSERT_EQ(cudaMemset(codes->raw(), 0xAB, codes->nbytes()), cudaSuccess);
    ASSERT_EQ(cudaMemset(codes_t->raw(), 0xCD, codes_t->nbytes()), cudaSuccess);
    ASSERT_EQ(cudaMemset(scalars->raw(), 0xFF, scalars->nbytes()), cudaSuccess);
    cuda::grouped_fp8_quantize_padded(exec, static_cast<const cuda::bf16_bits*>(x_d->raw()), g.offsets->data<int32_t>(),
                                      padded_d->data<int32_t>(), experts, rows, cols, ld, format,
                                      with_codes ? codes->data<uint8_t>() : nullptr, codes_t->data<uint8_t>(),
                                      scalars->data<float>(), scalars->data<float>() + 1);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const OwnedTensor got_padded = to_host(*padded_d), got = to_host(*codes), got_t = to_host(*codes_t);
    const OwnedTensor got_scalars = to_host(*scalars);
    EXPECT_TRUE(std::equal(padded.begin(), padded.end(), got_padded->data<int32_t>()));
    EXPECT_EQ(std::bit_cast<uint32_t>(got_scalars->data<float>()[0]), std::bit_cast<uint32_t>(amax));
    // No live rows: the reference has no block (an empty matrix), the kernel amax 0's scale 1.
    const float want_scale_inv = live > 0 ? ref.scale_inv[0] : 1.0f;
    EXPECT_EQ(std::bit_cast<uint32_t>(got_scalars->data<float>()[1]), std::bit_cast<uint32_t>(want_scale_inv));
    std::vector<uint8_t> want(static_cast<size_t>(rows * cols), 0xAB), want_t(static_cast<size_t>(cols * ld), 0);
    for (int64_t e = 0; e < experts; ++e)
      for (int64_t r = c.offsets[e]; r < c.offsets[e + 1]; ++r)
        for (int64_t j = 0; j < cols; ++j) {
          const uint8_t code = ref.codes[r * cols + j];
          if (with_codes) want[r * cols + j] = code;
          want_t[j * ld + padded[e] + r - c.offsets[e]] = code;
        }
    int64_t wrong = 0, wrong_t = 0;
    for (int64_t i = 0; i < rows * cols; ++i) wrong += got->data<uint8_t>()[i] != want[i];
    for (int64_t i = 0; i < cols * ld; ++i) wrong_t += got_t->data<uint8_t>()[i] != want_t[i];
    EXPECT_EQ(wrong, 0) << "row-major codes differ";
    EXPECT_EQ(wrong_t, 0) << "padded transposed codes differ";
  }
}

TEST(GpuFp8Experts, PaddedQuantizeIsTheTensorwiseCastOfTheLiveRowsTransposed) {
  for (const fp8::Format format : {fp8::Format::e4m3, fp8::Format::e5m2}) {
    // Offsets 37, 99: not multiples of 16; three stale rows; experts 0 and 3 without rows;
    // 80 columns and ld 176: edge tiles in both of the kernel's 64-wide dimensions.
    check_padded_quantize({{0, 0, 37, 99, 99}, 102}, 80, format);
    // One expert with every row, no stale ones.
    check_padded_quantize({{0, 0, 200, 200}, 200}, 64, format);
    // Many small experts (rows 1..9), the last without rows, and stale rows: more than one
    // expert in each 64-position tile.
    std::vector<int32_t> o{0};
    for (int e = 0; e < 9; ++e) o.push_back(o.back() + e + 1);
    o.push_back(o.back());
    check_padded_quantize({o, o.back() + 21}, 16, format);
    // No live rows at all: every byte of the transpose 0, amax 0.
    check_padded_quantize({{0, 0, 0}, 32}, 32, format);
  }
}

TEST(GpuFp8Experts, WidthsNotMultiplesOf16RunTheBf16ProductsBitForBit) {
  const int64_t rows = 40, experts = 3, in = 40, out = 24;
  const std::vector<int32_t> o{0, 13, 13, 40};
  const Grouping g(o, rows, Device::cuda);
  const ExecContext exec;
  Workspace ws{Device::cuda};
  ws.reserve_peak(ops::moe_grouped_linear_fp8_scratch_bytes(Device::cuda, rows, experts, in, out, true), Workspace::Level::gemm);
  ws.allocate();
  EXPECT_FALSE(ops::moe_grouped_linear_fp8_runs_fp8(Device::cuda, in, out));
  const OwnedTensor x = gpu_test::upload(*bf16_values(Shape{rows, in}, 41, 1.0), DType::bf16);
  const OwnedTensor w = gpu_test::upload(*bf16_values(Shape{experts * out, in}, 42, 0.1), DType::bf16);
  const OwnedTensor dy = gpu_test::upload(*bf16_values(Shape{rows, out}, 43, 1e-2), DType::bf16);
  const OwnedTensor y8 = gpu_test::poisoned(DType::bf16, Shape{rows, out}), y16 = gpu_test::poisoned(DType::bf16, Shape{rows, out});
  const OwnedTensor dx8 = gpu_test::poisoned(DType::bf16, Shape{rows, in}), dx16 = gpu_test::poisoned(DType::bf16, Shape{rows, in});
  OwnedTensor g8(DType::f32, Device::cuda, Shape{experts * out, in}), g16(DType::f32, Device::cuda, Shape{experts * out, in});
  zero_tensor(*g8), zero_tensor(*g16);
  ops::moe_grouped_linear_fp8_forward(exec, ws, *x, *w, g.d, *y8);
  ops::moe_grouped_linear_forward(exec, *x, *w, g.d, *y16);
  ops::moe_grouped_linear_fp8_backward(exec, ws, *x, *w, *dy, g.d, *dx8, *g8);
  ops::moe_grouped_linear_backward(exec, *x, *w, *dy, g.d, *dx16, *g16);
  EXPECT_TRUE(gpu_test::same_bytes(*to_host(*y8), *to_host(*y16)));
  EXPECT_TRUE(gpu_test::same_bytes(*to_host(*dx8), *to_host(*dx16)));
  EXPECT_TRUE(gpu_test::same_bytes(*to_host(*g8), *to_host(*g16)));
}

// The same bits run to run, and a captured graph of forward and backward replayed on other
// routings (device offsets rewritten between replays) gives the eager calls' bits.
TEST(GpuFp8Experts, SameBitsEveryRunAndFromACapturedGraph) {
  if (!cuda::sm90::grouped_gemm_fp8_available()) GTEST_SKIP() << "no sm_90a CUTLASS FP8 grouped GEMM on this device/build";
  const int64_t rows = 160, experts = 4, in = 64, out = 96;
  const std::vector<std::vector<int32_t>> routings{{0, 40, 40, 117, 150}, {0, 0, 0, 160, 160}, {0, 3, 80, 81, 155}};
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const ExecContext exec{stream};
  Workspace ws{Device::cuda};
  ws.reserve_peak(ops::moe_grouped_linear_fp8_scratch_bytes(Device::cuda, rows, experts, in, out, true), Workspace::Level::gemm);
  ws.allocate();
  const Grouping g(routings[0], rows, Device::cuda);
  const OwnedTensor x = gpu_test::upload(*bf16_values(Shape{rows, in}, 51, 1.0), DType::bf16);
  const OwnedTensor w = gpu_test::upload(*bf16_values(Shape{experts * out, in}, 52, 0.05), DType::bf16);
  const OwnedTensor dy = gpu_test::upload(*bf16_values(Shape{rows, out}, 53, 1e-3), DType::bf16);
  const OwnedTensor g0 = to_device(*bf16_values(Shape{experts * out, in}, 54, 1e-2));
  const OwnedTensor y = gpu_test::poisoned(DType::bf16, Shape{rows, out}), dx = gpu_test::poisoned(DType::bf16, Shape{rows, in});
  const OwnedTensor dw(DType::f32, Device::cuda, Shape{experts * out, in});
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto step = [&] {
    ops::moe_grouped_linear_fp8_forward(exec, ws, *x, *w, g.d, *y);
    ops::moe_grouped_linear_fp8_backward(exec, ws, *x, *w, *dy, g.d, *dx, *dw);
  };
  struct Result {
    OwnedTensor y, dx, dw;
  };
  const auto results = [&] {
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    return Result{to_host(*y), to_host(*dx), to_host(*dw)};
  };
  const auto reset = [&](const std::vector<int32_t>& o) {
    set_offsets(g, o);
    copy_tensor(*g0, *dw);
    gpu_test::poison(*y), gpu_test::poison(*dx);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  };
  const auto same = [](const Result& a, const Result& b, int64_t live, int64_t in_w, int64_t out_w, const std::string& what) {
    // Rows past the live ones are not written: compare the live rows of y and dx, all of dW.
    const auto bits = [](const OwnedTensor& t) { return static_cast<const uint16_t*>(t->raw()); };
    EXPECT_TRUE(std::equal(bits(a.y), bits(a.y) + live * out_w, bits(b.y))) << what << " y";
    EXPECT_TRUE(std::equal(bits(a.dx), bits(a.dx) + live * in_w, bits(b.dx))) << what << " dx";
    EXPECT_TRUE(gpu_test::same_bytes(*a.dw, *b.dw)) << what << " dW";
  };
  // Eager, twice per routing (the first call also makes the plans, outside any capture).
  std::vector<Result> eager;
  for (const auto& o : routings) {
    reset(o);
    step();
    eager.push_back(results());
    reset(o);
    step();
    same(eager.back(), results(), o.back(), in, out, "run to run");
  }
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t graph_exec = nullptr;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  step();
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&graph_exec, graph, 0), cudaSuccess);
  for (size_t i = 0; i < routings.size(); ++i) {
    reset(routings[i]);
    ASSERT_EQ(cudaGraphLaunch(graph_exec, stream), cudaSuccess);
    same(eager[i], results(), routings[i].back(), in, out, "graph replay " + std::to_string(i));
  }
  cudaGraphExecDestroy(graph_exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// test_gpu_fp8_linear's small model with an MoE layer (4 experts, top 2; every width a
// multiple of 16, so the experts' products run FP8), in captured step graphs.
gpu_test::TrainingRun train(const std::string& out, const std::string& precision, bool fp8_experts) {
  const std::vector<std::string> overrides = {
      "data.path=" + test::source_dir() + "/data/tinyshakespeare.txt", "train.out_dir=" + out, "train.device=cuda",
      "train.precision=" + precision, std::string("train.fp8_experts=") + (fp8_experts ? "true" : "false"),
      "train.cuda_graphs=true", "model.hidden=64", "model.layers=2", "model.heads=4", "model.kv_heads=2",
      "model.head_dim=16", "model.ffn_hidden=128", "model.mlp=moe", "model.moe.experts=4", "model.moe.top_k=2",
      "model.moe.expert_hidden=64", "model.max_seq_len=64", "train.micro_batch_tokens=256", "train.grad_accum=2",
      "train.steps=40", "train.eval_every=0", "train.eval_batches=1", "train.sample_every=0", "train.sample_tokens=0",
      "log.every=1", "checkpoint.save_final=false", "optim.warmup_steps=5"};
  return gpu_test::run_training(overrides, out);
}

TEST(GpuFp8Experts, ASmallMoeModelTrainsInCapturedGraphsNearItsBf16Run) {
  if (!cuda::sm90::grouped_gemm_fp8_available()) GTEST_SKIP() << "no sm_90a CUTLASS FP8 grouped GEMM on this device/build";
  const std::string dir = test::temp_dir("kiln-gpu-fp8-experts-train");
  const gpu_test::TrainingRun bf16 = train(dir + "/bf16", "bf16", false);
  const gpu_test::TrainingRun dense = train(dir + "/dense", "fp8_tensorwise", false);
  const gpu_test::TrainingRun a = train(dir + "/fp8a", "fp8_tensorwise", true);
  const gpu_test::TrainingRun b = train(dir + "/fp8b", "fp8_tensorwise", true);
  const auto [mean, most] = gpu_test::fp8_linear::gaps_to_bf16(a, bf16, 40);
  // The dense FP8 model's bounds (test_gpu_fp8_linear): mean within 1%, no step over 5%.
  EXPECT_LT(mean, 0.01);
  EXPECT_LT(most, 0.05);
  // The experts really ran in FP8: not the dense-only FP8 run's losses.
  EXPECT_NE(a.losses, dense.losses);
  // Deterministic: the same losses and weights, bit for bit.
  EXPECT_EQ(a.lines, b.lines);
  EXPECT_EQ(a.weights, b.weights);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kiln
