// cuDNN bf16 attention (ops/attention/attention_cudnn.h) against the fp64 CPU reference
// (ops/attention/attention_cpu.h): packed layouts of awkward lengths, MHA and GQA, head dims
// 64 and 128, a sliding window, with and without shape bucketing. q, k, v and dout are
// rounded to bf16 on the host; the reference computes on exactly those values. The backward
// reference reads the GPU forward's saved out and lse (as the GPU backward does), so it
// measures the backward alone. GPU outputs are poisoned with NaN before each run; the
// backward runs twice and must give the same bits (training is bitwise reproducible).
#include "core/dtype.h"
#include "core/rng.h"
#include "core/tensor.h"
#include "gpu/gpu_harness.h"
#include "ops/attention/attention_cpu.h"
#include "ops/attention/attention_cudnn.h"
#include "test_util.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

namespace kiln {
namespace {

using namespace gpu_test;
using cuda::bf16_bits;

// Tolerances of bf16 outputs against the fp64 reference on the same bf16 inputs.
// out, dq, dk, dv: relative error 2e-2, judged per head vector (one token, one head): max
// |gpu - ref| over the vector divided by max |ref| over it (floored at kFloorFraction of the
// tensor's largest |ref|, for vectors that are ~0, e.g. dq of a 1-token sequence). The flash
// kernels round P (and dS) to bf16 before the second GEMMs, an error of ~2^-9 relative to the
// terms, i.e. to the vector's scale, not to each element; the final bf16 store adds 2^-9 of
// the element. A CPU simulation of exactly these roundings (lengths 130..1024, d 64/128) gives
// 4-6e-3 by this measure, but 4e-2..2.6e-1 element by element with the harness's 1% floor
// (elements near zero in large vectors), hence the per-vector measure. A wrong mask, offset
// or row is off by O(1).
// lse: 1e-3 absolute (fp32 scores of exact bf16 products, fp32 log-sum-exp).
constexpr double kBf16Tolerance = 2e-2;
constexpr double kLseTolerance = 1e-3;

// ---- data --------------------------------------------------------------------------------

struct Heads {
  int64_t q, kv, dim;
};

// bf16 values: their bits (for the GPU) and exact values (for the reference).
struct Bf16 {
  std::vector<bf16_bits> bits;
  std::vector<double> values;
};

Bf16 random_bf16(int64_t n, uint64_t seed) {
  Bf16 out;
  out.bits.resize(static_cast<size_t>(n));
  out.values.resize(static_cast<size_t>(n));
  Rng rng(seed);
  for (int64_t i = 0; i < n; ++i) {
    const bf16_bits b = float_to_bf16(static_cast<float>(rng.normal()));
    out.bits[static_cast<size_t>(i)] = b;
    out.values[static_cast<size_t>(i)] = bf16_to_float(b);
  }
  return out;
}

OwnedTensor device_bf16(const std::vector<bf16_bits>& bits) {
  const Shape shape{static_cast<int64_t>(bits.size())};
  OwnedTensor dev(DType::bf16, Device::cuda, shape);
  copy_tensor(Tensor(const_cast<bf16_bits*>(bits.data()), DType::bf16, Device::cpu, shape), *dev);
  return dev;
}

OwnedTensor device_output(DType dtype, int64_t n) {
  OwnedTensor dev(dtype, Device::cuda, Shape{n});
  poison(*dev);
  return dev;
}

std::vector<double> host_bf16(const Tensor& dev) {
  OwnedTensor host = to_host(dev);
  const auto* bits = static_cast<const bf16_bits*>(host->raw());
  std::vector<double> out(static_cast<size_t>(host->numel()));
  for (size_t i = 0; i < out.size(); ++i) out[i] = bf16_to_float(bits[i]);
  return out;
}

std::vector<double> host_f32(const Tensor& dev) {
  OwnedTensor host = to_host(dev);
  std::vector<double> out(static_cast<size_t>(host->numel()));
  for (size_t i = 0; i < out.size(); ++i) out[i] = host->data<float>()[i];
  return out;
}

std::vector<unsigned char> host_bytes(const Tensor& dev) {
  OwnedTensor host = to_host(dev);
  const auto* p = static_cast<const unsigned char*>(host->raw());
  return std::vector<unsigned char>(p, p + host->nbytes());
}

// ---- comparisons -------------------------------------------------------------------------

// See the tolerance note: [n / width] vectors of `width` elements.
void expect_close_bf16(const char* name, const std::vector<double>& gpu, const std::vector<double>& ref,
                       int64_t width, double tolerance) {
  ASSERT_EQ(gpu.size(), ref.size()) << name;
  double scale = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    ASSERT_TRUE(std::isfinite(ref[i])) << name << ": reference is not finite at " << i;
    scale = std::max(scale, std::fabs(ref[i]));
  }
  const double floor = std::max(kFloorFraction * scale, 1e-30);
  double worst = 0;
  size_t worst_at = 0;
  for (size_t row = 0; row * width < ref.size(); ++row) {
    const size_t begin = row * static_cast<size_t>(width), end = begin + static_cast<size_t>(width);
    double row_scale = floor, row_err = 0;
    size_t row_worst = begin;
    for (size_t i = begin; i < end; ++i) {
      ASSERT_TRUE(std::isfinite(gpu[i])) << name << "[" << i << "] = " << gpu[i] << " (unwritten or overflow), ref "
                                         << ref[i];
      row_scale = std::max(row_scale, std::fabs(ref[i]));
      const double err = std::fabs(gpu[i] - ref[i]);
      if (err > row_err) row_err = err, row_worst = i;
    }
    if (row_err / row_scale > worst) worst = row_err / row_scale, worst_at = row_worst;
  }
  EXPECT_LE(worst, tolerance) << name << ": max relative error " << worst << " at " << worst_at << " (gpu "
                              << gpu[worst_at] << ", ref " << ref[worst_at] << ")";
  ::testing::Test::RecordProperty(std::string(name) + "_max_rel_err", fmt::format("{:.3e}", worst));
}

void expect_lse_close(const std::vector<double>& gpu, const std::vector<double>& ref) {
  ASSERT_EQ(gpu.size(), ref.size());
  double worst = 0;
  size_t worst_at = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    ASSERT_TRUE(std::isfinite(gpu[i])) << "lse[" << i << "] = " << gpu[i] << " (unwritten?), ref " << ref[i];
    const double err = std::fabs(gpu[i] - ref[i]);
    if (err > worst) worst = err, worst_at = i;
  }
  EXPECT_LE(worst, kLseTolerance) << "lse: max absolute error " << worst << " at " << worst_at << " (gpu "
                                  << gpu[worst_at] << ", ref " << ref[worst_at] << ")";
  ::testing::Test::RecordProperty("lse_max_abs_err", fmt::format("{:.3e}", worst));
}

