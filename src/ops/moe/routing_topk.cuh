// The routers' shared device pieces (routing_cuda.cu, routing_balanced_cuda.cu,
// routing_relu_cuda.cu): a warp per token row, eight rows per 256-thread block; a row's E
// values in registers, kPer = E / 32 rounded up to a power of two per lane (expert j at
// lane j % 32, slot j / 32); the top k in k rounds of a warp argmax (the larger key, equal
// keys the lower id), so every lane knows each round's winner.
#pragma once

#include "core/error.h"
#include "ops/block_reduce.cuh"
#include "ops/moe/routing_cuda.h"

#include <climits>

namespace kiln::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kWarpSize;
constexpr unsigned kFull = 0xffffffffu;

// ---- the top-k rounds ---------------------------------------------------------------------

// A candidate: its key, its expert id and (for sigmoid_bias) its score.
struct Candidate {
  float key;
  int id;
  float score;
};

__device__ __forceinline__ bool better(const Candidate& a, const Candidate& b) {
  return a.key > b.key || (a.key == b.key && a.id < b.id);
}

__device__ __forceinline__ Candidate none() { return {-INFINITY, INT_MAX, 0.0f}; }

// The warp's best candidate, on every lane (a total order: every lane meets the same one).
__device__ __forceinline__ Candidate warp_best(Candidate c) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const Candidate o{__shfl_xor_sync(kFull, c.key, offset), __shfl_xor_sync(kFull, c.id, offset),
                      __shfl_xor_sync(kFull, c.score, offset)};
    if (better(o, c)) c = o;
  }
  return c;
}

// This lane's best among its slots in `eligible` (bit i: slot i), keys and scores in
// registers; slot i holds expert lane + 32 i.
template <int kPer>
__device__ __forceinline__ Candidate lane_best(const float (&key)[kPer], const float (&score)[kPer], uint32_t eligible,
                                               int lane) {
  Candidate best = none();
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const Candidate c{key[i], lane + kWarpSize * i, score[i]};
    if ((eligible >> i & 1u) && better(c, best)) best = c;
  }
  return best;
}

// Slots of this lane that hold one of the e_count experts.
template <int kPer>
__device__ __forceinline__ uint32_t valid_slots(int lane, int64_t e_count) {
  uint32_t mask = 0;
#pragma unroll
  for (int i = 0; i < kPer; ++i)
    if (lane + kWarpSize * i < e_count) mask |= 1u << i;
  return mask;
}

// k rounds over `eligible` slots: experts[r] and their scores (or keys, for softmax:
// key = score) land on lane r % 32 at slot r / 32; the chosen scores' sum in choice order.
template <int kPer>
__device__ __forceinline__ float choose_top_k(const float (&key)[kPer], const float (&score)[kPer], uint32_t eligible,
                                              int64_t k, int lane, int (&my_id)[kPer], float (&my_score)[kPer]) {
  float chosen = 0.0f;
  for (int64_t r = 0; r < k; ++r) {
    const Candidate best = warp_best(lane_best(key, score, eligible, lane));
    if (best.id % kWarpSize == lane) eligible &= ~(1u << (best.id / kWarpSize));
    chosen += best.score;
#pragma unroll
    for (int i = 0; i < kPer; ++i)
      if (r == lane + kWarpSize * i) my_id[i] = best.id, my_score[i] = best.score;
  }
  return chosen;
}

// ---- launches -----------------------------------------------------------------------------

unsigned row_blocks(int64_t rows) { return static_cast<unsigned>((rows + kWarps - 1) / kWarps); }

// Calls launch.template operator()<kPer>() with the per-lane slots E needs.
template <typename Launch>
void by_width(int64_t e_count, Launch&& launch) {
  if (e_count <= 32) return launch.template operator()<1>();
  if (e_count <= 64) return launch.template operator()<2>();
  if (e_count <= 128) return launch.template operator()<4>();
  if (e_count <= 256) return launch.template operator()<8>();
  if (e_count <= 512) return launch.template operator()<16>();
  if (e_count <= kRoutingMaxExperts) return launch.template operator()<32>();
  fail("moe routing", "{} experts: the GPU routers take at most {}", e_count, kRoutingMaxExperts);
}

}  // namespace

}  // namespace kiln::cuda
