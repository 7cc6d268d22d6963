// What the CPU tests of the FP8 linear layers share (test_fp8_linear.cpp,
// test_fp8_blockwise_linear.cpp): a build context over its own arenas, awkward inputs, bit
// comparisons, and a small model trained through the kiln binary.
#pragma once

#include "grad_check.h"
#include "nn/linear_layer.h"
#include "nn/precision_recipe.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

namespace kiln::fp8_test {

using test::values_of;

// A CPU build context in f32 over its own arenas, with the given recipe.
struct Build {
  explicit Build(const PrecisionRecipe& recipe, int64_t max_tokens, bool training = true)
      : ctx{exec, params, grads, activations, workspace, parameters, compute, recipe, Device::cpu, max_tokens, training,
            true} {}
  ExecContext exec;
  Arena params{"parameters", Device::cpu}, grads{"gradients", Device::cpu}, activations{"activations", Device::cpu};
  Workspace workspace{Device::cpu};
  std::vector<std::unique_ptr<Parameter>> parameters;
  ComputeWeights compute{Device::cpu};
  BuildContext ctx;
  void allocate() {
    params.allocate();
    grads.allocate();
    activations.allocate();
    workspace.allocate();
  }
};

inline std::vector<float> floats_of(const Tensor& t) { return {t.data<float>(), t.data<float>() + t.numel()}; }

// N(0, scale) values with a few awkward ones: an outlier, a zero row's worth of zeros and a
// tiny value (flushed to zero under per-tensor scaling).
inline std::vector<float> awkward(int64_t rows, int64_t cols, uint64_t seed, double scale) {
  const std::vector<double> values = values_of(*test::random_f64(Shape{rows, cols}, seed, scale));
  std::vector<float> v(values.begin(), values.end());
  v[0] = static_cast<float>(40 * scale);
  for (int64_t c = 0; c < cols && rows > 1; ++c) v[(rows - 1) * cols + c] = 0;
  if (v.size() > 2) v[1] = static_cast<float>(1e-6 * scale);
  return v;
}

inline void fill(const Tensor& t, const std::vector<float>& v) { std::copy(v.begin(), v.end(), t.data<float>()); }

inline std::vector<float> transpose(const std::vector<float>& v, int64_t rows, int64_t cols) {
  std::vector<float> t(v.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = v[r * cols + c];
  return t;
}

// The same bits, element for element (EXPECT_EQ on floats would let -0 equal +0).
inline void expect_bits(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int64_t differ = 0;
  for (size_t i = 0; i < got.size(); ++i) differ += std::bit_cast<uint32_t>(got[i]) != std::bit_cast<uint32_t>(want[i]);
  EXPECT_EQ(differ, 0) << what << ": " << differ << " of " << got.size() << " elements differ";
}

// After a layer's first backward(x, dy, dx) gave dx_want and its weight gradient dw_once:
// accumulating adds the same sums once more in fp32 (dx += and dW +=), the halves add what
// backward adds (backward_input writes dx, backward_weight adds dW), and dx written over x
// is the same dx (x is quantized before anything is written).
inline void expect_accumulation_and_halves(const LinearLayer& layer, const Tensor& x, const Tensor& dy,
                                           const Tensor& dx, const std::vector<float>& dx_want,
                                           const std::vector<float>& dw_once) {
  std::vector<float> dx_twice = dx_want, dw_twice = dw_once;
  for (size_t i = 0; i < dx_twice.size(); ++i) dx_twice[i] += dx_want[i];
  for (size_t i = 0; i < dw_twice.size(); ++i) dw_twice[i] += dw_once[i];
  layer.backward(x, dy, dx, true);
  expect_bits(floats_of(dx), dx_twice, "dx +=");
  expect_bits(floats_of(layer.weight_grad()), dw_twice, "dW +=");
  layer.backward_input(dy, dx);
  expect_bits(floats_of(dx), dx_want, "backward_input");
  layer.backward_weight(x, dy);
  std::vector<float> dw_thrice = dw_twice;
  for (size_t i = 0; i < dw_thrice.size(); ++i) dw_thrice[i] += dw_once[i];
  expect_bits(floats_of(layer.weight_grad()), dw_thrice, "backward_weight");
  layer.backward(x, dy, x);
  expect_bits(floats_of(x), dx_want, "dx over x");
}

// y [n, out] += bias in fp32, row by row, as the layers add it.
inline void add_bias(std::vector<float>& y, const std::vector<float>& bias, int64_t n, int64_t out) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < out; ++j) y[i * out + j] += bias[j];
}

