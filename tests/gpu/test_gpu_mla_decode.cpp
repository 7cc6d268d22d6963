// The NoPE MLA mixer's decoder (nn/mla_mixer_decode.cpp) on the GPU.
//
// Its two new kernels (ops/mla/mla_absorb_cuda.cu) against the CPU op in f64 on the same
// inputs (bf16 ones rounded first), 37 rows of 3 heads, d 20 and r 24 (and d 12), outputs
// poisoned first: f32 1e-5 (fp32 sums of 24 terms), bf16 1e-2 (one bf16 rounding of the
// output, 2^-8, over fp32 sums), each against 1% of the largest |output| as the floor.
//
// The decoder: a tiny "mla, gqa"
// model (d_qk 20 > d_v 12, a latent 24 wide) decoding a script of steps that mixes prefill
// chunks of one sequence with single tokens of another, reuses a slot and forks one
// (copy_slot), with steps of up to 4 rows captured as CUDA graphs:
//   GPU f32 decode vs the GPU f32 full forward      1e-4 of the largest |logit|
//   GPU bf16 decode vs the GPU bf16 full forward    5e-2 of the largest |logit| (both bf16,
//                                                   rounded in other places: the absorbed
//                                                   query and the weighted latents vs k and
//                                                   v; the gqa decoder's bf16 bar)
//   GPU f32 decode vs the CPU f32 decode            1e-4 (same weights, other summation order)
// Each measured error is printed. Not yet run on a GPU: the numbers are bars, not measurements.
#include "core/rng.h"
#include "full_forward.h"
#include "grad_check.h"
#include "gpu/bf16_tensors.h"
#include "gpu/gpu_harness.h"
#include "infer/decoder.h"
#include "model/model.h"
#include "ops/mla/mla_absorb.h"
#include "test_util.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <memory>
#include <vector>

