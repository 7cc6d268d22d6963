// KV-cache decoding on the GPU.
//
// Cache ops (ops/attention/cached_attention.h) against the CPU reference in f64 on the same
// inputs (bf16 inputs rounded to bf16 first, so both sides read identical numbers):
//   kv_cache_write                   bit-exact   a scatter of rows (f32 and bf16)
//   cached_attention f32             1e-5        fp32 dots and online softmax (expf), vs f64;
//                                                floor 1% of max |V| (see check_cached_attention;
//                                                with 1% of max |out| the H200 measured 1.4e-5 on
//                                                384-position averages, absolute error 6e-8)
//   cached_attention bf16            1e-2        one bf16 rounding of the output (2^-8) over
//                                                fp32 math (measured 3.9e-3)
// over awkward shapes: head_dim 16/80/128/256, groups of 1, 2 and 6 query heads (6 spans
// two head tiles), rows of one slot at several positions and of several slots, sliding
// window and softcap, with the split workspace (several blocks per row, merged) and without;
// head_dim 128 and 256 take the one-warp kernel, 16 and 80 the per-dimension one.
//
// Decoder (infer/decoder.h) on the GPU against the CPU fp32 decoder with the same weights,
// teacher-forced with the CPU's greedy tokens: 3 prompts prefilled in chunks of <= 5 rows,
// then 8 decode steps of 3 rows (CUDA graphs: graph_rows 4, so 5-row chunks run uncaptured
// and the 2-row tail and every decode step are captured), with the fused kernels (bf16:
// captured steps on the fused decode projections, and on cuBLASLt) and without (the ops
// one by one).
//   CUDA f32 decoder logits          1e-4 of the largest |logit| (fp32 GEMMs, other order;
//                                    H200: 1.9e-6)
//   CUDA bf16 decoder logits         5e-2 of the largest |logit| (bf16 weights and
//                                    activations through 2 blocks; H200: 3.0e-2, recorded
//                                    as a property and printed)
//   greedy tokens                    the GPU's pick is the CPU's, or within the tolerance
//                                    of the CPU's top logit (a near tie); agreement printed
//   device argmax (greedy())         equal to the host argmax of the same logits
//   replaying a step's graph         bit-identical logits: eager warm-up == replay == replay
#include "core/device_memory.h"
#include "core/dtype.h"
#include "core/rng.h"
#include "gpu/gpu_harness.h"
#include "greedy_steps.h"
#include "infer/decoder.h"
#include "infer/decoder_cuda.h"
#include "ops/decode/decode_kernels.h"
#include "model/model.h"
#include "ops/attention/cached_attention.h"
#include "ops/attention/cached_attention_cuda.h"
#include "ops/rope/rope.h"
#include "test_util.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <vector>

