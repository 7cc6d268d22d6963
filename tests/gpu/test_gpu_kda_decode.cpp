// KDA decoding on the GPU (nn/kda_mixer_decode.cpp, ops/kda/kda_decode_cuda.cu).
//
// The decode kernels through the ops:: front ends against the CPU decode ops in f32 on the
// same inputs: the short convolution's step and the delta rule's step, rows of one slot in
// order (a prefill chunk) and rows of distinct slots (run in parallel), outputs and the
// states left behind. Both run fp32 math over the same f32 inputs in other orders, and a
// slot's state carries each row's rounding into the next: 5e-5 relative (expect_close,
// floor 1% of each tensor's largest value; measured on an H100, 2026-12-05: states up to
// 2.35e-5 after a chunk of rows, outputs 1.51e-5).
//
// A tiny "kda, kda, kda, gqa" model decoding on the GPU against its own GPU full forward
// (test_kda_mixer.cpp does the same on the CPU in f64): slot 0 prefills in chunks while
// slot 1 decodes one token a step, then slot 1 is reset for a new sequence, then slot 0
// prefills a prompt that slot 1 copies and both go on. Every row's logits, scaled by the
// largest |logit| of the reference (full_forward.h's scaled_diff):
//   f32   1e-4   fp32 GEMMs over other row counts; the delta rule's step is the sequence
//                kernel's, same fp32 operations in the same order
//   bf16  5e-2   bf16 activations and weights through 4 blocks, both paths rounding at
//                the same points but their GEMMs over other row counts (test_gpu_decode's
//                bar for bf16 decoder logits)
// The bf16 decoder captures its steps of <= 4 rows as CUDA graphs (the kernels must be
// capturable). The run's log prints the errors.
#include "core/rng.h"
#include "full_forward.h"
#include "gpu/gpu_harness.h"
#include "infer/decoder.h"
#include "model/model.h"
#include "ops/kda/kda_decode.h"
#include "ops/short_conv/short_conv.h"
#include "test_util.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