namespace kiln {
namespace {

using namespace gpu_test;
using test::DecodeRow;

// ---- the absorbed products ---------------------------------------------------------------

class MlaAbsorbGpu : public GpuTest {};

TEST_F(MlaAbsorbGpu, AbsorbAndExpandMatchTheCpuInF64) {
  const int64_t n = 37, heads = 3, r = 24;
  for (const DType dt : {DType::f32, DType::bf16})
    for (const int64_t d : {20, 12}) {
      SCOPED_TRACE(fmt::format("{} d {}", dtype_name(dt), d));
      const bool bf16 = dt == DType::bf16;
      // f32 inputs (bf16-rounded when bf16): the CPU reference reads them as f64.
      OwnedTensor q = to_f32(*test::random_f64(Shape{n, heads, d}, 51 + d));
      OwnedTensor w = to_f32(*test::random_f64(Shape{heads * d, r}, 52 + d));
      OwnedTensor cbar = to_f32(*test::random_f64(Shape{n, heads, r}, 53 + d));
      if (bf16) round_to_bf16(*q), round_to_bf16(*w), round_to_bf16(*cbar);
      auto device = [&](const OwnedTensor& host) { return to_device(bf16 ? *bf16_of(*host) : *host); };
      auto back = [&](const OwnedTensor& dev) { return bf16 ? f32_of_bf16(*to_host(*dev)) : to_host(*dev); };
      const double tol = bf16 ? 1e-2 : 1e-5;

      OwnedTensor want_q(DType::f64, Device::cpu, Shape{n, heads, r});
      ops::mla_absorb_query(process_exec(), *to_f64(*q), *to_f64(*w), *want_q);
      OwnedTensor got_q(dt, Device::cuda, Shape{n, heads, r});
      poison(*got_q);
      ops::mla_absorb_query(process_exec(), *device(q), *device(w), *got_q);
      const double err_q = expect_close("absorb_query", *back(got_q), *want_q, tol, 0, kFloorFraction);

      OwnedTensor want_o(DType::f64, Device::cpu, Shape{n, heads, d});
      ops::mla_expand_values(process_exec(), *to_f64(*cbar), *to_f64(*w), *want_o);
      OwnedTensor got_o(dt, Device::cuda, Shape{n, heads, d});
      poison(*got_o);
      ops::mla_expand_values(process_exec(), *device(cbar), *device(w), *got_o);
      const double err_o = expect_close("expand_values", *back(got_o), *want_o, tol, 0, kFloorFraction);
      fmt::print("mla absorbed products ({}, d {}): absorb {:.2e}, expand {:.2e}\n", dtype_name(dt), d, err_q, err_o);
    }
}

// ---- the decoder ---------------------------------------------------------------------------

ModelConfig mla_hybrid_config() {
  ModelConfig c;
  c.name = "mla-decode-tiny";
  c.vocab_size = 259, c.hidden = 64, c.layers = 2, c.heads = 4, c.kv_heads = 2, c.head_dim = 16, c.ffn_hidden = 128;
  c.max_seq_len = 32;
  c.attention = "mla", c.alt_attention = "gqa", c.alt_attention_layers = "from:1";
  c.mla.kv_rank = 24, c.mla.qk_head_dim = 20, c.mla.v_head_dim = 12;
  return c;
}

// An inference model whose full forward takes a whole sequence (the decode reference).
std::unique_ptr<Model> make_model(Device device, DType dtype) {
  const ModelConfig c = mla_hybrid_config();
  BuildOptions o;
  o.device = device, o.dtype = dtype, o.training = false;
  o.max_tokens = c.max_seq_len, o.loss_chunk_rows = 16;
  auto m = std::make_unique<Model>(c, o);
  m->allocate();
  return m;
}

// The same f32 weights on every model: matrices N(0, 0.1) (attention logits of order 0.5,
// far from a uniform softmax), gains 1 + N(0, 0.2) (the latent norm's too).
void same_random_weights(const std::vector<Model*>& models, uint64_t seed) {
  Rng rng(seed);
  const auto& first = models.front()->parameters();
  for (size_t i = 0; i < first.size(); ++i) {
    const Parameter& p = *first[i];
    const bool gain = p.init().kind == InitKind::ones, matrix = p.shape().rank() == 2;
    OwnedTensor v(DType::f32, Device::cpu, p.shape());
    for (int64_t j = 0; j < v->numel(); ++j)
      v->data<float>()[j] = static_cast<float>((gain ? 1.0 : 0.0) + (matrix ? 0.1 : 0.2) * rng.normal());
    for (Model* m : models) {
      ASSERT_EQ(m->parameters()[i]->name(), p.name());
      copy_tensor(*v, m->parameters()[i]->value());
    }
  }
}

DecoderOptions decoder_options() {
  DecoderOptions d;
  d.slots = 2, d.max_rows = 6, d.logit_rows = 6;
  d.graph_rows = 4;  // the 5- and 6-row chunks run op by op, the others are captured
  return d;
}

class MlaDecodeGpu : public GpuTest {
 protected:
  // The GPU decoder's logits against the same GPU model's full forward over each prefix.
  void against_full_forward(DType dtype, double tolerance) {
    const auto model = make_model(Device::cuda, dtype);
    same_random_weights({model.get()}, 29);
    Decoder decoder(*model, decoder_options());
    ASSERT_EQ(decoder.dtype(), dtype);
    const double worst = test::slot_script_decode_error(*model, decoder);
    EXPECT_GT(decoder.graphs(), 0u) << "no step was captured";
    EXPECT_LT(worst, tolerance) << "mla GPU decode vs its full forward";
    fmt::print("mla GPU decode ({}) vs its full forward: {} steps, worst scaled error {:.2e} (bar {:.0e})\n",
               dtype_name(dtype), test::kSlotScriptSteps, worst, tolerance);
  }
};

TEST_F(MlaDecodeGpu, Fp32DecodeMatchesItsFullForward) { against_full_forward(DType::f32, 1e-4); }
TEST_F(MlaDecodeGpu, Bf16DecodeMatchesItsFullForward) { against_full_forward(DType::bf16, 5e-2); }

// The GPU f32 decoder against the CPU f32 one on the same weights, step by step.
TEST_F(MlaDecodeGpu, Fp32DecodeMatchesTheCpuDecode) {
  const auto cpu_model = make_model(Device::cpu, DType::f32), gpu_model = make_model(Device::cuda, DType::f32);
  same_random_weights({cpu_model.get(), gpu_model.get()}, 31);
  Decoder cpu(*cpu_model, decoder_options()), gpu(*gpu_model, decoder_options());
  double worst = 0;
  const int rows_run = test::run_slot_script(
      {[&](const std::vector<DecodeRow>& rows) {
         std::vector<int32_t> tok, slot, pos, which;
         for (const DecodeRow& r : rows) {
           which.push_back(static_cast<int32_t>(tok.size()));
           tok.push_back((*r.sequence)[static_cast<size_t>(r.position)]), slot.push_back(r.slot),
               pos.push_back(r.position);
         }
         cpu.forward(tok, slot, pos);
         gpu.forward(tok, slot, pos);
         std::vector<float> want, got;
         cpu.logits(which, want);
         gpu.logits(which, got);
         const int64_t vocab = cpu.vocab_size();
         for (size_t i = 0; i < rows.size(); ++i)
           worst = std::max(worst, test::scaled_diff(got.data() + static_cast<int64_t>(i) * vocab,
                                                     want.data() + static_cast<int64_t>(i) * vocab, vocab));
       },
       [&](int32_t slot) { cpu.reset_slot(slot), gpu.reset_slot(slot); },
       [&](int32_t from, int32_t to, int64_t n) { cpu.copy_slot(from, to, n), gpu.copy_slot(from, to, n); }});
  EXPECT_EQ(rows_run, test::kSlotScriptRows);
  EXPECT_LT(worst, 1e-4) << "mla GPU f32 decode vs the CPU f32 decode";
  std::printf("mla GPU f32 decode vs the CPU f32 decode: %d rows, worst scaled error %.2e (bar 1e-04)\n", rows_run,
              worst);
}

}  // namespace
}  // namespace kiln
