// The MLA mixer's head-width change on the GPU (declared in mla_heads_cuda.h): a thread per
// destination element, grid-stride, reading its source column or writing zero.
#include "ops/mla/mla_heads_cuda.h"

#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "core/error.h"

#include <cstdint>

namespace kiln::cuda {

namespace {

constexpr int kThreads = 256;

template <typename Bits>
__global__ void copy_heads_kernel(const Bits* __restrict__ src, int64_t rows, int64_t a, int64_t b,
                                  Bits* __restrict__ dst) {
  const int64_t total = rows * b;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = i / b, j = i % b;
    dst[i] = j < a ? src[r * a + j] : Bits(0);
  }
}

}  // namespace

void mla_copy_heads(const ExecContext& ctx, int64_t element_bytes, const void* src, int64_t rows, int64_t a,
                    int64_t b, void* dst) {
  if (rows * b == 0) return;
  const unsigned blocks = blocks_for(rows * b, kThreads);
  if (element_bytes == 4)
    copy_heads_kernel<uint32_t><<<blocks, kThreads, 0, stream(ctx)>>>(static_cast<const uint32_t*>(src), rows, a, b,
                                                                       static_cast<uint32_t*>(dst));
  else if (element_bytes == 2)
    copy_heads_kernel<uint16_t><<<blocks, kThreads, 0, stream(ctx)>>>(static_cast<const uint16_t*>(src), rows, a, b,
                                                                       static_cast<uint16_t*>(dst));
  else
    fail("mla_copy_heads", "elements of {} bytes (f32 or bf16 only on the GPU)", element_bytes);
  check_launch("mla_copy_heads", "copy_heads_kernel");
}

}  // namespace kiln::cuda
