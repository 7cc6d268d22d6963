// Dropout's CUDA kernel against the CPU reference: the same mask (dropout::keeps on both),
// fp32 values bit for bit, bf16 the fp32 result rounded once; the key read from device
// memory; a size that is not a multiple of anything.
//
// Dropout of the attention probabilities (model.attention_dropout). The fp32 kernels draw
// the CPU's mask: the op table checks them against the CPU (Ops/OpCuda.*drop*). cuDNN's
// (bf16) masks are Philox's, which the CPU cannot draw, so these check what can be checked:
// the same key gives the same bits and another key other masks; the drop rate and the
// kept values' scale; the backward against a reference built from the mask the forward
// revealed (V one-hot by key position: the output is then the dropped probabilities), so a
// backward that drew other masks fails; and a captured graph replays with each key.
#include "core/device_memory.h"
#include "core/step_graphs.h"
#include "gpu/bf16_tensors.h"
#include "gpu/gpu_harness.h"
#include "ops/attention/attention.h"
#include "ops/dropout/dropout.h"
#include "ops/dropout/dropout_mask.h"
#include "test_util.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace kiln {
namespace {

using namespace gpu_test;

OwnedTensor key_tensor(uint64_t key) {
  OwnedTensor t(DType::i32, Device::cpu, Shape{2});
  t->data<int32_t>()[0] = static_cast<int32_t>(static_cast<uint32_t>(key));
  t->data<int32_t>()[1] = static_cast<int32_t>(static_cast<uint32_t>(key >> 32));
  return t;
}

class DropoutGpu : public GpuTest {};

TEST_F(DropoutGpu, MatchesTheCpuMaskAndValues) {
  const Shape shape{1237, 193};
  const OwnedTensor x = test::random_tensor(DType::f32, shape, 3);
  for (const uint64_t key : {uint64_t{0}, uint64_t{0xfeedface12345678ull}}) {
    for (const double p : {0.1, 0.5}) {
      SCOPED_TRACE(fmt::format("key {:x} p {}", key, p));
      const OwnedTensor host_key = key_tensor(key), device_key = to_device(*host_key);
      OwnedTensor want(DType::f32, Device::cpu, shape);
      ops::dropout_apply(process_exec(), *x, {p, 5, *host_key}, *want);

      const OwnedTensor dx = to_device(*x);
      OwnedTensor dy(DType::f32, Device::cuda, shape);
      ops::dropout_apply(process_exec(), *dx, {p, 5, *device_key}, *dy);
      const OwnedTensor got = to_host(*dy);
      EXPECT_EQ(std::memcmp(got->raw(), want->raw(), want->nbytes()), 0) << "fp32 not bit for bit";

      // bf16 in, bf16 out (in place): the fp32 product of the bf16 input, rounded once.
      const OwnedTensor xb = bf16_of(*x);
      const OwnedTensor dxb = to_device(*xb);
      ops::dropout_apply(process_exec(), *dxb, {p, 5, *device_key}, *dxb);
      const OwnedTensor gotb = f32_of_bf16(*to_host(*dxb));
      OwnedTensor from_bf16(DType::f32, Device::cpu, shape);
      ops::dropout_apply(process_exec(), *f32_of_bf16(*xb), {p, 5, *host_key}, *from_bf16);
      const OwnedTensor wantb = f32_of_bf16(*bf16_of(*from_bf16));
      EXPECT_EQ(std::memcmp(gotb->raw(), wantb->raw(), wantb->nbytes()), 0) << "bf16 not the rounded fp32";
    }
  }
}

// ---- attention dropout -------------------------------------------------------------------

// Packed sequences as the model passes them: cu_seqlens (host values), the longest, uniform.
struct Layout {
  std::vector<int32_t> cu{0};
  int64_t max_len = 0;
  bool uniform = false;
  int64_t tokens() const { return cu.back(); }
};

Layout layout_of(const std::vector<int32_t>& lengths, bool uniform = false) {
  Layout l;
  for (int32_t n : lengths) {
    l.cu.push_back(l.cu.back() + n);
    l.max_len = std::max<int64_t>(l.max_len, n);
  }
  l.uniform = uniform;
  return l;
}

OwnedTensor host_ints(const std::vector<int32_t>& v) {
  OwnedTensor t(DType::i32, Device::cpu, Shape{static_cast<int64_t>(v.size())});
  std::copy(v.begin(), v.end(), t->data<int32_t>());
  return t;
}

ops::AttentionOptions dropout_options(const Layout& l, double p, const Tensor& key) {
  ops::AttentionOptions o;
  o.max_seqlen = l.max_len;
  o.uniform = l.uniform;
  o.dropout = {p, dropout::attention_site(2), key};
  return o;
}

// An attention problem on the device: q, k, v (bf16 or f32) from host f32 values, rounded
// to the device dtype on the host too, so a reference reads what the GPU read.
struct Problem {
  Layout layout;
  int64_t hq, hkv, d;
  DType dtype;
  OwnedTensor qh, kh, vh, q, k, v, cu;
  Problem(Layout l, int64_t hq_, int64_t hkv_, int64_t d_, DType dt, OwnedTensor q_host, OwnedTensor k_host,
          OwnedTensor v_host)
      : layout(std::move(l)), hq(hq_), hkv(hkv_), d(d_), dtype(dt), qh(std::move(q_host)), kh(std::move(k_host)),
        vh(std::move(v_host)) {
    if (dtype == DType::bf16)
      for (const OwnedTensor* t : {&qh, &kh, &vh}) round_to_bf16(**t);
    q = upload(*qh, dtype), k = upload(*kh, dtype), v = upload(*vh, dtype);
    cu = to_device(*host_ints(layout.cu));
  }
  Shape q_shape() const { return Shape{layout.tokens(), hq, d}; }
  Shape kv_shape() const { return Shape{layout.tokens(), hkv, d}; }
};

struct Forward {
  OwnedTensor out, lse;  // host: out f32 values, lse f32
};

Forward run_forward(const Problem& pr, const ops::AttentionOptions& o) {
  OwnedTensor out = poisoned(pr.dtype, pr.q_shape()), lse = poisoned(DType::f32, Shape{pr.layout.tokens(), pr.hq});
  ops::attention_forward(process_exec(), *pr.q, *pr.k, *pr.v, *pr.cu, o, *out, *lse);
  return {download_f32(*out), to_host(*lse)};
}

// The same key gives the same bits; another key other masks (about 2p(1-p) of the output
// rows' elements change); the lse is the undropped softmax's. Ragged and uniform layouts.
TEST_F(DropoutGpu, CudnnAttentionMasksFollowTheKey) {
  for (const Layout& l : {layout_of({37, 64, 20, 1}), layout_of({64, 64}, true)}) {
    SCOPED_TRACE(fmt::format("tokens {} uniform {}", l.tokens(), l.uniform));
    const int64_t n = l.tokens();
    const Problem pr(l, 4, 2, 64, DType::bf16, test::random_tensor(DType::f32, Shape{n, 4, 64}, 1, 0.5),
                     test::random_tensor(DType::f32, Shape{n, 2, 64}, 2, 0.5),
                     test::random_tensor(DType::f32, Shape{n, 2, 64}, 3));
    const OwnedTensor key_a = to_device(*key_tensor(0x1234)), key_b = to_device(*key_tensor(0x1235));
    const Forward a = run_forward(pr, dropout_options(l, 0.3, *key_a));
    const Forward again = run_forward(pr, dropout_options(l, 0.3, *key_a));
    const Forward b = run_forward(pr, dropout_options(l, 0.3, *key_b));
    const Forward plain = run_forward(pr, dropout_options(l, 0.0, *key_a));
    EXPECT_TRUE(same_bytes(*a.out, *again.out)) << "one key, two masks";
    EXPECT_TRUE(same_bytes(*a.lse, *again.lse));
    int64_t changed = 0;
    for (int64_t i = 0; i < a.out->numel(); ++i) changed += a.out->data<float>()[i] != b.out->data<float>()[i];
    EXPECT_GT(changed, a.out->numel() / 2) << "another key, the same masks";
    int64_t moved = 0;
    for (int64_t i = 0; i < a.out->numel(); ++i) moved += a.out->data<float>()[i] != plain.out->data<float>()[i];
    EXPECT_GT(moved, a.out->numel() / 2) << "p 0.3 changed too little";
    for (int64_t i = 0; i < a.lse->numel(); ++i)
      ASSERT_NEAR(a.lse->data<float>()[i], plain.lse->data<float>()[i], 1e-3) << "lse " << i;
  }
}

// q = k = 0 (each row's probabilities uniform over its keys), V = 1: a row of n keys
// outputs (kept / n) / (1 - p) in every column. Sequences of one token show each draw
// (0 or 1 / (1 - p)): their kept share is 1 - p within 5 standard deviations. Over the rows
// of at least 8 keys the output's mean is 1 and its variance p / ((1 - p) n) per row: the
// sum of squared deviations within 30% of the expected sum (about 4 standard deviations;
// without dropout it would be 0).
TEST_F(DropoutGpu, CudnnAttentionDropsTheRateAndScalesWhatItKeeps) {
  std::vector<int32_t> lengths(1024, 1);
  for (int32_t n : {200, 150, 90, 7}) lengths.push_back(n);
  const Layout l = layout_of(lengths);
  const int64_t n = l.tokens(), hq = 4, hkv = 2, d = 64;
  OwnedTensor zeros_q(DType::f32, Device::cpu, Shape{n, hq, d}), zeros_k(DType::f32, Device::cpu, Shape{n, hkv, d}),
      ones(DType::f32, Device::cpu, Shape{n, hkv, d});
  std::fill_n(zeros_q->data<float>(), zeros_q->numel(), 0.0f);
  std::fill_n(zeros_k->data<float>(), zeros_k->numel(), 0.0f);
  std::fill_n(ones->data<float>(), ones->numel(), 1.0f);
  const Problem pr(l, hq, hkv, d, DType::bf16, std::move(zeros_q), std::move(zeros_k), std::move(ones));
  const OwnedTensor key = to_device(*key_tensor(0xabcdef0123ull));
  for (const double p : {0.1, 0.5}) {
    SCOPED_TRACE(fmt::format("p {}", p));
    const Forward f = run_forward(pr, dropout_options(l, p, *key));
    const float* out = f.out->data<float>();
    int64_t draws = 0, kept = 0;
    double squares = 0, expected = 0, sum = 0;
    int64_t rows = 0;
    for (size_t s = 0; s + 1 < l.cu.size(); ++s)
      for (int32_t i = l.cu[s]; i < l.cu[s + 1]; ++i)
        for (int64_t h = 0; h < hq; ++h) {
          const float* row = out + (i * hq + h) * d;
          const int64_t keys = i - l.cu[s] + 1;
          if (l.cu[s + 1] - l.cu[s] == 1) {
            ++draws;
            ASSERT_TRUE(row[0] == 0.0f || std::abs(row[0] - 1 / (1 - p)) < 1e-2) << row[0];
            kept += row[0] != 0.0f;
          } else if (keys >= 8) {  // rows of few keys would make the squares' sum heavy-tailed
            squares += (row[0] - 1.0) * (row[0] - 1.0);
            expected += p / ((1 - p) * static_cast<double>(keys));
            sum += row[0];
            ++rows;
          }
        }
    const double share = static_cast<double>(kept) / static_cast<double>(draws);
    EXPECT_NEAR(share, 1 - p, 5 * std::sqrt(p * (1 - p) / static_cast<double>(draws)));
    EXPECT_NEAR(squares / expected, 1.0, 0.3);
    // The mean of the long rows: its standard deviation is sqrt(expected) / rows (plus the
    // bf16 rounding of each output, below 2^-8 relative).
    EXPECT_NEAR(sum / static_cast<double>(rows), 1.0, 5 * std::sqrt(expected) / static_cast<double>(rows) + 4e-3);
  }
}

// V one-hot by key position (v_j = e_(j - sequence start), head_dim 64 >= every length):
// out[i, h, c] is then P_ij Z_ij for key j = start + c, so the forward shows its mask and
// its kept values (P_ij / (1 - p), P from the host's scores and the GPU's lse). The
// backward is checked against the fp64 gradients of that mask: dV_j = sum_i P Z dO_i,
// dS = P (Z dO_i . v_j - dO_i . O_i), dQ = scale dS K, dK = scale dS^T Q, per head vector
// within 2e-2 of its largest element. A backward with other masks is off by O(1).
TEST_F(DropoutGpu, CudnnAttentionBackwardUsesTheForwardsMask) {
  constexpr double kP = 0.3, kTolerance = 2e-2;
  for (const Layout& l : {layout_of({37, 64, 20}), layout_of({64, 64}, true)}) {
    SCOPED_TRACE(fmt::format("tokens {} uniform {}", l.tokens(), l.uniform));
    const int64_t n = l.tokens(), hq = 4, hkv = 2, d = 64, group = hq / hkv;
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    OwnedTensor v(DType::f32, Device::cpu, Shape{n, hkv, d});
    std::fill_n(v->data<float>(), v->numel(), 0.0f);
    std::vector<int32_t> start(static_cast<size_t>(n));
    for (size_t s = 0; s + 1 < l.cu.size(); ++s)
      for (int32_t j = l.cu[s]; j < l.cu[s + 1]; ++j) {
        start[static_cast<size_t>(j)] = l.cu[s];
        for (int64_t g = 0; g < hkv; ++g) v->data<float>()[(j * hkv + g) * d + (j - l.cu[s])] = 1.0f;
      }
    const Problem pr(l, hq, hkv, d, DType::bf16, test::random_tensor(DType::f32, Shape{n, hq, d}, 11, 0.5),
                     test::random_tensor(DType::f32, Shape{n, hkv, d}, 12, 0.5), std::move(v));
    const OwnedTensor key = to_device(*key_tensor(0x77));
    const ops::AttentionOptions o = dropout_options(l, kP, *key);
    OwnedTensor out = poisoned(DType::bf16, pr.q_shape()), lse = poisoned(DType::f32, Shape{n, hq});
    ops::attention_forward(process_exec(), *pr.q, *pr.k, *pr.v, *pr.cu, o, *out, *lse);
    const OwnedTensor oh = download_f32(*out), lh = to_host(*lse);
    const float *qv = pr.qh->data<float>(), *kv = pr.kh->data<float>(), *ov = oh->data<float>();
    // The lse's layout (ops/attention/attention_cudnn.cu): packed [tokens, Hq], or head-major
    // [B, Hq, S] for a uniform batch.
    auto lse_at = [&](int64_t i, int64_t h) {
      const float* lse_rows = lh->data<float>();
      if (!l.uniform) return static_cast<double>(lse_rows[i * hq + h]);
      const int64_t s = l.max_len;
      return static_cast<double>(lse_rows[(i / s * hq + h) * s + i % s]);
    };
    // P in fp64 from the bf16 q, k and the GPU's lse; Z from the output's zeros.
    auto prob = [&](int64_t i, int64_t h, int64_t j) {
      double s = 0;
      const float *qr = qv + (i * hq + h) * d, *kr = kv + (j * hkv + h / group) * d;
      for (int64_t c = 0; c < d; ++c) s += static_cast<double>(qr[c]) * kr[c];
      return std::exp(s * scale - lse_at(i, h));
    };
    std::vector<double> z(static_cast<size_t>(n * hq * d), 0.0);  // [i, h, key offset]
    int64_t dropped = 0, visible = 0;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < hq; ++h)
        for (int64_t c = 0; c < d; ++c) {
          const float got = ov[(i * hq + h) * d + c];
          const int64_t j = start[static_cast<size_t>(i)] + c;
          if (j > i) {
            ASSERT_EQ(got, 0.0f) << "a key after the query";
            continue;
          }
          ++visible;
          if (got == 0.0f) {
            ++dropped;
            continue;
          }
          z[static_cast<size_t>((i * hq + h) * d + c)] = 1 / (1 - kP);
          const double want = prob(i, h, j) / (1 - kP);
          ASSERT_NEAR(got, want, kTolerance * std::max(want, 1e-2)) << "kept value at " << i << "," << h << "," << c;
        }
    EXPECT_NEAR(static_cast<double>(dropped) / static_cast<double>(visible), kP, 0.05);

    const OwnedTensor do_host = test::random_tensor(DType::f32, pr.q_shape(), 13);
    round_to_bf16(*do_host);
    const OwnedTensor dout = upload(*do_host, DType::bf16);
    const float* dov = do_host->data<float>();
    OwnedTensor dq = poisoned(DType::bf16, pr.q_shape()), dk = poisoned(DType::bf16, pr.kv_shape()),
                dv = poisoned(DType::bf16, pr.kv_shape());
    ops::attention_backward(process_exec(), *pr.q, *pr.k, *pr.v, *out, *lse, *dout, *pr.cu, o, *dq, *dk, *dv);
    const OwnedTensor dq1 = to_host(*dq), dk1 = to_host(*dk), dv1 = to_host(*dv);
    ops::attention_backward(process_exec(), *pr.q, *pr.k, *pr.v, *out, *lse, *dout, *pr.cu, o, *dq, *dk, *dv);
    EXPECT_TRUE(same_bytes(*dq1, *to_host(*dq)) && same_bytes(*dk1, *to_host(*dk)) && same_bytes(*dv1, *to_host(*dv)))
        << "two backward runs differ";

    std::vector<double> rq(static_cast<size_t>(n * hq * d), 0.0), rk(static_cast<size_t>(n * hkv * d), 0.0),
        rv(static_cast<size_t>(n * hkv * d), 0.0);
    const float* vv = pr.vh->data<float>();
    for (int64_t i = 0; i < n; ++i)
      for (int64_t h = 0; h < hq; ++h) {
        const int64_t g = h / group, row = (i * hq + h) * d;
        double delta = 0;
        for (int64_t c = 0; c < d; ++c) delta += static_cast<double>(dov[row + c]) * ov[row + c];
        for (int64_t j = start[static_cast<size_t>(i)]; j <= i; ++j) {
          const double p = prob(i, h, j), zj = z[static_cast<size_t>(row + j - start[static_cast<size_t>(i)])];
          double dp = 0;
          for (int64_t c = 0; c < d; ++c) dp += static_cast<double>(dov[row + c]) * vv[(j * hkv + g) * d + c];
          const double ds = p * (zj * dp - delta) * scale;
          for (int64_t c = 0; c < d; ++c) {
            rv[static_cast<size_t>((j * hkv + g) * d + c)] += p * zj * dov[row + c];
            rq[static_cast<size_t>(row + c)] += ds * kv[(j * hkv + g) * d + c];
            rk[static_cast<size_t>((j * hkv + g) * d + c)] += ds * qv[row + c];
          }
        }
      }
    // Per head vector: max |gpu - ref| within kTolerance of the vector's largest |ref|
    // (floored at 5% of the tensor's largest).
    auto expect_vectors = [&](const char* name, const Tensor& gpu_bf16, const std::vector<double>& ref) {
      const OwnedTensor got = f32_of_bf16(gpu_bf16);
      double top = 0;
      for (double r : ref) top = std::max(top, std::abs(r));
      double worst = 0;
      for (size_t at = 0; at < ref.size(); at += static_cast<size_t>(d)) {
        double err = 0, big = 0.05 * top;
        for (size_t c = 0; c < static_cast<size_t>(d); ++c) {
          err = std::max(err, std::abs(got->data<float>()[at + c] - ref[at + c]));
          big = std::max(big, std::abs(ref[at + c]));
        }
        worst = std::max(worst, err / big);
      }
      EXPECT_LT(worst, kTolerance) << name;
    };
    expect_vectors("dq", *dq1, rq);
    expect_vectors("dk", *dk1, rk);
    expect_vectors("dv", *dv1, rv);
  }
}