namespace kiln {
namespace {

using namespace gpu_test;

// ---- host data ------------------------------------------------------------------------------

// Random values, rounded to bf16 when `bf16` (so a bf16 copy holds exactly these numbers).
std::vector<float> random_values(int64_t n, uint64_t seed, bool bf16, double scale = 1.0) {
  Rng rng(seed);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) {
    x = static_cast<float>(rng.normal() * scale);
    if (bf16) x = bf16_to_float(float_to_bf16(x));
  }
  return v;
}

OwnedTensor host_f64(const std::vector<float>& v, Shape shape) {
  OwnedTensor t(DType::f64, Device::cpu, shape);
  for (size_t i = 0; i < v.size(); ++i) t->data<double>()[i] = v[i];
  return t;
}

// A device tensor of `dtype` (f32 or bf16) holding v.
OwnedTensor device_of(const std::vector<float>& v, Shape shape, DType dtype) {
  OwnedTensor host(dtype, Device::cpu, shape);
  for (size_t i = 0; i < v.size(); ++i) {
    if (dtype == DType::f32) host->data<float>()[i] = v[i];
    else static_cast<uint16_t*>(host->raw())[i] = float_to_bf16(v[i]);
  }
  return to_device(*host);
}

// A device tensor (f32 or bf16) back as host f32.
OwnedTensor host_f32(const Tensor& dev) {
  OwnedTensor h = to_host(dev);
  if (dev.dtype() == DType::f32) return h;
  OwnedTensor out(DType::f32, Device::cpu, dev.shape());
  for (int64_t i = 0; i < dev.numel(); ++i) out->data<float>()[i] = bf16_to_float(static_cast<uint16_t*>(h->raw())[i]);
  return out;
}

OwnedTensor i32_tensor(const std::vector<int32_t>& v, Device device) {
  OwnedTensor host(DType::i32, Device::cpu, Shape{static_cast<int64_t>(v.size())});
  std::copy(v.begin(), v.end(), host->data<int32_t>());
  return device == Device::cpu ? std::move(host) : to_device(*host);
}

// ---- cache ops --------------------------------------------------------------------------------

struct CacheCase {
  int64_t rows, q_heads, kv_heads, head_dim, slots, max_len;
  int64_t window;
  double softcap;
  std::string name() const {
    return fmt::format("r{}_h{}x{}_d{}_s{}_l{}_w{}_c{}", rows, q_heads, kv_heads, head_dim, slots, max_len, window,
                       static_cast<int>(softcap));
  }
};

// Rows: slot i % slots, positions spread over the cache (the first row at the last
// position, the second at position 0, repeats of a slot at several positions).
void rows_of(const CacheCase& c, uint64_t seed, std::vector<int32_t>& slots, std::vector<int32_t>& positions) {
  Rng rng(seed);
  slots.clear(), positions.clear();
  for (int64_t i = 0; i < c.rows; ++i) {
    slots.push_back(static_cast<int32_t>(i % c.slots));
    int64_t p = static_cast<int64_t>(rng.below(static_cast<uint64_t>(c.max_len)));
    if (i == 0) p = c.max_len - 1;
    if (i == 1) p = 0;
    positions.push_back(static_cast<int32_t>(p));
  }
}

void check_cached_attention(const CacheCase& c, DType dtype, bool split) {
  SCOPED_TRACE(c.name() + (dtype == DType::bf16 ? " bf16" : " f32") + (split ? " split" : " one block per row"));
  const bool bf16 = dtype == DType::bf16;
  const Shape qs{c.rows, c.q_heads, c.head_dim}, cs{c.slots, c.max_len, c.kv_heads, c.head_dim};
  const uint64_t seed = static_cast<uint64_t>(c.rows * 1000 + c.head_dim * 10 + c.q_heads);
  const std::vector<float> q = random_values(qs.numel(), seed, bf16);
  const std::vector<float> kc = random_values(cs.numel(), seed + 1, bf16);
  const std::vector<float> vc = random_values(cs.numel(), seed + 2, bf16);
  std::vector<int32_t> slots, positions;
  rows_of(c, seed + 3, slots, positions);
  ops::AttentionOptions options;
  options.window = c.window;
  options.softcap = c.softcap;

  OwnedTensor ref(DType::f64, Device::cpu, qs);
  ops::cached_attention_forward(process_exec(), *host_f64(q, qs), *host_f64(kc, cs), *host_f64(vc, cs), *i32_tensor(slots, Device::cpu),
                                *i32_tensor(positions, Device::cpu), options, *ref);

  OwnedTensor dq = device_of(q, qs, dtype), dk = device_of(kc, cs, dtype), dv = device_of(vc, cs, dtype);
  OwnedTensor out(dtype, Device::cuda, qs);
  poison(*out);
  const int64_t elems =
      ops::cached_attention_workspace(c.rows, c.q_heads, c.kv_heads, c.head_dim, c.max_len);
  OwnedTensor workspace;
  if (split && elems > 0) {
    workspace = OwnedTensor(DType::f32, Device::cuda, Shape{elems});
    poison(*workspace);
  }
  ops::cached_attention_forward(process_exec(), *dq, *dk, *dv, *i32_tensor(slots, Device::cuda), *i32_tensor(positions, Device::cuda),
                                options, *out, workspace.tensor.defined() ? *workspace : Tensor());
  // Each output is a convex combination of V rows: its rounding error scales with |V| (the
  // terms), not with |out|, which cancellation makes small (an average of 384 random rows
  // is ~0.05). So the floor is 1% of max |V|; a wrong element is still off by O(|out|).
  double v_scale = 0;
  for (const float x : vc) v_scale = std::max(v_scale, std::fabs(static_cast<double>(x)));
  expect_close(bf16 ? "attn_bf16" : "attn_f32", *host_f32(*out), *ref, bf16 ? 1e-2 : 1e-5, v_scale);
}

class CachedAttentionGpu : public GpuTest {};

TEST_F(CachedAttentionGpu, KvCacheWriteMatchesCpuBitwise) {
  for (const DType dtype : {DType::f32, DType::bf16}) {
    for (const CacheCase& c : {CacheCase{1, 2, 2, 128, 1, 5, 0, 0}, CacheCase{37, 6, 3, 16, 4, 40, 0, 0},
                               CacheCase{5, 2, 1, 80, 3, 9, 0, 0}}) {
      SCOPED_TRACE(c.name() + (dtype == DType::bf16 ? " bf16" : " f32"));
      const Shape ks{c.rows, c.kv_heads, c.head_dim}, cs{c.slots, c.max_len, c.kv_heads, c.head_dim};
      const bool bf16 = dtype == DType::bf16;
      const std::vector<float> k = random_values(ks.numel(), 5, bf16), v = random_values(ks.numel(), 6, bf16);
      const std::vector<float> old = random_values(cs.numel(), 7, bf16);
      std::vector<int32_t> slots, positions;
      for (int64_t i = 0; i < c.rows; ++i) {  // distinct (slot, position) pairs, as a step has
        slots.push_back(static_cast<int32_t>(i % c.slots));
        positions.push_back(static_cast<int32_t>((i / c.slots * 3 + i) % c.max_len));
      }
      // CPU: the same bytes (the CPU op moves rows as bytes whatever the dtype).
      OwnedTensor hk = to_host(*device_of(k, ks, dtype)), hv = to_host(*device_of(v, ks, dtype));
      OwnedTensor hkc = to_host(*device_of(old, cs, dtype)), hvc = to_host(*device_of(old, cs, dtype));
      ops::kv_cache_write(process_exec(), *hk, *hv, *i32_tensor(slots, Device::cpu), *i32_tensor(positions, Device::cpu), *hkc, *hvc);
      OwnedTensor dkc = device_of(old, cs, dtype), dvc = device_of(old, cs, dtype);
      ops::kv_cache_write(process_exec(), *device_of(k, ks, dtype), *device_of(v, ks, dtype), *i32_tensor(slots, Device::cuda),
                          *i32_tensor(positions, Device::cuda), *dkc, *dvc);
      EXPECT_TRUE(same_bytes(*to_host(*dkc), *hkc)) << "k cache";
      EXPECT_TRUE(same_bytes(*to_host(*dvc), *hvc)) << "v cache";
    }
  }
}

TEST_F(CachedAttentionGpu, MatchesCpuReference) {
  const std::vector<CacheCase> cases = {
      {1, 16, 8, 128, 1, 384, 0, 0},     // the 0.6B decode shape, batch 1
      {8, 16, 8, 128, 8, 300, 0, 0},     // batch 8
      {3, 4, 2, 16, 2, 50, 0, 0},        // tiny heads
      {37, 6, 1, 80, 3, 97, 0, 0},       // group 6 (two head tiles), head_dim not a multiple of 32
      {5, 4, 4, 256, 2, 1000, 17, 0},    // sliding window, long cache
      {6, 8, 2, 64, 3, 130, 0, 30.0},    // softcap
      {300, 2, 1, 32, 5, 64, 0, 0},      // many rows: one split
  };
  for (const CacheCase& c : cases)
    for (const DType dtype : {DType::f32, DType::bf16})
      for (const bool split : {true, false}) check_cached_attention(c, dtype, split);
}

// ---- one-kernel decode attention ---------------------------------------------------------------

struct OneKernelCase {
  int64_t rows, q_heads, kv_heads, head_dim, max_len, window;
  double softcap;
  bool qk_norm, rope;
  std::string name() const {
    return fmt::format("r{}_h{}x{}_d{}_l{}_w{}_c{}{}{}", rows, q_heads, kv_heads, head_dim, max_len, window,
                       static_cast<int>(softcap), qk_norm ? "_qknorm" : "", rope ? "_rope" : "");
  }
};

// cuda::decode_attention against the three kernels it replaces (qkv_to_cache, then cached
// attention with its split merge) on the same inputs: rows are distinct slots, positions
// spread over the cache (the first row at the last position, the second at 0). The caches
// must come out the same bytes; the outputs close to each other and to the fp64 reference
// (the splits differ, so the fp32 sums differ in order).
void check_one_kernel_attention(const OneKernelCase& c) {
  SCOPED_TRACE(c.name());
  const int64_t hq = c.q_heads, hkv = c.kv_heads, hd = c.head_dim, heads = hq + 2 * hkv, slots = c.rows + 1;
  const Shape qkv_shape{c.rows, heads * hd}, qs{c.rows, hq, hd}, cs{slots, c.max_len, hkv, hd};
  const uint64_t seed = static_cast<uint64_t>(c.rows * 7919 + hd * 31 + hq * 7 + c.max_len);
  const std::vector<float> qkv = random_values(qkv_shape.numel(), seed, true);
  const std::vector<float> cache = random_values(cs.numel(), seed + 1, true);
  std::vector<float> q_gain = random_values(hd, seed + 2, false), k_gain = random_values(hd, seed + 3, false);
  for (float& g : q_gain) g = 1.0f + 0.2f * g;
  for (float& g : k_gain) g = 1.0f + 0.2f * g;
  std::vector<int32_t> slot_ids, positions;
  Rng rng(seed + 4);
  for (int64_t i = 0; i < c.rows; ++i) {
    slot_ids.push_back(static_cast<int32_t>((i * 5 + 1) % slots));  // distinct: 5 and slots are coprime
    int64_t p = static_cast<int64_t>(rng.below(static_cast<uint64_t>(c.max_len)));
    if (i == 0) p = c.max_len - 1;
    if (i == 1) p = 0;
    positions.push_back(static_cast<int32_t>(p));
  }
  OwnedTensor cos_host(DType::f32, Device::cpu, Shape{c.max_len, hd / 2}), sin_host(DType::f32, Device::cpu, Shape{c.max_len, hd / 2});
  ops::rope_fill_tables(process_exec(), ops::rope_inverse_frequencies(1e6, hd), *cos_host, *sin_host);
  OwnedTensor cos = to_device(*cos_host), sin = to_device(*sin_host);
  OwnedTensor d_qkv = device_of(qkv, qkv_shape, DType::bf16);
  OwnedTensor d_q_gain = device_of(q_gain, Shape{hd}, DType::f32), d_k_gain = device_of(k_gain, Shape{hd}, DType::f32);
  OwnedTensor d_slots = i32_tensor(slot_ids, Device::cuda), d_positions = i32_tensor(positions, Device::cuda);
  const float eps = 1e-6f;
  const auto scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  const float* qg = c.qk_norm ? d_q_gain->data<float>() : nullptr;
  const float* kg = c.qk_norm ? d_k_gain->data<float>() : nullptr;
  const float* cp = c.rope ? cos->data<float>() : nullptr;
  const float* sp = c.rope ? sin->data<float>() : nullptr;

  // The three kernels.
  OwnedTensor k3 = device_of(cache, cs, DType::bf16), v3 = device_of(cache, cs, DType::bf16);
  OwnedTensor q3(DType::bf16, Device::cuda, qs), out3(DType::bf16, Device::cuda, qs);
  poison(*q3), poison(*out3);
  cuda::qkv_to_cache(process_exec(), DType::bf16, d_qkv->raw(), c.rows, hq, hkv, hd, qg, kg, eps, cp, sp, d_slots->data<int32_t>(),
                     d_positions->data<int32_t>(), c.max_len, q3->raw(), k3->raw(), v3->raw());
  const int64_t elems = ops::cached_attention_workspace(c.rows, hq, hkv, hd, c.max_len);
  OwnedTensor workspace(DType::f32, Device::cuda, Shape{std::max<int64_t>(elems, 1)});
  const cuda::CachedAttentionArgs three{c.rows, hq, hkv, hd, c.max_len, d_slots->data<int32_t>(), d_positions->data<int32_t>(),
                                        scale, c.window, static_cast<float>(c.softcap)};
  cuda::cached_attention_forward(process_exec(), three, DType::bf16, q3->raw(), k3->raw(), v3->raw(), out3->raw(), workspace->data<float>(),
                                 elems);

  // The one kernel.
  OwnedTensor k1 = device_of(cache, cs, DType::bf16), v1 = device_of(cache, cs, DType::bf16);
  OwnedTensor out1(DType::bf16, Device::cuda, qs);
  poison(*out1);
  cuda::DecodeAttentionArgs one{};
  one.rows = c.rows, one.q_heads = hq, one.kv_heads = hkv, one.head_dim = hd, one.max_len = c.max_len;
  one.qkv = d_qkv->raw(), one.q_gain = qg, one.k_gain = kg, one.eps = eps, one.cos = cp, one.sin = sp;
  one.slots = d_slots->data<int32_t>(), one.positions = d_positions->data<int32_t>();
  one.scale = scale, one.window = c.window, one.softcap = static_cast<float>(c.softcap);
  one.k_cache = k1->raw(), one.v_cache = v1->raw(), one.out = out1->raw();
  cuda::decode_attention(process_exec(), one);

  EXPECT_TRUE(same_bytes(*to_host(*k1), *to_host(*k3))) << "k cache";
  EXPECT_TRUE(same_bytes(*to_host(*v1), *to_host(*v3))) << "v cache";
  // fp64 reference from the three kernels' q and caches (the same bytes as the one kernel's).
  OwnedTensor ref(DType::f64, Device::cpu, qs);
  auto f64_of = [](const Tensor& dev) {
    OwnedTensor f = host_f32(dev);
    OwnedTensor d(DType::f64, Device::cpu, dev.shape());
    for (int64_t i = 0; i < dev.numel(); ++i) d->data<double>()[i] = f->data<float>()[i];
    return d;
  };
  ops::AttentionOptions options;
  options.window = c.window, options.softcap = c.softcap;
  ops::cached_attention_forward(process_exec(), *f64_of(*q3), *f64_of(*k3), *f64_of(*v3), *i32_tensor(slot_ids, Device::cpu),
                                *i32_tensor(positions, Device::cpu), options, *ref);
  double v_scale = 0;
  for (const float x : cache) v_scale = std::max(v_scale, std::fabs(static_cast<double>(x)));
  expect_close("one-kernel attention vs fp64", *host_f32(*out1), *ref, 1e-2, v_scale);
  expect_close("three kernels vs fp64", *host_f32(*out3), *ref, 1e-2, v_scale);
}

class DecodeAttentionGpu : public GpuTest {};

TEST_F(DecodeAttentionGpu, MatchesTheThreeKernels) {
  const std::vector<OneKernelCase> cases = {
      {1, 16, 8, 128, 384, 0, 0, true, true},     // the 0.6B decode shape, batch 1
      {8, 16, 8, 128, 300, 0, 0, true, true},     // batch 8
      {3, 8, 8, 64, 7, 0, 0, false, true},        // group 1, fewer positions than splits
      {5, 32, 4, 128, 1000, 0, 0, true, false},   // group 8, long cache, no RoPE
      {4, 8, 2, 256, 500, 17, 0, true, true},     // head_dim 256, sliding window
      {6, 8, 2, 64, 130, 0, 30.0, false, false},  // softcap, neither norm nor RoPE
  };
  for (const OneKernelCase& c : cases) check_one_kernel_attention(c);
}

// ---- greedy argmax ------------------------------------------------------------------------------

class ArgmaxGpu : public GpuTest {};

// argmax_rows_f32 against a host scan with its rule (largest value, lowest index among
// equals, NaN never larger; a row without any value above -inf gives 0), on vocabularies
// that are and are not multiples of 4 (its vector and scalar paths), with repeated maxima.
TEST_F(ArgmaxGpu, RowsMatchTheHostScan) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  for (const int64_t vocab : {int64_t{7}, int64_t{259}, int64_t{4100}, int64_t{65536}, int64_t{151936}}) {
    const int64_t rows = 6;
    std::vector<float> v = random_values(rows * vocab, 70 + static_cast<uint64_t>(vocab), false);
    auto at = [&](int64_t r, int64_t j) -> float& { return v[static_cast<size_t>(r * vocab + j)]; };
    at(1, vocab / 3) = 50.0f, at(1, vocab - 1) = 50.0f;      // repeated maximum: the lower index
    at(2, 0) = nan, at(2, vocab / 2) = nan;                   // NaN never wins
    for (int64_t j = 0; j < vocab; ++j) at(3, j) = -inf;      // nothing above -inf: 0
    at(4, vocab - 1) = 1e30f;                                 // the very last element
    for (int64_t j = 0; j < vocab; ++j) at(5, j) = 0.25f;     // all equal: 0
    OwnedTensor logits = device_of(v, Shape{rows, vocab}, DType::f32);
    OwnedTensor ids(DType::i32, Device::cuda, Shape{rows});
    cuda::argmax_rows_f32(process_exec(), logits->data<float>(), rows, vocab, ids->data<int32_t>());
    OwnedTensor got = to_host(*ids);
    for (int64_t r = 0; r < rows; ++r) {
      float best = -std::numeric_limits<float>::max();
      int64_t index = -1;
      for (int64_t j = 0; j < vocab; ++j)
        if (at(r, j) > best || (at(r, j) == best && index < 0)) best = at(r, j), index = j;
      EXPECT_EQ(got->data<int32_t>()[r], index < 0 ? 0 : index) << "vocab " << vocab << " row " << r;
    }
  }
}

