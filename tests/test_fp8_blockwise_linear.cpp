// train.precision = "fp8_blockwise" on the CPU: a dense LinearLayer's forward and backward
// are, bit for bit, the FP8 emulation's blockwise quantize + gemm_reference by hand (every
// operand e4m3; x and dy in 1 x 128 tiles for the forward and dgrad, in 128 x 1 column tiles
// for the weight gradient; W in 128 x 128 blocks); the recipe's roles; and a small model
// trains with it within a stated distance of the fp32 run.
#include "fp8_linear_fixture.h"
#include "nn/linear_layer.h"
#include "nn/precision_recipe.h"
#include "ops/fp8/fp8_blockwise_linear.h"
#include "ops/fp8/fp8_gemm_reference.h"
#include "ops/linear/linear.h"
#include "test_util.h"
#include "train/training_build.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

namespace kiln {
namespace {

namespace fp8 = ops::fp8;
using namespace fp8_test;
using fp8::Format;

PrecisionRecipe blockwise_recipe() { return resolve_precision_recipe("fp8_blockwise", Device::cpu); }

constexpr fp8::BlockShape kTile = fp8::kActivationTile, kBlock = fp8::kWeightBlock;

// C = A B^T from the emulation: A [m, k] and B [n, k], each quantized in e4m3 by its blocks.
std::vector<float> by_hand(const std::vector<float>& a, int64_t m, fp8::BlockShape a_block, const std::vector<float>& b,
                           int64_t n, fp8::BlockShape b_block, int64_t k) {
  return fp8::gemm_reference(fp8::quantize(a, m, k, a_block, Format::e4m3), fp8::quantize(b, n, k, b_block, Format::e4m3));
}

struct ShapeCase {
  int64_t n, in, out;
  bool bias;
};

TEST(Fp8BlockwiseLinear, ForwardAndBackwardAreTheEmulationsBlocksAndGemmBitForBit) {
  // Partial tiles and blocks at every edge, several blocks along each dimension, one row.
  for (const ShapeCase s : {ShapeCase{37, 45, 19, true}, ShapeCase{1, 3, 130, false}, ShapeCase{131, 260, 129, true}}) {
    SCOPED_TRACE(testing::Message() << s.n << " x " << s.in << " -> " << s.out);
    Build b(blockwise_recipe(), s.n);
    LinearLayer layer;
    layer.declare(b.ctx, ParamName{"w", "w", ""}, s.out, s.in, ParamRole::matrix, Init::normal(0.02));
    if (s.bias) layer.declare_bias(b.ctx, ParamName{"b", "b", ""}, ParamRole::bias, Init::zeros());
    EXPECT_EQ(layer.format(), GemmFormat::fp8_blockwise);
    EXPECT_FALSE(layer.takes_amax()) << "block scales come from each block, not a producer's amax";
    EXPECT_GT(b.workspace.planned_bytes(), 0u) << "the operands' copies are planned scratch";
    b.allocate();
    const std::vector<float> x = awkward(s.n, s.in, 1, 1.0), w = awkward(s.out, s.in, 2, 0.05),
                             dy = awkward(s.n, s.out, 3, 1e-3), bias = awkward(1, s.out, 4, 0.1);
    fill(layer.weight(), w);
    if (s.bias) fill(layer.bias(), bias);
    const OwnedTensor xt(DType::f32, Device::cpu, Shape{s.n, s.in}), dyt(DType::f32, Device::cpu, Shape{s.n, s.out});
    fill(*xt, x), fill(*dyt, dy);

    // y = T(x) B(W)^T (+ b in fp32).
    const OwnedTensor y(DType::f32, Device::cpu, Shape{s.n, s.out});
    layer.forward(*xt, *y);
    std::vector<float> y_want = by_hand(x, s.n, kTile, w, s.out, kBlock, s.in);
    if (s.bias) add_bias(y_want, bias, s.n, s.out);
    expect_bits(floats_of(*y), y_want, "y");
    // Not the f32 product, and not the per-tensor recipe's either (x's outlier flushes its
    // tiny values there, only in its own tile here).
    const OwnedTensor y32(DType::f32, Device::cpu, Shape{s.n, s.out});
    ops::linear_forward(b.exec, *xt, layer.weight(), layer.bias(), *y32);
    EXPECT_NE(floats_of(*y), floats_of(*y32));
    std::vector<float> y_tensorwise = fp8::gemm_reference(fp8::quantize_tensorwise(x, s.n, s.in, Format::e4m3),
                                                          fp8::quantize_tensorwise(w, s.out, s.in, Format::e4m3));
    if (s.bias) add_bias(y_tensorwise, bias, s.n, s.out);
    if (s.n > 1) EXPECT_NE(floats_of(*y), y_tensorwise);

    // dx = T(dy) B(W): B is W^T [in, out], whose 128 x 128 blocks are W's transposed.
    // dW = C(dy)^T C(x): K is the tokens, so dy^T [out, n] and x^T [in, n] in 1 x 128 tiles.
    const std::vector<float> dx_want = by_hand(dy, s.n, kTile, transpose(w, s.out, s.in), s.in, kBlock, s.out);
    const std::vector<float> dw_once =
        by_hand(transpose(dy, s.n, s.out), s.out, kTile, transpose(x, s.n, s.in), s.in, kTile, s.n);
    const OwnedTensor dx(DType::f32, Device::cpu, Shape{s.n, s.in});
    layer.backward(*xt, *dyt, *dx);
    expect_bits(floats_of(*dx), dx_want, "dx");
    expect_bits(floats_of(layer.weight_grad()), dw_once, "dW");
    if (s.bias) {  // the f32 path's column sums of the unquantized dy
      const OwnedTensor db(DType::f32, Device::cpu, Shape{s.out});
      zero_tensor(*db);
      ops::linear_backward(b.exec, *xt, layer.weight(), *dyt, Tensor(), Tensor(), *db);
      expect_bits(floats_of(layer.bias_grad()), floats_of(*db), "db");
    }

    expect_accumulation_and_halves(layer, *xt, *dyt, *dx, dx_want, dw_once);
  }
}

TEST(Fp8BlockwiseLinear, TheRecipeHasTheDenseRoleBlockwiseAndKeepsNothing) {
  for (Device device : {Device::cpu, Device::cuda}) {
    const PrecisionRecipe r = resolve_precision_recipe("fp8_blockwise", device);
    const GemmFormat rest = device == Device::cpu ? GemmFormat::f32 : GemmFormat::bf16;
    EXPECT_EQ(r.compute, device == Device::cpu ? DType::f32 : DType::bf16);
    EXPECT_EQ(r.master, DType::f32);
    EXPECT_EQ(r.format(ParamRole::matrix), GemmFormat::fp8_blockwise);
    for (ParamRole role : {ParamRole::expert, ParamRole::router, ParamRole::head, ParamRole::embedding})
      EXPECT_EQ(r.format(role), rest) << role_name(role);
    EXPECT_NE(r.describe().find("fp8_blockwise GEMMs"), std::string::npos) << r.describe();
  }
  // keep_fp8_input is fp8_tensorwise's: a blockwise layer plans no kept codes.
  Build b(blockwise_recipe(), 8);
  LinearLayer layer;
  layer.declare(b.ctx, ParamName{"w", "w", ""}, 4, 6, ParamRole::matrix, Init::normal(0.02));
  layer.keep_fp8_input(b.ctx);
  EXPECT_EQ(b.activations.planned_bytes(), 0u);
  EXPECT_TRUE(layer.weight_grad_reads_x(8));
}

// train.fp8_blockwise_kernels reaches the recipe: "vector" by default (the faster kernels,
// since their first GPU run), "scalar" when asked; other values are refused naming the key.
TEST(Fp8BlockwiseLinear, TheQuantizeKernelsAreChosenByKey) {
  Config config;
  config.train.precision = "fp8_blockwise";
  EXPECT_EQ(config.train.fp8_blockwise_kernels, "vector");
  EXPECT_TRUE(training_build_options(config, Device::cuda).precision->blockwise_vector_kernels);
  config.train.fp8_blockwise_kernels = "scalar";
  EXPECT_FALSE(training_build_options(config, Device::cuda).precision->blockwise_vector_kernels);
  std::string output;
  EXPECT_NE(test::run_command(test::kiln_binary() + " train " + test::source_dir() + "/configs/default.toml" + kSmall +
                                  " --set train.fp8_blockwise_kernels=wide --set train.out_dir=" +
                                  test::temp_dir("kiln-fp8-kernels-key") + "/run 2>&1",
                              &output),
            0);
  EXPECT_NE(output.find("train.fp8_blockwise_kernels"), std::string::npos) << output;
}

TEST(Fp8BlockwiseLinear, TheGpuRunsFp8OnWholeBlocksOnly) {
  EXPECT_TRUE(fp8::fp8_blockwise_linear_runs_fp8(Device::cpu, 3, 5, 7));  // the emulation takes any shape
  EXPECT_TRUE(fp8::fp8_blockwise_linear_runs_fp8(Device::cuda, 256, 1024, 384));
  for (auto [n, in, out] : {std::tuple{16, 1024, 384}, std::tuple{256, 1040, 384}, std::tuple{256, 1024, 400}})
    EXPECT_FALSE(fp8::fp8_blockwise_linear_runs_fp8(Device::cuda, n, in, out)) << n << " " << in << " " << out;
}

TEST(Fp8BlockwiseLinear, ANonFiniteOperandIsAnErrorNamingTheRecipe) {
  expect_nonfinite_input_refused("fp8_blockwise");
}

TEST(Fp8BlockwiseLinear, ASmallModelTrainsCloseToItsFp32Run) {
  const std::string dir = test::temp_dir("kiln-fp8-blockwise-train");
  RecordProperty("largest_relative_gap_to_fp32", std::to_string(expect_trains_near_fp32("fp8_blockwise", dir)));
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kiln
