// The KDA mixer on the GPU. Its per-token kernels (ops/kda/kda_mixer_cuda.cu) through the
// ops:: front ends against the CPU ops in f64 on the same inputs (rounded first to what the
// GPU reads: bf16 or f32), each run twice to the same bytes (outputs poisoned between, so
// an element never written fails); then a tiny "kda, kda, kda, gqa" model, GPU vs the CPU
// f64 model with the same weights: loss, logits and every parameter gradient; and the
// captured training step (CUDA graphs) against the op-by-op one, both delta-rule kernels.
//
// Op error: relative L2 per tensor. bf16 5e-3 forward, 7e-3 gradients (seed 001's bars:
// one bf16 rounding of each result, ~2^-9 rms, over fp32 math); f32 1e-5 / 1e-4 (fp32
// sums over at most a few hundred terms). Parameter gradients (dw, dgain) are fp32 in
// both paths: 1e-4 with f32 inputs, 7e-3 with bf16.
// Model bars: those of test_gpu_layer_norm_geglu_model.cpp (fp32 logits 1e-4, loss 1e-5
// relative, gradients 1e-3 with the 1% floor; bf16 3e-2, 1e-3, 6e-2 against each tensor's
// largest value). Not yet run on a GPU: the numbers are the bars, not measurements.
#include "core/rng.h"
#include "gpu/bf16_tensors.h"
#include "gpu/gpu_harness.h"
#include "gpu/training_run.h"
#include "gpu/whole_model.h"
#include "grad_check.h"
#include "model/model.h"
#include "ops/kda/kda_mixer_ops.h"
#include "ops/short_conv/short_conv.h"
#include "test_util.h"
#include "train/trainer.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

