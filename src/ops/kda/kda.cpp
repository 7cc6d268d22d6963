#include "ops/kda/kda.h"

#include "core/op_profiler.h"
#include "ops/common.h"
#include "ops/kda/kda_cpu.h"
#if KILN_WITH_CUDA
#include "ops/kda/kda_chunked_cuda.h"
#include "ops/kda/kda_cuda.h"
#endif

#include <cmath>
#include <string>
#include <tuple>
#include <utility>

namespace kiln::ops {

namespace {

// q, k, g [N, H, d_k], v [N, H, d_v], beta [N, H], all float tensors of q's dtype (f32 or
// bf16 on the GPU), cu_seqlens i32 [S+1] from 0 to N on q's device. The GPU's cu_seqlens
// is not read back to check its values (as attention's): the caller vouches for them.
void validate(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
              const Tensor& cu_seqlens) {
  expect_rank(op, "q", q, 3);
  expect_rank(op, "v", v, 3);
  if (q.device() == Device::cuda) {
    KILN_CHECK(q.dtype() == DType::f32 || q.dtype() == DType::bf16, op, "q must be f32 or bf16 on the GPU, got {}",
               q.describe());
  }
  expect_shape(op, "k", k, q.shape());
  expect_shape(op, "g", g, q.shape());
  KILN_CHECK(v.size(0) == q.size(0) && v.size(1) == q.size(1), op, "v {} and q {} disagree", v.describe(), q.describe());
  expect_shape(op, "beta", beta, Shape{q.size(0), q.size(1)});
  for (const auto& [name, t] : {std::pair{"k", &k}, {"v", &v}, {"g", &g}, {"beta", &beta}}) expect_same(op, name, *t, q);
  expect_rank(op, "cu_seqlens", cu_seqlens, 1);
  expect_dtype(op, "cu_seqlens", cu_seqlens, DType::i32);
  KILN_CHECK(cu_seqlens.device() == q.device(), op, "cu_seqlens must be on {}, got {}", device_name(q.device()),
             cu_seqlens.describe());
  const int64_t s = cu_seqlens.size(0) - 1;
  KILN_CHECK(s >= 1, op, "cu_seqlens needs at least 2 entries");
  if (cu_seqlens.device() == Device::cuda) return;
  const int32_t* cu = cu_seqlens.data<int32_t>();
  KILN_CHECK(cu[0] == 0 && cu[s] == q.size(0), op, "cu_seqlens must run from 0 to {} tokens, got {}..{}", q.size(0),
             cu[0], cu[s]);
  for (int64_t i = 0; i < s; ++i) KILN_CHECK(cu[i] <= cu[i + 1], op, "cu_seqlens must not decrease (entry {})", i + 1);
}

// A per-sequence state [S, H, d_k, d_v] of q's dtype (f32 on the GPU), or undefined.
void validate_state(const char* op, const char* name, const Tensor& state, const Tensor& q, const Tensor& v,
                    const Tensor& cu_seqlens) {
  if (!state.defined()) return;
  const Shape shape{cu_seqlens.size(0) - 1, q.size(1), q.size(2), v.size(2)};
  if (q.device() == Device::cuda)
    expect_tensor(op, name, state, shape, DType::f32, Device::cuda);
  else {
    expect_shape(op, name, state, shape);
    expect_same(op, name, state, q);
  }
}

// The backward's arguments: the forward's, the states' gradients and dout, dq, dk, dv, dg,
// dbeta shaped as their primals.
void validate_backward(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                       const Tensor& beta, const Tensor& cu_seqlens, const Tensor& initial_state, const Tensor& dout,
                       const Tensor& d_final_state, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                       const Tensor& dg, const Tensor& dbeta, const Tensor& d_initial_state) {
  validate(op, q, k, v, g, beta, cu_seqlens);
  validate_state(op, "initial_state", initial_state, q, v, cu_seqlens);
  validate_state(op, "d_final_state", d_final_state, q, v, cu_seqlens);
  validate_state(op, "d_initial_state", d_initial_state, q, v, cu_seqlens);
  for (const auto& [name, t, like] : {std::tuple{"dout", &dout, &v}, {"dq", &dq, &q}, {"dk", &dk, &k},
                                      {"dv", &dv, &v}, {"dg", &dg, &g}, {"dbeta", &dbeta, &beta}}) {
    expect_shape(op, name, *t, like->shape());
    expect_same(op, name, *t, q);
  }
}

#if KILN_WITH_CUDA
cuda::KdaArgs cuda_args(const Tensor& q, const Tensor& v, const Tensor& cu, const KdaOptions& o) {
  cuda::KdaArgs a;
  a.tokens = q.size(0);
  a.heads = q.size(1);
  a.dk = q.size(2);
  a.dv = v.size(2);
  a.num_seqs = cu.size(0) - 1;
  a.cu_seqlens = cu.data<int32_t>();
  a.scale = static_cast<float>(o.scale > 0 ? o.scale : 1.0 / std::sqrt(static_cast<double>(a.dk)));
  a.dtype = q.dtype();
  a.slice = o.gpu_slice;
  a.tensor_cores = o.gpu_tensor_cores;
  a.bf16_grads = o.gpu_bf16_grads;
  return a;
}

#endif

// The f32 cuda workspace of at least `need` elements a GPU kernel takes.
void expect_workspace(const char* op, const char* sizer, const Tensor& workspace, int64_t need) {
  KILN_CHECK(workspace.defined() && workspace.dtype() == DType::f32 && workspace.device() == Device::cuda &&
                 workspace.numel() >= need,
             op, "needs an f32 cuda workspace of at least {} elements ({}), got {}", need, sizer,
             workspace.defined() ? workspace.describe() : std::string("none"));
}

// The chunked GPU kernels' limits, checked before they launch.
void expect_chunked_gpu(const char* op, const Tensor& q, const KdaOptions& options) {
  if (q.device() != Device::cuda) return;
  KILN_CHECK(options.chunk == 64, op, "the GPU kernels take chunk 64, got {}", options.chunk);
  KILN_CHECK(options.gpu_slice == 0 || options.gpu_slice == 8 || options.gpu_slice == 16 || options.gpu_slice == 32,
             op, "gpu_slice must be 0, 8, 16 or 32, got {}", options.gpu_slice);
  KILN_CHECK(q.size(2) <= kda_chunked_max_dk(), op, "the GPU kernels take d_k up to {}, got {}", kda_chunked_max_dk(),
             q.size(2));
}

cpu::KdaShape shape_of(const Tensor& q, const Tensor& v, const Tensor& cu, const KdaOptions& o) {
  cpu::KdaShape s;
  s.tokens = q.size(0);
  s.heads = q.size(1);
  s.dk = q.size(2);
  s.dv = v.size(2);
  s.num_seqs = cu.size(0) - 1;
  s.cu_seqlens = cu.data<int32_t>();
  s.scale = o.scale > 0 ? o.scale : 1.0 / std::sqrt(static_cast<double>(s.dk));
  s.chunk = o.chunk;
  return s;
}

template <typename T>
const T* maybe(const Tensor& t) {
  return t.defined() ? t.data<T>() : nullptr;
}

template <typename T>
T* maybe_mut(const Tensor& t) {
  return t.defined() ? t.data<T>() : nullptr;
}

}  // namespace

void kda_recurrent_forward(const ExecContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                           const Tensor& beta, const Tensor& cu_seqlens, const Tensor& initial_state,
                           const KdaOptions& options, const Tensor& out, const Tensor& final_state) {
  const char* op = "kda_recurrent_forward";
  KILN_OP_SCOPE(op, q);
  validate(op, q, k, v, g, beta, cu_seqlens);
  validate_state(op, "initial_state", initial_state, q, v, cu_seqlens);
  validate_state(op, "final_state", final_state, q, v, cu_seqlens);
  expect_shape(op, "out", out, v.shape());
  expect_same(op, "out", out, q);
  KILN_ON_CUDA(q, op,
               cuda::kda_recurrent_forward(ctx, cuda_args(q, v, cu_seqlens, options), q.raw(), k.raw(), v.raw(), g.raw(),
                                           beta.raw(), initial_state.data_or_null<float>(), out.raw(),
                                           final_state.data_or_null<float>()));
  dispatch_cpu_float(op, q.dtype(), [&](auto zero) {
    using T = decltype(zero);
    cpu::kda_recurrent_forward<T>(shape_of(q, v, cu_seqlens, options), q.data<T>(), k.data<T>(), v.data<T>(),
                                  g.data<T>(), beta.data<T>(), maybe<T>(initial_state), out.data<T>(),
                                  maybe_mut<T>(final_state));
  });
}

void kda_chunked_forward(const ExecContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                         const Tensor& beta, const Tensor& cu_seqlens, const Tensor& initial_state,
                         const KdaOptions& options, const Tensor& out, const Tensor& final_state,
                         const Tensor& workspace) {
  const char* op = "kda_chunked_forward";
  KILN_OP_SCOPE(op, q);
  validate(op, q, k, v, g, beta, cu_seqlens);
  validate_state(op, "initial_state", initial_state, q, v, cu_seqlens);
  validate_state(op, "final_state", final_state, q, v, cu_seqlens);
  expect_shape(op, "out", out, v.shape());
  expect_same(op, "out", out, q);
  KILN_CHECK(options.chunk >= 1, op, "chunk must be at least 1, got {}", options.chunk);
  expect_chunked_gpu(op, q, options);
  if (q.device() == Device::cuda && KILN_WITH_CUDA)
    expect_workspace(op, "kda_chunked_workspace", workspace,
                     kda_chunked_workspace(q.size(0), q.size(1), q.size(2), v.size(2), cu_seqlens.size(0) - 1));
  KILN_ON_CUDA(q, op,
               cuda::kda_chunked_forward(ctx, cuda_args(q, v, cu_seqlens, options), q.raw(), k.raw(), v.raw(), g.raw(),
                                         beta.raw(), initial_state.data_or_null<float>(), out.raw(),
                                         final_state.data_or_null<float>(), workspace.data<float>()));
  dispatch_cpu_float(op, q.dtype(), [&](auto zero) {
    using T = decltype(zero);
    cpu::kda_chunked_forward<T>(shape_of(q, v, cu_seqlens, options), q.data<T>(), k.data<T>(), v.data<T>(),
                                g.data<T>(), beta.data<T>(), maybe<T>(initial_state), out.data<T>(),
                                maybe_mut<T>(final_state));
  });
}

int64_t kda_chunked_workspace(int64_t tokens, int64_t heads, int64_t dk, int64_t dv, int64_t num_seqs) {
#if KILN_WITH_CUDA
  return cuda::kda_chunked_workspace_elems(tokens, heads, dk, dv, num_seqs);
#else
  (void)tokens, (void)heads, (void)dk, (void)dv, (void)num_seqs;
  return 0;
#endif
}

int64_t kda_chunked_max_dk() {
#if KILN_WITH_CUDA
  return cuda::kKdaChunkedMaxDk;
#else
  return 0;
#endif
}

int64_t kda_backward_workspace(int64_t tokens, int64_t heads, int64_t dk, int64_t dv, int64_t num_seqs) {
#if KILN_WITH_CUDA
  return cuda::kda_backward_workspace_elems(tokens, heads, dk, dv, num_seqs);
#else
  (void)tokens, (void)heads, (void)dk, (void)dv, (void)num_seqs;
  return 0;
#endif
}

void kda_recurrent_backward(const ExecContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                            const Tensor& beta, const Tensor& cu_seqlens, const Tensor& initial_state,
                            const Tensor& dout, const Tensor& d_final_state, const KdaOptions& options, const Tensor& dq,
                            const Tensor& dk, const Tensor& dv, const Tensor& dg, const Tensor& dbeta,
                            const Tensor& d_initial_state, const Tensor& workspace) {
  const char* op = "kda_recurrent_backward";
  KILN_OP_SCOPE(op, q);
  validate_backward(op, q, k, v, g, beta, cu_seqlens, initial_state, dout, d_final_state, dq, dk, dv, dg, dbeta,
                    d_initial_state);
  if (q.device() == Device::cuda && KILN_WITH_CUDA)
    expect_workspace(op, "kda_backward_workspace", workspace,
                     kda_backward_workspace(q.size(0), q.size(1), q.size(2), v.size(2), cu_seqlens.size(0) - 1));
  KILN_ON_CUDA(q, op,
               cuda::kda_recurrent_backward(ctx, cuda_args(q, v, cu_seqlens, options), q.raw(), k.raw(), v.raw(),
                                            g.raw(), beta.raw(), initial_state.data_or_null<float>(), dout.raw(),
                                            d_final_state.data_or_null<float>(), dq.raw(), dk.raw(), dv.raw(), dg.raw(),
                                            dbeta.raw(), d_initial_state.data_or_null<float>(), workspace.data<float>()));
  dispatch_cpu_float(op, q.dtype(), [&](auto zero) {
    using T = decltype(zero);
    cpu::kda_recurrent_backward<T>(shape_of(q, v, cu_seqlens, options), q.data<T>(), k.data<T>(), v.data<T>(),
                                   g.data<T>(), beta.data<T>(), maybe<T>(initial_state), dout.data<T>(),
                                   maybe<T>(d_final_state), dq.data<T>(), dk.data<T>(), dv.data<T>(), dg.data<T>(),
                                   dbeta.data<T>(), maybe_mut<T>(d_initial_state));
  });
}

void kda_chunked_backward(const ExecContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                          const Tensor& beta, const Tensor& cu_seqlens, const Tensor& initial_state,
                          const Tensor& dout, const Tensor& d_final_state, const KdaOptions& options, const Tensor& dq,
                          const Tensor& dk, const Tensor& dv, const Tensor& dg, const Tensor& dbeta,
                          const Tensor& d_initial_state, const Tensor& workspace) {
  const char* op = "kda_chunked_backward";
  KILN_OP_SCOPE(op, q);
  validate_backward(op, q, k, v, g, beta, cu_seqlens, initial_state, dout, d_final_state, dq, dk, dv, dg, dbeta,
                    d_initial_state);
  KILN_CHECK(options.chunk >= 1, op, "chunk must be at least 1, got {}", options.chunk);
  expect_chunked_gpu(op, q, options);
  if (q.device() == Device::cuda && KILN_WITH_CUDA)
    expect_workspace(op, "kda_chunked_workspace", workspace,
                     kda_chunked_workspace(q.size(0), q.size(1), q.size(2), v.size(2), cu_seqlens.size(0) - 1));
  KILN_ON_CUDA(q, op,
               cuda::kda_chunked_backward(ctx, cuda_args(q, v, cu_seqlens, options), q.raw(), k.raw(), v.raw(),
                                          g.raw(), beta.raw(), initial_state.data_or_null<float>(), dout.raw(),
                                          d_final_state.data_or_null<float>(), dq.raw(), dk.raw(), dv.raw(), dg.raw(),
                                          dbeta.raw(), d_initial_state.data_or_null<float>(), workspace.data<float>()));
  dispatch_cpu_float(op, q.dtype(), [&](auto zero) {
    using T = decltype(zero);
    cpu::kda_chunked_backward<T>(shape_of(q, v, cu_seqlens, options), q.data<T>(), k.data<T>(), v.data<T>(),
                                 g.data<T>(), beta.data<T>(), maybe<T>(initial_state), dout.data<T>(),
                                 maybe<T>(d_final_state), dq.data<T>(), dk.data<T>(), dv.data<T>(), dg.data<T>(),
                                 dbeta.data<T>(), maybe_mut<T>(d_initial_state));
  });
}

}  // namespace kiln::ops
