// AdamW on bf16 master weights (optim.master_weights = "bf16"): no fp32 copy of a weight is
// kept; the update is computed in fp32 from the bf16 value, fp32 gradient and fp32 moments
// (the arithmetic of adamw_lowmem_math.h, the fp32 kernel's bits) and written back rounded
// to bf16 stochastically (stochastic_round.h), with random bits keyed by (the tensor's
// stream, the update number, the element's index in its parameter). The CPU form is the
// reference of the CUDA kernel, bit for bit.
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"
#include "ops/optim/adamw.h"
#include "ops/optim/update_scalars.h"

#include <cstdint>
#include <vector>

namespace kiln::ops {

struct AdamWBf16MasterTensor {
  Tensor param;  // bf16, the master itself
  Tensor grad, m, v;  // fp32, as many elements
  double weight_decay = 0;
  uint64_t stream = 0;     // rounding_stream(parameter name)
  int64_t index_base = 0;  // the first element's index in its parameter (a ZeRO piece's begin)
};

// One update of every tensor; `update` is its 1-based number (the rounding's counter).
void adamw_bf16_master_update_all(const ExecContext& ctx, const std::vector<AdamWBf16MasterTensor>& tensors,
                                  const AdamWStep& step, int64_t update);

// The GPU form with the scalars in device memory (a captured step): lr, bias corrections and
// the update number from scalars->group[group], gradients times scalars->grad_scale, nothing
// while scalars->skip is set.
void adamw_bf16_master_update_all_on_device(const ExecContext& ctx, const std::vector<AdamWBf16MasterTensor>& tensors,
                                            const AdamWStep& fixed, const DeviceUpdateScalars* scalars, int group);

// The CPU reference on host arrays (p: bf16 bit patterns), g already scaled.
void adamw_bf16_master_reference(uint16_t* p, const float* g, float* m, float* v, int64_t n, const AdamWStep& step,
                                 double weight_decay, uint64_t stream, int64_t update, int64_t index_base);

}  // namespace kiln::ops

namespace kiln::cuda {

struct AdamWBf16MasterArgs {
  uint16_t* p;
  const float* g;
  float* m;
  float* v;
  int64_t n;
  float weight_decay;
  uint64_t stream;
  int64_t index_base;
};
void adamw_bf16_master_update(const ExecContext& ctx, const AdamWBf16MasterArgs& t, float lr, float beta1, float beta2,
                              float eps, float bias_correction1, float bias_correction2, int64_t update);
void adamw_bf16_master_update_on_device(const ExecContext& ctx, const AdamWBf16MasterArgs& t, float beta1, float beta2,
                                        float eps, const ops::DeviceUpdateScalars* scalars, int group);

}  // namespace kiln::cuda