// ---- decoder ----------------------------------------------------------------------------------

ModelConfig tiny_config(int64_t head_dim = 32) {
  ModelConfig c;
  c.vocab_size = 259;
  c.hidden = 64;
  c.layers = 2;
  c.heads = 4;
  c.kv_heads = 2;
  c.head_dim = head_dim;  // != hidden / heads
  c.ffn_hidden = 96;
  c.max_seq_len = 96;
  c.qk_norm = true;
  c.tie_embeddings = true;
  return c;
}

std::unique_ptr<Model> make_model(const ModelConfig& config, Device device, DType dtype = DType::f32) {
  BuildOptions o;
  o.device = device;
  o.dtype = dtype;
  o.training = false;
  o.max_tokens = 8;
  o.loss_chunk_rows = 8;
  auto model = std::make_unique<Model>(config, o);
  model->allocate();
  return model;
}

// Every parameter random (norm gains around 1), the same on both models.
void randomize(const Model& cpu, const Model& gpu, uint64_t seed) {
  const bool dyt = cpu.config().norm == "dyt";
  int i = 0;
  for (size_t p = 0; p < cpu.parameters().size(); ++p) {
    const Parameter& a = *cpu.parameters()[p];
    const Parameter& b = *gpu.parameters()[p];
    ASSERT_EQ(a.name(), b.name());
    // By how the parameter starts: matrices N(0, 0.3^2); gains (ones) 1 + 0.2 N; offsets and
    // biases (zeros: Gemma's 1 + w, DyT's b) 0.2 N; scalars (constant: DyT's alpha) their
    // value times 1 + 0.2 N. (Gains of ~2 and DyT biases of ~1, as a name-based guess gave,
    // bury each token's signal under a shared constant.) DyT does not normalize: its
    // matrices keep activations at unit scale instead (embeddings N(0, 1), others
    // N(0, 1 / fan_in)); at 0.3 they grow ~2.4x per product, and bf16's absolute error with
    // them, while tanh's steep part stays near 0 (0.19 scaled error on the H200).
    const InitKind kind = a.init().kind;
    const bool rank1 = kind != InitKind::normal;
    double scale = rank1 ? 0.2 : 0.3;
    if (!rank1 && dyt && a.value().shape().rank() == 2)
      scale = a.name() == "embed.weight" ? 1.0 : 1.0 / std::sqrt(static_cast<double>(a.value().shape()[1]));
    OwnedTensor r = test::random_tensor(DType::f32, a.value().shape(), seed + static_cast<uint64_t>(i++), scale);
    for (int64_t j = 0; j < r->numel(); ++j) {
      float& v = r->data<float>()[j];
      if (kind == InitKind::ones) v += 1.0f;
      if (kind == InitKind::constant) v = static_cast<float>(a.init().std * (1.0 + v));
    }
    copy_tensor(*r, a.value());
    copy_tensor(*r, b.value());
  }
}