// ---- one problem -------------------------------------------------------------------------

// Runs forward and backward (twice) of one packed layout on cuDNN and checks them against
// the reference. Bucketing is whatever set_attention_cudnn_bucketing last chose. `uniform`
// marks the batch as one of equal lengths (AttentionArgs::uniform: cuDNN's plain layout);
// `softcap` > 0 caps the logits (cuDNN's score modifier).
void check_attention(const std::vector<int32_t>& lengths, Heads heads, int64_t window, uint64_t seed,
                     bool uniform = false, double softcap = 0, bool reproducible = true) {
  std::vector<int32_t> cu{0};
  int64_t max_len = 0;
  for (int32_t len : lengths) {
    cu.push_back(cu.back() + len);
    max_len = std::max<int64_t>(max_len, len);
  }
  const int64_t tokens = cu.back(), num_seqs = static_cast<int64_t>(lengths.size());
  const int64_t q_n = tokens * heads.q * heads.dim, kv_n = tokens * heads.kv * heads.dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(heads.dim));

  const Bf16 q = random_bf16(q_n, seed + 1), k = random_bf16(kv_n, seed + 2), v = random_bf16(kv_n, seed + 3);
  const Bf16 dout = random_bf16(q_n, seed + 4);

  // GPU: forward, then the backward twice from the same inputs.
  OwnedTensor cu_dev(DType::i32, Device::cuda, Shape{num_seqs + 1});
  copy_tensor(Tensor(cu.data(), DType::i32, Device::cpu, Shape{num_seqs + 1}), *cu_dev);
  OwnedTensor q_dev = device_bf16(q.bits), k_dev = device_bf16(k.bits), v_dev = device_bf16(v.bits);
  OwnedTensor dout_dev = device_bf16(dout.bits);
  OwnedTensor out_dev = device_output(DType::bf16, q_n), lse_dev = device_output(DType::f32, tokens * heads.q);
  cuda::AttentionArgs a{};
  a.tokens = tokens;
  a.q_heads = heads.q;
  a.kv_heads = heads.kv;
  a.head_dim = heads.dim;
  a.num_seqs = num_seqs;
  a.cu_seqlens = static_cast<const int32_t*>(cu_dev->raw());
  a.scale = scale;
  a.window = window;
  a.softcap = static_cast<float>(softcap);
  a.uniform = uniform;
  const auto* qp = static_cast<const bf16_bits*>(q_dev->raw());
  const auto* kp = static_cast<const bf16_bits*>(k_dev->raw());
  const auto* vp = static_cast<const bf16_bits*>(v_dev->raw());
  cuda::attention_forward_bf16(process_exec(), a, max_len, qp, kp, vp, static_cast<bf16_bits*>(out_dev->raw()),
                               static_cast<float*>(lse_dev->raw()));
  const std::vector<double> out = host_bf16(*out_dev);
  std::vector<double> lse = host_f32(*lse_dev);
  if (uniform) {  // head-major [seqs, heads, len] -> packed [tokens, heads], as the reference writes it
    std::vector<double> packed(lse.size());
    const int64_t len = max_len;
    for (int64_t s = 0; s < num_seqs; ++s)
      for (int64_t h = 0; h < heads.q; ++h)
        for (int64_t i = 0; i < len; ++i)
          packed[static_cast<size_t>((s * len + i) * heads.q + h)] = lse[static_cast<size_t>((s * heads.q + h) * len + i)];
    lse.swap(packed);
  }

  std::vector<double> dq[2], dk[2], dv[2];
  std::vector<unsigned char> bytes[2][3];
  for (int run = 0; run < 2; ++run) {
    OwnedTensor dq_dev = device_output(DType::bf16, q_n), dk_dev = device_output(DType::bf16, kv_n),
                dv_dev = device_output(DType::bf16, kv_n);
    cuda::attention_backward_bf16(process_exec(), a, max_len, qp, kp, vp, static_cast<const bf16_bits*>(out_dev->raw()),
                                  static_cast<const float*>(lse_dev->raw()),
                                  static_cast<const bf16_bits*>(dout_dev->raw()),
                                  static_cast<bf16_bits*>(dq_dev->raw()), static_cast<bf16_bits*>(dk_dev->raw()),
                                  static_cast<bf16_bits*>(dv_dev->raw()));
    dq[run] = host_bf16(*dq_dev);
    dk[run] = host_bf16(*dk_dev);
    dv[run] = host_bf16(*dv_dev);
    bytes[run][0] = host_bytes(*dq_dev);
    bytes[run][1] = host_bytes(*dk_dev);
    bytes[run][2] = host_bytes(*dv_dev);
  }

  // Reference in fp64 on the same bf16 values; its backward reads the GPU's out and lse.
  const cpu::AttentionShape shape{tokens, heads.q, heads.kv, heads.dim, num_seqs, cu.data(),
                                  static_cast<double>(scale), window, static_cast<double>(a.softcap)};
  std::vector<double> out_ref(static_cast<size_t>(q_n)), lse_ref(static_cast<size_t>(tokens * heads.q));
  cpu::attention_forward<double>(shape, q.values.data(), k.values.data(), v.values.data(), out_ref.data(),
                                 lse_ref.data());
  std::vector<double> dq_ref(static_cast<size_t>(q_n)), dk_ref(static_cast<size_t>(kv_n)),
      dv_ref(static_cast<size_t>(kv_n));
  cpu::attention_backward<double>(shape, q.values.data(), k.values.data(), v.values.data(), out.data(), lse.data(),
                                  dout.values.data(), dq_ref.data(), dk_ref.data(), dv_ref.data());

  expect_close_bf16("out", out, out_ref, heads.dim, kBf16Tolerance);
  expect_lse_close(lse, lse_ref);
  expect_close_bf16("dq", dq[0], dq_ref, heads.dim, kBf16Tolerance);
  expect_close_bf16("dk", dk[0], dk_ref, heads.dim, kBf16Tolerance);
  expect_close_bf16("dv", dv[0], dv_ref, heads.dim, kBf16Tolerance);
  const char* names[3] = {"dq", "dk", "dv"};
  for (int i = 0; i < 3 && reproducible; ++i)
    EXPECT_TRUE(bytes[0][i] == bytes[1][i]) << names[i] << " differs between two identical backward runs";
}

