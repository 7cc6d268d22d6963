// LatentMoE (model.moe.latent_width; nn/moe/moe_mlp.cpp) on the GPU against the same model
// on the CPU: the projections W_down [L, d] and W_up [d, L] through the CUDA linear ops, the
// router on the full x, the experts' dispatch, grouped GEMMs and combine at the latent width.
// A dense first layer, then two LatentMoE layers with a shared expert, the balance loss and
// the z-loss on; the same weights (the CPU model's init with the router scaled up, so its
// choices are clear); one packed batch of three documents and a PAD tail; logits, loss, the
// router losses' slots and every parameter's gradient compared.
//
// fp32 routes top 2 of 8 (the GPU's router logits differ from the CPU's by ~1e-6, far
// below the gaps between the scaled random keys: both choose alike). bf16 rounds the
// router's input, which flips near ties, so its comparison routes every token to every
// expert (top_k = E), as test_gpu_moe_model.cpp does. Latent widths 24 (a multiple of 8:
// CUTLASS's grouped GEMM on Hopper in bf16) and 20 (the portable grouped kernel).
//
// Tolerances as test_gpu_moe_model.cpp's (fp32: logits 1e-4, loss 1e-5 relative, gradients
// 1e-3 with a floor of 1% of each tensor's max; bf16: 3e-2, 1e-3, 6e-2 against each
// tensor's max). Written, not yet run on a GPU.
#include "core/rng.h"
#include "gpu/gpu_harness.h"
#include "gpu/whole_model.h"
#include "model/model.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace kiln {
namespace {

using namespace gpu_test;

// Three layers of hidden 64: layer 0 dense SwiGLU, layers 1-2 LatentMoE (E = 8 experts of
// width 40 in a latent of `latent`, a shared expert of width 48 on x).
ModelConfig latent_config(const std::string& router, int64_t top_k, int64_t latent) {
  ModelConfig c;
  c.name = "latent-moe-tiny";
  c.vocab_size = 259, c.hidden = 64, c.layers = 3, c.heads = 4, c.kv_heads = 2, c.head_dim = 16, c.ffn_hidden = 128;
  c.max_seq_len = 128, c.tie_embeddings = false, c.qk_norm = true;
  c.mlp = "moe";
  c.alt_mlp = "swiglu";
  c.alt_mlp_layers = "first:1";
  c.moe.experts = 8, c.moe.top_k = top_k, c.moe.expert_hidden = 40, c.moe.shared_hidden = 48;
  c.moe.latent_width = latent;
  c.moe.router = router;
  c.moe.aux_loss = 0.01, c.moe.z_loss = 0.001;
  if (router == "sigmoid_bias") c.moe.routed_scaling = 2.5;
  return c;
}

// Three documents of 17, 40 and 23 bytes and an 8-token PAD tail without targets.
HostBatch three_documents() { return packed_documents({17, 40, 23}, 8, 2026); }

class LatentMoeGpu : public GpuTest {
 protected:
  void compare(const ModelConfig& c, DType dtype, ModelTolerance tol) {
    const HostBatch batch = three_documents();
    Model cpu(c, options_for(Device::cpu, DType::f32, batch.size()));
    cpu.allocate();
    init_moe_weights(cpu, 37);
    Model gpu(c, options_for(Device::cuda, dtype, batch.size()));
    gpu.allocate();
    copy_weights(cpu, gpu);
    const ModelRun want = run_model(cpu, batch), got = run_model(gpu, batch);
    const double logits_error = expect_logits_close(want, got, c.vocab_size, tol.logits, tol.floor_fraction);
    EXPECT_NEAR(got.loss, want.loss, tol.loss * want.loss);
    for (const char* name : {"moe_aux", "moe_z"}) {
      const int slot = cpu.loss_terms().find(name);
      ASSERT_GE(slot, 0) << name;
      const double w = want.slots[static_cast<size_t>(slot)], g = got.slots[static_cast<size_t>(slot)];
      EXPECT_GT(w, 0) << name;
      EXPECT_NEAR(g, w, (dtype == DType::f32 ? 1e-5 : 3e-2) * w) << name;
    }
    double grad_error = 0;
    int latent_grads = 0;
    for (size_t i = 0; i < want.grads.size(); ++i) {
      grad_error = std::max(grad_error, expect_close(want.names[i].c_str(), *got.grads[i], *to_f64(*want.grads[i]),
                                                     tol.grads, 0, tol.floor_fraction));
      if (want.names[i].find("latent_") != std::string::npos) ++latent_grads;
    }
    EXPECT_EQ(latent_grads, 4);  // both projections of both sparse layers were compared
    std::printf("latent moe (%s, top %lld, L %lld), GPU %s vs CPU f32: logits error %.2e, loss %.7f vs %.7f, worst "
                "gradient error %.2e\n",
                c.moe.router.c_str(), static_cast<long long>(c.moe.top_k), static_cast<long long>(c.moe.latent_width),
                std::string(dtype_name(dtype)).c_str(), logits_error, got.loss, want.loss, grad_error);
  }
};

TEST_F(LatentMoeGpu, Fp32SoftmaxTopKMatchesTheCpu) { compare(latent_config("softmax_topk", 2, 24), DType::f32, kFp32Model); }
TEST_F(LatentMoeGpu, Fp32SigmoidBiasMatchesTheCpu) { compare(latent_config("sigmoid_bias", 2, 24), DType::f32, kFp32Model); }
TEST_F(LatentMoeGpu, Fp32OddLatentWidthMatchesTheCpu) { compare(latent_config("softmax_topk", 2, 20), DType::f32, kFp32Model); }

TEST_F(LatentMoeGpu, Fp32WithoutSavedOutputsMatchesTheCpu) {
  ModelConfig c = latent_config("softmax_topk", 2, 24);
  c.moe.save_outputs = false;  // the weights' gradient from the latent experts' activations
  compare(c, DType::f32, kFp32Model);
}

TEST_F(LatentMoeGpu, Bf16EveryExpertMatchesTheFp32Cpu) {
  compare(latent_config("softmax_topk", 8, 24), DType::bf16, kBf16Model);  // CUTLASS's grouped GEMM on Hopper
  compare(latent_config("softmax_topk", 8, 20), DType::bf16, kBf16Model);  // the portable one
}

// Two GPU models with the same weights give the same bits (bf16, top 2).
TEST_F(LatentMoeGpu, Bf16TopTwoIsBitwiseRepeatable) {
  const ModelConfig c = latent_config("softmax_topk", 2, 24);
  const HostBatch batch = three_documents();
  Model cpu(c, options_for(Device::cpu, DType::f32, batch.size()));
  cpu.allocate();
  init_moe_weights(cpu, 41);
  std::vector<ModelRun> results;
  for (int i = 0; i < 2; ++i) {
    Model gpu(c, options_for(Device::cuda, DType::bf16, batch.size()));
    gpu.allocate();
    copy_weights(cpu, gpu);
    results.push_back(run_model(gpu, batch));
  }
  EXPECT_EQ(std::memcmp(&results[0].loss, &results[1].loss, sizeof(double)), 0);
  EXPECT_EQ(std::memcmp(results[0].logits.data(), results[1].logits.data(), results[0].logits.size() * sizeof(float)), 0);
  for (size_t i = 0; i < results[0].grads.size(); ++i)
    EXPECT_TRUE(same_bytes(*results[0].grads[i], *results[1].grads[i])) << results[0].names[i];
}

}  // namespace
}  // namespace kiln
