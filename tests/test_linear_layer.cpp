// PrecisionRecipe (train.precision resolved once) and LinearLayer (the one place a module's
// projection picks its GEMM): names and refusals, and that a declared layer registers what
// BuildContext::parameter / fused_parameter did and computes what ops::linear computes.
#include "grad_check.h"
#include "nn/linear_layer.h"
#include "nn/precision_recipe.h"
#include "ops/linear/linear.h"
#include "test_util.h"

#include <gtest/gtest.h>

namespace kiln {
namespace {

using test::random_f64;
using test::values_of;

TEST(PrecisionRecipe, ResolvesTrainPrecisionAndRefusesWhatIsNotBuilt) {
  const PrecisionRecipe cpu = resolve_precision_recipe("auto", Device::cpu);
  EXPECT_EQ(cpu.compute, DType::f32);
  EXPECT_EQ(cpu.master, DType::f32);
  EXPECT_FALSE(cpu.mixed());
  const PrecisionRecipe gpu = resolve_precision_recipe("auto", Device::cuda);
  EXPECT_EQ(gpu.compute, DType::bf16);
  EXPECT_EQ(gpu.master, DType::f32);
  EXPECT_TRUE(gpu.mixed());
  for (ParamRole role : {ParamRole::matrix, ParamRole::expert, ParamRole::head, ParamRole::router})
    EXPECT_EQ(gpu.format(role), GemmFormat::bf16) << role_name(role);
  EXPECT_EQ(resolve_precision_recipe("fp32", Device::cuda).dense, GemmFormat::f32);
  EXPECT_EQ(PrecisionRecipe::uniform(DType::f64).expert, GemmFormat::f64);
  for (const char* name : {"fp16"}) {  // fp8_tensorwise / fp8_blockwise: test_fp8_linear.cpp, test_fp8_blockwise_linear.cpp
    const std::string error = test::error_of([&] { resolve_precision_recipe(name, Device::cuda); });
    EXPECT_NE(error.find("[train.precision]"), std::string::npos) << error;
    EXPECT_NE(error.find("not built yet"), std::string::npos) << error;
  }
  EXPECT_NE(test::error_of([] { resolve_precision_recipe("bf16", Device::cpu); }).find("train.precision"),
            std::string::npos);
}

TEST(PrecisionRecipe, EachRoleHasItsOwnFormat) {
  PrecisionRecipe r = PrecisionRecipe::uniform(DType::bf16);
  r.lm_head = GemmFormat::f32;  // an exception by role, as an FP8 recipe keeps the head in bf16
  EXPECT_EQ(r.format(ParamRole::head), GemmFormat::f32);
  EXPECT_EQ(r.format(ParamRole::embedding), GemmFormat::f32);  // a tied head
  EXPECT_EQ(r.format(ParamRole::matrix), GemmFormat::bf16);
  EXPECT_EQ(r.format(ParamRole::expert), GemmFormat::bf16);
}

// A CPU build context in f64 over its own arenas.
struct Build {
  ExecContext exec;
  Arena params{"parameters", Device::cpu}, grads{"gradients", Device::cpu}, activations{"activations", Device::cpu};
  Workspace workspace{Device::cpu};
  std::vector<std::unique_ptr<Parameter>> parameters;
  ComputeWeights compute{Device::cpu};
  BuildContext ctx{exec, params, grads, activations, workspace, parameters, compute,
                   PrecisionRecipe::uniform(DType::f64), Device::cpu, 8, true, true};
  void allocate() {
    params.allocate();
    grads.allocate();
  }
};

void fill(const Tensor& t, uint64_t seed) { copy_tensor(*random_f64(t.shape(), seed), t); }

TEST(LinearLayer, RegistersItsWeightsAndComputesWhatOpsLinearComputes) {
  Build b;
  const NameScope n{"layers.0.", "model.layers.0.", "blk.0."};
  LinearLayer fused, single;
  fused.declare_fused(b.ctx, {{n("q.weight", "q.weight", ""), 3}, {n("k.weight", "k.weight", ""), 2}}, 4,
                      ParamRole::matrix, Init::normal(0.02));
  fused.declare_fused_bias(b.ctx, {{n("q.bias", "q.bias", ""), 3}, {n("k.bias", "k.bias", ""), 2}}, ParamRole::bias,
                           Init::zeros());
  single.declare(b.ctx, n("o.weight", "o.weight", ""), 4, 5, ParamRole::expert, Init::normal(0.01));
  ASSERT_EQ(b.parameters.size(), 5u);
  EXPECT_EQ(b.parameters[0]->name(), "layers.0.q.weight");
  EXPECT_EQ(b.parameters[0]->shape(), (Shape{3, 4}));
  EXPECT_EQ(b.parameters[1]->name(), "layers.0.k.weight");
  EXPECT_EQ(b.parameters[1]->shape(), (Shape{2, 4}));
  EXPECT_EQ(b.parameters[3]->role(), ParamRole::bias);
  EXPECT_EQ(b.parameters[4]->role(), ParamRole::expert);
  EXPECT_EQ(fused.format(), GemmFormat::f64);
  b.allocate();
  fill(fused.weight(), 1), fill(fused.bias(), 2), fill(single.weight(), 3);

  const OwnedTensor x = random_f64(Shape{6, 4}, 4), dy = random_f64(Shape{6, 5}, 5);
  const OwnedTensor y(DType::f64, Device::cpu, Shape{6, 5}), want(DType::f64, Device::cpu, Shape{6, 5});
  fused.forward(*x, *y);
  ops::linear_forward(b.exec, *x, fused.weight(), fused.bias(), *want);
  EXPECT_EQ(values_of(*y), values_of(*want));

  // Backward: dx (=, then +=) and the weight and bias gradients (+=), as ops::linear_backward.
  const OwnedTensor dx(DType::f64, Device::cpu, Shape{6, 4}), dx_want(DType::f64, Device::cpu, Shape{6, 4});
  const OwnedTensor dw(DType::f64, Device::cpu, Shape{5, 4}), db(DType::f64, Device::cpu, Shape{5});
  zero_tensor(*dw), zero_tensor(*db);
  fused.backward(*x, *dy, *dx);
  fused.backward(*x, *dy, *dx, true);
  ops::linear_backward(b.exec, *x, fused.weight(), *dy, *dx_want, *dw, *db);
  ops::linear_backward(b.exec, *x, fused.weight(), *dy, *dx_want, *dw, *db, true);
  EXPECT_EQ(values_of(*dx), values_of(*dx_want));
  EXPECT_EQ(values_of(fused.weight_grad()), values_of(*dw));
  EXPECT_EQ(values_of(fused.bias_grad()), values_of(*db));
  // The halves: backward_input then backward_weight add what backward adds.
  fused.backward_input(*dy, *dx);
  fused.backward_weight(*x, *dy);
  ops::linear_backward(b.exec, *x, fused.weight(), *dy, *dx_want, *dw, *db);
  EXPECT_EQ(values_of(*dx), values_of(*dx_want));
  EXPECT_EQ(values_of(fused.weight_grad()), values_of(*dw));

  // A row view (the k rows): its output is those columns of the whole layer's.
  const LinearLayer k = fused.rows(3, 5);
  EXPECT_EQ(k.out_features(), 2);
  const OwnedTensor yk(DType::f64, Device::cpu, Shape{6, 2});
  k.forward(*x, *yk);
  const std::vector<double> whole = values_of(*y), part = values_of(*yk);
  for (int64_t i = 0; i < 6; ++i)
    for (int64_t j = 0; j < 2; ++j) EXPECT_EQ(part[i * 2 + j], whole[i * 5 + 3 + j]) << i << "," << j;
  EXPECT_EQ(k.weight_grad().data<double>(), fused.weight_grad().data<double>() + 3 * 4);
}

}  // namespace
}  // namespace kiln
