// The fused attention input preparation (ops/attention/qkv_prepare.h: per-head q/k RMSNorm,
// RoPE, v copied out, and the backward of all three) on the GPU, fp32 and bf16, against
// the CPU reference in fp64 on the same input values (bf16 inputs are rounded to bf16
// first, so both sides read identical numbers). Outputs are poisoned with NaN first.
// Shapes cover every launch shape of the kernel: scalar rows (head_dim 12, 8), 4, 8 and
// 16 threads per row (head_dim 16, 64/128, 256), with and without the norm, with and
// without the rotation, single tokens and odd counts.
//
// Tolerances (max |gpu - ref| / max(|ref|, 1% of the output's scale)):
//   fp32 q/k/v                 1e-5  a row sum, then a few products
//   fp32 dqkv, gain gradients  1e-4  a row dot that cancels; long column sums
//   bf16 q/k/v, dqkv           1e-2  one bf16 rounding of the output (2^-8 = 3.9e-3)
//   bf16-path gain gradients   1e-3  fp32 sums of exactly known bf16 inputs
#include "core/dtype.h"
#include "gpu/gpu_harness.h"
#include "ops/attention/qkv_prepare.h"
#include "ops/rope/rope.h"
#include "test_util.h"

namespace kiln {
namespace {

using namespace gpu_test;

struct Case {
  int64_t tokens, q_heads, kv_heads, head_dim;
  bool norm, rope;
};

// Host values (f32, already representable in `dtype`) and their device copy in `dtype`.
struct Values {
  OwnedTensor f32, f64, gpu;
  Values(DType dtype, Shape shape, uint64_t seed, double scale = 1.0, double offset = 0.0)
      : f32(test::random_tensor(DType::f32, shape, seed, scale)) {
    float* v = f32->data<float>();
    for (int64_t i = 0; i < f32->numel(); ++i) {
      v[i] += static_cast<float>(offset);
      if (dtype == DType::bf16) v[i] = bf16_to_float(float_to_bf16(v[i]));
    }
    f64 = to_f64(*f32);
    gpu = device_copy(*f32, dtype);
  }

