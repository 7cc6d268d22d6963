// AdamW on bf16 masters on the GPU (declared in adamw_bf16_master.h): one launch per tensor,
// one element per thread of a grid-stride loop, the arithmetic of adamw_bf16_master_math.h
// (the bits of the CPU reference).
#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "ops/grid_stride.cuh"
#include "ops/optim/adamw_bf16_master.h"
#include "ops/optim/adamw_bf16_master_math.h"

namespace kiln::cuda {

namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ void update_tensor(const AdamWBf16MasterArgs& t, float grad_scale, float b1, float b2,
                                              float eps, const adamw_lowmem::Factors& f, uint64_t update) {
  KILN_GRID_STRIDE(i, t.n)
  ops::adamw_bf16_master_element(t.p[i], __fmul_rn(t.g[i], grad_scale), t.m[i], t.v[i], b1, b2, eps, f, t.stream,
                                 update, static_cast<uint64_t>(t.index_base + i));
}

__global__ void adamw_bf16_master_kernel(AdamWBf16MasterArgs t, float lr, float b1, float b2, float eps, float bc1,
                                         float bc2, int64_t update) {
  update_tensor(t, 1.0f, b1, b2, eps, adamw_lowmem::factors(lr, t.weight_decay, bc1, bc2),
                static_cast<uint64_t>(update));
}

__global__ void adamw_bf16_master_device_kernel(AdamWBf16MasterArgs t, float b1, float b2, float eps,
                                                const ops::DeviceUpdateScalars* scalars, int group) {
  if (scalars->skip != 0) return;
  const ops::GroupUpdateScalars& g = scalars->group[group];
  update_tensor(t, scalars->grad_scale, b1, b2, eps,
                adamw_lowmem::factors(g.lr, t.weight_decay, g.bias_correction1, g.bias_correction2), g.update);
}

}  // namespace

void adamw_bf16_master_update(const ExecContext& ctx, const AdamWBf16MasterArgs& t, float lr, float beta1, float beta2,
                              float eps, float bc1, float bc2, int64_t update) {
  if (t.n == 0) return;
  adamw_bf16_master_kernel<<<blocks_for(t.n, kThreads), kThreads, 0, stream(ctx)>>>(t, lr, beta1, beta2, eps, bc1,
                                                                                   bc2, update);
  check_launch("adamw_bf16_master", "adamw_bf16_master_kernel");
}

void adamw_bf16_master_update_on_device(const ExecContext& ctx, const AdamWBf16MasterArgs& t, float beta1, float beta2,
                                        float eps, const ops::DeviceUpdateScalars* scalars, int group) {
  if (t.n == 0) return;
  adamw_bf16_master_device_kernel<<<blocks_for(t.n, kThreads), kThreads, 0, stream(ctx)>>>(t, beta1, beta2, eps,
                                                                                          scalars, group);
  check_launch("adamw_bf16_master", "adamw_bf16_master_device_kernel");
}

}  // namespace kiln::cuda
