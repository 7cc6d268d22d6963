#include "ops/kda/kda_decode.h"

#include "core/op_profiler.h"
#include "ops/common.h"
#include "ops/kda/kda_cpu.h"
#if KILN_WITH_CUDA
#include "ops/kda/kda_decode_cuda.h"
#endif

#include <cmath>
#include <utility>

namespace kiln::ops {

#if KILN_WITH_CUDA
namespace {

cuda::KdaArgs decode_args(const Tensor& q, const Tensor& v, const Tensor& states, double scale) {
  cuda::KdaArgs a{};
  a.tokens = q.size(0), a.heads = q.size(1), a.dk = q.size(2), a.dv = v.size(2);
  a.num_seqs = states.size(0);  // the slots; cu_seqlens is not used by the decode step
  a.cu_seqlens = nullptr;
  a.scale = static_cast<float>(scale);
  a.dtype = q.dtype();
  return a;
}

}  // namespace
#endif

void kda_decode_step(const ExecContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                     const Tensor& beta, const Tensor& slots, bool distinct_slots, const KdaOptions& options,
                     const Tensor& states, const Tensor& out) {
  (void)ctx, (void)distinct_slots;  // CPU builds: only the CUDA path reads them
  const char* op = "kda_decode_step";
  KILN_OP_SCOPE(op, q);
  expect_rank(op, "q", q, 3);
  expect_rank(op, "v", v, 3);
  const bool gpu = q.device() == Device::cuda;
  if (gpu)
    KILN_CHECK(q.dtype() == DType::f32 || q.dtype() == DType::bf16, op, "q must be f32 or bf16 on the GPU, got {}",
               q.describe());
  const int64_t n = q.size(0), heads = q.size(1), dk = q.size(2), dv = v.size(2);
  expect_shape(op, "k", k, q.shape());
  expect_shape(op, "g", g, q.shape());
  expect_shape(op, "v", v, Shape{n, heads, dv});
  expect_shape(op, "beta", beta, Shape{n, heads});
  expect_shape(op, "out", out, v.shape());
  for (const auto& [name, t] : {std::pair{"k", &k}, {"v", &v}, {"g", &g}, {"beta", &beta}, {"out", &out}})
    expect_same(op, name, *t, q);
  expect_tensor(op, "slots", slots, Shape{n}, DType::i32, q.device());
  expect_rank(op, "states", states, 4);
  KILN_CHECK(states.size(1) == heads && states.size(2) == dk && states.size(3) == dv, op,
             "states {} must be [slots, {}, {}, {}]", states.describe(), heads, dk, dv);
  if (gpu)
    expect_dtype(op, "states", states, DType::f32);
  else
    expect_dtype(op, "states", states, q.dtype());
  KILN_CHECK(states.device() == q.device(), op, "states must be on {}, got {}", device_name(q.device()),
             states.describe());
  const double scale = options.scale > 0 ? options.scale : 1.0 / std::sqrt(static_cast<double>(dk));
  KILN_ON_CUDA(q, op,
               cuda::kda_decode_step(ctx, decode_args(q, v, states, scale), q.raw(), k.raw(), v.raw(), g.raw(),
                                     beta.raw(), slots.data<int32_t>(), distinct_slots, states.data<float>(),
                                     out.raw()));
  dispatch_cpu_float(op, q.dtype(), [&](auto zero) {
    using T = decltype(zero);
    // Each row as a one-token sequence starting from its slot's state and ending in it
    // (the recurrence copies the state in before it writes it back).
    const int32_t one[2] = {0, 1};
    const int32_t* slot = slots.data<int32_t>();
    cpu::KdaShape s{1, heads, dk, dv, 1, one, scale, options.chunk};
    const int64_t state_size = heads * dk * dv;
    for (int64_t i = 0; i < n; ++i) {
      KILN_CHECK(slot[i] >= 0 && slot[i] < states.size(0), op, "row {}: slot {} outside the states' {}", i, slot[i],
                 states.size(0));
      T* st = states.data<T>() + slot[i] * state_size;
      cpu::kda_recurrent_forward<T>(s, q.data<T>() + i * heads * dk, k.data<T>() + i * heads * dk,
                                    v.data<T>() + i * heads * dv, g.data<T>() + i * heads * dk,
                                    beta.data<T>() + i * heads, st, out.data<T>() + i * heads * dv, st);
    }
  });
}

}  // namespace kiln::ops
