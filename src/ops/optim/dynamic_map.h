// The dynamic (tree) quantization maps of 8-bit AdamW (Dettmers et al. 2021, "8-bit
// Optimizers via Block-wise Quantization", after Dettmers 2016, "8-Bit Approximations for
// Parallelism in Deep Learning"). A code's bits after the sign are z zeros (the value's
// decade, 10^-z), a one (the indicator), and k fraction bits: the value is
// 10^-z (0.1 + 0.9 (j + 1) / 2^k) for fraction j, so each decade (10^-(z+1), 10^-z] gets
// 2^k evenly spaced values and small values keep their relative precision. The fraction
// values are the upper ends of their bins (the papers' linear fraction is not pinned down;
// bitsandbytes takes the midpoints): so 1 is a code and a block's largest element, which
// sets its absmax, comes back exact. All bits zero is 0.
//   signed   (m): a sign and 7 bits: 127 magnitudes in [1e-6, 1] each way, and +-0 (two
//                 codes, both 0): 256 codes.
//   unsigned (v): 8 bits: 255 magnitudes in [1e-7, 1] and 0.
// Tables are sorted ascending; a code is its index (ops/optim/adamw_lowmem_math.h has the
// nearest-code search the CPU and the GPU share).
#pragma once

#include <array>

namespace kiln::ops {

using DynamicMap = std::array<float, 256>;
const DynamicMap& signed_dynamic_map();
const DynamicMap& unsigned_dynamic_map();

}  // namespace kiln::ops
