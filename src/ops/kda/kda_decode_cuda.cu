// The KDA mixer's decode kernels (declared in kda_decode_cuda.h).
//
// Short convolution: a thread per channel walks the step's rows in order, so a slot's later
// row reads what its earlier row left in the state. The sum runs over the kernel's taps
// oldest first, as the sequence kernel's (kda_mixer_cuda.cu), so a decoded row gets the
// full forward's value.
//
// Delta rule: the sequence kernel's block layout and step (kda_recurrent_step.cuh), one
// block per (d_v slice, head, row) when the rows are distinct slots, else per (d_v slice,
// head) walking every row in order. Each row loads its slot's slice of the state from
// global memory, steps, reads out, and stores it back; the thread that stores an element
// is the one that loads it for the next row, so no barrier is needed between rows.
#include "ops/kda/kda_decode_cuda.h"

#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "core/error.h"
#include "ops/bf16_vector.cuh"
#include "ops/kda/kda_recurrent_step.cuh"

#include <cuda_bf16.h>

#include <cstdint>

namespace kiln::cuda {

namespace {

using namespace kda_step;

__device__ __forceinline__ float sigmoidf(float z) {
  return z >= 0.f ? 1.f / (1.f + expf(-z)) : expf(z) / (1.f + expf(z));
}

template <typename T>
__global__ void conv_step_kernel(const T* x, const T* w, const int32_t* slots, int64_t n, int64_t ch, int64_t K,
                                 T* state, T* y) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= ch) return;
  const int64_t held = K - 1;
  for (int64_t i = 0; i < n; ++i) {
    T* past = state + slots[i] * held * ch;
    const T xi = x[i * ch + c];
    float z = 0.f;
    for (int64_t j = 0; j < held; ++j) z += to_f32(w[c * K + j]) * to_f32(past[j * ch + c]);
    z += to_f32(w[c * K + held]) * to_f32(xi);
    from_f32(z * sigmoidf(z), y + i * ch + c);
    for (int64_t j = 0; j + 1 < held; ++j) past[j * ch + c] = past[(j + 1) * ch + c];
    if (held > 0) past[(held - 1) * ch + c] = xi;
  }
}

template <typename T, int R>
__global__ void __launch_bounds__(kThreads) decode_step_kernel(KdaArgs s, const T* q, const T* k, const T* v,
                                                               const T* g, const T* beta, const int32_t* slots,
                                                               bool distinct, float* states, T* out) {
  constexpr int C = kRegs / R;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t h = blockIdx.y, H = s.heads;
  const int64_t j0 = blockIdx.x * int64_t{kWarps * C} + warp * C;
  const int64_t first = distinct ? blockIdx.z : 0, last = distinct ? first + 1 : s.tokens;
  float S[R][C], w[C];
  for (int64_t i = first; i < last; ++i) {
    float* state = states + (int64_t{slots[i]} * H + h) * s.dk * s.dv;
    load_state<R, C>(s, state, lane, j0, S);
    const int64_t row = i * H + h;
    Token<T, R, C> x;
    x.load(s, q, k, v, g, beta, row, lane, j0);
    step(x, S, w);
    read_out(s, x, S, lane, j0, out + row * s.dv);
    store_state<R, C>(s, state, lane, j0, S);
  }
}

}  // namespace

void short_conv_step(const ExecContext& ctx, DType dtype, const void* x, const void* w, const int32_t* slots,
                     int64_t n, int64_t ch, int64_t kernel, void* state, void* y) {
  if (n == 0 || ch == 0) return;
  const int threads = 128;
  if (dtype == DType::f32)
    conv_step_kernel<float><<<blocks_for(ch, threads), threads, 0, stream(ctx)>>>(
        static_cast<const float*>(x), static_cast<const float*>(w), slots, n, ch, kernel, static_cast<float*>(state),
        static_cast<float*>(y));
  else
    conv_step_kernel<bf16><<<blocks_for(ch, threads), threads, 0, stream(ctx)>>>(
        static_cast<const bf16*>(x), static_cast<const bf16*>(w), slots, n, ch, kernel, static_cast<bf16*>(state),
        static_cast<bf16*>(y));
  check_launch("short_conv_step", "conv_step_kernel");
}

void kda_decode_step(const ExecContext& ctx, const KdaArgs& a, const void* q, const void* k, const void* v,
                     const void* g, const void* beta, const int32_t* slots, bool distinct_slots, float* states,
                     void* out) {
  if (a.tokens == 0 || a.heads == 0 || a.dv == 0) return;
  dispatch("kda_decode_step", a.dtype, a.dk, [&]<typename T, int R>() {
    const dim3 grid(static_cast<unsigned>(slices(a.dk, a.dv)), static_cast<unsigned>(a.heads),
                    distinct_slots ? static_cast<unsigned>(a.tokens) : 1u);
    decode_step_kernel<T, R><<<grid, kThreads, 0, stream(ctx)>>>(
        a, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), static_cast<const T*>(g),
        static_cast<const T*>(beta), slots, distinct_slots, states, static_cast<T*>(out));
    check_launch("kda_decode_step", "decode_step_kernel");
  });
}

}  // namespace kiln::cuda