// A CPU and a GPU inference model of `config` with the same random weights (randomize).
struct ModelPair {
  std::unique_ptr<Model> cpu, gpu;
};
// The GPU model computes (and so decodes) in gpu_dtype: bf16 is the mixed path (fp32
// masters, bf16 copies), what kiln sample and serve load.
ModelPair random_model_pair(const ModelConfig& config, uint64_t seed, DType gpu_dtype = DType::bf16) {
  ModelPair pair{make_model(config, Device::cpu), make_model(config, Device::cuda, gpu_dtype)};
  randomize(*pair.cpu, *pair.gpu, seed);
  return pair;
}

double scaled_diff(const float* a, const float* b, int64_t n) {
  double diff = 0, scale = 0;
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_TRUE(std::isfinite(a[i])) << "logit " << i;
    diff = std::max(diff, std::fabs(static_cast<double>(a[i]) - b[i]));
    scale = std::max(scale, std::fabs(static_cast<double>(b[i])));
  }
  return diff / scale;
}

struct DecodeReport {
  double worst = 0;
  int rows = 0, agree = 0;
};

// Runs the same steps on both decoders; compares every logits row and the greedy picks.
void compare_decoders(Decoder& cpu, Decoder& gpu, double tolerance, DecodeReport& report) {
  const int64_t vocab = cpu.vocab_size();
  auto compare = [&](const std::vector<int32_t>& tok, const std::vector<int32_t>& slot,
                     const std::vector<int32_t>& pos, const std::vector<int32_t>& rows) {
    cpu.forward(tok, slot, pos);
    gpu.forward(tok, slot, pos);
    std::vector<float> want, got;
    cpu.logits(rows, want);
    gpu.logits(rows, got);
    std::vector<int32_t> picks;
    gpu.greedy(rows, picks);
    for (size_t j = 0; j < rows.size(); ++j) {
      const float* w = want.data() + static_cast<int64_t>(j) * vocab;
      const float* g = got.data() + static_cast<int64_t>(j) * vocab;
      const double err = scaled_diff(g, w, vocab);
      report.worst = std::max(report.worst, err);
      const auto cpu_pick = static_cast<int32_t>(std::max_element(w, w + vocab) - w);
      const auto gpu_pick = static_cast<int32_t>(std::max_element(g, g + vocab) - g);
      EXPECT_EQ(picks[j], gpu_pick) << "device argmax vs host argmax of the same logits";
      double scale = 0;
      for (int64_t i = 0; i < vocab; ++i) scale = std::max(scale, std::fabs(static_cast<double>(w[i])));
      EXPECT_GE(w[gpu_pick], w[cpu_pick] - 2 * tolerance * scale) << "the GPU's pick is no near tie of the CPU's";
      ++report.rows;
      report.agree += gpu_pick == cpu_pick;
    }
    return want;
  };

  std::vector<std::vector<int32_t>> seqs;
  for (int s = 0; s < 3; ++s) {
    Rng rng(static_cast<uint64_t>(100 + s));
    std::vector<int32_t> t(static_cast<size_t>(s == 0 ? 7 : s == 1 ? 3 : 12));
    for (auto& x : t) x = static_cast<int32_t>(rng.below(static_cast<uint64_t>(vocab)));
    seqs.push_back(t);
  }
  // Prefill: chunks of at most 5 rows that mix sequences (5, 5, 5, 5, 2 rows).
  std::vector<size_t> cached(3, 0);
  for (;;) {
    std::vector<int32_t> tok, slot, pos, rows;
    for (int s = 0; s < 3 && tok.size() < 5; ++s)
      while (cached[s] < seqs[s].size() && tok.size() < 5) {
        rows.push_back(static_cast<int32_t>(tok.size()));
        tok.push_back(seqs[s][cached[s]]), slot.push_back(s), pos.push_back(static_cast<int32_t>(cached[s]++));
      }
    if (tok.empty()) break;
    compare(tok, slot, pos, rows);
  }
  // Decode: 8 steps of one row per sequence, fed the CPU's greedy tokens.
  std::vector<int32_t> next(3);
  for (int s = 0; s < 3; ++s) next[s] = seqs[s].back();
  for (int step = 0; step < 8; ++step) {
    std::vector<int32_t> tok, slot = {0, 1, 2}, pos;
    for (int s = 0; s < 3; ++s) {
      tok.push_back(next[s]);
      pos.push_back(static_cast<int32_t>(seqs[s].size() - 1));
    }
    // Step 0 repeats the prompts' last rows (same K/V rewritten) and gives the first logits.
    const std::vector<float> want = compare(tok, slot, pos, {0, 1, 2});
    for (int s = 0; s < 3; ++s) {
      const float* w = want.data() + s * vocab;
      next[s] = static_cast<int32_t>(std::max_element(w, w + vocab) - w);
      seqs[s].push_back(next[s]);
    }
  }
}

