// Block Attention Residuals (model.attn_res_block; nn/attn_res.h, ops/attn_res/attn_res_cuda.cu)
// on the GPU:
//   - the mix op, forward and backward, in fp32 against the CPU reference in fp64 on the
//     same inputs (5 sources, 37 rows of width 200: columns past one block's threads);
//   - a whole model (3 layers in blocks of 2: completed blocks, partial sums and a partial
//     last block at the final read) on the GPU in fp32 and bf16 mixed precision against
//     the same model on the CPU (fp32), the pseudo-queries random (not the plain mean):
//     logits, loss and every parameter's gradient.
//   - the decoder (nn/attn_res_decode.cpp) in fp32 and bf16, with and without sandwich
//     norms, through tests/full_forward.h's slot script (chunked prefill beside single
//     tokens, a reused slot, a fork), steps of up to 4 rows captured as CUDA graphs, against
//     the same GPU model's full forward over each prefix: the other mixers' decode bars
//     (f32 1e-4, bf16 5e-2 of the largest |logit|). Not yet run on a GPU.
// Tolerances: the op 5e-5 relative (fp32 against fp64; see the op test); the model as
// test_gpu_moe_model.cpp's (fp32: logits 1e-4, loss 1e-5, gradients 1e-3 with a floor of
// 1% of each tensor's max; bf16: 3e-2, 1e-3, 6e-2 against each tensor's max).
#include "core/exec_context.h"
#include "core/rng.h"
#include "full_forward.h"
#include "gpu/gpu_harness.h"
#include "gpu/whole_model.h"
#include "infer/decoder.h"
#include "model/model.h"
#include "ops/attn_res/attn_res.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