// ---- cases -------------------------------------------------------------------------------

// Bucketing as the environment sets it (KILN_CUDNN_BUCKET=0 turns it off), restored after
// each test so other suites see the default.
bool default_bucketing() {
  const char* env = std::getenv("KILN_CUDNN_BUCKET");
  return !(env != nullptr && std::strcmp(env, "0") == 0);
}

class CudnnAttention : public GpuTest {
 protected:
  void TearDown() override { cuda::set_attention_cudnn_bucketing(default_bucketing()); }
};

enum class Layout { mixed, single_long, many };

std::vector<int32_t> lengths_of(Layout layout) {
  switch (layout) {
    case Layout::mixed: return {1, 7, 130, 64, 300};
    case Layout::single_long: return {1024};
    case Layout::many: {
      std::vector<int32_t> lengths;
      Rng rng(37);
      for (int i = 0; i < 37; ++i) lengths.push_back(1 + static_cast<int32_t>(rng.below(200)));
      return lengths;
    }
  }
  return {};
}

const char* layout_name(Layout layout) {
  switch (layout) {
    case Layout::mixed: return "mixed";
    case Layout::single_long: return "long";
    case Layout::many: return "many";
  }
  return "?";
}

constexpr Heads kMha64{12, 12, 64};
constexpr Heads kGqa128{16, 8, 128};