// configs/default.toml shrunk as test_loss_gap's kSmall: 30 steps on the CPU, one seed and
// the same data whatever the precision.
inline const std::string kSmall =
    " --set model.layers=2 --set model.hidden=64 --set model.heads=4 --set model.kv_heads=2 --set model.head_dim=16"
    " --set model.max_seq_len=128 --set train.micro_batch_tokens=1024 --set train.steps=30 --set train.eval_every=0"
    " --set train.sample_every=0 --set train.sample_tokens=0 --set checkpoint.every=0 --set log.every=5"
    " --set train.threads=2 --set train.device=cpu --set log.tensorboard=false --set log.plot=false";

inline std::vector<double> train(const std::string& dir, const std::string& precision, std::string* output,
                                 const std::string& extra = "") {
  const std::string command = test::kiln_binary() + " train " + test::source_dir() + "/configs/default.toml" + kSmall +
                              " --set train.precision=" + precision + " --set train.out_dir=" + dir + extra + " 2>&1";
  EXPECT_EQ(test::run_command(command, output), 0) << *output;
  return test::train_losses(dir);
}

// A layer of `recipe` handed a NaN in x: an error naming the recipe and the non-finite value.
inline void expect_nonfinite_input_refused(const char* recipe) {
  Build b(resolve_precision_recipe(recipe, Device::cpu), 4);
  LinearLayer layer;
  layer.declare(b.ctx, ParamName{"w", "w", ""}, 3, 5, ParamRole::matrix, Init::normal(0.02));
  b.allocate();
  const OwnedTensor x(DType::f32, Device::cpu, Shape{4, 5}), y(DType::f32, Device::cpu, Shape{4, 3});
  zero_tensor(*x);
  x->data<float>()[7] = std::nanf("");
  const std::string error = test::error_of([&] { layer.forward(*x, *y); });
  EXPECT_NE(error.find(recipe), std::string::npos) << error;
  EXPECT_NE(error.find("non-finite"), std::string::npos) << error;
}

// The small model (kSmall) trained in `recipe` and in fp32 from the same seed and data: it
// learns (the last logged loss half a nat under the first), its log names the recipe, and
// every logged loss is within 1% of fp32's without equalling them all (FP8 really ran).
// Returns the largest relative gap.
inline double expect_trains_near_fp32(const std::string& recipe, const std::string& dir) {
  std::string out32, out8;
  const std::vector<double> fp32 = train(dir + "/fp32", "fp32", &out32);
  const std::vector<double> fp8 = train(dir + "/fp8", recipe, &out8);
  EXPECT_NE(out8.find(recipe + " GEMMs"), std::string::npos) << out8;
  EXPECT_EQ(fp32.size(), 6u) << out32;  // steps 5, 10, ..., 30
  EXPECT_EQ(fp8.size(), fp32.size()) << out8;
  if (fp8.size() != 6u || fp32.size() != 6u) return 1e9;
  EXPECT_LT(fp8.back(), fp8.front() - 0.5) << out8;
  double most = 0;
  for (size_t i = 0; i < fp8.size(); ++i) {
    EXPECT_TRUE(std::isfinite(fp8[i])) << i;
    most = std::max(most, std::fabs(fp8[i] - fp32[i]) / fp32[i]);
  }
  EXPECT_LT(most, 0.01) << out8;
  EXPECT_GT(most, 0.0) << recipe << " logged the fp32 run's losses exactly";
  return most;
}

}  // namespace kiln::fp8_test