namespace kiln {
namespace {

using namespace gpu_test;

// ---- the decode ops ---------------------------------------------------------------------

// f32 host values: normal * scale + shift.
OwnedTensor host_random(Shape shape, uint64_t seed, double scale = 1.0, double shift = 0.0) {
  Rng rng(seed);
  OwnedTensor t(DType::f32, Device::cpu, shape);
  for (int64_t i = 0; i < t->numel(); ++i) t->data<float>()[i] = static_cast<float>(shift + scale * rng.normal());
  return t;
}

OwnedTensor host_i32(const std::vector<int32_t>& v) {
  OwnedTensor t(DType::i32, Device::cpu, Shape{static_cast<int64_t>(v.size())});
  std::copy(v.begin(), v.end(), t->data<int32_t>());
  return t;
}

OwnedTensor device_empty(Shape shape) {
  OwnedTensor t(DType::f32, Device::cuda, shape);
  poison(*t);
  return t;
}

double check(const char* name, const Tensor& gpu, const Tensor& cpu) {
  const double e = expect_close(name, *to_host(gpu), *to_f64(cpu), 5e-5);
  std::printf("kda decode op %s: max relative error %.2e\n", name, e);
  return e;
}

// Rows: a chunk of slot 1 (3 rows in order), slot 0, slot 1 again, slot 2; then a step of
// distinct slots.
struct StepRows {
  std::vector<int32_t> slots;
  bool distinct;
};
const std::vector<StepRows> kSteps = {{{1, 1, 1, 0, 1, 2}, false}, {{2, 0, 1}, true}, {{0, 0}, false}};

class KdaDecodeOpsGpu : public GpuTest {};

TEST_F(KdaDecodeOpsGpu, ShortConvStepMatchesTheCpu) {
  const int64_t ch = 37, slots = 3;
  for (const int64_t kernel : {4, 2, 3}) {
    SCOPED_TRACE("kernel " + std::to_string(kernel));
    OwnedTensor w = host_random(Shape{ch, kernel}, 3, 0.5);
    OwnedTensor state = host_random(Shape{slots, kernel - 1, ch}, 4);
    OwnedTensor w_d = to_device(*w), state_d = to_device(*state);
    uint64_t seed = 10;
    for (const StepRows& s : kSteps) {
      const int64_t n = static_cast<int64_t>(s.slots.size());
      OwnedTensor x = host_random(Shape{n, ch}, ++seed), y(DType::f32, Device::cpu, Shape{n, ch});
      OwnedTensor y_d = device_empty(Shape{n, ch});
      ops::short_conv_step(process_exec(), *x, *w, *host_i32(s.slots), *state, *y);
      ops::short_conv_step(process_exec(), *to_device(*x), *w_d, *to_device(*host_i32(s.slots)), *state_d, *y_d);
      check("short_conv_step y", *y_d, *y);
      check("short_conv_step state", *state_d, *state);
    }
  }
}

TEST_F(KdaDecodeOpsGpu, DeltaRuleStepMatchesTheCpu) {
  const int64_t slots = 3;
  // d_k 20 (one row per lane, lanes past d_k idle; one d_v slice), 40 (two rows per lane,
  // two d_v slices), 128 (four rows per lane; d_v 24 over two slices of 16, the second part full).
  for (const auto& [heads, dk, dv] : {std::tuple<int64_t, int64_t, int64_t>{3, 20, 20}, {2, 40, 40}, {1, 128, 24}}) {
    SCOPED_TRACE("heads " + std::to_string(heads) + " d_k " + std::to_string(dk) + " d_v " + std::to_string(dv));
    OwnedTensor state = host_random(Shape{slots, heads, dk, dv}, 5, 0.3);
    OwnedTensor state_d = to_device(*state);
    uint64_t seed = 20;
    for (const StepRows& s : kSteps) {
      const int64_t n = static_cast<int64_t>(s.slots.size());
      // Keys and queries of unit length, as the L2 norm upstream leaves them; g = log decay
      // in (-1, 0); beta in (0, 1).
      auto unit_rows = [&](uint64_t sd) {
        OwnedTensor t = host_random(Shape{n, heads, dk}, sd);
        for (int64_t r = 0; r < n * heads; ++r) {
          float* p = t->data<float>() + r * dk;
          double ss = 0;
          for (int64_t i = 0; i < dk; ++i) ss += double{p[i]} * p[i];
          for (int64_t i = 0; i < dk; ++i) p[i] = static_cast<float>(p[i] / std::sqrt(ss));
        }
        return t;
      };
      OwnedTensor q = unit_rows(++seed), k = unit_rows(++seed), v = host_random(Shape{n, heads, dv}, ++seed);
      OwnedTensor g = host_random(Shape{n, heads, dk}, ++seed, 0.2, -0.4), beta = host_random(Shape{n, heads}, ++seed);
      for (int64_t i = 0; i < g->numel(); ++i) g->data<float>()[i] = -std::fabs(g->data<float>()[i]);
      for (int64_t i = 0; i < beta->numel(); ++i)
        beta->data<float>()[i] = 1.f / (1.f + std::exp(-beta->data<float>()[i]));
      OwnedTensor out(DType::f32, Device::cpu, Shape{n, heads, dv});
      OwnedTensor out_d = device_empty(Shape{n, heads, dv});
      ops::kda_decode_step(process_exec(), *q, *k, *v, *g, *beta, *host_i32(s.slots), s.distinct, {}, *state, *out);
      ops::kda_decode_step(process_exec(), *to_device(*q), *to_device(*k), *to_device(*v), *to_device(*g),
                           *to_device(*beta), *to_device(*host_i32(s.slots)), s.distinct, {}, *state_d, *out_d);
      check("kda_decode_step out", *out_d, *out);
      check("kda_decode_step states", *state_d, *state);
    }
  }
}

// ---- the decoder against the full forward -------------------------------------------------

ModelConfig hybrid_config() {
  ModelConfig c;
  c.name = "kda-decode-tiny";
  c.vocab_size = 259, c.hidden = 64, c.layers = 4, c.heads = 4, c.kv_heads = 2, c.head_dim = 16, c.ffn_hidden = 96;
  c.max_seq_len = 32;
  c.attention = "kda";
  c.alt_attention = "gqa";
  c.alt_attention_layers = "every:4";
  c.kda.heads = 3;  // its own heads and width, unlike the attention layer's
  c.kda.head_dim = 20;
  return c;
}

// Random weights (gains near 1), as test_gpu_moe_decode.cpp's.
void randomize(Model& model, uint64_t seed) {
  Rng rng(seed);
  for (const auto& p : model.parameters()) {
    OwnedTensor v(DType::f32, Device::cpu, p->value().shape());
    const bool gain = p->name().find("norm") != std::string::npos;
    const double scale = !p->trainable() ? 0.1 : gain ? 0.2 : 0.3;
    for (int64_t i = 0; i < v->numel(); ++i)
      v->data<float>()[i] = static_cast<float>((gain ? 1.0 : 0.0) + scale * rng.normal());
    copy_tensor(*v, p->value());
  }
}

class KdaDecoderGpu : public GpuTest, public ::testing::WithParamInterface<DType> {};

TEST_P(KdaDecoderGpu, MatchesItsFullForward) {
  const DType dtype = GetParam();
  const double tolerance = dtype == DType::f32 ? 1e-4 : 5e-2;
  const ModelConfig config = hybrid_config();
  BuildOptions o;
  o.device = Device::cuda;
  o.dtype = dtype;
  o.training = false;
  o.max_tokens = config.max_seq_len;
  o.loss_chunk_rows = 16;
  Model model(config, o);
  model.allocate();
  randomize(model, 17);
  DecoderOptions d;
  d.slots = 2;
  d.max_rows = 6;
  d.logit_rows = 6;
  d.graph_rows = 4;
  Decoder decoder(model, d);
  const double worst = test::slot_script_decode_error(model, decoder);
  EXPECT_LT(worst, tolerance) << "GPU decoder logits vs the GPU full forward";
  if (dtype == DType::bf16) {
    EXPECT_GT(decoder.graphs(), 0u) << "the decode steps ran as CUDA graphs";
  }
  ::testing::Test::RecordProperty("worst_scaled_error", fmt::format("{:.3e}", worst));
  std::printf("kda decoder %s: %d logit rows, worst scaled error %.2e (bar %.0e), %zu graphs\n",
              std::string(dtype_name(dtype)).c_str(), test::kSlotScriptRows, worst, tolerance, decoder.graphs());
}

INSTANTIATE_TEST_SUITE_P(Dtypes, KdaDecoderGpu, ::testing::Values(DType::f32, DType::bf16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

}  // namespace
}  // namespace kiln