using Param = std::tuple<Layout, bool, int64_t, bool>;  // layout, GQA d128 (else MHA d64), window, bucketing

class CudnnAttentionCases : public CudnnAttention, public ::testing::WithParamInterface<Param> {};

TEST_P(CudnnAttentionCases, MatchesReferenceAndIsDeterministic) {
  const auto [layout, gqa, window, bucketing] = GetParam();
  cuda::set_attention_cudnn_bucketing(bucketing);
  const uint64_t seed = static_cast<uint64_t>(layout) * 1000 + (gqa ? 100 : 0) + static_cast<uint64_t>(window);
  check_attention(lengths_of(layout), gqa ? kGqa128 : kMha64, window, seed);
}

std::string case_name(const ::testing::TestParamInfo<Param>& info) {
  const auto& [layout, gqa, window, bucketing] = info.param;
  return fmt::format("{}_{}_w{}_{}", layout_name(layout), gqa ? "gqa16x8d128" : "mha12d64", window,
                     bucketing ? "bucketed" : "exact");
}

INSTANTIATE_TEST_SUITE_P(Layouts, CudnnAttentionCases,
                         ::testing::Combine(::testing::Values(Layout::mixed, Layout::single_long, Layout::many),
                                            ::testing::Bool(), ::testing::Values<int64_t>(0, 33), ::testing::Bool()),
                         case_name);

// Many short documents and one long one: the deterministic backward's workspace of the
// bucketed shape (256 entries of 4096 positions, 2 heads: 16 GiB) is over a sixteenth of an
// H200, so that backward runs the atomic algorithm, still right (not bitwise reproducible,
// so not checked for it). At 16 heads the same batch's workspace (137 GB) ran a 0.6B
// training out of memory.
TEST_F(CudnnAttention, ABatchTooLargeForTheDeterministicWorkspaceRunsTheAtomicBackward) {
  cuda::set_attention_cudnn_bucketing(true);
  size_t free_bytes = 0, total = 0;
  cuda_memory_info(&free_bytes, &total);
  if (total > (size_t{256} << 30)) GTEST_SKIP() << "a GPU this large has the deterministic workspace";
  std::vector<int32_t> lengths(200, 5);
  lengths.push_back(4096);
  const int64_t before = cuda::attention_cudnn_atomic_fallbacks();
  check_attention(lengths, Heads{2, 1, 64}, 0, 91, false, 0, false);
  EXPECT_EQ(cuda::attention_cudnn_atomic_fallbacks(), before + 2);  // the two backward runs
}

// Empty sequences inside the packed layout (as bucketing appends at the end).
TEST_F(CudnnAttention, EmptySequences) {
  for (bool bucketing : {true, false}) {
    SCOPED_TRACE(bucketing ? "bucketed" : "exact");
    cuda::set_attention_cudnn_bucketing(bucketing);
    check_attention({3, 0, 70, 0, 129}, kMha64, 0, 77);
  }
}

