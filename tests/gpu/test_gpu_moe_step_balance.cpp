// The step's balance loss (model.moe.balance_scope = "step"; docs/moe-routers.md) on the
// GPU, as tests/test_moe_step_balance.cpp checks it on the CPU: the counting pass adds the
// step's routed counts to a device buffer, and the balance loss's and z-loss's kernels read
// them there, in the op-by-op step and in the captured one (the counting pass a graph of its
// own, nothing read back inside the step). A sparse model (test_gpu_moe_model.cpp's: a dense
// layer, two MoE layers of 8 experts, top 2, a shared expert; the router x 30 so that the
// CPU and the GPU choose the same experts) trains 4 AdamW steps of 2 or 3 micro-batches in
// fp32 on both devices from the same weights; every step's loss, balance loss, z-loss and
// gradient norm, and the final weights, agree with the CPU's within kTolerance relative.
//
// AdamW's eps is 1e-3 here: with the default 1e-8 an element whose gradient is ~1e-8 moves
// by ~lr in a direction fp32 rounding picks (the CPU's and the GPU's sums differ in order),
// which is no error of the step scope; with 1e-3 an update changes by at most lr x its
// gradient's difference / 1e-3.
//
// Not yet run on a GPU (written 2026-12-06 on a machine without one).
#include "gpu/gpu_harness.h"
#include "gpu/whole_model.h"
#include "model/model.h"
#include "ops/elementwise/elementwise.h"
#include "ops/moe/routing.h"
#include "grad_check.h"
#include "test_util.h"
#include "train/optimizer_groups.h"
#include "train/step_program.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace kiln {
namespace {

using namespace gpu_test;

// fp32 on both devices, sums in other orders (the whole-model test's loss bar).
constexpr double kTolerance = 1e-5;
constexpr int64_t kTokens = 88;  // every micro-batch's rows (the captured step stages full batches)
constexpr int kSteps = 4;

// test_gpu_moe_model.cpp's model with large balance and z-loss coefficients, so that their
// gradients are a large part of the router's.
ModelConfig step_config(const std::string& scope) {
  ModelConfig c;
  c.name = "moe-step-balance";
  c.vocab_size = 259, c.hidden = 64, c.layers = 3, c.heads = 4, c.kv_heads = 2, c.head_dim = 16, c.ffn_hidden = 128;
  c.max_seq_len = 128, c.tie_embeddings = false, c.qk_norm = true;
  c.mlp = "moe";
  c.alt_mlp = "swiglu";
  c.alt_mlp_layers = "first:1";
  c.moe.experts = 8, c.moe.top_k = 2, c.moe.expert_hidden = 40, c.moe.shared_hidden = 48;
  c.moe.aux_loss = 0.5, c.moe.z_loss = 0.2;
  c.moe.balance_scope = scope;
  return c;
}

// Micro-batch i of step s: documents of other lengths per micro-batch (88 rows each, an
// 8-token PAD tail), other bytes per step.
HostBatch micro_batch(int step, int i) {
  const auto seed = static_cast<uint64_t>(1000 * step + i);
  if (i == 0) return packed_documents({17, 40, 23}, 8, seed);
  if (i == 1) return packed_documents({30, 50}, 8, seed);
  return packed_documents({60, 5, 15}, 8, seed);
}

struct TrainedRun {
  std::vector<double> losses, balance, z, grad_norms;  // per step
  std::vector<double> weights;                         // after the last step
  size_t graphs = 0;
  int64_t launches = 0;
};

TrainedRun train(Device device, StepExecution execution, const std::string& scope, int grad_accum, double loss_scale = 1) {
  const ModelConfig c = step_config(scope);
  Model model(c, options_for(device, DType::f32, kTokens));
  Arena state{"optimizer", device};
  OptimConfig optim;
  optim.eps = 1e-3;
  const std::unique_ptr<Optimizer> optimizer = make_optimizer(model.exec(), optim, model.parameters(), 1.0);
  optimizer->plan(state);
  model.allocate();
  state.allocate();
  // The same weights on every run: the CPU model's init (the router x 30), copied.
  Model init(c, options_for(Device::cpu, DType::f32, kTokens));
  init.allocate();
  init_moe_weights(init, 53);
  copy_weights(init, model);
  model.set_micro_batches(grad_accum);
  StepProgram program(model, *optimizer, grad_accum, execution);
  TrainedRun r;
  for (int s = 0; s < kSteps; ++s) {
    std::vector<HostBatch> batches;
    int64_t targets = 0;
    for (int i = 0; i < grad_accum; ++i) batches.push_back(micro_batch(s, i)), targets += batches.back().target_count;
    StepPlan plan;
    plan.lr = 1e-3;
    plan.loss_limit = plan.grad_limit = std::numeric_limits<double>::infinity();
    plan.loss_scale = loss_scale;
    const StepOutcome o = program.run(batches, targets, plan);
    EXPECT_TRUE(o.applied());
    const LossTerms& terms = model.loss_terms();
    r.losses.push_back(o.loss);
    r.balance.push_back(terms.value(terms.find("moe_aux"), o.step_sums, targets, grad_accum));
    r.z.push_back(terms.value(terms.find("moe_z"), o.step_sums, targets, grad_accum));
    r.grad_norms.push_back(o.grad_norm);
  }
  for (const auto& p : model.parameters()) {
    const OwnedTensor host = to_host(p->value());
    for (int64_t i = 0; i < host->numel(); ++i) r.weights.push_back(host->data<float>()[i]);
  }
  r.graphs = program.graphs_captured();
  r.launches = program.graph_launches();
  return r;
}

// The largest of the per-step quantities' and the weights' differences.
double run_difference(const TrainedRun& got, const TrainedRun& want, const char* what) {
  const double d[] = {test::max_diff_over_max(got.losses, want.losses), test::max_diff_over_max(got.balance, want.balance), test::max_diff_over_max(got.z, want.z),
                      test::max_diff_over_max(got.grad_norms, want.grad_norms), test::max_diff_over_max(got.weights, want.weights)};
  std::printf("%s: loss %.2e, balance %.2e, z %.2e, grad norm %.2e, weights %.2e\n", what, d[0], d[1], d[2], d[3], d[4]);
  return *std::max_element(std::begin(d), std::end(d));
}

const char* name_of(StepExecution e) { return e == StepExecution::captured ? "captured" : "op by op"; }

class MoeStepBalanceGpu : public GpuTest {};

OwnedTensor f64_values(const std::vector<double>& values) {
  OwnedTensor t(DType::f64, Device::cpu, Shape{static_cast<int64_t>(values.size())});
  std::copy(values.begin(), values.end(), t->data<double>());
  return t;
}

double read_double(const Tensor& dev) { return to_host(dev)->data<double>()[0]; }

// The ops alone (T = 37 tokens, E = 6): the counting pass's sum, and the balance loss and the
// z-loss with the step's counts (their values returned and summed on the device, their
// gradients with a device loss scale), against the CPU; with the counts cleared (0 tokens)
// both fall back to the micro-batch's own.
TEST_F(MoeStepBalanceGpu, StepScopeOpsMatchTheCpu) {
  const ExecContext& ctx = process_exec();
  const int64_t t = 37, e = 6, k = 2;
  const OwnedTensor probs = test::random_tensor(DType::f32, Shape{t, e}, 5, 1.0), logits = test::random_tensor(DType::f32, Shape{t, e}, 6, 3.0);
  OwnedTensor counts(DType::i32, Device::cpu, Shape{e});
  for (int64_t i = 0; i < e; ++i) counts->data<int32_t>()[i] = static_cast<int32_t>(3 * i + 1);
  const OwnedTensor counts_dev = to_device(*counts), probs_dev = to_device(*probs), logits_dev = to_device(*logits);
  // Another micro-batch's counts were added first: the step's are not this one's.
  const OwnedTensor step = f64_values({5, 0, 9, 2, 11, 7, 17});
  OwnedTensor step_dev = to_device(*step);
  ops::balance_step_routes_add(ctx, *counts, t, *step);
  ops::balance_step_routes_add(ctx, *counts_dev, t, *step_dev);
  const OwnedTensor step_back = to_host(*step_dev);
  for (int64_t i = 0; i <= e; ++i) EXPECT_EQ(step_back->data<double>()[i], step->data<double>()[i]) << i;
  EXPECT_EQ(step->data<double>()[e], 17.0 + 37.0);

  const OwnedTensor scale_dev = to_device(*f64_values({4.0}));
  for (const bool cleared : {false, true}) {
    SCOPED_TRACE(cleared ? "cleared: the micro-batch's counts" : "the step's counts");
    if (cleared) ops::zero(ctx, *step), ops::zero(ctx, *step_dev);  // on the stream the kernels run on
    const Tensor step_tokens = step->rows(e, e + 1), step_tokens_dev = step_dev->rows(e, e + 1);
    // The balance loss: value, device sum, gradient x 0.5 x S (S = 4, from device memory).
    const double want = ops::balance_loss(ctx, *probs, *counts, k, 0, Tensor(), *step);
    EXPECT_NEAR(ops::balance_loss(ctx, *probs_dev, *counts_dev, k, 0, Tensor(), *step_dev), want, 1e-6 * std::abs(want));
    OwnedTensor sum_dev = to_device(*f64_values({0.25}));
    ops::balance_loss_sum(ctx, *probs_dev, *counts_dev, k, sum_dev->data<double>(), *step_dev);
    EXPECT_NEAR(read_double(*sum_dev), 0.25 + want, 1e-6 * std::abs(want));
    OwnedTensor dprobs(DType::f32, Device::cpu, Shape{t, e});
    const OwnedTensor dprobs_dev(DType::f32, Device::cuda, Shape{t, e});
    poison(*dprobs_dev);
    ops::balance_loss_backward(ctx, *probs, *counts, k, 2.0, *dprobs, *step);
    ops::balance_loss_backward(ctx, *probs_dev, *counts_dev, k, ops::GradScale(0.5, scale_dev->data<double>()), *dprobs_dev,
                               *step_dev);
    expect_close("dprobs", *to_host(*dprobs_dev), *to_f64(*dprobs), 1e-6);
    // The z-loss: the mean over the step's tokens.
    const double z = ops::router_z_loss(ctx, *logits, 0, Tensor(), step_tokens);
    EXPECT_NEAR(ops::router_z_loss(ctx, *logits_dev, 0, Tensor(), step_tokens_dev), z, 1e-6 * z);
    OwnedTensor z_sum_dev = to_device(*f64_values({0}));
    ops::router_z_loss_sum(ctx, *logits_dev, z_sum_dev->data<double>(), step_tokens_dev);
    EXPECT_NEAR(read_double(*z_sum_dev), z, 1e-6 * z);
    OwnedTensor dlogits(DType::f32, Device::cpu, Shape{t, e});
    zero_tensor(*dlogits);
    const OwnedTensor dlogits_dev = to_device(*dlogits);
    ops::router_z_loss_backward(ctx, *logits, 2.0, *dlogits, step_tokens);
    ops::router_z_loss_backward(ctx, *logits_dev, ops::GradScale(0.5, scale_dev->data<double>()), *dlogits_dev, step_tokens_dev);
    expect_close("dlogits", *to_host(*dlogits_dev), *to_f64(*dlogits), 1e-6);
    // The step's value is not the micro-batch's (the counts and tokens differ), unless cleared.
    const double own = ops::balance_loss(ctx, *probs, *counts, k, 0, Tensor());
    if (cleared) EXPECT_EQ(want, own);
    else EXPECT_GT(std::abs(want - own), 1e-3 * std::abs(own));
  }
}

// grad_accum 2 and 3: the GPU's step scope, op by op and captured, trains as the CPU's; and
// the micro-batch scope would not (so the agreement is the step scope's).
TEST_F(MoeStepBalanceGpu, StepScopeTrainsAsTheCpuOpByOpAndCaptured) {
  for (const int grad_accum : {2, 3}) {
    const TrainedRun cpu = train(Device::cpu, StepExecution::op_by_op, "step", grad_accum);
    const TrainedRun cpu_micro = train(Device::cpu, StepExecution::op_by_op, "micro_batch", grad_accum);
    EXPECT_GT(run_difference(cpu_micro, cpu, "CPU micro_batch vs step scope"), 100 * kTolerance);
    for (const StepExecution execution : {StepExecution::op_by_op, StepExecution::captured}) {
      SCOPED_TRACE(std::string(name_of(execution)) + ", grad_accum " + std::to_string(grad_accum));
      const TrainedRun gpu = train(Device::cuda, execution, "step", grad_accum);
      EXPECT_LE(run_difference(gpu, cpu, "GPU vs CPU, step scope"), kTolerance);
      if (execution == StepExecution::captured) {
        // Micro-batch, update and counting-pass graphs, replayed after their warm-ups.
        const TrainedRun micro = train(Device::cuda, execution, "micro_batch", grad_accum);
        EXPECT_GT(gpu.graphs, micro.graphs);
        EXPECT_GT(gpu.launches, micro.launches);
      } else {
        EXPECT_EQ(gpu.launches, 0);
      }
    }
  }
}

// One micro-batch a step: the whole step is the micro-batch, so both scopes give the same
// losses and weights (on the GPU, either executor).
TEST_F(MoeStepBalanceGpu, AtGradAccumOneTheScopesAgree) {
  for (const StepExecution execution : {StepExecution::op_by_op, StepExecution::captured}) {
    SCOPED_TRACE(name_of(execution));
    const TrainedRun step = train(Device::cuda, execution, "step", 1), micro = train(Device::cuda, execution, "micro_batch", 1);
    EXPECT_LE(run_difference(step, micro, "GPU step vs micro_batch scope, grad_accum 1"), kTolerance);
  }
}

// A loss scale S (train/loss_scaler.h): the router losses' gradients carry it, from the host
// op by op and from device memory in the captured step, and the step divides it out again.
TEST_F(MoeStepBalanceGpu, ALossScaleChangesNothing) {
  for (const StepExecution execution : {StepExecution::op_by_op, StepExecution::captured}) {
    SCOPED_TRACE(name_of(execution));
    const TrainedRun plain = train(Device::cuda, execution, "step", 2), scaled = train(Device::cuda, execution, "step", 2, 1024);
    EXPECT_LE(run_difference(scaled, plain, "GPU step scope, S = 1024 vs 1"), 1e-6);
  }
}

}  // namespace
}  // namespace kiln