class DecoderGpu : public GpuTest {};

void check_gpu_decoder_of(const ModelConfig& config, const std::string& label, DType dtype, bool fuse,
                          double tolerance, bool decode_gemv) {
  const auto [cpu_model, gpu_model] = random_model_pair(config, 21, dtype);
  DecoderOptions d;
  d.slots = 3;
  d.max_rows = 5;
  d.logit_rows = 4;
  d.graph_rows = 4;
  Decoder cpu(*cpu_model, d);
  d.fuse = fuse;
  d.gemv_rows = decode_gemv ? 8 : 0;
  Decoder gpu(*gpu_model, d);
  EXPECT_EQ(gpu.dtype(), dtype);
  DecodeReport report;
  compare_decoders(cpu, gpu, tolerance, report);
  EXPECT_LE(report.worst, tolerance) << "GPU decoder logits vs the CPU fp32 decoder";
  // Graphs for the 2-row prefill tail and the 3-row decode steps; none on the unfused fp32
  // path (its RMSNorm launches on the legacy stream, which a capture cannot hold).
  EXPECT_EQ(gpu.graphs(), dtype == DType::f32 && !fuse ? 0u : 2u);
  const std::string name = fmt::format("decoder_{}{}{}_{}", dtype == DType::bf16 ? "bf16" : "f32", fuse ? "" : "_ops",
                                       fuse && !decode_gemv ? "_cublas" : "", label);
  ::testing::Test::RecordProperty(name + "_logits_max_rel_err", fmt::format("{:.3e}", report.worst));
  ::testing::Test::RecordProperty(name + "_greedy_agreement", fmt::format("{}/{}", report.agree, report.rows));
  std::printf("%s: %d logits rows, worst scaled error %.2e, greedy agreement %d/%d, %zu graphs\n", name.c_str(),
              report.rows, report.worst, report.agree, report.rows, gpu.graphs());
}