// A second layout in the same bucket reuses the cached graphs (and is still right); without
// bucketing a different exact shape builds its own.
TEST_F(CudnnAttention, SameBucketReusesGraphs) {
  cuda::set_attention_cudnn_bucketing(true);
  check_attention({100, 27, 60}, kGqa128, 0, 5);  // 3 sequences -> 4, longest 100 -> 128
  const int64_t built = cuda::attention_cudnn_graph_count();
  check_attention({50, 50, 87, 1}, kGqa128, 0, 6);  // 4 -> 4, 87 -> 128: the same graphs
  EXPECT_EQ(cuda::attention_cudnn_graph_count(), built);

  cuda::set_attention_cudnn_bucketing(false);
  check_attention({100, 27, 60}, kGqa128, 0, 7);
  const int64_t exact = cuda::attention_cudnn_graph_count();
  check_attention({50, 50, 87, 1}, kGqa128, 0, 8);
  EXPECT_EQ(cuda::attention_cudnn_graph_count(), exact + 2);  // a forward and a backward graph
}

// Uniform batches (every sequence max_seqlen long) run cuDNN's plain layout, a graph of
// their own, exactly as right: MHA and GQA, with and without a window, one sequence or several.
TEST_F(CudnnAttention, UniformBatchesUsePlainGraphsThatMatchTheReference) {
  for (Heads heads : {kMha64, kGqa128})
    for (int64_t window : {int64_t{0}, int64_t{33}})
      for (const std::vector<int32_t>& lengths : {std::vector<int32_t>{256, 256, 256}, std::vector<int32_t>{300}}) {
        SCOPED_TRACE(fmt::format("heads {}/{} d{}, window {}, {} x {}", heads.q, heads.kv, heads.dim, window,
                                 lengths.size(), lengths[0]));
        const int64_t before = cuda::attention_cudnn_graph_count();
        check_attention(lengths, heads, window, 900 + static_cast<uint64_t>(window), true);
        EXPECT_EQ(cuda::attention_cudnn_graph_count(), before + 2) << "a uniform batch builds its own forward and backward graph";
        check_attention(lengths, heads, window, 950 + static_cast<uint64_t>(window), false);  // the ragged path
      }
}

TEST_F(CudnnAttention, UniformFlagOnUnequalLengthsIsRefused) {
  const std::string message = test::error_of([&] { check_attention({100, 50}, kMha64, 0, 3, true); });
  EXPECT_NE(message.find("uniform batch must be 2 sequences of 100 tokens, but it has 150"), std::string::npos)
      << message;
}

// A logit softcap goes through cuDNN's score modifier, which carries the causal band, the
// window and the padding mask itself: packed and uniform layouts, MHA and GQA, with and
// without a window. A cap of 2 bites hard on these scores (unit-normal q and k: scaled
// scores of order 1 and up to ~4).
void check_softcap_cases(bool uniform) {
  for (Heads heads : {kMha64, kGqa128})
    for (int64_t window : {int64_t{0}, int64_t{33}}) {
      const std::vector<int32_t> lengths = uniform ? std::vector<int32_t>{200, 200} : lengths_of(Layout::mixed);
      SCOPED_TRACE(fmt::format("{}, heads {}/{} d{}, window {}", uniform ? "uniform" : "packed", heads.q, heads.kv,
                               heads.dim, window));
      check_attention(lengths, heads, window, 700 + static_cast<uint64_t>(window), uniform, 2.0);
    }
}

TEST_F(CudnnAttention, SoftcapUniformMatchesTheReference) { check_softcap_cases(true); }
TEST_F(CudnnAttention, SoftcapPackedMatchesTheReference) { check_softcap_cases(false); }

// The same cap as a different number builds its own graphs, and no cap differs from a cap.
TEST_F(CudnnAttention, SoftcapIsPartOfTheGraphKey) {
  cuda::set_attention_cudnn_bucketing(true);
  check_attention({90, 40}, kMha64, 0, 11, false, 3.0);
  const int64_t built = cuda::attention_cudnn_graph_count();
  check_attention({90, 40}, kMha64, 0, 12, false, 3.0);
  EXPECT_EQ(cuda::attention_cudnn_graph_count(), built);
  check_attention({90, 40}, kMha64, 0, 13, false, 1.5);
  EXPECT_EQ(cuda::attention_cudnn_graph_count(), built + 2);
}

TEST_F(CudnnAttention, NegativeSoftcapIsRefused) {
  cuda::AttentionArgs a{};
  a.tokens = 4;
  a.q_heads = a.kv_heads = 1;
  a.head_dim = 64;
  a.num_seqs = 1;
  a.scale = 0.125f;
  a.softcap = -1;
  const std::string message = test::error_of([&] {
    cuda::attention_forward_bf16(process_exec(), a, 4, nullptr, nullptr, nullptr, nullptr, nullptr);
  });
  EXPECT_NE(message.find("softcap -1 is negative"), std::string::npos) << message;
}

}  // namespace
}  // namespace kiln
