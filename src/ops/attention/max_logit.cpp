// Per-head maximum attention logits (ops/attention/max_logit.h): the front end and the CPU
// reference (dots in double, each sequence's causal, windowed pairs in turn); the GPU's
// kernels are max_logit_cuda.h.
#include "ops/attention/max_logit.h"

#include "core/device_memory.h"
#include "core/op_profiler.h"
#include "ops/attention/logit_key.h"
#include "ops/attention/max_logit_cuda.h"
#include "ops/common.h"

#include <algorithm>
#include <cmath>

namespace kiln::ops {

namespace {

void validate(const char* op, const Tensor& q, const Tensor& k, const Tensor& cu_seqlens, const Tensor& running) {
  expect_rank(op, "q", q, 3);
  expect_rank(op, "k", k, 3);
  expect_same(op, "k", k, q);
  KILN_CHECK(k.size(0) == q.size(0) && k.size(2) == q.size(2), op, "q {} and k {} disagree", q.describe(),
             k.describe());
  KILN_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, op, "query heads {} must be a multiple of kv heads {}",
             q.size(1), k.size(1));
  expect_rank(op, "cu_seqlens", cu_seqlens, 1);
  expect_dtype(op, "cu_seqlens", cu_seqlens, DType::i32);
  KILN_CHECK(cu_seqlens.size(0) >= 2 && cu_seqlens.device() == q.device(), op,
             "cu_seqlens must hold at least 2 entries on q's device, got {}", cu_seqlens.describe());
  expect_tensor(op, "running", running, Shape{q.size(1)}, DType::i32, q.device());
}

double scale_of(const Tensor& q, const AttentionOptions& o) {
  return o.scale > 0 ? o.scale : 1.0 / std::sqrt(static_cast<double>(q.size(2)));
}

template <typename T>
void max_logits_cpu(const Tensor& q, const Tensor& k, const Tensor& cu_seqlens, const AttentionOptions& o,
                    uint32_t* running) {
  const int64_t hq = q.size(1), hkv = k.size(1), d = q.size(2), group = hq / hkv;
  const T* qd = q.data<T>();
  const T* kd = k.data<T>();
  const int32_t* cu = cu_seqlens.data<int32_t>();
  const double scale = scale_of(q, o);
  for (int64_t s = 0; s + 1 < cu_seqlens.size(0); ++s) {
    for (int64_t i = cu[s]; i < cu[s + 1]; ++i) {
      const int64_t first = o.window > 0 ? std::max<int64_t>(cu[s], i - o.window + 1) : cu[s];
      for (int64_t h = 0; h < hq; ++h) {
        const T* qi = qd + (i * hq + h) * d;
        double best = -INFINITY;
        for (int64_t j = first; j <= i; ++j) {
          const T* kj = kd + (j * hkv + h / group) * d;
          double dot = 0;
          for (int64_t c = 0; c < d; ++c) dot += static_cast<double>(qi[c]) * static_cast<double>(kj[c]);
          best = std::max(best, dot);
        }
        if (first <= i) running[h] = std::max(running[h], logit_key(static_cast<float>(best * scale)));
      }
    }
  }
}

}  // namespace

void attention_max_logits(const ExecContext& ctx, const Tensor& q, const Tensor& k, const Tensor& cu_seqlens, const AttentionOptions& options,
                          const Tensor& running) {
  const char* op = "attention_max_logits";
  KILN_OP_SCOPE(op, q);
  validate(op, q, k, cu_seqlens, running);
  auto* keys = static_cast<uint32_t*>(running.raw());
  KILN_ON_CUDA(q, op, {
    cuda::AttentionArgs a{};
    a.tokens = q.size(0), a.q_heads = q.size(1), a.kv_heads = k.size(1), a.head_dim = q.size(2);
    a.num_seqs = cu_seqlens.size(0) - 1;
    a.cu_seqlens = cu_seqlens.data<int32_t>();
    a.scale = static_cast<float>(scale_of(q, options));
    a.window = options.window;
    if (is_mixed(q))
      cuda::attention_max_logits_bf16(ctx, a, bf16_data(q), bf16_data(k), keys);
    else
      cuda::attention_max_logits_f32(ctx, a, q.data<float>(), k.data<float>(), keys);
  });
  dispatch_cpu_float(op, q.dtype(), [&](auto zero) {
    max_logits_cpu<decltype(zero)>(q, k, cu_seqlens, options, keys);
  });
}

void take_max_logits(const ExecContext& ctx, const Tensor& running, const Tensor& last) {
  const char* op = "take_max_logits";
  KILN_OP_SCOPE(op, running);
  expect_rank(op, "running", running, 1);
  expect_dtype(op, "running", running, DType::i32);
  expect_tensor(op, "last", last, running.shape(), DType::i32, running.device());
  auto* step = static_cast<uint32_t*>(running.raw());
  auto* kept = static_cast<uint32_t*>(last.raw());
  KILN_ON_CUDA(running, op, cuda::take_max_logits(ctx, step, running.numel(), kept));
  std::copy(step, step + running.numel(), kept);
  std::fill(step, step + running.numel(), 0u);
}

std::vector<float> read_max_logits(const ExecContext& ctx, const Tensor& running) {
  KILN_CHECK(running.defined() && running.rank() == 1 && running.dtype() == DType::i32, "read_max_logits",
             "expected i32 [heads] logit keys, got {}", running.describe());
  // The plain copy below is ordered only with the process-wide stream: wait for the
  // context's stream, which wrote the keys, first.
  if (running.device() == Device::cuda) synchronize_stream(ctx);
  OwnedTensor host(DType::i32, Device::cpu, running.shape());
  copy_tensor(running, *host);
  std::vector<float> out(static_cast<size_t>(running.numel()));
  const auto* keys = static_cast<const uint32_t*>(host->raw());
  for (size_t h = 0; h < out.size(); ++h) out[h] = logit_of_key(keys[h]);
  return out;
}

}  // namespace kiln::ops
