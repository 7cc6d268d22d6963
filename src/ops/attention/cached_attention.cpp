#include "ops/attention/cached_attention.h"
#include "ops/attention/attention_math.h"

#include "core/op_profiler.h"
#include "ops/attention/attention_cpu.h"
#include "ops/attention/cached_attention_cuda.h"
#include "ops/common.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace kiln::ops {

namespace {

// The packed kernel's row math (attention_math.h): same rounding as the full forward.

struct CacheShape {
  int64_t rows, q_heads, kv_heads, head_dim, slots, max_len;
  double scale, softcap;
  int64_t window;
};

// Each (row, query head) transposes the keys it sees from the cache, as the packed forward
// transposes a sequence's, then takes the same scores, softmax and output.
template <typename T>
void cached_attention_cpu(const CacheShape& s, const T* q, const T* kc, const T* vc, const int32_t* slot,
                          const int32_t* pos, T* out, const T* sinks) {
  const int64_t d = s.head_dim, group = s.q_heads / s.kv_heads;
  const T scale = static_cast<T>(s.scale);
#pragma omp parallel
  {
    std::vector<T> kt, sc;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < s.rows * s.q_heads; ++item) {
      const int64_t i = item / s.q_heads, h = item % s.q_heads, g = h / group;
      const int64_t p = pos[i];
      // Keys of this slot and kv head: position j at base + j * kv_heads * d.
      const T* kbase = kc + (slot[i] * s.max_len * s.kv_heads + g) * d;
      const T* vbase = vc + (slot[i] * s.max_len * s.kv_heads + g) * d;
      const int64_t stride = s.kv_heads * d;
      const int64_t first = s.window > 0 ? std::max<int64_t>(0, p - s.window + 1) : 0, n = p + 1 - first;
      const int64_t ld = cpu::transposed_ld(n);
      kt.resize(static_cast<size_t>(d * ld));
      sc.resize(static_cast<size_t>(n));
      cpu::transpose_keys(kbase + first * stride, stride, n, d, kt.data(), ld);
      cpu::transposed_scores(q + (i * s.q_heads + h) * d, kt.data(), ld, n, d, scale, sc.data());
      if (s.softcap > 0) cpu::softcap_scores(sc.data(), n, s.softcap, static_cast<T*>(nullptr));
      cpu::softmax_combine(sc.data(), n, d, [&](int64_t j) { return vbase + (first + j) * stride; },
                           out + (i * s.q_heads + h) * d, sinks ? sinks + h : nullptr);
    }
  }
}

void validate_rows(const char* op, const Tensor& x, const Tensor& cache, const Tensor& slots, const Tensor& positions) {
  expect_rank(op, "cache", cache, 4);
  expect_shape(op, "slots", slots, Shape{x.size(0)});
  expect_dtype(op, "slots", slots, DType::i32);
  expect_shape(op, "positions", positions, Shape{x.size(0)});
  expect_dtype(op, "positions", positions, DType::i32);
  KILN_CHECK(slots.device() == x.device() && positions.device() == x.device(), op,
             "slots/positions must live with the activations");
  if (slots.device() != Device::cpu) return;
  const int32_t* s = slots.data<int32_t>();
  const int32_t* p = positions.data<int32_t>();
  for (int64_t i = 0; i < x.size(0); ++i) {
    KILN_CHECK(s[i] >= 0 && s[i] < cache.size(0), op, "row {}: slot {} outside [0, {})", i, s[i], cache.size(0));
    KILN_CHECK(p[i] >= 0 && p[i] < cache.size(1), op, "row {}: position {} outside the cache length {}", i, p[i],
               cache.size(1));
  }
}

// The GPU kernels read and write f32, or bf16 on the mixed path.
void expect_gpu_dtype(const char* op, const Tensor& x) {
  KILN_CHECK(x.device() == Device::cpu || x.dtype() == DType::f32 || x.dtype() == DType::bf16, op,
             "the GPU computes in f32 or bf16, got {}", x.describe());
}

}  // namespace

int64_t cached_attention_workspace(int64_t rows, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                   int64_t max_len) {
  KILN_CHECK(rows > 0 && kv_heads > 0 && q_heads % kv_heads == 0 && head_dim > 0 && max_len > 0,
             "cached_attention", "bad workspace shape: rows {}, heads {}/{}, head_dim {}, max_len {}", rows, q_heads,
             kv_heads, head_dim, max_len);
  return cuda::cached_attention_workspace_elems(rows, q_heads, kv_heads, head_dim, max_len);
}

