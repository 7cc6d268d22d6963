// The load diagnostics (ops/moe/load_stats.h): front ends and the CPU reference; the GPU's
// kernels are load_stats_cuda.h.
#include "ops/moe/load_stats.h"

#include "core/device_memory.h"
#include "core/op_profiler.h"
#include "ops/common.h"
#include "ops/moe/load_stats_cuda.h"

#include <algorithm>
#include <cmath>

namespace kiln::ops {

namespace {

void expect_counts(const char* op, const char* name, const Tensor& t, const Tensor& like) {
  expect_tensor(op, name, t, like.shape(), DType::i32, like.device());
}

void expect_sums(const char* op, const char* name, const Tensor& t, Device device) {
  expect_tensor(op, name, t, Shape{2}, DType::f64, device);
}

// A tensor's values on the host (a copy when it lives on the GPU).
OwnedTensor on_host(const Tensor& t) {
  OwnedTensor host(t.dtype(), Device::cpu, t.shape());
  copy_tensor(t, *host);
  return host;
}

}  // namespace

void moe_accumulate_counts(const ExecContext& ctx, const Tensor& counts, const Tensor& total) {
  const char* op = "moe_accumulate_counts";
  KILN_OP_SCOPE(op, counts);
  expect_rank(op, "counts", counts, 1);
  expect_counts(op, "counts", counts, counts);
  expect_counts(op, "total", total, counts);
  KILN_ON_CUDA(counts, op, cuda::add_counts(ctx, counts.data<int32_t>(), counts.numel(), total.data<int32_t>()));
  const int32_t* c = counts.data<int32_t>();
  int32_t* sum = total.data<int32_t>();
  for (int64_t e = 0; e < counts.numel(); ++e) sum[e] += c[e];
}

void routing_entropy_sum(const ExecContext& ctx, const Tensor& probs, const Tensor& sums) {
  const char* op = "routing_entropy_sum";
  KILN_OP_SCOPE(op, probs);
  expect_rank(op, "probs", probs, 2);
  expect_sums(op, "sums", sums, probs.device());
  KILN_ON_CUDA(probs, op, {
    expect_dtype(op, "probs", probs, DType::f32);
    cuda::routing_entropy_sum(ctx, probs.data<float>(), probs.size(0), probs.size(1), sums.data<double>());
  });
  dispatch_cpu_float(op, probs.dtype(), [&](auto zero) {
    using T = decltype(zero);
    double h = 0;
    for (int64_t i = 0; i < probs.numel(); ++i) {
      const double p = static_cast<double>(probs.data<T>()[i]);
      if (p > 0) h -= p * std::log(p);
    }
    sums.data<double>()[0] += h;
    sums.data<double>()[1] += static_cast<double>(probs.size(0));
  });
}

void moe_end_step(const ExecContext& ctx, const Tensor& counts, const Tensor& entropy, const Tensor& last_counts, const Tensor& last_entropy,
                  const Tensor& dead_steps) {
  const char* op = "moe_end_step";
  KILN_OP_SCOPE(op, counts);
  expect_rank(op, "counts", counts, 1);
  expect_counts(op, "counts", counts, counts);
  expect_counts(op, "last_counts", last_counts, counts);
  expect_counts(op, "dead_steps", dead_steps, counts);
  expect_sums(op, "entropy", entropy, counts.device());
  expect_sums(op, "last_entropy", last_entropy, counts.device());
  KILN_ON_CUDA(counts, op,
               cuda::moe_end_step(ctx, counts.data<int32_t>(), entropy.data<double>(), last_counts.data<int32_t>(),
                                  last_entropy.data<double>(), dead_steps.data<int32_t>(), counts.numel()));
  int32_t *c = counts.data<int32_t>(), *last = last_counts.data<int32_t>(), *dead = dead_steps.data<int32_t>();
  for (int64_t e = 0; e < counts.numel(); ++e) {
    dead[e] = c[e] == 0 ? dead[e] + 1 : 0;
    last[e] = c[e];
    c[e] = 0;
  }
  for (int i = 0; i < 2; ++i) {
    last_entropy.data<double>()[i] = entropy.data<double>()[i];
    entropy.data<double>()[i] = 0;
  }
}

void moe_take_counts(const ExecContext& ctx, const Tensor& counts, const Tensor& last) {
  const char* op = "moe_take_counts";
  KILN_OP_SCOPE(op, counts);
  expect_rank(op, "counts", counts, 1);
  expect_counts(op, "counts", counts, counts);
  expect_counts(op, "last", last, counts);
  KILN_ON_CUDA(counts, op, cuda::take_counts(ctx, counts.data<int32_t>(), counts.numel(), last.data<int32_t>()));
  int32_t *c = counts.data<int32_t>(), *l = last.data<int32_t>();
  for (int64_t i = 0; i < counts.numel(); ++i) l[i] = c[i], c[i] = 0;
}

int64_t moe_read_count(const ExecContext& ctx, const Tensor& counts) {
  expect_counts("moe_read_count", "counts", counts, counts);
  // on_host copies on the legacy stream, which a stream other than the process-wide one
  // does not wait for.
  if (counts.device() == Device::cuda) synchronize_stream(ctx);
  return on_host(counts)->data<int32_t>()[0];
}

MoeLoadReport moe_load_report(const ExecContext& ctx, const Tensor& last_counts, const Tensor& last_entropy, const Tensor& dead_steps) {
  const char* op = "moe_load_report";
  expect_rank(op, "last_counts", last_counts, 1);
  expect_counts(op, "dead_steps", dead_steps, last_counts);
  expect_sums(op, "last_entropy", last_entropy, last_counts.device());
  if (last_counts.device() == Device::cuda) synchronize_stream(ctx);  // as moe_read_count
  const OwnedTensor counts_host = on_host(last_counts), dead_host = on_host(dead_steps), entropy_host = on_host(last_entropy);
  const int32_t* counts = counts_host->data<int32_t>();
  const int32_t* dead = dead_host->data<int32_t>();
  const double* entropy = entropy_host->data<double>();
  const int64_t e_count = last_counts.numel();
  MoeLoadReport r;
  double mean = 0, sq = 0;
  for (int64_t j = 0; j < e_count; ++j) mean += counts[j];
  r.routed = mean;
  mean /= static_cast<double>(e_count);
  for (int64_t j = 0; j < e_count; ++j) {
    const double share = mean > 0 ? counts[j] / mean : 0.0;
    sq += (share - 1) * (share - 1);
    r.min = j == 0 ? share : std::min(r.min, share);
    r.max = j == 0 ? share : std::max(r.max, share);
    r.dead += counts[j] == 0;
    r.dead_steps_max = std::max<int64_t>(r.dead_steps_max, dead[j]);
  }
  r.cv = std::sqrt(sq / static_cast<double>(e_count));
  r.entropy = entropy[1] > 0 ? entropy[0] / entropy[1] : 0.0;
  return r;
}

}  // namespace kiln::ops