void check_gpu_decoder(DType dtype, bool fuse, double tolerance, bool decode_gemv = true, int64_t head_dim = 32) {
  check_gpu_decoder_of(tiny_config(head_dim), fmt::format("d{}", head_dim), dtype, fuse, tolerance, decode_gemv);
}

// model.sliding_window and both softcaps (small enough to bite) through the fused and the
// op-by-op decoder, as the CPU decoder applies them (tests/test_decode.cpp checks that one
// against the full forward).
TEST_F(DecoderGpu, WindowAndSoftcapsMatchCpuDecoder) {
  ModelConfig config = tiny_config(64);
  config.sliding_window = 5;
  config.attention_softcap = 2.0;
  config.logit_softcap = 8.0;
  check_gpu_decoder_of(config, "window_softcap_d64", DType::f32, true, 1e-4, true);
  check_gpu_decoder_of(config, "window_softcap_d64", DType::bf16, true, 5e-2, true);
  check_gpu_decoder_of(config, "window_softcap_d64", DType::bf16, false, 5e-2, true);
}

// Partial rotary (a quarter of the head, YaRN-scaled tables) through both GPU decoders: the
// fused decode kernels rotate by the same tables as the CPU decoder.
TEST_F(DecoderGpu, PartialRotaryMatchesCpuDecoder) {
  ModelConfig config = tiny_config(64);
  config.rope = {.scaling = "yarn", .factor = 4.0, .original_max_seq_len = 16, .fraction = 0.25};
  check_gpu_decoder_of(config, "partial_rotary_d64", DType::f32, true, 1e-4, true);
  check_gpu_decoder_of(config, "partial_rotary_d64", DType::bf16, true, 5e-2, true);
  check_gpu_decoder_of(config, "partial_rotary_d64", DType::bf16, false, 5e-2, true);
}