namespace kiln {
namespace {

using namespace gpu_test;

// f64 values as the GPU reads them in dt (rounded to f32, then to bf16 for bf16).
OwnedTensor rounded(const Tensor& f64, DType dt) {
  OwnedTensor f32 = to_f32(f64);
  if (dt == DType::bf16) round_to_bf16(*f32);
  return to_f64(*f32);
}

OwnedTensor device_of(const Tensor& f64, DType dt) {
  OwnedTensor f32 = to_f32(f64);
  return dt == DType::bf16 ? to_device(*bf16_of(*f32)) : to_device(*f32);
}

OwnedTensor device_empty(DType dt, Shape shape) {
  OwnedTensor t(dt, Device::cuda, shape);
  poison(*t);
  return t;
}

std::vector<double> values(const Tensor& dev) {
  OwnedTensor host = to_host(dev);
  return test::values_of(host->dtype() == DType::bf16 ? *f32_of_bf16(*host) : *host);
}

std::vector<uint8_t> bytes(const Tensor& dev) {
  OwnedTensor host = to_host(dev);
  const auto* p = static_cast<const uint8_t*>(host->raw());
  return std::vector<uint8_t>(p, p + host->nbytes());
}

void expect_rel(const std::string& name, const Tensor& dev, const Tensor& ref, double tol) {
  const std::vector<double> got = values(dev), want = test::values_of(ref);
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += std::isfinite(got[i]) ? (got[i] - want[i]) * (got[i] - want[i]) : INFINITY;
    den += want[i] * want[i];
  }
  const double e = std::sqrt(num / std::max(den, 1e-300));
  EXPECT_LT(e, tol) << name << " relative L2 " << e;
  ::testing::Test::RecordProperty(name + "_rel_l2", fmt::format("{:.3e}", e));
}

double tol_fwd(DType dt) { return dt == DType::bf16 ? 5e-3 : 1e-5; }
double tol_grad(DType dt) { return dt == DType::bf16 ? 7e-3 : 1e-4; }

// Runs `gpu` twice (it poisons and fills its outputs, returning them) and checks both
// passes give the same bytes; `check` judges the first.
void twice(const std::function<std::vector<OwnedTensor>()>& gpu, const std::function<void(const std::vector<OwnedTensor>&)>& check) {
  std::vector<std::vector<uint8_t>> first;
  for (int pass = 0; pass < 2; ++pass) {
    const std::vector<OwnedTensor> out = gpu();
    if (pass == 0) {
      check(out);
      for (const auto& t : out) first.push_back(bytes(*t));
    } else {
      for (size_t i = 0; i < out.size(); ++i) EXPECT_EQ(bytes(*out[i]), first[i]) << "output " << i << " differs";
    }
  }
}

class KdaMixerGpu : public GpuTest, public ::testing::WithParamInterface<DType> {};

// Documents of 1, 63, 0 (empty), 65, 7 and 300 tokens; 300 channels (the sweep's blocks
// take 256); kernels 4, 2 and 8; both GPU kernels (the sweep's tiles are 64 tokens, so
// documents end on and between their edges).
TEST_P(KdaMixerGpu, ShortConvMatchesTheCpu) {
  const DType dt = GetParam();
  const std::vector<int32_t> cu{0, 1, 64, 64, 129, 136, 436};
  const int64_t n = cu.back(), ch = 300;
  OwnedTensor cu_host = test::i32_tensor(cu), cu_dev = to_device(*cu_host);
  for (const auto& [kernel, gpu_kernel] :
       {std::pair{4, ops::ShortConvGpuKernel::per_element}, {2, ops::ShortConvGpuKernel::per_element},
        {8, ops::ShortConvGpuKernel::per_element}, {4, ops::ShortConvGpuKernel::sweep},
        {2, ops::ShortConvGpuKernel::sweep}, {8, ops::ShortConvGpuKernel::sweep}}) {
    SCOPED_TRACE(fmt::format("{} kernel {} {}", dtype_name(dt), kernel,
                             gpu_kernel == ops::ShortConvGpuKernel::sweep ? "sweep" : "per_element"));
    OwnedTensor x = rounded(*test::random_f64(Shape{n, ch}, 11), dt), w = rounded(*test::random_f64(Shape{ch, kernel}, 12, 0.5), dt);
    OwnedTensor dy = rounded(*test::random_f64(Shape{n, ch}, 13), dt), dw0 = rounded(*test::random_f64(Shape{ch, kernel}, 14), DType::f32);
    OwnedTensor y = test::nan_f64(Shape{n, ch}), dx = test::nan_f64(Shape{n, ch}), dw = rounded(*dw0, DType::f64);
    ops::short_conv_forward(process_exec(), *x, *w, *cu_host, *y);
    ops::short_conv_backward(process_exec(), *x, *w, *cu_host, *dy, *dx, *dw);
    OwnedTensor x_d = device_of(*x, dt), w_d = device_of(*w, dt), dy_d = device_of(*dy, dt);
    twice(
        [&] {
          std::vector<OwnedTensor> out;
          out.push_back(device_empty(dt, Shape{n, ch}));
          out.push_back(device_empty(dt, Shape{n, ch}));
          out.push_back(device_of(*dw0, DType::f32));  // dw accumulates onto its start
          ops::short_conv_forward(process_exec(), *x_d, *w_d, *cu_dev, *out[0], gpu_kernel);
          ops::short_conv_backward(process_exec(), *x_d, *w_d, *cu_dev, *dy_d, *out[1], *out[2], gpu_kernel);
          return out;
        },
        [&](const std::vector<OwnedTensor>& out) {
          expect_rel("y", *out[0], *y, tol_fwd(dt));
          expect_rel("dx", *out[1], *dx, tol_grad(dt));
          expect_rel("dw", *out[2], *dw, tol_grad(dt));
        });
  }
}

// 133 tokens, 3 heads, d_k 20, d_v 12 (neither a warp's multiple): the L2 norm split and beta.
TEST_P(KdaMixerGpu, SplitNormAndBetaMatchTheCpu) {
  const DType dt = GetParam();
  const int64_t n = 133, H = 3, dk = 20, dv = 12, cols = H * (2 * dk + dv);
  OwnedTensor qkv = rounded(*test::random_f64(Shape{n, cols}, 21), dt), raw = rounded(*test::random_f64(Shape{n, H}, 22, 3), dt);
  OwnedTensor dq = rounded(*test::random_f64(Shape{n, H, dk}, 23), dt), dk_ = rounded(*test::random_f64(Shape{n, H, dk}, 24), dt);
  OwnedTensor dv_ = rounded(*test::random_f64(Shape{n, H, dv}, 25), dt), db = rounded(*test::random_f64(Shape{n, H}, 26), dt);
  OwnedTensor q = test::nan_f64(Shape{n, H, dk}), k = test::nan_f64(Shape{n, H, dk}), v = test::nan_f64(Shape{n, H, dv});
  OwnedTensor dqkv = test::nan_f64(Shape{n, cols}), beta = test::nan_f64(Shape{n, H}), draw = test::nan_f64(Shape{n, H});
  ops::kda_split_norm_forward(process_exec(), *qkv, *q, *k, *v);
  ops::kda_split_norm_backward(process_exec(), *qkv, *dq, *dk_, *dv_, *dqkv);
  ops::kda_beta_forward(process_exec(), *raw, *beta);
  ops::kda_beta_backward(process_exec(), *raw, *db, *draw);
  OwnedTensor qkv_d = device_of(*qkv, dt), raw_d = device_of(*raw, dt), dq_d = device_of(*dq, dt), dk_d = device_of(*dk_, dt);
  OwnedTensor dv_d = device_of(*dv_, dt), db_d = device_of(*db, dt);
  twice(
      [&] {
        std::vector<OwnedTensor> out;
        for (const Shape& s : {Shape{n, H, dk}, Shape{n, H, dk}, Shape{n, H, dv}, Shape{n, cols}, Shape{n, H}, Shape{n, H}})
          out.push_back(device_empty(dt, s));
        ops::kda_split_norm_forward(process_exec(), *qkv_d, *out[0], *out[1], *out[2]);
        ops::kda_split_norm_backward(process_exec(), *qkv_d, *dq_d, *dk_d, *dv_d, *out[3]);
        ops::kda_beta_forward(process_exec(), *raw_d, *out[4]);
        ops::kda_beta_backward(process_exec(), *raw_d, *db_d, *out[5]);
        return out;
      },
      [&](const std::vector<OwnedTensor>& out) {
        expect_rel("q", *out[0], *q, tol_fwd(dt));
        expect_rel("k", *out[1], *k, tol_fwd(dt));
        expect_rel("v", *out[2], *v, tol_fwd(dt));
        expect_rel("dqkv", *out[3], *dqkv, tol_grad(dt));
        expect_rel("beta", *out[4], *beta, tol_fwd(dt));
        expect_rel("draw", *out[5], *draw, tol_grad(dt));
      });
}

// The gated per-head RMSNorm at d_v 40 and 300 (a warp's columns partly empty; more than a warp's width).
TEST_P(KdaMixerGpu, OutputGateMatchesTheCpu) {
  const DType dt = GetParam();
  for (int64_t d : {40, 300}) {
    SCOPED_TRACE(fmt::format("{} d_v {}", dtype_name(dt), d));
    const int64_t n = 133, H = 3;
    OwnedTensor o = rounded(*test::random_f64(Shape{n, H, d}, 31), dt), gate = rounded(*test::random_f64(Shape{n, H * d}, 32, 2), dt);
    OwnedTensor gain = rounded(*test::random_f64(Shape{d}, 33, 0.3), DType::f32);
    for (int64_t i = 0; i < d; ++i) gain->data<double>()[i] += 1;
    OwnedTensor dy = rounded(*test::random_f64(Shape{n, H * d}, 34), dt), dg0 = rounded(*test::random_f64(Shape{d}, 35), DType::f32);
    OwnedTensor y = test::nan_f64(Shape{n, H * d}), d_o = test::nan_f64(Shape{n, H, d}), dgate = test::nan_f64(Shape{n, H * d});
    OwnedTensor dgain = rounded(*dg0, DType::f64);
    ops::kda_output_gate_forward(process_exec(), *o, *gain, *gate, 1e-6, *y);
    ops::kda_output_gate_backward(process_exec(), *o, *gain, *gate, 1e-6, *dy, *d_o, *dgate, *dgain);
    OwnedTensor o_d = device_of(*o, dt), gate_d = device_of(*gate, dt), gain_d = device_of(*gain, DType::f32), dy_d = device_of(*dy, dt);
    twice(
        [&] {
          std::vector<OwnedTensor> out;
          out.push_back(device_empty(dt, Shape{n, H * d}));
          out.push_back(device_empty(dt, Shape{n, H, d}));
          out.push_back(device_empty(dt, Shape{n, H * d}));
          out.push_back(device_of(*dg0, DType::f32));  // dgain accumulates onto its start
          ops::kda_output_gate_forward(process_exec(), *o_d, *gain_d, *gate_d, 1e-6, *out[0]);
          ops::kda_output_gate_backward(process_exec(), *o_d, *gain_d, *gate_d, 1e-6, *dy_d, *out[1], *out[2], *out[3]);
          return out;
        },
        [&](const std::vector<OwnedTensor>& out) {
          expect_rel("y", *out[0], *y, tol_fwd(dt));
          expect_rel("d_o", *out[1], *d_o, tol_grad(dt));
          expect_rel("dgate", *out[2], *dgate, tol_grad(dt));
          expect_rel("dgain", *out[3], *dgain, tol_grad(dt));
        });
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, KdaMixerGpu, ::testing::Values(DType::f32, DType::bf16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// ---- a tiny hybrid model ---------------------------------------------------------------

ModelConfig hybrid_config() {
  ModelConfig c;
  c.name = "kda-hybrid-tiny";
  c.vocab_size = 259, c.hidden = 64, c.layers = 4, c.heads = 4, c.kv_heads = 2, c.head_dim = 16, c.ffn_hidden = 128;
  c.max_seq_len = 128, c.tie_embeddings = false;
  c.attention = "kda", c.alt_attention = "gqa", c.alt_attention_layers = "every:4";
  c.kda.gate_rank = 8;
  return c;
}

// Three documents of 17, 40 and 23 tokens (BOS first, EOS the last target) and a PAD tail of 8.
HostBatch three_documents() { return packed_documents({17, 40, 23}, 8, 2024); }

class KdaModelGpu : public GpuTest {
 protected:
  void compare(DType dtype, double logits_tol, double loss_tol, double grads_tol, double floor_fraction,
               const std::string& gpu_kernel = "recurrent", const std::string& conv_gpu_kernel = "per_element") {
    const HostBatch batch = three_documents();
    ModelConfig c = hybrid_config();
    c.kda.gpu_kernel = gpu_kernel;  // the GPU model's delta rule; the CPU's is always chunked
    c.kda.conv_gpu_kernel = conv_gpu_kernel;
    Model cpu(c, options_for(Device::cpu, DType::f64, batch.size()));
    cpu.allocate();
    cpu.init_weights(17);
    // Gains and biases (o_norm, g_b_proj's bias, the norms) moved off 1 and 0, so a path
    // that ignores one cannot pass.
    Rng rng(17 ^ 0x5eedull);
    for (const auto& p : cpu.parameters()) {
      if (p->shape().rank() != 1 || p->init().kind == InitKind::log_uniform ||
          p->init().kind == InitKind::inverse_softplus_log_uniform)
        continue;
      double* v = p->value().data<double>();
      for (int64_t i = 0; i < p->value().numel(); ++i) v[i] = (p->init().kind == InitKind::ones ? 1.0 : 0.0) + 0.2 * rng.normal();
    }
    // f32 copies of the weights on both: the f64 CPU model computes with the values the GPU holds.
    Model gpu(c, options_for(Device::cuda, dtype, batch.size()));
    gpu.allocate();
    ASSERT_EQ(cpu.parameters().size(), gpu.parameters().size());
    for (size_t i = 0; i < cpu.parameters().size(); ++i) {
      ASSERT_EQ(cpu.parameters()[i]->name(), gpu.parameters()[i]->name());
      const Tensor v = cpu.parameters()[i]->value();
      OwnedTensor r = rounded(v, DType::f32);
      copy_tensor(*r, v);
      copy_tensor(*to_f32(v), gpu.parameters()[i]->value());
    }
    const ModelRun want = run_model(cpu, batch), got = run_model(gpu, batch);
    expect_logits_close(want, got, c.vocab_size, logits_tol, floor_fraction);
    EXPECT_NEAR(got.loss, want.loss, loss_tol * want.loss);
    for (size_t i = 0; i < want.grads.size(); ++i)
      expect_close(want.names[i].c_str(), *got.grads[i], *want.grads[i], grads_tol, 0, floor_fraction);
  }
};

TEST_F(KdaModelGpu, Fp32GpuMatchesTheF64Cpu) { compare(DType::f32, 1e-4, 1e-5, 1e-3, kFloorFraction); }
TEST_F(KdaModelGpu, Bf16GpuMatchesTheF64Cpu) { compare(DType::bf16, 3e-2, 1e-3, 6e-2, 1.0); }
TEST_F(KdaModelGpu, Fp32ChunkedGpuMatchesTheF64Cpu) { compare(DType::f32, 1e-4, 1e-5, 1e-3, kFloorFraction, "chunked"); }
TEST_F(KdaModelGpu, Bf16ChunkedGpuMatchesTheF64Cpu) { compare(DType::bf16, 3e-2, 1e-3, 6e-2, 1.0, "chunked"); }
// The backward's grads on bf16 tensor cores (head_dim 16: one 16-channel slab).
TEST_F(KdaModelGpu, Bf16ChunkedBf16GradsGpuMatchesTheF64Cpu) {
  compare(DType::bf16, 3e-2, 1e-3, 6e-2, 1.0, "chunked_bf16");
}
TEST_F(KdaModelGpu, Fp32SweepConvGpuMatchesTheF64Cpu) {
  compare(DType::f32, 1e-4, 1e-5, 1e-3, kFloorFraction, "chunked", "sweep");
}
TEST_F(KdaModelGpu, Bf16SweepConvGpuMatchesTheF64Cpu) { compare(DType::bf16, 3e-2, 1e-3, 6e-2, 1.0, "chunked", "sweep"); }

// ---- training steps, captured and op by op ---------------------------------------------

// The CPU test's run (tests/test_kda_mixer.cpp: "kda, gqa", hidden 32) on the GPU, two
// micro-batches a step: backward recomputes the convolution's output into the workspace on
// the step's stream, inside the captured graph too.
TrainingRun train(const std::string& out, const std::string& precision, const std::string& gpu_kernel,
                  const std::string& conv_gpu_kernel, bool graphs) {
  const std::vector<std::string> overrides = {
      "data.path=" + test::source_dir() + "/data/tinyshakespeare.txt", "train.out_dir=" + out, "train.device=cuda",
      "train.precision=" + precision, "train.cuda_graphs=" + std::string(graphs ? "true" : "false"),
      "model.hidden=32", "model.layers=2", "model.heads=4", "model.kv_heads=2", "model.head_dim=8",
      "model.ffn_hidden=64", "model.max_seq_len=64", "model.attention=kda", "model.alt_attention=gqa",
      "model.alt_attention_layers=1", "model.kda.gpu_kernel=" + gpu_kernel,
      "model.kda.conv_gpu_kernel=" + conv_gpu_kernel, "train.micro_batch_tokens=256",
      "train.grad_accum=2", "train.steps=30", "train.eval_every=0", "train.eval_batches=1", "train.sample_every=0",
      "train.sample_tokens=0", "log.every=1", "checkpoint.save_final=false", "optim.warmup_steps=5"};
  return run_training(overrides, out);
}

class KdaTrainingGpu : public GpuTest {};

// Same losses and weights to the bit with and without graphs (the mixer enqueues only on the
// step's stream, its recompute included; nothing synchronizes or allocates), and the loss
// falls as the CPU's does (by more than 1 nat over 30 steps).
TEST_F(KdaTrainingGpu, CapturedStepsMatchTheOpByOpStepsAndLearn) {
  const std::string dir = test::temp_dir("kiln-gpu-kda-train");
  for (const auto& [gpu_kernel, conv] : {std::pair<std::string, std::string>{"recurrent", "per_element"},
                                         {"chunked", "per_element"},
                                         {"chunked", "sweep"},
                                         {"chunked_bf16", "per_element"}}) {
    for (const std::string precision : {"bf16", "fp32"}) {
      SCOPED_TRACE(gpu_kernel + ", " + conv + ", " + precision);
      const std::string base = dir + "/" + gpu_kernel + "-" + conv + "-" + precision;
      const TrainingRun ops = train(base + "-ops", precision, gpu_kernel, conv, false);
      const TrainingRun graphs = train(base + "-graphs", precision, gpu_kernel, conv, true);
      EXPECT_EQ(ops.graph_launches, 0);
      EXPECT_GT(graphs.graph_launches, 30);
      ASSERT_EQ(ops.losses.size(), 30u);
      expect_same_run(graphs, ops);
      for (double l : ops.losses) EXPECT_TRUE(std::isfinite(l));
      const double last = mean_last_losses(ops, 5);
      std::printf("kda hybrid on the GPU (%s, %s conv, %s): loss %.3f -> %.3f over 30 steps\n", gpu_kernel.c_str(),
                  conv.c_str(), precision.c_str(), ops.losses[0], last);
      EXPECT_LT(last, ops.losses[0] - 1.0);
    }
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kiln
