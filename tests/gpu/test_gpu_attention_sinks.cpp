// Learnable attention sinks on the GPU (docs/attention-sinks.md): the sink-free kernels'
// output and lse corrected for the sink (ops/attention/attention_sinks_cuda.h), and the
// sinks' gradient as one fixed-order reduction.
//
// Op: ops::attention_forward / attention_backward with sinks (of both signs) on the GPU, fp32
// (kiln's own kernels) and bf16 (cuDNN), against the same op on the CPU in f64 on the same
// inputs (bf16 inputs rounded to bf16 first): out, lse (sink included), dq, dk, dv and
// dsinks, with GQA, packed documents (one empty), windows, a softcap, and a uniform batch
// (cuDNN's head-major lse). dsinks starts at 0.5 on the GPU: it must be added to (+=).
// Model: a 2-layer model with attention_sinks = true (a windowed and a full layer, sinks
// moved off zero) on the GPU in fp32 and bf16 against the CPU model in fp32: logits, loss,
// every gradient (the sinks' included), whole_model.h's bars. Decode: the GPU decoder of such a
// model against its own GPU full forward (every kernel path), and cached attention with sinks
// against the CPU op in f64 (both kernels, split or not).
//
// Tolerances: fp32 as the op table's f32 row (kF32: summation order only); bf16 2e-2 of each
// tensor's largest value (the flash kernels round P to bf16, 2^-9 of the terms; O' one more
// bf16 rounding), lse 1e-3 absolute, dsinks 3e-2 of its largest value.
// The decode tests have not run on a GPU yet: the errors are printed for the record.
#include "core/rng.h"
#include "gpu/bf16_tensors.h"
#include "gpu/gpu_harness.h"
#include "gpu/whole_model.h"
#include "infer/decoder.h"
#include "model/model.h"
#include "ops/attention/attention.h"
#include "ops/attention/cached_attention.h"
#include "test_util.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace kiln {
namespace {

using namespace gpu_test;

struct SinkCase {
  std::vector<int32_t> lengths;  // documents, packed in order (0: an empty one)
  int64_t q_heads, kv_heads, head_dim, window;
  double softcap;
  bool uniform;  // every document max_seqlen long: cuDNN's plain layout, head-major lse
};

std::string describe(const SinkCase& c, DType dtype) {
  return fmt::format("{} docs={} Hq={} Hkv={} D={} window={} softcap={} uniform={}", dtype_name(dtype),
                     fmt::join(c.lengths, ","), c.q_heads, c.kv_heads, c.head_dim, c.window, c.softcap, c.uniform);
}

// The GPU's lse in the packed [tokens, Hq] order (a uniform bf16 batch's is [B, Hq, S]).
OwnedTensor packed_lse(const Tensor& gpu_lse, int64_t tokens, int64_t heads, int64_t seq) {
  OwnedTensor host = to_host(gpu_lse);
  if (seq <= 0) return host;
  OwnedTensor out(DType::f32, Device::cpu, Shape{tokens, heads});
  for (int64_t i = 0; i < tokens; ++i)
    for (int64_t h = 0; h < heads; ++h)
      out->data<float>()[i * heads + h] = host->data<float>()[((i / seq) * heads + h) * seq + i % seq];
  return out;
}

// The largest |gpu - ref| over the largest |ref| (the bf16 measure; also dsinks').
double max_relative(const Tensor& gpu_f32, const Tensor& ref_f64) {
  double scale = 0, err = 0;
  for (int64_t i = 0; i < ref_f64.numel(); ++i) {
    scale = std::max(scale, std::fabs(ref_f64.data<double>()[i]));
    const double d = std::fabs(static_cast<double>(gpu_f32.data<float>()[i]) - ref_f64.data<double>()[i]);
    err = std::isfinite(d) ? std::max(err, d) : INFINITY;
  }
  return err / std::max(scale, 1e-30);
}

class AttentionSinksGpu : public GpuTest {};

TEST_F(AttentionSinksGpu, OpMatchesTheF64Cpu) {
  const std::vector<SinkCase> cases = {
      {{5, 0, 37, 20}, 4, 2, 64, 0, 0, false},   // packed documents, one empty; GQA
      {{5, 0, 37, 20}, 4, 2, 64, 7, 0, false},   // a window
      {{31, 12}, 4, 4, 32, 9, 30.0, false},      // a window and a softcap
      {{24, 24, 24}, 4, 2, 64, 0, 0, true},      // uniform: head-major lse on cuDNN
  };
  for (DType dtype : {DType::f32, DType::bf16})
    for (const SinkCase& c : cases) {
      SCOPED_TRACE(describe(c, dtype));
      const bool bf16 = dtype == DType::bf16;
      std::vector<int32_t> cu{0};
      for (int32_t n : c.lengths) cu.push_back(cu.back() + n);
      const int64_t n = cu.back(), hq = c.q_heads, hkv = c.kv_heads, d = c.head_dim;
      const int64_t max_seqlen = *std::max_element(c.lengths.begin(), c.lengths.end());
      const uint64_t seed = 7000 + static_cast<uint64_t>(n * hq + d + c.window);
      OwnedTensor q = test::random_tensor(DType::f32, Shape{n, hq, d}, seed, 1.5);
      OwnedTensor k = test::random_tensor(DType::f32, Shape{n, hkv, d}, seed + 1, 1.5);
      OwnedTensor v = test::random_tensor(DType::f32, Shape{n, hkv, d}, seed + 2);
      OwnedTensor dout = test::random_tensor(DType::f32, Shape{n, hq, d}, seed + 3);
      if (bf16) round_to_bf16(*q), round_to_bf16(*k), round_to_bf16(*v), round_to_bf16(*dout);
      // Sinks of both signs, some above the scores' scale (the sink takes most of the weight).
      OwnedTensor sinks(DType::f32, Device::cpu, Shape{hq});
      for (int64_t h = 0; h < hq; ++h)
        sinks->data<float>()[h] = static_cast<float>((h % 2 ? -1.0 : 1.0) * (0.4 + 0.9 * h));
      const Tensor cu_host(cu.data(), DType::i32, Device::cpu, Shape{static_cast<int64_t>(cu.size())});

      ops::AttentionOptions options;
      options.window = c.window;
      options.softcap = c.softcap;
      options.max_seqlen = max_seqlen;
      options.uniform = c.uniform;

      // The reference: the CPU op in f64.
      OwnedTensor q64 = to_f64(*q), k64 = to_f64(*k), v64 = to_f64(*v), dout64 = to_f64(*dout);
      OwnedTensor sinks64 = to_f64(*sinks);
      OwnedTensor out64(DType::f64, Device::cpu, Shape{n, hq, d}), lse64(DType::f64, Device::cpu, Shape{n, hq});
      OwnedTensor dq64(DType::f64, Device::cpu, Shape{n, hq, d}), dk64(DType::f64, Device::cpu, Shape{n, hkv, d});
      OwnedTensor dv64(DType::f64, Device::cpu, Shape{n, hkv, d}), dsinks64(DType::f64, Device::cpu, Shape{hq});
      for (int64_t h = 0; h < hq; ++h) dsinks64->data<double>()[h] = 0.0;
      ops::AttentionOptions cpu_options = options;
      cpu_options.sinks = *sinks64;
      ops::attention_forward(process_exec(), *q64, *k64, *v64, cu_host, cpu_options, *out64, *lse64);
      ops::attention_backward(process_exec(), *q64, *k64, *v64, *out64, *lse64, *dout64, cu_host, cpu_options, *dq64,
                              *dk64, *dv64, *dsinks64);

      // The GPU.
      OwnedTensor qd = upload(*q, dtype), kd = upload(*k, dtype), vd = upload(*v, dtype), doutd = upload(*dout, dtype);
      OwnedTensor cud = to_device(cu_host), sinksd = to_device(*sinks);
      OwnedTensor outd = poisoned(dtype, Shape{n, hq, d}), lsed = poisoned(DType::f32, Shape{n, hq});
      OwnedTensor dqd = poisoned(dtype, Shape{n, hq, d}), dkd = poisoned(dtype, Shape{n, hkv, d});
      OwnedTensor dvd = poisoned(dtype, Shape{n, hkv, d});
      OwnedTensor start(DType::f32, Device::cpu, Shape{hq});
      for (int64_t h = 0; h < hq; ++h) start->data<float>()[h] = 0.5f;
      OwnedTensor dsinksd = to_device(*start);
      ops::AttentionOptions gpu_options = options;
      gpu_options.sinks = *sinksd;
      ops::attention_forward(process_exec(), *qd, *kd, *vd, *cud, gpu_options, *outd, *lsed);
      ops::attention_backward(process_exec(), *qd, *kd, *vd, *outd, *lsed, *doutd, *cud, gpu_options, *dqd, *dkd, *dvd,
                              *dsinksd);

      OwnedTensor dsinks = to_host(*dsinksd);
      for (int64_t h = 0; h < hq; ++h) dsinks->data<float>()[h] -= 0.5f;
      const int64_t lse_seq = bf16 && c.uniform ? max_seqlen : 0;
      OwnedTensor lse = packed_lse(*lsed, n, hq, lse_seq);
      double lse_err = 0;
      for (int64_t i = 0; i < n * hq; ++i)
        lse_err = std::max(lse_err, std::fabs(lse->data<float>()[i] - lse64->data<double>()[i]));
      EXPECT_LE(lse_err, bf16 ? 1e-3 : 1e-5) << "lse (sink included)";
      // The sink scales a head's output by w = sigmoid(lse - s) < 1 while the kernel's
      // absolute error stays, so the output's relative error grows by up to 1/w: 1.19e-5
      // measured on an H100 (2026-12-05) against kF32.forward's 1e-5 for attention alone.
      constexpr double kSinkForward = 5e-5;
      double worst = 0;
      const char* names[] = {"out", "dq", "dk", "dv"};
      const Tensor* gpu[] = {&*outd, &*dqd, &*dkd, &*dvd};
      const Tensor* ref[] = {&*out64, &*dq64, &*dk64, &*dv64};
      for (int t = 0; t < 4; ++t) {
        OwnedTensor got = download_f32(*gpu[t]);
        worst = std::max(worst, bf16 ? expect_close(names[t], *got, *ref[t], 2e-2, 0, 1.0)
                                     : expect_close(names[t], *got, *ref[t], t == 0 ? kSinkForward : kF32.backward));
      }
      const double dsinks_err = max_relative(*dsinks, *dsinks64);
      EXPECT_LE(dsinks_err, bf16 ? 3e-2 : 1e-4) << "dsinks";
      std::printf("attention sinks %s: out/dq/dk/dv worst %.2e, lse %.2e abs, dsinks %.2e\n",
                  describe(c, dtype).c_str(), worst, lse_err, dsinks_err);
    }
}

ModelConfig sinks_config() {
  ModelConfig c;
  c.name = "attention-sinks-tiny";
  c.vocab_size = 259, c.hidden = 64, c.layers = 2, c.heads = 4, c.kv_heads = 2, c.head_dim = 16, c.ffn_hidden = 128;
  c.max_seq_len = 128, c.tie_embeddings = false, c.qk_norm = true;
  c.attention_sinks = true;
  c.sliding_window = 9;  // layer 0 windowed (shorter than the documents), layer 1 full
  c.full_attention_layers = "1";
  return c;
}

// Allocates the CPU model and draws its weights, with the sinks off their zero init, both
// signs, so a path that drops them cannot pass.
void init_with_sinks(Model& cpu, const ModelConfig& c) {
  cpu.allocate();
  cpu.init_weights(29);
  int64_t moved = 0;
  for (const auto& p : cpu.parameters()) {
    if (!p->name().ends_with("attn.sinks")) continue;
    const int64_t layer = moved++;
    for (int64_t h = 0; h < c.heads; ++h)
      p->value().data<float>()[h] = static_cast<float>((h % 2 ? -1.0 : 1.0) * (0.5 + 0.6 * h + 0.3 * layer));
  }
  ASSERT_EQ(moved, c.layers) << "a sinks parameter per layer";
}

class AttentionSinksModel : public GpuTest {
 protected:
  void compare(DType dtype, ModelTolerance tol) {
    const ModelConfig c = sinks_config();
    const HostBatch batch = packed_documents({17, 40, 23}, 8, 2025);
    Model cpu(c, options_for(Device::cpu, DType::f32, batch.size()));
    init_with_sinks(cpu, c);
    Model gpu(c, options_for(Device::cuda, dtype, batch.size()));
    gpu.allocate();
    copy_weights(cpu, gpu);

    const ModelRun want = run_model(cpu, batch), got = run_model(gpu, batch);
    const double logits_error = expect_logits_close(want, got, c.vocab_size, tol.logits, tol.floor_fraction);
    EXPECT_NEAR(got.loss, want.loss, tol.loss * want.loss);
    double grad_error = 0, sinks_error = 0;
    for (size_t i = 0; i < want.grads.size(); ++i) {
      const double e = expect_close(want.names[i].c_str(), *got.grads[i], *to_f64(*want.grads[i]), tol.grads, 0,
                                    tol.floor_fraction);
      grad_error = std::max(grad_error, e);
      if (want.names[i].ends_with("attn.sinks")) sinks_error = std::max(sinks_error, e);
    }
    std::printf("attention sinks model, GPU %s vs CPU f32: logits error %.2e, loss %.7f vs %.7f, worst gradient "
                "error %.2e (sinks %.2e)\n",
                std::string(dtype_name(dtype)).c_str(), logits_error, got.loss, want.loss, grad_error, sinks_error);
  }
};

TEST_F(AttentionSinksModel, Fp32GpuMatchesTheCpu) { compare(DType::f32, kFp32Model); }

TEST_F(AttentionSinksModel, Bf16GpuMatchesTheFp32Cpu) { compare(DType::bf16, kBf16Model); }

// Decode: a GPU decoder of the sinks model against the same GPU model's full forward (its
// logits already checked against the CPU above), in f32 and bf16, with the fused kernels and
// without (DecoderOptions::fuse), at head_dim 16 (cached attention's per-dimension kernel)
// and 64 (its one-warp kernel; with bf16 and fuse the one-kernel decode attention on the
// single-token steps). Three documents are prefilled in chunks of up to 5 rows mixing them,
// then decoded one token per document per step; every row's logits are compared with the
// full forward's row of the same document and position (scaled error: max |diff| over the
// row's largest |logit|; bars as test_gpu_decode's decoder against the CPU).
TEST_F(AttentionSinksModel, GpuDecodeMatchesTheGpuFullForward) {
  for (const int64_t head_dim : {16, 64})
    for (const DType dtype : {DType::f32, DType::bf16})
      for (const bool fuse : {true, false}) {
        const std::string label = fmt::format("d{} {}{}", head_dim, dtype_name(dtype), fuse ? " fused" : " ops");
        SCOPED_TRACE(label);
        ModelConfig c = sinks_config();
        c.head_dim = head_dim;
        const HostBatch batch = packed_documents({17, 11, 23}, 8, 2026);
        Model cpu(c, options_for(Device::cpu, DType::f32, batch.size()));
        init_with_sinks(cpu, c);
        Model gpu(c, options_for(Device::cuda, dtype, batch.size()));
        gpu.allocate();
        copy_weights(cpu, gpu);
        gpu.load_batch(batch);
        std::vector<float> full;
        gpu.logits(0, batch.size(), full);

        DecoderOptions d;
        d.slots = 3;
        d.max_rows = 5;
        d.logit_rows = 5;
        d.graph_rows = 4;
        d.fuse = fuse;
        Decoder decoder(gpu, d);
        const int64_t vocab = c.vocab_size;
        constexpr int kDocs = 3;
        std::vector<size_t> length(kDocs), fed(kDocs, 0);
        for (int s = 0; s < kDocs; ++s) length[s] = static_cast<size_t>(batch.cu_seqlens[s + 1] - batch.cu_seqlens[s]);
        double worst = 0;
        int rows_checked = 0;
        // One forward: prefill (up to 5 rows, each document's tokens below prefill_to in turn)
        // or, with SIZE_MAX, a decode step (the next token of each unfinished document); then
        // every row's logits against the full forward's. False once nothing is left to feed.
        auto step = [&](size_t prefill_to) {
          std::vector<int32_t> tok, slot, pos, rows, full_row;
          for (int s = 0; s < kDocs; ++s)
            while (fed[s] < std::min(length[s], prefill_to) && tok.size() < 5) {
              const int32_t at = batch.cu_seqlens[s] + static_cast<int32_t>(fed[s]);
              rows.push_back(static_cast<int32_t>(tok.size()));
              tok.push_back(batch.tokens[at]), slot.push_back(s), pos.push_back(static_cast<int32_t>(fed[s]++));
              full_row.push_back(at);
              if (prefill_to == SIZE_MAX) break;  // a decode step: one row per document
            }
          if (tok.empty()) return false;
          decoder.forward(tok, slot, pos);
          std::vector<float> got;
          decoder.logits(rows, got);
          for (size_t r = 0; r < rows.size(); ++r) {
            const float* g = got.data() + static_cast<int64_t>(r) * vocab;
            const float* w = full.data() + static_cast<int64_t>(full_row[r]) * vocab;
            double diff = 0, scale = 0;
            for (int64_t i = 0; i < vocab; ++i) {
              EXPECT_TRUE(std::isfinite(g[i])) << "logit " << i;
              diff = std::max(diff, std::fabs(static_cast<double>(g[i]) - w[i]));
              scale = std::max(scale, std::fabs(static_cast<double>(w[i])));
            }
            worst = std::max(worst, diff / scale);
            ++rows_checked;
          }
          return true;
        };
        while (step(8)) {  // prefill: each document's first 8 tokens, 5 rows at a time across them
        }
        while (step(SIZE_MAX)) {  // decode: a row per unfinished document per step
        }
        const double bar = dtype == DType::f32 ? 1e-4 : 5e-2;
        EXPECT_EQ(rows_checked, 17 + 11 + 23);
        EXPECT_LE(worst, bar) << "decoder logits vs the full forward's";
        std::printf("attention sinks decode %s: %d rows, worst scaled logit error %.2e (bar %.0e)\n", label.c_str(),
                    rows_checked, worst, bar);
      }
}

// Cached attention with sinks on the GPU against the op on the CPU in f64 (the CPU decode's
// op, itself checked against the full forward by test_decode): with the split workspace (the
// sink joins in the merge of the splits) and without (in the block that writes the row), at
// head_dim 16 and 64 (both kernels), with and without a window and softcap; fp32 1e-5 (the
// order of a sum), bf16 1e-2 of the largest output (one bf16 rounding of it).
TEST_F(AttentionSinksGpu, CachedAttentionMatchesTheF64Cpu) {
  const int64_t hq = 4, hkv = 2, slots = 2, max_len = 64;
  const std::vector<int32_t> slot = {0, 1, 1, 0}, pos = {0, 9, 40, 63};
  const int64_t n = static_cast<int64_t>(slot.size());
  for (const int64_t d : {16, 64})
    for (const auto& [window, softcap] : {std::pair<int64_t, double>{0, 0.0}, {7, 20.0}})
      for (const DType dtype : {DType::f32, DType::bf16})
        for (const bool split : {true, false}) {
          const std::string label = fmt::format("D={} window={} softcap={} {} {}", d, window, softcap, dtype_name(dtype),
                                                split ? "split" : "one block per row");
          SCOPED_TRACE(label);
          const bool bf16 = dtype == DType::bf16;
          // Inputs as the GPU will read them (bf16-rounded on that path), f32 on the host.
          auto input = [&](Shape shape, uint64_t seed) {
            OwnedTensor t = test::random_tensor(DType::f32, shape, seed);
            return bf16 ? f32_of_bf16(*bf16_of(*t)) : std::move(t);
          };
          OwnedTensor q = input(Shape{n, hq, d}, 1), kc = input(Shape{slots, max_len, hkv, d}, 2),
                      vc = input(Shape{slots, max_len, hkv, d}, 3);
          OwnedTensor sinks(DType::f32, Device::cpu, Shape{hq});
          for (int64_t h = 0; h < hq; ++h) sinks->data<float>()[h] = static_cast<float>((h % 2 ? -1.0 : 1.0) * (0.4 + 0.9 * h));
          OwnedTensor slot_t(DType::i32, Device::cpu, Shape{n}), pos_t(DType::i32, Device::cpu, Shape{n});
          std::copy(slot.begin(), slot.end(), slot_t->data<int32_t>());
          std::copy(pos.begin(), pos.end(), pos_t->data<int32_t>());

          ops::AttentionOptions cpu_options;
          cpu_options.window = window, cpu_options.softcap = softcap;
          OwnedTensor q64 = to_f64(*q), k64 = to_f64(*kc), v64 = to_f64(*vc), sinks64 = to_f64(*sinks);
          cpu_options.sinks = *sinks64;
          OwnedTensor want(DType::f64, Device::cpu, Shape{n, hq, d});
          ops::cached_attention_forward(process_exec(), *q64, *k64, *v64, *slot_t, *pos_t, cpu_options, *want);

          ops::AttentionOptions gpu_options = cpu_options;
          OwnedTensor sinks_d = to_device(*sinks);
          gpu_options.sinks = *sinks_d;
          OwnedTensor qd = upload(*q, dtype), kd = upload(*kc, dtype), vd = upload(*vc, dtype);
          OwnedTensor slot_d = to_device(*slot_t), pos_d = to_device(*pos_t);
          OwnedTensor out = poisoned(dtype, Shape{n, hq, d});
          const int64_t elems = ops::cached_attention_workspace(n, hq, hkv, d, max_len);
          ASSERT_GT(elems, 0) << "this shape splits";
          OwnedTensor ws(DType::f32, Device::cuda, Shape{elems});
          ops::cached_attention_forward(process_exec(), *qd, *kd, *vd, *slot_d, *pos_d, gpu_options, *out,
                                        split ? *ws : Tensor());
          const double err = bf16 ? expect_close("out", *download_f32(*out), *want, 1e-2, 0, 1.0)
                                  : expect_close("out", *download_f32(*out), *want, 1e-5);
          std::printf("attention sinks cached attention %s: out error %.2e\n", label.c_str(), err);
        }
}

}  // namespace
}  // namespace kiln
