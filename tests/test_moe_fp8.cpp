// train.fp8_experts on the CPU: the routed experts' grouped products in tensorwise FP8 are,
// bit for bit, quantize_tensorwise + gemm_reference by hand (x and dy quantized over the live
// grouped rows as one tensor, each expert's weight with its own scale), at awkward groupings
// (an expert without rows, one with all of them, stale rows past the live ones); a small MoE
// model trains with them near its fp32 run and the same bits run to run; and the switch is
// refused without fp8_tensorwise.
#include "config/config.h"
#include "grad_check.h"
#include "ops/fp8/fp8_gemm_reference.h"
#include "ops/moe/moe.h"
#include "test_util.h"
#include "train/training_build.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <filesystem>

namespace kiln {
namespace {

namespace fp8 = ops::fp8;
using test::values_of;

std::vector<float> awkward(int64_t rows, int64_t cols, uint64_t seed, double scale) {
  const std::vector<double> values = values_of(*test::random_f64(Shape{rows, cols}, seed, scale));
  std::vector<float> v(values.begin(), values.end());
  if (!v.empty()) v[0] = static_cast<float>(40 * scale);                 // an outlier
  if (v.size() > 2) v[1] = static_cast<float>(1e-6 * scale);             // flushed to zero
  return v;
}

std::vector<float> floats_of(const Tensor& t) { return {t.data<float>(), t.data<float>() + t.numel()}; }
void fill(const Tensor& t, const std::vector<float>& v) { std::copy(v.begin(), v.end(), t.data<float>()); }

void expect_bits(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t differ = 0;
  for (size_t i = 0; i < got.size(); ++i) differ += std::bit_cast<uint32_t>(got[i]) != std::bit_cast<uint32_t>(want[i]);
  EXPECT_EQ(differ, 0) << what << ": " << differ << " of " << got.size() << " elements differ";
}

// Rows [first, first + n) of a tensorwise-scaled matrix (the same scale).
fp8::ScaledMatrix rows_of(const fp8::ScaledMatrix& q, int64_t first, int64_t n) {
  fp8::ScaledMatrix r = q;
  r.rows = n;
  r.block = {n, q.cols};  // still one block
  r.codes.assign(q.codes.begin() + first * q.cols, q.codes.begin() + (first + n) * q.cols);
  return r;
}

// The transposed codes of a tensorwise-scaled matrix (the same scale).
fp8::ScaledMatrix transposed(const fp8::ScaledMatrix& q) {
  fp8::ScaledMatrix t = q;
  t.rows = q.cols, t.cols = q.rows;
  t.block = {t.rows, t.cols};  // still one block
  for (int64_t r = 0; r < q.rows; ++r)
    for (int64_t c = 0; c < q.cols; ++c) t.codes[c * q.rows + r] = q.codes[r * q.cols + c];
  return t;
}

struct Grouping {
  std::vector<int32_t> offsets;  // E + 1
  int64_t rows;                  // R >= offsets[E]: the rows past the live ones hold stale values
};

TEST(Fp8Experts, GroupedProductsAreTheEmulationBitForBit) {
  const int64_t in = 37, out = 19;
  for (const Grouping& g : {Grouping{{0, 5, 5, 17, 23}, 26},   // expert 1 without rows, 3 stale rows
                            Grouping{{0, 0, 23, 23, 23}, 23},  // expert 1 with all of them
                            Grouping{{0, 1, 2, 3}, 3}}) {      // one row each
    const int64_t experts = static_cast<int64_t>(g.offsets.size()) - 1, rows = g.rows, live = g.offsets.back();
    SCOPED_TRACE("experts " + std::to_string(experts) + ", live rows " + std::to_string(live));
    OwnedTensor counts(DType::i32, Device::cpu, Shape{experts}), offsets(DType::i32, Device::cpu, Shape{experts + 1}),
        pair_of_row(DType::i32, Device::cpu, Shape{rows}), row_of_pair(DType::i32, Device::cpu, Shape{rows});
    std::copy(g.offsets.begin(), g.offsets.end(), offsets->data<int32_t>());
    const ops::MoeDispatch d{experts, 1, 0, *counts, *offsets, *pair_of_row, *row_of_pair, Tensor()};

    OwnedTensor x(DType::f32, Device::cpu, Shape{rows, in}), w(DType::f32, Device::cpu, Shape{experts * out, in}),
        dy(DType::f32, Device::cpu, Shape{rows, out}), y(DType::f32, Device::cpu, Shape{rows, out}),
        dx(DType::f32, Device::cpu, Shape{rows, in}), dw(DType::f32, Device::cpu, Shape{experts * out, in});
    std::vector<float> xv = awkward(rows, in, 11, 0.5), dyv = awkward(rows, out, 13, 1e-3);
    // Stale rows past the live ones: far larger than the live values, so a scale that read
    // them would change every code.
    for (int64_t r = live; r < rows; ++r) {
      for (int64_t c = 0; c < in; ++c) xv[r * in + c] = 1e4f;
      for (int64_t c = 0; c < out; ++c) dyv[r * out + c] = -1e4f;
    }
    std::vector<float> wv = awkward(experts * out, in, 17, 0.1);
    for (int64_t e = 0; e < experts; ++e)  // each expert's weight at its own magnitude
      for (int64_t i = 0; i < out * in; ++i) wv[e * out * in + i] *= std::ldexp(1.0f, static_cast<int>(e) * 3 - 4);
    const std::vector<float> dw0 = awkward(experts * out, in, 19, 1e-2);
    fill(*x, xv), fill(*w, wv), fill(*dy, dyv), fill(*dw, dw0);
    std::fill(y->data<float>(), y->data<float>() + y->numel(), 7.0f);

    Workspace workspace{Device::cpu};
    workspace.reserve_peak(ops::moe_grouped_linear_fp8_scratch_bytes(Device::cpu, rows, experts, in, out, true),
                           Workspace::Level::gemm);
    workspace.allocate();
    const ExecContext& ctx = process_exec();
    ops::moe_grouped_linear_fp8_forward(ctx, workspace, *x, *w, d, *y);
    ops::moe_grouped_linear_fp8_backward(ctx, workspace, *x, *w, *dy, d, *dx, *dw);

    // By hand: x and dy over the live rows as one tensor each, W_e each on its own.
    const fp8::ScaledMatrix xq = fp8::quantize_tensorwise({xv.data(), static_cast<size_t>(live * in)}, live, in,
                                                          fp8::Format::e4m3);
    const fp8::ScaledMatrix dyq = fp8::quantize_tensorwise({dyv.data(), static_cast<size_t>(live * out)}, live, out,
                                                           fp8::Format::e5m2);
    std::vector<float> want_y(static_cast<size_t>(rows * out), 7.0f), want_dx = floats_of(*dx), want_dw = dw0;
    for (int64_t e = 0; e < experts; ++e) {
      const int64_t first = g.offsets[e], n = g.offsets[e + 1] - first;
      if (n == 0) continue;
      const fp8::ScaledMatrix wq =
          fp8::quantize_tensorwise({wv.data() + e * out * in, static_cast<size_t>(out * in)}, out, in, fp8::Format::e4m3);
      const fp8::ScaledMatrix xe = rows_of(xq, first, n), dye = rows_of(dyq, first, n);
      const std::vector<float> ye = fp8::gemm_reference(xe, wq);                       // [n, out]
      const std::vector<float> dxe = fp8::gemm_reference(dye, transposed(wq));         // [n, in]
      const std::vector<float> dwe = fp8::gemm_reference(transposed(dye), transposed(xe));  // [out, in]
      std::copy(ye.begin(), ye.end(), want_y.begin() + first * out);
      std::copy(dxe.begin(), dxe.end(), want_dx.begin() + first * in);
      for (int64_t i = 0; i < out * in; ++i) want_dw[e * out * in + i] = dw0[e * out * in + i] + dwe[i];
    }
    // dx's rows past the live ones are whatever they held (not checked: want_dx copied them).
    expect_bits(floats_of(*y), want_y, "y");
    expect_bits(floats_of(*dx), want_dx, "dx");
    expect_bits(floats_of(*dw), want_dw, "dw");
    // An expert without rows keeps its dW as it was.
    for (int64_t e = 0; e < experts; ++e) {
      if (g.offsets[e + 1] != g.offsets[e]) continue;
      for (int64_t i = 0; i < out * in; ++i)
        ASSERT_EQ(dw->data<float>()[e * out * in + i], dw0[e * out * in + i]) << "expert " << e;
    }

    // FP8 really ran: the f32 grouped product differs.
    OwnedTensor y32(DType::f32, Device::cpu, Shape{rows, out});
    std::fill(y32->data<float>(), y32->data<float>() + y32->numel(), 7.0f);
    ops::moe_grouped_linear_forward(ctx, *x, *w, d, *y32);
    EXPECT_NE(floats_of(*y32), floats_of(*y));

    // dx written over x (as MoeMlp's first backward call does, without dW): the same dx.
    OwnedTensor dx_in_x(DType::f32, Device::cpu, Shape{rows, in});
    fill(*dx_in_x, xv);
    ops::moe_grouped_linear_fp8_backward(ctx, workspace, *dx_in_x, *w, *dy, d, *dx_in_x, Tensor());
    std::vector<float> got = floats_of(*dx_in_x), want = want_dx;
    got.resize(static_cast<size_t>(live * in)), want.resize(static_cast<size_t>(live * in));
    expect_bits(got, want, "dx over x");
  }
}

TEST(Fp8Experts, ANonFiniteOperandIsAnError) {
  OwnedTensor counts(DType::i32, Device::cpu, Shape{2}), offsets(DType::i32, Device::cpu, Shape{3}),
      pair_of_row(DType::i32, Device::cpu, Shape{4}), row_of_pair(DType::i32, Device::cpu, Shape{4});
  const std::vector<int32_t> o{0, 3, 4};
  std::copy(o.begin(), o.end(), offsets->data<int32_t>());
  const ops::MoeDispatch d{2, 1, 0, *counts, *offsets, *pair_of_row, *row_of_pair, Tensor()};
  OwnedTensor x(DType::f32, Device::cpu, Shape{4, 5}), w(DType::f32, Device::cpu, Shape{6, 5}),
      y(DType::f32, Device::cpu, Shape{4, 3});
  std::fill(x->data<float>(), x->data<float>() + 20, 1.0f);
  std::fill(w->data<float>(), w->data<float>() + 30, 1.0f);
  x->data<float>()[7] = std::nanf("");
  Workspace workspace{Device::cpu};
  workspace.reserve_peak(ops::moe_grouped_linear_fp8_scratch_bytes(Device::cpu, 4, 2, 5, 3, false), Workspace::Level::gemm);
  workspace.allocate();
  const std::string error =
      test::error_of([&] { ops::moe_grouped_linear_fp8_forward(process_exec(), workspace, *x, *w, d, *y); });
  EXPECT_NE(error.find("non-finite"), std::string::npos) << error;
}

TEST(Fp8Experts, TheSwitchNeedsFp8Tensorwise) {
  Config config;
  config.train.fp8_experts = true;
  for (const char* precision : {"fp32", "auto", "bf16"}) {
    config.train.precision = precision;
    const std::string error = test::error_of([&] { (void)training_build_options(config, Device::cpu); });
    EXPECT_NE(error.find("train.fp8_experts"), std::string::npos) << error;
    EXPECT_NE(error.find("fp8_tensorwise"), std::string::npos) << error;
    EXPECT_EQ(error.find('\n'), std::string::npos) << error;  // one line
  }
  config.train.precision = "fp8_tensorwise";
  const BuildOptions options = training_build_options(config, Device::cpu);
  ASSERT_TRUE(options.precision.has_value());
  EXPECT_EQ(options.precision->expert, GemmFormat::fp8_tensorwise);
  EXPECT_EQ(options.precision->router, GemmFormat::f32);
  config.train.fp8_experts = false;
  EXPECT_EQ(training_build_options(config, Device::cpu).precision->expert, GemmFormat::f32);
}

// configs/default.toml shrunk as test_fp8_linear's kSmall, an MoE layer (4 experts, top 2,
// widths multiples of 16), 30 steps on the CPU.
const std::string kSmallMoe =
    " --set model.layers=2 --set model.hidden=64 --set model.heads=4 --set model.kv_heads=2 --set model.head_dim=16"
    " --set model.max_seq_len=128 --set train.micro_batch_tokens=1024 --set train.steps=30 --set train.eval_every=0"
    " --set train.sample_every=0 --set train.sample_tokens=0 --set checkpoint.every=0 --set log.every=5"
    " --set train.threads=2 --set train.device=cpu --set log.tensorboard=false --set log.plot=false"
    " --set model.mlp=moe --set model.moe.experts=4 --set model.moe.top_k=2 --set model.moe.expert_hidden=64";

std::vector<double> train(const std::string& dir, const std::string& settings, std::string* output) {
  const std::string command = test::kiln_binary() + " train " + test::source_dir() + "/configs/default.toml" +
                              kSmallMoe + settings + " --set train.out_dir=" + dir + " 2>&1";
  EXPECT_EQ(test::run_command(command, output), 0) << *output;
  return test::train_losses(dir);
}

TEST(Fp8Experts, ASmallMoeModelTrainsCloseToItsFp32RunAndRepeats) {
  const std::string dir = test::temp_dir("kiln-fp8-experts");
  std::string out32, out_dense, out8, again;
  const std::vector<double> fp32 = train(dir + "/fp32", " --set train.precision=fp32", &out32);
  const std::vector<double> dense = train(dir + "/dense", " --set train.precision=fp8_tensorwise", &out_dense);
  const std::string fp8_experts = " --set train.precision=fp8_tensorwise --set train.fp8_experts=true";
  const std::vector<double> fp8 = train(dir + "/fp8", fp8_experts, &out8);
  const std::vector<double> fp8_again = train(dir + "/again", fp8_experts, &again);
  ASSERT_EQ(fp32.size(), 6u) << out32;  // steps 5, 10, ..., 30
  ASSERT_EQ(fp8.size(), fp32.size()) << out8;
  EXPECT_LT(fp8.back(), fp8.front() - 0.5) << out8;  // it learns
  double most = 0;
  for (size_t i = 0; i < fp8.size(); ++i) {
    EXPECT_TRUE(std::isfinite(fp8[i])) << i;
    most = std::max(most, std::fabs(fp8[i] - fp32[i]) / fp32[i]);
  }
  // Within 1% of fp32 at every logged step (the dense FP8 recipe's bound, test_fp8_linear).
  EXPECT_LT(most, 0.01) << out8;
  // The experts really ran in FP8: not the dense-only FP8 run's losses.
  EXPECT_NE(fp8, dense) << "train.fp8_experts changed no loss";
  // And deterministic: the same losses and final weights run to run.
  EXPECT_EQ(fp8, fp8_again);
  const std::string weights = "/model/model.safetensors";
  const std::string first = test::read_file(dir + "/fp8" + weights);
  EXPECT_FALSE(first.empty());
  EXPECT_TRUE(first == test::read_file(dir + "/again" + weights)) << "the final weights differ";
  std::filesystem::remove_all(dir);
}

TEST(Fp8Experts, RefusedByTrainWithoutFp8Tensorwise) {
  const std::string dir = test::temp_dir("kiln-fp8-experts-refused");
  std::string output;
  const std::string command = test::kiln_binary() + " train " + test::source_dir() + "/configs/default.toml" +
                              kSmallMoe + " --set train.precision=fp32 --set train.fp8_experts=true --set train.out_dir=" +
                              dir + " 2>&1";
  EXPECT_NE(test::run_command(command, &output), 0) << output;
  EXPECT_NE(output.find("train.fp8_experts = true needs train.precision = 'fp8_tensorwise'"), std::string::npos)
      << output;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kiln
