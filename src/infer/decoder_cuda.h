// The GPU side of the Decoder (infer/decoder.h) that is not an op (its CUDA graphs are
// core/step_graphs.h): the greedy argmax of logits rows on the device (so a greedy step
// copies back one id per row instead of a row of logits), and the step's fused kernels. No CUDA headers here:
// decoder.cpp includes this in CUDA builds only (definitions in decoder_cuda.cu and
// decoder_fused.cu).
#pragma once

#include "core/dtype.h"

#include <cstdint>

namespace kiln::cuda {

// out[i] = the lowest index of the largest value of row i of logits [rows, vocab] (fp32,
// device), as the sampler's greedy pick (and torch.argmax). Enqueued on the stream.
void argmax_rows_f32(const float* logits, int64_t rows, int64_t vocab, int32_t* out);

// ---- fused kernels of a decode step ------------------------------------------------------
// Each replaces several op calls (DecoderOptions::fuse = false runs those ops instead: the
// reference) with the same arithmetic and roundings. dtype is the compute dtype (f32, or
// bf16 on the mixed path); gains and RoPE tables are fp32; enqueued on the stream.

// qkv [n, (hq + 2 hkv) hd] -> q [n, hq, hd], and k, v into the caches [slots, max_len, hkv,
// hd] at (slots[i], positions[i]): per-head RMSNorm of q and k with the gains (skipped when
// null) and RoPE of both with the tables [max_len, hd / 2] (skipped when null). Replaces
// qkv_split, rms_norm_forward x 2, rope_apply x 2 and kv_cache_write.
void qkv_to_cache(DType dtype, const void* qkv, int64_t n, int64_t hq, int64_t hkv, int64_t hd, const float* q_gain,
                  const float* k_gain, float eps, const float* cos, const float* sin, const int32_t* slots,
                  const int32_t* positions, int64_t max_len, void* q, void* k_cache, void* v_cache);

// x (fp32 residual stream [n, d]) += branch ([n, d], dtype; skipped when null), then
// y = RMSNorm(x) * gain (dtype). Replaces add / add_inplace and rms_norm_forward.
void add_rms_norm(DType dtype, float* x, const void* branch, const float* gain, float eps, int64_t n, int64_t d,
                  void* y);

// ---- the decode step's projections (infer/decode_gemv.cu) ----------------------------------
// bf16 weights W [n, k] (row-major, 16-byte aligned), up to 8 rows; fp32 residual stream.
// Each computes what the ops it replaces compute from the same inputs (the RMSNorm with
// add_rms_norm's arithmetic; bf16 roundings where those ops store bf16), the products in
// another summation order than cuBLASLt's. Enqueued on the stream.

// Whether steps of m rows with reduction length k (hidden, heads x head_dim, ffn_hidden)
// fit the kernel (m <= 8, k a multiple of 8, the rows within shared memory).
bool decode_gemv_fits(int64_t m, int64_t k);

// out [m, n] (f32 or bf16) = bf16(RMSNorm(x) * gain) W^T, x fp32 [m, k]: a block's q|k|v
// projection or the LM head after the norm before it.
void norm_gemv(DType out_dtype, const float* x, const float* gain, float eps, int64_t m, int64_t k, const void* w,
               int64_t n, void* out);

// x [m, n] += bf16(a W^T), a bf16 [m, k]: the o and down projections with the residual add.
void gemv_add_residual(const void* a, int64_t m, int64_t k, const void* w, int64_t n, float* x);

// act [m, f] (bf16) = silu(g) * u with g | u = bf16(RMSNorm(x) * gain) W^T, W [2f, k] the
// gate rows then the up rows: the MLP's norm, gate|up projection and SwiGLU.
void norm_gemv_swiglu(const float* x, const float* gain, float eps, int64_t m, int64_t k, const void* w, int64_t f,
                      void* act);

}  // namespace kiln::cuda