  static OwnedTensor device_copy(const Tensor& host_f32, DType dtype) {
    if (dtype == DType::f32) return to_device(host_f32);
    OwnedTensor host(DType::bf16, Device::cpu, host_f32.shape());
    for (int64_t i = 0; i < host_f32.numel(); ++i)
      static_cast<uint16_t*>(host->raw())[i] = float_to_bf16(host_f32.data<float>()[i]);
    return to_device(*host);
  }
};

// A device result of either dtype, read back as f32.
OwnedTensor read_f32(const Tensor& dev) {
  OwnedTensor host = to_host(dev);
  if (dev.dtype() == DType::f32) return host;
  OwnedTensor out(DType::f32, Device::cpu, dev.shape());
  const auto* bits = static_cast<const uint16_t*>(host->raw());
  for (int64_t i = 0; i < dev.numel(); ++i) out->data<float>()[i] = bf16_to_float(bits[i]);
  return out;
}

OwnedTensor poisoned(DType dtype, Shape shape) {
  OwnedTensor t(dtype, Device::cuda, shape);
  poison(*t);
  return t;
}

OwnedTensor zeros_f64(Shape shape) {
  OwnedTensor t(DType::f64, Device::cpu, shape);
  std::fill(t->data<double>(), t->data<double>() + t->numel(), 0.0);
  return t;
}

class QkvPrepareGpu : public GpuTest, public ::testing::WithParamInterface<std::tuple<Case, DType>> {};

TEST_P(QkvPrepareGpu, MatchesReferenceForwardAndBackward) {
  const auto [c, dtype] = GetParam();
  const bool bf16 = dtype == DType::bf16;
  const int64_t n = c.tokens, d = c.head_dim, cols = (c.q_heads + 2 * c.kv_heads) * d, max_pos = 64;
  const uint64_t seed = static_cast<uint64_t>(n * 1000 + d * 10 + c.q_heads) + (bf16 ? 7 : 0);

  // Inputs: the projection (rows of several scales, so each row's rstd matters), gains
  // around 1, tables of theta 10000, positions spread over the table.
  Values qkv(dtype, {n, cols}, seed, 1.5);
  Values q_gain(DType::f32, {d}, seed + 1, 0.3, 1.0), k_gain(DType::f32, {d}, seed + 2, 0.3, 1.0);
  const Shape table{max_pos, d / 2};
  OwnedTensor cos32(DType::f32, Device::cpu, table), sin32(DType::f32, Device::cpu, table);
  ops::rope_fill_tables(ops::rope_inverse_frequencies(10000.0, d), *cos32, *sin32);
  OwnedTensor cos64 = to_f64(*cos32), sin64 = to_f64(*sin32), cos_gpu = to_device(*cos32), sin_gpu = to_device(*sin32);
  std::vector<int32_t> pos(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) pos[static_cast<size_t>(i)] = static_cast<int32_t>((i * 13 + 5) % max_pos);
  const Tensor pos_cpu(pos.data(), DType::i32, Device::cpu, Shape{n});
  OwnedTensor pos_gpu = to_device(pos_cpu);

  ops::QkvPrepare gpu, ref;
  gpu.q_heads = ref.q_heads = c.q_heads;
  gpu.kv_heads = ref.kv_heads = c.kv_heads;
  gpu.head_dim = ref.head_dim = d;
  gpu.eps = ref.eps = 1e-6;
  if (c.norm) {
    gpu.q_gain = *q_gain.gpu, gpu.k_gain = *k_gain.gpu;
    ref.q_gain = *q_gain.f64, ref.k_gain = *k_gain.f64;
  }
  if (c.rope) {
    gpu.cos = *cos_gpu, gpu.sin = *sin_gpu, gpu.positions = *pos_gpu;
    ref.cos = *cos64, ref.sin = *sin64, ref.positions = pos_cpu;
  }

  const Shape q_shape{n, c.q_heads, d}, kv_shape{n, c.kv_heads, d};
  OwnedTensor q = poisoned(dtype, q_shape), k = poisoned(dtype, kv_shape), v = poisoned(dtype, kv_shape);
  OwnedTensor q_ref = zeros_f64(q_shape), k_ref = zeros_f64(kv_shape), v_ref = zeros_f64(kv_shape);
  ops::qkv_prepare_forward(*qkv.gpu, gpu, *q, *k, *v);
  ops::qkv_prepare_forward(*qkv.f64, ref, *q_ref, *k_ref, *v_ref);
  const double fwd_tol = bf16 ? 1e-2 : 1e-5;
  expect_close("q", *read_f32(*q), *q_ref, fwd_tol);
  expect_close("k", *read_f32(*k), *k_ref, fwd_tol);
  expect_close("v", *read_f32(*v), *v_ref, 0.0);  // a copy

  // Backward, gain gradients accumulated onto non-zero values; twice, to check the bytes.
  Values dq(dtype, q_shape, seed + 3), dk(dtype, kv_shape, seed + 4), dv(dtype, kv_shape, seed + 5);
  Values dq_gain0(DType::f32, {d}, seed + 6), dk_gain0(DType::f32, {d}, seed + 7);
  OwnedTensor dqkv_ref = zeros_f64({n, cols}), dq_gain_ref = to_f64(*dq_gain0.f32), dk_gain_ref = to_f64(*dk_gain0.f32);
  ops::qkv_prepare_backward(*qkv.f64, ref, *dq.f64, *dk.f64, *dv.f64, *dqkv_ref, c.norm ? *dq_gain_ref : Tensor(),
                            c.norm ? *dk_gain_ref : Tensor());
  OwnedTensor first_dqkv, first_gains;
  for (int run = 0; run < 2; ++run) {
    SCOPED_TRACE(fmt::format("run {}", run));
    OwnedTensor dqkv = poisoned(dtype, {n, cols});
    OwnedTensor dq_gain = to_device(*dq_gain0.f32), dk_gain = to_device(*dk_gain0.f32);
    ops::qkv_prepare_backward(*qkv.gpu, gpu, *dq.gpu, *dk.gpu, *dv.gpu, *dqkv, c.norm ? *dq_gain : Tensor(),
                              c.norm ? *dk_gain : Tensor());
    expect_close("dqkv", *read_f32(*dqkv), *dqkv_ref, bf16 ? 1e-2 : 1e-4);
    if (c.norm) {
      expect_close("dq_gain", *to_host(*dq_gain), *dq_gain_ref, bf16 ? 1e-3 : 1e-4);
      expect_close("dk_gain", *to_host(*dk_gain), *dk_gain_ref, bf16 ? 1e-3 : 1e-4);
    }
    OwnedTensor host_dqkv = to_host(*dqkv), host_gains = to_host(*dq_gain);
    if (run == 0) {
      first_dqkv = std::move(host_dqkv), first_gains = std::move(host_gains);
    } else {
      EXPECT_TRUE(same_bytes(*first_dqkv, *host_dqkv)) << "dqkv differs between runs";
      EXPECT_TRUE(same_bytes(*first_gains, *host_gains)) << "gain gradients differ between runs";
    }
  }
}

const Case kCases[] = {
    {29, 4, 2, 12, true, true},     // half 6: scalar path
    {1, 1, 1, 8, true, true},       // one token, half 4: scalar
    {70, 3, 1, 16, true, true},     // half 8: one vector, 4 threads per row
    {37, 16, 8, 128, true, true},   // Qwen3-0.6B heads: 8 threads per row
    {5, 2, 2, 64, false, true},     // Llama: no q/k norm
    {33, 4, 2, 128, true, false},   // NoPE
    {300, 2, 1, 256, true, true},   // 16 threads per row, several blocks
    {33000, 2, 1, 64, true, true},  // over 2048 groups of rows: each block takes several
};

std::string case_name(const ::testing::TestParamInfo<std::tuple<Case, DType>>& info) {
  const auto& [c, dtype] = info.param;
  return fmt::format("t{}_h{}x{}_d{}_{}{}_{}", c.tokens, c.q_heads, c.kv_heads, c.head_dim, c.norm ? "norm" : "nonorm",
                     c.rope ? "_rope" : "_norope", dtype_name(dtype));
}

INSTANTIATE_TEST_SUITE_P(Shapes, QkvPrepareGpu,
                         ::testing::Combine(::testing::ValuesIn(kCases), ::testing::Values(DType::f32, DType::bf16)),
                         case_name);

}  // namespace
}  // namespace kiln
