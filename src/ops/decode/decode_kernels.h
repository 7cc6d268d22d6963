// The fused kernels of a decode step, which the modules' decoders (nn/decode.h) choose at
// construction in place of runs of op front-end calls. Each computes what the ops it
// replaces compute, with the same arithmetic and roundings (DecoderOptions::fuse = false
// runs those ops instead: the reference they are tested against). At decode batch sizes
// these kernels are latency-bound, a few microseconds each, so their count, not their
// bytes, is what a step pays for. Raw pointers on the stream, trusting their inputs; no
// CUDA headers here (definitions in decode_fused.cu, decode_attention.cu, decode_gemv.cu).
#pragma once

#include "core/dtype.h"
#include "core/exec_context.h"

#include <cstdint>

namespace kiln::cuda {

// dtype is the compute dtype (f32, or bf16 on the mixed path); gains and RoPE tables are
// fp32; enqueued on the stream.

// qkv [n, (hq + 2 hkv) hd] -> q [n, hq, hd], and k, v into the caches [slots, max_len, hkv,
// hd] at (slots[i], positions[i]): per-head RMSNorm of q and k with the gains (skipped when
// null) and RoPE of both with the tables [max_len, hd / 2] (skipped when null). Replaces
// qkv_split, rms_norm_forward x 2, rope_apply x 2 and kv_cache_write.
void qkv_to_cache(const ExecContext& ctx, DType dtype, const void* qkv, int64_t n, int64_t hq, int64_t hkv, int64_t hd, const float* q_gain,
                  const float* k_gain, float eps, const float* cos, const float* sin, const int32_t* slots,
                  const int32_t* positions, int64_t max_len, void* q, void* k_cache, void* v_cache);

// x (fp32 residual stream [n, d]) += branch ([n, d], dtype; skipped when null), then
// y = RMSNorm(x) * gain (dtype). Replaces add / add_inplace and rms_norm_forward.
void add_rms_norm(const ExecContext& ctx, DType dtype, float* x, const void* branch, const float* gain, float eps, int64_t n, int64_t d,
                  void* y);

// ---- a decode step's attention in one kernel (decode_attention.cu) --------------------
// For steps whose rows are distinct slots, bf16: qkv_to_cache, cached_attention_forward and
// its split merge as one kernel (one cluster of blocks per row and kv head), the cache
// written at each row's position as qkv_to_cache writes it; a head's sink
// (docs/attention-sinks.md) joins the softmax in the final merge, as in the merge it replaces.
struct DecodeAttentionArgs {
  int64_t rows, q_heads, kv_heads, head_dim, max_len;  // cache [slots, max_len, kv_heads, head_dim]
  const void* qkv;                                     // [rows, (q_heads + 2 kv_heads) head_dim] bf16
  const float* q_gain;                                 // q/k RMSNorm gains [head_dim] (null: no norm)
  const float* k_gain;
  float eps;
  const float* cos;  // RoPE tables [max_len, head_dim / 2] (null: no RoPE)
  const float* sin;
  const int32_t* slots;      // [rows], device, pairwise distinct
  const int32_t* positions;  // [rows], device
  float scale;
  int64_t window;  // 0 = unlimited
  float softcap;   // 0 = off
  void* k_cache;   // bf16
  void* v_cache;
  void* out;  // [rows, q_heads, head_dim] bf16
  const float* sinks = nullptr;  // [q_heads] f32: the heads' sink logits (null: none)
};

// Whether the kernel takes heads of this shape (groups of 1, 2, 4 or 8 query heads per kv
// head, head_dim 64, 128 or 256, group x head_dim <= 1024) on this GPU (sm_90 or later:
// it runs as thread-block clusters).
bool decode_attention_fits(int64_t q_heads, int64_t kv_heads, int64_t head_dim);

void decode_attention(const ExecContext& ctx, const DecodeAttentionArgs& args);

// ---- the decode step's projections (decode_gemv.cu) ----------------------------------
// bf16 weights W [n, k] (row-major, 16-byte aligned), up to 8 rows; fp32 residual stream.
// Each computes what the ops it replaces compute from the same inputs (the RMSNorm with
// add_rms_norm's arithmetic; bf16 roundings where those ops store bf16), the products in
// another summation order than cuBLASLt's. Enqueued on the stream.

// Whether steps of m rows with reduction length k (hidden, heads x head_dim, ffn_hidden)
// fit the kernel (m <= 8, k a multiple of 8, the rows within shared memory).
bool decode_gemv_fits(int64_t m, int64_t k);

// out [m, n] (f32 or bf16) = bf16(RMSNorm(x) * gain) W^T, x fp32 [m, k]: a block's q|k|v
// projection or the LM head after the norm before it.
void norm_gemv(const ExecContext& ctx, DType out_dtype, const float* x, const float* gain, float eps, int64_t m, int64_t k, const void* w,
               int64_t n, void* out);

// x [m, n] += bf16(a W^T), a bf16 [m, k]: the o and down projections with the residual add.
void gemv_add_residual(const ExecContext& ctx, const void* a, int64_t m, int64_t k, const void* w, int64_t n, float* x);

// act [m, f] (bf16) = silu(g) * u with g | u = bf16(RMSNorm(x) * gain) W^T, W [2f, k] the
// gate rows then the up rows: the MLP's norm, gate|up projection and SwiGLU.
void norm_gemv_swiglu(const ExecContext& ctx, const float* x, const float* gain, float eps, int64_t m, int64_t k, const void* w, int64_t f,
                      void* act);

}  // namespace kiln::cuda