// A per-layer pattern (windowed and full layers, a NoPE layer, a GeGLU layer) through the
// GPU decoders against the CPU one: with RMSNorm the fused branches where a component has
// them (the GeGLU layer's MLP runs unfused in the same captured step), with LayerNorm every
// branch on its ops.
TEST_F(DecoderGpu, LayerPatternsMatchCpuDecoder) {
  for (const char* norm : {"rmsnorm", "layernorm"}) {
    ModelConfig config = tiny_config(64);
    config.layers = 3;
    config.sliding_window = 5;
    config.full_attention_layers = "1";
    config.nope_layers = "1";
    config.alt_mlp = "geglu";
    config.alt_mlp_layers = "from:2";
    config.norm = norm;
    const std::string label = std::string("pattern_") + norm;
    check_gpu_decoder_of(config, label, DType::bf16, true, 5e-2, true);
    check_gpu_decoder_of(config, label, DType::bf16, false, 5e-2, true);
    check_gpu_decoder_of(config, label, DType::f32, true, 1e-4, true);
  }
}

// Gemma's RMSNorm or DyT as every norm and the q/k norm, an ungated MLP in the first two
// layers and SwiGLU in the last: the fused decode branches take only what they compute
// (DyT's q/k norm runs as split, ops/dyt and ops/rope; Gemma's gains are formed each step,
// inside the captured steps), the rest runs on its ops.
TEST_F(DecoderGpu, BreadthComponentsMatchCpuDecoder) {
  for (const auto& [norm, mlp] : {std::pair<const char*, const char*>{"gemma_rmsnorm", "gelu"}, {"dyt", "relu2"}}) {
    ModelConfig config = tiny_config(64);
    config.layers = 3;
    config.norm = norm;
    config.qk_norm_type = norm;
    config.mlp = mlp;
    config.ungated_ffn_hidden = 144;
    config.alt_mlp = "swiglu";
    config.alt_mlp_layers = "from:2";
    if (std::string(norm) == "gemma_rmsnorm") config.embed_scale = 8.0;  // Gemma's sqrt(hidden)
    const std::string label = fmt::format("{}_{}", norm, mlp);
    check_gpu_decoder_of(config, label, DType::bf16, true, 5e-2, true);
    check_gpu_decoder_of(config, label, DType::bf16, false, 5e-2, true);
    check_gpu_decoder_of(config, label, DType::f32, true, 1e-4, true);
  }
}

TEST_F(DecoderGpu, F32MatchesCpuDecoder) {
  check_gpu_decoder(DType::f32, true, 1e-4);
  check_gpu_decoder(DType::f32, false, 1e-4);
}