void kv_cache_write(const ExecContext& ctx, const Tensor& k, const Tensor& v, const Tensor& slots, const Tensor& positions,
                    const Tensor& k_cache, const Tensor& v_cache) {
  const char* op = "kv_cache_write";
  KILN_OP_SCOPE(op, k);
  expect_rank(op, "k", k, 3);
  expect_shape(op, "v", v, k.shape());
  expect_same(op, "v", v, k);
  validate_rows(op, k, k_cache, slots, positions);
  expect_shape(op, "v_cache", v_cache, k_cache.shape());
  expect_same(op, "k_cache", k_cache, k);
  expect_same(op, "v_cache", v_cache, k);
  KILN_CHECK(k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2), op, "k {} does not fit the cache {}",
             k.describe(), k_cache.describe());
  expect_gpu_dtype(op, k);
  KILN_ON_CUDA(k, op, cuda::kv_cache_write(ctx, k.raw(), v.raw(), k.dtype(), slots.data<int32_t>(),
                                           positions.data<int32_t>(), k.size(0), k.size(1) * k.size(2),
                                           k_cache.size(1), k_cache.raw(), v_cache.raw()));
  const int64_t n = k.size(0), row = k.size(1) * k.size(2), len = k_cache.size(1);
  const size_t bytes = static_cast<size_t>(row) * dtype_size(k.dtype());
  const int32_t* s = slots.data<int32_t>();
  const int32_t* p = positions.data<int32_t>();
  auto* kc = static_cast<uint8_t*>(k_cache.raw());
  auto* vc = static_cast<uint8_t*>(v_cache.raw());
  for (int64_t i = 0; i < n; ++i) {
    const size_t at = static_cast<size_t>(s[i] * len + p[i]) * bytes;
    std::memcpy(kc + at, static_cast<const uint8_t*>(k.raw()) + static_cast<size_t>(i) * bytes, bytes);
    std::memcpy(vc + at, static_cast<const uint8_t*>(v.raw()) + static_cast<size_t>(i) * bytes, bytes);
  }
}

void cached_attention_forward(const ExecContext& ctx, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& slots,
                              const Tensor& positions, const AttentionOptions& options, const Tensor& out,
                              const Tensor& workspace) {
  const char* op = "cached_attention";
  KILN_OP_SCOPE(op, q);
  expect_rank(op, "q", q, 3);
  validate_rows(op, q, k_cache, slots, positions);
  expect_shape(op, "v_cache", v_cache, k_cache.shape());
  expect_same(op, "k_cache", k_cache, q);
  expect_same(op, "v_cache", v_cache, q);
  expect_shape(op, "out", out, q.shape());
  expect_same(op, "out", out, q);
  KILN_CHECK(k_cache.size(3) == q.size(2), op, "q {} and the cache {} disagree on head_dim", q.describe(),
             k_cache.describe());
  KILN_CHECK(k_cache.size(2) > 0 && q.size(1) % k_cache.size(2) == 0, op,
             "query heads {} must be a multiple of kv heads {}", q.size(1), k_cache.size(2));
  KILN_CHECK(q.size(2) <= cpu::kMaxAttentionHeadDim, op, "head_dim {} exceeds {}", q.size(2),
             cpu::kMaxAttentionHeadDim);
  expect_gpu_dtype(op, q);
  if (workspace.defined()) {
    expect_dtype(op, "workspace", workspace, DType::f32);
    KILN_CHECK(workspace.device() == q.device(), op, "workspace must be on {}, got {}", device_name(q.device()),
               workspace.describe());
  }
  if (options.sinks.defined()) {  // the packed forward's sinks: q's dtype on the CPU, f32 on the GPU (as its lse)
    expect_shape(op, "sinks", options.sinks, Shape{q.size(1)});
    if (q.device() == Device::cpu) {
      expect_same(op, "sinks", options.sinks, q);
    } else {
      expect_dtype(op, "sinks", options.sinks, DType::f32);
      KILN_CHECK(options.sinks.device() == q.device(), op, "sinks must be on {}, got {}", device_name(q.device()),
                 options.sinks.describe());
    }
  }
  const double scale = options.scale > 0 ? options.scale : 1.0 / std::sqrt(static_cast<double>(q.size(2)));
  KILN_ON_CUDA(q, op, {
    const cuda::CachedAttentionArgs args{q.size(0),
                                         q.size(1),
                                         k_cache.size(2),
                                         q.size(2),
                                         k_cache.size(1),
                                         slots.data<int32_t>(),
                                         positions.data<int32_t>(),
                                         static_cast<float>(scale),
                                         options.window,
                                         static_cast<float>(options.softcap),
                                         options.sinks.defined() ? options.sinks.data<float>() : nullptr};
    cuda::cached_attention_forward(ctx, args, q.dtype(), q.raw(), k_cache.raw(), v_cache.raw(), out.raw(),
                                   workspace.defined() ? workspace.data<float>() : nullptr,
                                   workspace.defined() ? workspace.numel() : 0);
  });
  CacheShape s{q.size(0),
               q.size(1),
               k_cache.size(2),
               q.size(2),
               k_cache.size(0),
               k_cache.size(1),
               scale,
               options.softcap,
               options.window};
  dispatch_cpu_float(op, q.dtype(), [&](auto zero) {
    using T = decltype(zero);
    cached_attention_cpu<T>(s, q.data<T>(), k_cache.data<T>(), v_cache.data<T>(), slots.data<int32_t>(),
                            positions.data<int32_t>(), out.data<T>(),
                            options.sinks.defined() ? options.sinks.data<T>() : nullptr);
  });
}

}  // namespace kiln::ops