namespace kiln {
namespace {

using namespace gpu_test;
using test::random_tensor;

class AttnResGpu : public GpuTest {};

TEST_F(AttnResGpu, MixForwardAndBackwardMatchTheCpuReference) {
  constexpr int64_t kRows = 37, kCols = 200;
  constexpr int kSources = 5;
  constexpr double kEps = 1e-6;
  ExecContext cpu_ctx, gpu_ctx;
  std::vector<OwnedTensor> v64, dv64, vdev, dvdev;
  std::vector<Tensor> v64_t, dv64_t, vdev_t, dvdev_t;
  for (int s = 0; s < kSources; ++s) {
    // Sources of different scales, so the RMSNorm matters.
    OwnedTensor v = random_tensor(DType::f32, Shape{kRows, kCols}, 100 + s, 0.5 + s);
    OwnedTensor dv0 = random_tensor(DType::f32, Shape{kRows, kCols}, 200 + s, 0.1);  // += onto these
    v64.push_back(to_f64(*v));
    dv64.push_back(to_f64(*dv0));
    vdev.push_back(to_device(*v));
    dvdev.push_back(to_device(*dv0));
  }
  for (int s = 0; s < kSources; ++s) {
    v64_t.push_back(*v64[static_cast<size_t>(s)]);
    dv64_t.push_back(*dv64[static_cast<size_t>(s)]);
    vdev_t.push_back(*vdev[static_cast<size_t>(s)]);
    dvdev_t.push_back(*dvdev[static_cast<size_t>(s)]);
  }
  OwnedTensor w = random_tensor(DType::f32, Shape{kCols}, 7, 0.3);
  OwnedTensor dout = random_tensor(DType::f32, Shape{kRows, kCols}, 8, 1.0);
  OwnedTensor dw0 = random_tensor(DType::f32, Shape{kCols}, 9, 0.1);
  OwnedTensor w64 = to_f64(*w), dout64 = to_f64(*dout), dw64 = to_f64(*dw0);
  OwnedTensor wdev = to_device(*w), doutdev = to_device(*dout), dwdev = to_device(*dw0);

  OwnedTensor out64(DType::f64, Device::cpu, Shape{kRows, kCols});
  OwnedTensor outdev(DType::f32, Device::cuda, Shape{kRows, kCols});
  poison(*outdev);
  ops::attn_res_mix_forward(cpu_ctx, v64_t, *w64, kEps, *out64);
  ops::attn_res_mix_forward(gpu_ctx, vdev_t, *wdev, kEps, *outdev);
  // Each weight is a softmax of an fp32 dot product over 200 columns (absolute error about
  // 1e-5 on logits of order 10), and the output mixes sources of both signs, so an
  // element's relative error grows where they cancel: 1.96e-5 (out) and 1.88e-5 (source
  // gradients) measured on an H100, 2026-12-05; a wrong weight or term is off by far more.
  constexpr double kMixTolerance = 5e-5;
  expect_close("out", *to_host(*outdev), *out64, kMixTolerance);

  ops::attn_res_mix_backward(cpu_ctx, v64_t, *w64, kEps, *dout64, dv64_t, *dw64);
  ops::attn_res_mix_backward(gpu_ctx, vdev_t, *wdev, kEps, *doutdev, dvdev_t, *dwdev);
  for (int s = 0; s < kSources; ++s)
    expect_close(fmt::format("dsource{}", s).c_str(), *to_host(dvdev_t[static_cast<size_t>(s)]),
                 dv64_t[static_cast<size_t>(s)], kMixTolerance);
  // The query's gradient sums every row's and source's products in fp32 (1.5e-5 measured
  // on an H100, 2026-12-05), where each source's own gradient is one product per element.
  expect_close("dquery", *to_host(*dwdev), *dw64, 1e-4);
}

// Three layers of hidden 64, blocks of 2 sublayers.
ModelConfig attn_res_config() {
  ModelConfig c;
  c.name = "attn-res-tiny";
  c.vocab_size = 259, c.hidden = 64, c.layers = 3, c.heads = 4, c.kv_heads = 2, c.head_dim = 16, c.ffn_hidden = 128;
  c.max_seq_len = 128, c.tie_embeddings = false, c.qk_norm = true;
  c.attn_res_block = 2;
  return c;
}

// Two documents of 30 and 41 bytes and a 9-token PAD tail without targets.
HostBatch two_documents() { return packed_documents({30, 41}, 9, 2027); }

// The pseudo-queries off zero: a mix that is not the plain mean. Returns how many there are.
int randomize_queries(Model& model, uint64_t seed) {
  Rng rng(seed);
  int queries = 0;
  for (const auto& p : model.parameters()) {
    if (p->name().find("attn_res.") == std::string::npos) continue;
    ++queries;
    OwnedTensor v(DType::f32, Device::cpu, p->shape());
    for (int64_t i = 0; i < v->numel(); ++i) v->data<float>()[i] = static_cast<float>(0.3 * rng.normal());
    copy_tensor(*v, p->value());
  }
  return queries;
}

void compare(DType dtype, double logits_tol, double loss_tol, double grads_tol, double query_grads_tol,
             double floor_fraction) {
  const ModelConfig c = attn_res_config();
  const HostBatch batch = two_documents();
  Model cpu(c, options_for(Device::cpu, DType::f32, batch.size()));
  cpu.allocate();
  cpu.init_weights(53);
  EXPECT_EQ(randomize_queries(cpu, 54), 2 * c.layers);  // sublayers 1 .. 2L - 1 and the final read
  Model gpu(c, options_for(Device::cuda, dtype, batch.size()));
  gpu.allocate();
  ASSERT_EQ(cpu.parameters().size(), gpu.parameters().size());
  for (size_t i = 0; i < cpu.parameters().size(); ++i) copy_tensor(cpu.parameters()[i]->value(), gpu.parameters()[i]->value());
  const ModelRun want = run_model(cpu, batch), got = run_model(gpu, batch);
  const double logits_error = expect_logits_close(want, got, c.vocab_size, logits_tol, floor_fraction);
  EXPECT_NEAR(got.loss, want.loss, loss_tol * want.loss);
  double grad_error = 0;
  for (size_t i = 0; i < want.grads.size(); ++i)
    grad_error = std::max(grad_error, expect_close(want.names[i].c_str(), *got.grads[i], *to_f64(*want.grads[i]),
                                                   want.names[i].ends_with("_query") ? query_grads_tol : grads_tol, 0,
                                                   floor_fraction));
  std::printf("attn_res model, GPU %s vs CPU f32: logits error %.2e, loss %.7f vs %.7f, worst gradient error %.2e\n",
              std::string(dtype_name(dtype)).c_str(), logits_error, got.loss, want.loss, grad_error);
}

TEST_F(AttnResGpu, Fp32ModelMatchesTheCpu) { compare(DType::f32, 1e-4, 1e-5, 1e-3, 1e-3, kFloorFraction); }
// A pseudo-query's gradient is a sum over tokens of the sources' deviations from their mix:
// the bf16 sublayer outputs (rounded before they join the fp32 block sums) perturb those
// differences more than any other gradient. Measured on an H100 (2026-12-05): 9.5e-2 of
// the tensor's largest value for a query, 6e-2 or less for everything else.
TEST_F(AttnResGpu, Bf16MixedModelMatchesTheFp32Cpu) { compare(DType::bf16, 3e-2, 1e-3, 6e-2, 0.15, 1.0); }

// The GPU decoder against the same GPU model's full forward (the header's last item).
void decode_against_full_forward(DType dtype, bool sandwich, double tolerance) {
  ModelConfig c = attn_res_config();
  c.sandwich_norms = sandwich;
  c.max_seq_len = 32;
  BuildOptions o = options_for(Device::cuda, dtype, c.max_seq_len);
  o.training = false;
  Model model(c, o);
  model.allocate();
  model.init_weights(61);
  EXPECT_EQ(randomize_queries(model, 62), 2 * c.layers);
  DecoderOptions d;
  d.slots = 2, d.max_rows = 6, d.logit_rows = 6;
  d.graph_rows = 4;  // the 5- and 6-row chunks run op by op, the others are captured
  Decoder decoder(model, d);
  ASSERT_EQ(decoder.dtype(), dtype);
  const double worst = test::slot_script_decode_error(model, decoder);
  EXPECT_GT(decoder.graphs(), 0u) << "no step was captured";
  EXPECT_LT(worst, tolerance) << "attn_res GPU decode vs its full forward";
  std::printf("attn_res GPU decode (%s, sandwich %d) vs its full forward: %d rows, worst scaled error %.2e (bar %.0e)\n",
              std::string(dtype_name(dtype)).c_str(), sandwich, test::kSlotScriptRows, worst, tolerance);
}

TEST_F(AttnResGpu, Fp32DecodeMatchesItsFullForward) {
  decode_against_full_forward(DType::f32, false, 1e-4);
  decode_against_full_forward(DType::f32, true, 1e-4);
}
TEST_F(AttnResGpu, Bf16DecodeMatchesItsFullForward) {
  decode_against_full_forward(DType::bf16, false, 5e-2);
  decode_against_full_forward(DType::bf16, true, 5e-2);
}

}  // namespace
}  // namespace kiln
