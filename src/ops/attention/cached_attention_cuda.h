// CUDA kernels of the KV-cache ops (ops/attention/cached_attention.h): fp32, and bf16 on
// the mixed path (bf16 cache, q and out; scores, softmax and accumulation in fp32).
//
// Attention runs one block per (row, kv head, tile of up to kHeadTile query heads sharing
// it, split of the row's positions). A split is a contiguous range of the positions the
// row sees; its warps walk the range a few positions at a time with an online softmax,
// then the block merges its warps. (Head dims of 64, 128 and 256 run a one-warp block
// instead that scores 32 positions at a time, one per lane: the same items, splits and
// outputs, several times fewer instructions; see warp_attention_kernel.) With one split the
// block writes the output; with more,
// each writes (max, sum, unnormalized accumulator) into a workspace and a second kernel
// merges the splits. A head's sink (docs/attention-sinks.md) joins the softmax where the
// output is normalized: in the block that writes it, or in the merge. The split count depends on shapes only (rows, heads, the cache's
// max_len), never on positions, which live on the device: a captured decode step stays
// valid whatever positions it is replayed with. Each split's length is derived on the
// device from the row's position, so short contexts use fewer, full splits.
//
// These launch on the context's stream, neither synchronize nor allocate (a decode step is
// captured as a CUDA graph), and trust their inputs (the front end validates; slots and
// positions are device data nobody checks here).
#pragma once

#include "core/dtype.h"
#include "core/exec_context.h"

#include <algorithm>
#include <cstdint>

namespace kiln::cuda {

inline constexpr int64_t kHeadTile = 4;        // query heads of one kv head per block
inline constexpr int64_t kMinSplitLen = 32;    // positions of a split, at least
inline constexpr int64_t kTargetBlocks = 528;  // ~4 blocks per SM of an H100/H200 (132 SMs)

// Splits of each row's positions: enough blocks to fill the GPU at decode batch sizes,
// one when the rows alone do.
inline int64_t cached_attention_splits(int64_t rows, int64_t q_heads, int64_t kv_heads, int64_t max_len) {
  const int64_t tiles = (q_heads / kv_heads + kHeadTile - 1) / kHeadTile;
  const int64_t blocks = rows * kv_heads * tiles;
  if (blocks >= kTargetBlocks) return 1;
  const int64_t most = std::max<int64_t>(1, (max_len + kMinSplitLen - 1) / kMinSplitLen);
  return std::clamp<int64_t>(kTargetBlocks / blocks, 1, most);
}

// f32 elements of the split workspace: [rows, q_heads, splits, head_dim + 2] holding each
// split's (max, sum, accumulator); 0 when one split suffices.
inline int64_t cached_attention_workspace_elems(int64_t rows, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                                int64_t max_len) {
  const int64_t splits = cached_attention_splits(rows, q_heads, kv_heads, max_len);
  return splits > 1 ? rows * q_heads * splits * (head_dim + 2) : 0;
}

struct CachedAttentionArgs {
  int64_t rows, q_heads, kv_heads, head_dim, max_len;  // cache [slots, max_len, kv_heads, head_dim]
  const int32_t* slots;                                // [rows], device
  const int32_t* positions;                            // [rows], device
  float scale;
  int64_t window;  // 0 = unlimited
  float softcap;   // 0 = off
  const float* sinks = nullptr;  // [q_heads] f32, device: the heads' sink logits (null: none)
};

// k/v [rows, row_elems] (row_elems = kv_heads * head_dim) into the caches at
// (slots[i], positions[i]); dtype f32 or bf16 (all four tensors share it).
void kv_cache_write(const ExecContext& ctx, const void* k, const void* v, DType dtype, const int32_t* slots, const int32_t* positions,
                    int64_t rows, int64_t row_elems, int64_t max_len, void* k_cache, void* v_cache);

// q, out [rows, q_heads, head_dim]; dtype f32 or bf16. workspace holds workspace_elems f32
// (at least cached_attention_workspace_elems(...) to split, else one split is used).
void cached_attention_forward(const ExecContext& ctx, const CachedAttentionArgs& a, DType dtype, const void* q, const void* k_cache,
                              const void* v_cache, void* out, float* workspace, int64_t workspace_elems);

}  // namespace kiln::cuda