// bf16 with the fused kernels: the captured steps (2 and 3 rows) on the fused decode
// projections, and again through linear_forward (gemv_rows = 0).
TEST_F(DecoderGpu, Bf16GraphsMatchCpuDecoder) {
  check_gpu_decoder(DType::bf16, true, 5e-2);
  check_gpu_decoder(DType::bf16, true, 5e-2, false);
  check_gpu_decoder(DType::bf16, false, 5e-2);
}

// head_dim 64: the captured 3-row decode steps (distinct sequences) take the one-kernel
// attention (infer/decode_attention.cu); the 2-row prefill tail (one sequence) does not.
TEST_F(DecoderGpu, Bf16OneKernelAttentionMatchesCpuDecoder) {
  check_gpu_decoder(DType::bf16, true, 5e-2, true, 64);
}

// The device's greedy chain (each step's argmax fed back on the GPU, every step a graph,
// the ids copied back once) gives the tokens of single steps bit for bit, on the captured
// path of decode steps (one-kernel attention, fused projections).
TEST_F(DecoderGpu, GreedyChainEqualsSingleSteps) {
  const ModelConfig config = tiny_config(64);
  const auto [cpu_model, gpu_model] = random_model_pair(config, 45);
  DecoderOptions d;
  d.slots = 3;
  d.max_rows = 32;
  d.graph_rows = 4;
  d.chain_steps = 8;
  Decoder gpu(*gpu_model, d);
  Rng rng(9);
  std::vector<std::vector<int32_t>> prompts(3);
  for (size_t s = 0; s < prompts.size(); ++s)
    for (size_t i = 0; i < 4 + 3 * s; ++i) prompts[s].push_back(static_cast<int32_t>(rng.below(259)));
  const std::vector<int32_t> single = test::greedy_tokens(gpu, prompts, 20, 1);
  const size_t graphs = gpu.graphs();
  EXPECT_EQ(test::greedy_tokens(gpu, prompts, 20, 8), single);  // chains of 8, 8 and 4
  EXPECT_EQ(gpu.graphs(), graphs + 1) << "the chained step is one more graph";
  EXPECT_EQ(test::greedy_tokens(gpu, prompts, 20, 3), single);
  // After a chain, greedy() names the chain's last tokens (the last step's logits).
  // Steps 0-4 as one chain, then step 5 (step 4's tokens at the next positions) and a
  // chain of 4 more: steps 5-8 of the single steps.
  test::greedy_tokens(gpu, prompts, 5, 5);
  std::vector<int32_t> tokens(single.begin() + 4 * 3, single.begin() + 5 * 3), positions;
  for (const auto& p : prompts) positions.push_back(static_cast<int32_t>(p.size() + 5));
  gpu.forward(tokens, std::vector<int32_t>{0, 1, 2}, positions);
  std::vector<int32_t> chained, again;
  gpu.greedy_chain(4, chained);
  EXPECT_TRUE(std::equal(chained.begin(), chained.end(), single.begin() + 5 * 3));
  gpu.greedy(std::vector<int32_t>{0, 1, 2}, again);
  EXPECT_TRUE(std::equal(again.begin(), again.end(), chained.end() - 3));
}

TEST_F(DecoderGpu, GraphReplayIsBitwiseRepeatable) {
  const ModelConfig config = tiny_config();
  const auto [cpu_model, gpu_model] = random_model_pair(config, 33);
  DecoderOptions d;
  d.slots = 2;
  d.max_rows = 16;
  d.graph_rows = 2;
  Decoder gpu(*gpu_model, d);
  // Prefill two prompts of 6 tokens (12 rows: uncaptured), then the same 2-row step three
  // times: eager warm-up + capture, replay, replay. Each rewrites the same K/V, so the
  // state, and therefore the logits, must not change by a bit.
  std::vector<int32_t> tok, slot, pos;
  for (int32_t s = 0; s < 2; ++s)
    for (int32_t p = 0; p < 6; ++p) tok.push_back((s * 31 + p * 7) % 259), slot.push_back(s), pos.push_back(p);
  gpu.forward(tok, slot, pos);
  EXPECT_EQ(gpu.graphs(), 0u);
  const std::vector<int32_t> step_tok = {5, 77}, step_slot = {0, 1}, step_pos = {6, 6}, rows = {0, 1};
  std::vector<std::vector<float>> runs(3);
  for (auto& logits : runs) {
    gpu.forward(step_tok, step_slot, step_pos);
    gpu.logits(rows, logits);
  }
  EXPECT_EQ(gpu.graphs(), 1u);
  EXPECT_TRUE(runs[1] == runs[2]) << "two replays of the captured step differ";
  EXPECT_TRUE(runs[0] == runs[1]) << "the eager warm-up and the replay differ";
  // The uncaptured path (rows past graph_rows) gives the same logits for the same step.
  gpu.forward(std::vector<int32_t>{5, 77, 5}, std::vector<int32_t>{0, 1, 0}, std::vector<int32_t>{6, 6, 6});
  std::vector<float> eager;
  gpu.logits(rows, eager);
  ASSERT_EQ(eager.size(), runs[2].size());
  EXPECT_LE(scaled_diff(eager.data(), runs[2].data(), static_cast<int64_t>(eager.size())), 2e-2)
      << "a 3-row uncaptured step vs the 2-row graph (other GEMM shapes: close, not equal)";
}

}  // namespace
}  // namespace kiln
