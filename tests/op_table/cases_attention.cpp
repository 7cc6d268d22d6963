// attention (ops/attention/attention.h): causal grouped-query attention over packed
// sequences, with sliding window, softcap, an explicit scale and sinks (a per-head logit in
// the denominator; on the GPU a correction around the kernels, attention_sinks_cuda.h). The reference is a full softmax per query with explicit
// causal, window and document masks (two passes, no online rescaling). GPU: the fp32 kernels (the bf16 cuDNN path has its own suite,
// tests/gpu/test_gpu_attention_cudnn.cpp).
// Dropout of the probabilities: the reference draws dropout::attention_keeps itself and
// weighs each kept probability by 1 / (1 - p); with the key fixed the op is a
// differentiable function, so finite differences check the backward's mask too, and the
// GPU's fp32 kernels must drop what the CPU drops.
#include "op_table/op_table.h"
#include "ops/attention/attention.h"
#include "ops/dropout/dropout_mask.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

namespace kiln::op_test {

namespace {

struct AttentionShape {
  std::vector<int32_t> lengths;
  int64_t hq, hkv, d;
  ops::AttentionOptions o;
  bool sinks = false;
  double dropout = 0;  // drop probability of the softmax probabilities (key and site below)
};

// The dropout cases' stream key (as an i32 [2] input) and site.
constexpr uint64_t kDropoutKey = 0x9e3779b97f4a7c15ull;
const uint32_t kDropoutSite = dropout::attention_site(3);

std::vector<int32_t> key_words(uint64_t key) {
  return {static_cast<int32_t>(static_cast<uint32_t>(key)), static_cast<int32_t>(static_cast<uint32_t>(key >> 32))};
}

void reference_attention(const Tensors& t, const ops::AttentionOptions& o, double drop) {
  const Tensor& q = t["q"];
  const int64_t n = q.size(0), hq = q.size(1), hkv = t["k"].size(1), d = q.size(2);
  const double scale = o.scale > 0 ? o.scale : 1 / std::sqrt(static_cast<double>(d));
  const double *qp = t.f64("q"), *kp = t.f64("k"), *vp = t.f64("v");
  double *out = t.f64("out"), *lse = t.f64("lse");
  const double* sinks = t.has("sinks") ? t.f64("sinks") : nullptr;
  const std::vector<int32_t>& cu = t.ints("cu_seqlens");
  std::vector<int64_t> doc(static_cast<size_t>(n));
  for (size_t s = 0; s + 1 < cu.size(); ++s)
    for (int32_t i = cu[s]; i < cu[s + 1]; ++i) doc[static_cast<size_t>(i)] = static_cast<int64_t>(s);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < hq; ++h) {
      const int64_t g = h / (hq / hkv);
      std::vector<double> s(static_cast<size_t>(n), -std::numeric_limits<double>::infinity());
      double m = sinks ? sinks[h] : -std::numeric_limits<double>::infinity();
      for (int64_t j = 0; j < n; ++j) {
        const bool visible = doc[static_cast<size_t>(j)] == doc[static_cast<size_t>(i)] && j <= i &&
                             (o.window == 0 || i - j < o.window);
        if (!visible) continue;
        double dot = 0;
        for (int64_t c = 0; c < d; ++c) dot += qp[(i * hq + h) * d + c] * kp[(j * hkv + g) * d + c];
        double sc = dot * scale;
        if (o.softcap > 0) sc = o.softcap * std::tanh(sc / o.softcap);
        s[static_cast<size_t>(j)] = sc;
        m = std::max(m, sc);
      }
      double sum = sinks ? std::exp(sinks[h] - m) : 0.0;  // the sink: in the sum, no value
      for (int64_t j = 0; j < n; ++j) sum += std::exp(s[static_cast<size_t>(j)] - m);
      double* o_row = out + (i * hq + h) * d;
      std::fill(o_row, o_row + d, 0.0);
      const uint64_t row_key = dropout::attention_row_key(kDropoutKey, kDropoutSite, static_cast<uint64_t>(i * hq + h));
      for (int64_t j = 0; j < n; ++j) {
        double p = std::exp(s[static_cast<size_t>(j)] - m) / sum;
        if (drop > 0)
          p *= dropout::attention_keeps(row_key, static_cast<uint64_t>(j), dropout::threshold_of(drop)) ? 1 / (1 - drop)
                                                                                                       : 0.0;
        if (p == 0) continue;
        for (int64_t c = 0; c < d; ++c) o_row[c] += p * vp[(j * hkv + g) * d + c];
      }
      lse[i * hq + h] = m + std::log(sum);
    }
}

OpCase attention_case(AttentionShape a, double qk_scale, std::vector<DType> cuda) {
  std::vector<int32_t> cu = {0};
  std::string lengths;
  for (int32_t l : a.lengths) {
    cu.push_back(cu.back() + l);
    lengths += fmt::format("{}{}", lengths.empty() ? "" : "_", l);
    a.o.max_seqlen = std::max<int64_t>(a.o.max_seqlen, l);
  }
  const int64_t n = cu.back();
  const Shape qs{n, a.hq, a.d}, ks{n, a.hkv, a.d};
  OpCase c;
  c.op = "attention";
  c.name = fmt::format("len{}_h{}x{}_d{}_w{}_cap{}{}{}{}", lengths, a.hq, a.hkv, a.d, a.o.window, a.o.softcap,
                       a.o.scale > 0 ? fmt::format("_scale{}", a.o.scale) : "", a.sinks ? "_sinks" : "",
                       a.dropout > 0 ? fmt::format("_drop{}", a.dropout) : "");
  std::replace(c.name.begin(), c.name.end(), '.', 'p');
  c.tensors = {in("q", qs).scaled(qk_scale), in("k", ks).scaled(qk_scale), in("v", ks), ints("cu_seqlens", cu),
               out("out", qs),               out("lse", {n, a.hq}, Width::wide), grad_out("dout", "out", qs),
               grad_in("dq", "q", qs),       grad_in("dk", "k", ks),             grad_in("dv", "v", ks)};
  if (a.sinks)  // about 1: comparable to the scores, so the sink takes a real share
    c.tensors.insert(c.tensors.end(), {in("sinks", {a.hq}, Width::wide).scaled(1.0, 1.0),
                                       grad_in("dsinks", "sinks", {a.hq}, Width::wide).accumulating()});
  if (a.dropout > 0) c.tensors.push_back(ints("dropout_key", key_words(kDropoutKey)));
  const ops::AttentionOptions base = a.o;
  const double drop = a.dropout;
  auto with_sinks = [base, drop](const Tensors& t) {
    ops::AttentionOptions o = base;
    o.sinks = t.get("sinks");
    if (drop > 0) o.dropout = {drop, kDropoutSite, t["dropout_key"]};
    return o;
  };
  c.forward = [with_sinks](const Tensors& t) {
    ops::attention_forward(process_exec(), t["q"], t["k"], t["v"], t["cu_seqlens"], with_sinks(t), t["out"], t["lse"]);
  };
  c.backward = [with_sinks](const Tensors& t) {
    ops::attention_backward(process_exec(), t["q"], t["k"], t["v"], t["out"], t["lse"], t["dout"], t["cu_seqlens"],
                            with_sinks(t), t["dq"], t["dk"], t["dv"], t.get("dsinks"));
  };
  c.reference = [base, drop](const Tensors& t) { reference_attention(t, base, drop); };
  c.cuda = std::move(cuda);
  c.cpu = qs.numel() <= kCpuMaxElements;
  c.finite_differences = c.cpu && c.cuda.empty();
  c.fd = fd_options(1e-6, 1e-4);
  return c;
}

}  // namespace

