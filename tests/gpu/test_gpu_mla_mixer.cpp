// The NoPE MLA mixer (nn/mla_mixer.h) on the GPU: its one kernel (the head-width copy,
// ops/mla/mla_heads_cuda.cu) against the CPU op bit for bit; tiny "mla, gqa" and "mla, mla"
// models, GPU vs the CPU f64 model with the same weights: loss, logits and every parameter
// gradient, fp32 and bf16 mixed precision; the captured training step (CUDA graphs) against
// the op-by-op one with QK-Clip on, and the loss falling as on the CPU
// (tests/test_mla_mixer.cpp's run). GPU decode: test_gpu_mla_decode.cpp.
//
// Model bars: those of test_gpu_kda_mixer.cpp (fp32 logits 1e-4, loss 1e-5 relative,
// gradients 1e-3 with the 1% floor; bf16 3e-2, 1e-3, 6e-2 against each tensor's largest
// value). Not yet run on a GPU: the numbers are the bars, not measurements.
#include "core/rng.h"
#include "gpu/bf16_tensors.h"
#include "gpu/gpu_harness.h"
#include "gpu/training_run.h"
#include "gpu/whole_model.h"
#include "grad_check.h"
#include "model/model.h"
#include "ops/mla/mla_heads.h"
#include "test_util.h"
#include "train/trainer.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace kiln {
namespace {

using namespace gpu_test;

// ---- the head-width copy ---------------------------------------------------------------

// Padding 6 -> 8 and 3 -> 8, cropping 8 -> 3 and a plain copy, over 37 rows of 3 heads; the
// destination poisoned first, so a column never written fails. f32 and bf16 move bits: the
// GPU's bytes equal the CPU op's on the same f32 values (bf16 ones: rounded first).
class MlaHeadsGpu : public GpuTest {};

TEST_F(MlaHeadsGpu, CopyHeadsEqualsTheCpuBitForBit) {
  const int64_t n = 37, heads = 3;
  for (const DType dt : {DType::f32, DType::bf16})
    for (const auto& [a, b] : std::vector<std::pair<int64_t, int64_t>>{{6, 8}, {3, 8}, {8, 3}, {5, 5}}) {
      SCOPED_TRACE(fmt::format("{} {} -> {}", dtype_name(dt), a, b));
      OwnedTensor src = to_f32(*test::random_f64(Shape{n, heads, a}, 41));
      OwnedTensor want(DType::f32, Device::cpu, Shape{n, heads, b});
      if (dt == DType::bf16) round_to_bf16(*src);
      ops::mla_copy_heads(process_exec(), *src, *want);
      OwnedTensor src_d = to_device(dt == DType::bf16 ? *bf16_of(*src) : *src);
      OwnedTensor dst_d(dt, Device::cuda, Shape{n, heads, b});
      poison(*dst_d);
      ops::mla_copy_heads(process_exec(), *src_d, *dst_d);
      OwnedTensor got = to_host(*dst_d);
      if (dt == DType::bf16) got = f32_of_bf16(*got);
      EXPECT_TRUE(same_bytes(*got, *want));
    }
}

// ---- tiny models, GPU vs the CPU in f64 ---------------------------------------------------

// "mla, gqa" with d_qk 20 > d_v 12 (padded to 24 on the GPU: cuDNN's multiple of 8), or
// "mla, mla" with d_qk 8 < d_v 16 and tied embeddings.
ModelConfig mla_config(bool hybrid) {
  ModelConfig c;
  c.name = hybrid ? "mla-hybrid-tiny" : "mla-only-tiny";
  c.vocab_size = 259, c.hidden = 64, c.layers = 2, c.heads = 4, c.kv_heads = 2, c.head_dim = 16, c.ffn_hidden = 128;
  c.max_seq_len = 128, c.tie_embeddings = !hybrid;
  c.attention = "mla";
  if (hybrid) c.alt_attention = "gqa", c.alt_attention_layers = "from:1";
  c.mla.kv_rank = 24;
  c.mla.qk_head_dim = hybrid ? 20 : 8;
  c.mla.v_head_dim = hybrid ? 12 : 16;
  return c;
}

// Three documents of 17, 40 and 23 tokens (BOS first, EOS the last target) and a PAD tail of 8.
HostBatch three_documents() { return packed_documents({17, 40, 23}, 8, 2025); }

class MlaModelGpu : public GpuTest {
 protected:
  void compare(bool hybrid, DType dtype, double logits_tol, double loss_tol, double grads_tol, double floor_fraction) {
    const HostBatch batch = three_documents();
    const ModelConfig c = mla_config(hybrid);
    Model cpu(c, options_for(Device::cpu, DType::f64, batch.size()));
    cpu.allocate();
    cpu.init_weights(19);
    // Matrices N(0, 0.1) (attention logits of order 0.5, so the softmax is far from
    // uniform and a wrong scale or mask shows), gains 1 + N(0, 0.2) (the latent norm's too).
    Rng rng(19 ^ 0x5eedull);
    for (const auto& p : cpu.parameters()) {
      const bool gain = p->init().kind == InitKind::ones, matrix = p->shape().rank() == 2;
      double* v = p->value().data<double>();
      for (int64_t i = 0; i < p->value().numel(); ++i) v[i] = (gain ? 1.0 : 0.0) + (matrix ? 0.1 : 0.2) * rng.normal();
    }
    // f32 copies of the weights on both: the f64 CPU model computes with the values the GPU holds.
    Model gpu(c, options_for(Device::cuda, dtype, batch.size()));
    gpu.allocate();
    ASSERT_EQ(cpu.parameters().size(), gpu.parameters().size());
    for (size_t i = 0; i < cpu.parameters().size(); ++i) {
      ASSERT_EQ(cpu.parameters()[i]->name(), gpu.parameters()[i]->name());
      const Tensor v = cpu.parameters()[i]->value();
      OwnedTensor f32 = to_f32(v);
      copy_tensor(*to_f64(*f32), v);
      copy_tensor(*f32, gpu.parameters()[i]->value());
    }
    const ModelRun want = run_model(cpu, batch), got = run_model(gpu, batch);
    expect_logits_close(want, got, c.vocab_size, logits_tol, floor_fraction);
    EXPECT_NEAR(got.loss, want.loss, loss_tol * want.loss);
    bool latent = false;
    for (size_t i = 0; i < want.grads.size(); ++i) {
      expect_close(want.names[i].c_str(), *got.grads[i], *want.grads[i], grads_tol, 0, floor_fraction);
      latent = latent || want.names[i] == "layers.0.mla.kv_a_layernorm.weight";
    }
    EXPECT_TRUE(latent) << "the mla layer's parameters were not compared";
  }
};

TEST_F(MlaModelGpu, HybridFp32GpuMatchesTheF64Cpu) { compare(true, DType::f32, 1e-4, 1e-5, 1e-3, kFloorFraction); }
TEST_F(MlaModelGpu, HybridBf16GpuMatchesTheF64Cpu) { compare(true, DType::bf16, 3e-2, 1e-3, 6e-2, 1.0); }
TEST_F(MlaModelGpu, MlaOnlyFp32GpuMatchesTheF64Cpu) { compare(false, DType::f32, 1e-4, 1e-5, 1e-3, kFloorFraction); }
TEST_F(MlaModelGpu, MlaOnlyBf16GpuMatchesTheF64Cpu) { compare(false, DType::bf16, 3e-2, 1e-3, 6e-2, 1.0); }

// ---- training: captured vs op by op ----------------------------------------------------

struct MlaRun : TrainingRun {
  // The mla layer's heads over tau, summed over the steps (at the last step alone it
  // depended on the run's rounding: 0 in bf16 once the LM head's GEMM kernels changed).
  double clipped = 0;
};

// The CPU test's run (tests/test_mla_mixer.cpp: "mla, gqa", d_qk 8, d_v 6, rank 16) on the
// GPU, with QK-Clip at a tau below the first step's logits, so every step's measure and
// scaling run (inside and right after the captured step).
MlaRun train(const std::string& out, const std::string& precision, bool graphs) {
  const std::vector<std::string> overrides = {
      "data.path=" + test::source_dir() + "/data/tinyshakespeare.txt", "train.out_dir=" + out, "train.device=cuda",
      "train.precision=" + precision, "train.cuda_graphs=" + std::string(graphs ? "true" : "false"),
      "model.hidden=32", "model.layers=2", "model.heads=4", "model.kv_heads=2", "model.head_dim=8",
      "model.ffn_hidden=64", "model.max_seq_len=64", "model.attention=mla", "model.alt_attention=gqa",
      "model.alt_attention_layers=1", "model.mla.kv_rank=16", "model.mla.v_head_dim=6", "train.micro_batch_tokens=256",
      "train.grad_accum=2", "train.steps=30", "train.eval_every=0", "train.eval_batches=1", "train.sample_every=0",
      "train.sample_tokens=0", "log.every=1", "checkpoint.save_final=false", "optim.warmup_steps=5",
      "optim.qk_clip.enabled=true", "optim.qk_clip.tau=0.01"};
  MlaRun r;
  double clipped = 0;
  static_cast<TrainingRun&>(r) =
      run_training(overrides, out, [&](const nlohmann::json& j) { clipped += j.value("attn.0.clipped", 0.0); });
  r.clipped = clipped;
  return r;
}

class MlaTrainingGpu : public GpuTest {};

// Same losses, QK-Clip reports and weights to the bit with and without graphs (the mixer
// enqueues only on the step's stream, nothing synchronizes or allocates); the clip ran; the
// loss falls as the CPU's does (by more than 1 nat over 30 steps: mostly what the embeddings
// and MLPs learn, which the clip's near-uniform attention leaves alone).
TEST_F(MlaTrainingGpu, CapturedStepsMatchTheOpByOpStepsAndLearn) {
  const std::string dir = test::temp_dir("kiln-gpu-mla-train");
  for (const std::string precision : {"bf16", "fp32"}) {
    SCOPED_TRACE(precision);
    const MlaRun ops = train(dir + "/" + precision + "-ops", precision, false);
    const MlaRun graphs = train(dir + "/" + precision + "-graphs", precision, true);
    EXPECT_EQ(ops.graph_launches, 0);
    EXPECT_GT(graphs.graph_launches, 30);
    ASSERT_EQ(ops.losses.size(), 30u);
    EXPECT_NE(ops.lines.back().find("attn.0.max_logit"), std::string::npos) << ops.lines.back();
    EXPECT_GT(ops.clipped, 0) << ops.lines.back();
    expect_same_run(graphs, ops);
    for (double l : ops.losses) EXPECT_TRUE(std::isfinite(l));
    const double last = mean_last_losses(ops, 5);
    std::printf("mla hybrid on the GPU (%s): loss %.3f -> %.3f over 30 steps\n", precision.c_str(), ops.losses[0], last);
    EXPECT_LT(last, ops.losses[0] - 1.0);
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kiln