// Sinks are corrected around cuDNN's kernels, whose Philox masks nothing checks against the
// CPU: with attention dropout that combination is refused, naming both keys.
TEST_F(DropoutGpu, CudnnAttentionRefusesSinksWithDropoutByKey) {
  const Layout l = layout_of({5, 3});
  const Problem pr(l, 2, 1, 64, DType::bf16, test::random_tensor(DType::f32, Shape{8, 2, 64}, 31),
                   test::random_tensor(DType::f32, Shape{8, 1, 64}, 32),
                   test::random_tensor(DType::f32, Shape{8, 1, 64}, 33));
  const OwnedTensor key = to_device(*key_tensor(9));
  OwnedTensor sinks(DType::f32, Device::cuda, Shape{2});
  ops::AttentionOptions o = dropout_options(l, 0.1, *key);
  o.sinks = *sinks;
  OwnedTensor out(DType::bf16, Device::cuda, pr.q_shape()), lse(DType::f32, Device::cuda, Shape{8, 2});
  const std::string error =
      test::error_of([&] { ops::attention_forward(process_exec(), *pr.q, *pr.k, *pr.v, *pr.cu, o, *out, *lse); });
  EXPECT_NE(error.find("model.attention_dropout with model.attention_sinks"), std::string::npos) << error;
}