std::vector<OpCase> attention_cases() {
  std::vector<OpCase> cases;
  // Finite differences: packed sequences of awkward lengths, GQA, window, softcap; scores
  // of a few units (q, k scaled 1.5) so the softcap (5) and the window both matter.
  for (auto [hq, hkv] : {std::pair<int64_t, int64_t>{2, 2}, {4, 2}, {8, 2}})
    for (int64_t d : {8, 6})
      for (int64_t window : {0, 3})
        for (double softcap : {0.0, 5.0}) {
          AttentionShape a{{1, 5, 17, 3}, hq, hkv, d, {}};
          a.o.window = window;
          a.o.softcap = softcap;
          cases.push_back(attention_case(a, 1.5, {}));
        }
  // An empty sequence among others with one kv head shared by 4 query heads and an
  // explicit scale; window 1 (each query sees only itself); a window longer than every
  // sequence with a softcap.
  AttentionShape empty{{2, 0, 7, 1}, 4, 1, 4, {}};
  empty.o.scale = 0.3;
  AttentionShape w1{{3, 4}, 2, 1, 6, {}};
  w1.o.window = 1;
  AttentionShape wide{{3, 4}, 2, 1, 6, {}};
  wide.o.window = 100;
  wide.o.softcap = 2.0;
  for (const AttentionShape& a : {empty, w1, wide}) cases.push_back(attention_case(a, 1.5, {}));
  // Sinks (finite differences on the CPU): GQA over packed documents (one empty), with and without a window
  // and a softcap; window 1 leaves each query its own key and the sink.
  for (auto [window, softcap] : {std::pair<int64_t, double>{0, 0.0}, {3, 5.0}, {1, 0.0}}) {
    AttentionShape a{{1, 5, 0, 17, 3}, 4, 2, 6, {}, true};
    a.o.window = window;
    a.o.softcap = softcap;
    cases.push_back(attention_case(a, 1.5, {}));
  }
  // Sinks on the GPU (the fp32 kernels, then attention_sinks_cuda.h's correction): packed
  // documents with an empty one, GQA, a window shorter than the longest, a softcap.
  for (auto [window, softcap] : {std::pair<int64_t, double>{0, 0.0}, {7, 5.0}}) {
    AttentionShape a{{1, 5, 0, 17, 40}, 4, 2, 64, {}, true};
    a.o.window = window;
    a.o.softcap = softcap;
    cases.push_back(attention_case(a, 0.5, {DType::f32}));
  }
  // Dropout of the probabilities (finite differences on the CPU): packed documents with an
  // empty one, GQA, with and without a window and a softcap, p 0.3 and 0.6; with sinks.
  for (double p : {0.3, 0.6})
    for (auto [window, softcap] : {std::pair<int64_t, double>{0, 0.0}, {3, 5.0}}) {
      AttentionShape a{{1, 5, 0, 17, 3}, 4, 2, 6, {}};
      a.o.window = window;
      a.o.softcap = softcap;
      a.dropout = p;
      cases.push_back(attention_case(a, 1.5, {}));
    }
  AttentionShape sink_drop{{1, 5, 0, 17, 3}, 4, 2, 6, {}, true, 0.3};
  sink_drop.o.window = 3;
  cases.push_back(attention_case(sink_drop, 1.5, {}));
  // Dropout on the GPU's fp32 kernels (the CPU's mask): GQA, packed documents, a window and a
  // softcap, with sinks (the correction around the kernels).
  for (auto [window, softcap, sinks] : {std::tuple<int64_t, double, bool>{0, 0.0, false}, {7, 5.0, false},
                                        {0, 0.0, true}, {7, 5.0, true}}) {
    AttentionShape a{{1, 5, 0, 17, 40}, 4, 2, 64, {}, sinks, 0.2};
    a.o.window = window;
    a.o.softcap = softcap;
    cases.push_back(attention_case(a, 0.5, {DType::f32}));
  }
  // GPU: sequences of 1 to 40 tokens, 4 query heads over 1, 2 or 4 kv heads, head dims
  // below, at and above a warp's multiple.
  for (int64_t hkv : {1, 2, 4})
    for (int64_t d : {8, 64, 72})
      for (int64_t window : {0, 7})
        for (double softcap : {0.0, 5.0}) {
          AttentionShape a{{1, 5, 17, 3, 40}, 4, hkv, d, {}};
          a.o.window = window;
          a.o.softcap = softcap;
          cases.push_back(attention_case(a, 0.5, {DType::f32}));
        }
  return cases;
}

}  // namespace kiln::op_test
