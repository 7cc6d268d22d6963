// One element of AdamW on a bf16 master, shared by the CPU reference (adamw_bf16_master.cpp,
// compiled without contraction) and the CUDA kernel (adamw_bf16_master_cuda.cu).
#pragma once

#include "ops/optim/adamw_lowmem_math.h"
#include "ops/optim/stochastic_round.h"

namespace kiln::ops {

// p: the bf16 bit pattern; g already multiplied by the gradient scale; `index` the element's
// index in its parameter.
KILN_HOST_DEVICE inline void adamw_bf16_master_element(uint16_t& p, float g, float& m, float& v, float b1, float b2,
                                                       float eps, const adamw_lowmem::Factors& f, uint64_t stream,
                                                       uint64_t update, uint64_t index) {
  float w = bf16_bits_to_float(p);
  adamw_lowmem::update(w, g, m, v, b1, b2, eps, f);
  p = stochastic_round_bf16(w, rounding_bits(stream, update, index));
}

}  // namespace kiln::ops