// A captured forward and backward (one step graph) replays with the key in device memory
// at each launch: the replay with a new key equals an uncaptured run with that key, bit for
// bit, and differs from the first key's. The fp32 kernels and cuDNN (bf16).
TEST_F(DropoutGpu, CapturedAttentionDrawsEachReplaysKey) {
  const Layout l = layout_of({37, 64, 20});
  const int64_t n = l.tokens();
  for (const DType dtype : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dtype));
    const Problem pr(l, 4, 2, 64, dtype, test::random_tensor(DType::f32, Shape{n, 4, 64}, 21, 0.5),
                     test::random_tensor(DType::f32, Shape{n, 2, 64}, 22, 0.5),
                     test::random_tensor(DType::f32, Shape{n, 2, 64}, 23));
    const OwnedTensor dout = upload(*test::random_tensor(DType::f32, pr.q_shape(), 24), dtype);
    OwnedTensor key(DType::i32, Device::cuda, Shape{2});
    OwnedTensor out(dtype, Device::cuda, pr.q_shape()), lse(DType::f32, Device::cuda, Shape{n, 4});
    OwnedTensor dq(dtype, Device::cuda, pr.q_shape()), dk(dtype, Device::cuda, pr.kv_shape()),
        dv(dtype, Device::cuda, pr.kv_shape());
    const ops::AttentionOptions o = dropout_options(l, 0.25, *key);
    auto step = [&] {
      ops::attention_forward(process_exec(), *pr.q, *pr.k, *pr.v, *pr.cu, o, *out, *lse);
      ops::attention_backward(process_exec(), *pr.q, *pr.k, *pr.v, *out, *lse, *dout, *pr.cu, o, *dq, *dk, *dv);
    };
    auto set_key = [&](uint64_t k) {
      synchronize_stream();
      copy_tensor(*key_tensor(k), *key);
      synchronize_stream();
    };
    auto results = [&] {
      synchronize_stream();
      std::vector<OwnedTensor> r;
      for (const OwnedTensor* t : {&out, &dq, &dk, &dv}) r.push_back(to_host(**t));
      return r;
    };
    cuda::StepGraphs graphs("attention dropout test", process_exec());
    set_key(101);
    graphs.run(0, step);  // runs op by op, then captures
    ASSERT_TRUE(graphs.captured(0)) << "the attention step could not be captured";
    const auto first = results();
    set_key(202);
    graphs.run(0, step);  // the graph, with the new key
    EXPECT_EQ(graphs.launches(), 1);
    const auto replayed = results();
    step();  // uncaptured, the same key
    const auto direct = results();
    const char* names[] = {"out", "dq", "dk", "dv"};
    for (size_t t = 0; t < 4; ++t) {
      EXPECT_TRUE(same_bytes(*replayed[t], *direct[t])) << names[t] << ": the replay is not the new key's run";
      EXPECT_FALSE(same_bytes(*replayed[t], *first[t])) << names[t] << ": the replay kept the first key's masks";
    }
  }
}

}  // namespace
}  // namespace kiln
