// CUDA kernels behind ops/optim/muon.h (muon_cuda.cu). No CUDA headers: muon.cpp builds the
// tables below in every build and calls these only in CUDA builds.
//
// One GPU update of a list of fp32 matrices is
//   1. muon_momentum_f32: one launch over every matrix, cut into chunks of kMuonChunk
//      elements: the momentum update (M written) and each chunk's sum of U^2 (a fixed order:
//      each thread's elements in index order, then the block's fixed reduction);
//   2. per batch of same-shape matrices, muon_orthogonalize_apply_f32: U recomputed from G
//      and the new M (the same bits as in 1), scaled by 1 / (||U||_F + eps) (the chunks'
//      sums added in chunk order) and rounded once to bf16 into the batch's iterate buffer;
//      ns_steps x 3 strided-batched GEMMs; the last iterate applied to the fp32 parameters.
// The scalars come from the host (step) or from device memory when the kernels run
// (step_on_device); either way the kernels compute the same float arithmetic.
#pragma once

#include "core/exec_context.h"
#include "ops/mixed_precision.h"
#include "ops/optim/update_scalars.h"

#include <cstddef>
#include <cstdint>

namespace kiln::cuda {

// Elements per block of the elementwise kernels (and per partial sum of squares).
inline constexpr int64_t kMuonChunk = 64 * 1024;
// Every workspace slot (one matrix's iterate or Gram buffer) is padded to this many bf16
// elements (256 bytes: cuBLASLt's default alignment assumption for every batch member).
inline constexpr int64_t kMuonSlotAlign = 128;

// The run's fixed settings in the kernels' float form (1 - momentum rounded once from double).
struct MuonKernelSettings {
  float momentum, one_minus_momentum, eps;
  int32_t nesterov, ema, ns_steps;
};

// One matrix of the device table: its fp32 arrays, its slots in its batch's first iterate
// buffer (written by the normalization) and in the buffer holding the last iterate (read
// by the update), and its chunks' partial sums [first_chunk, first_chunk + chunk_count).
struct MuonMatrixF32 {
  float* p;        // null for a bf16 master: p16 instead
  bf16_bits* p16;  // a bf16 master (optim.master_weights), rounded stochastically with `stream`
  uint64_t stream;
  const float* g;
  float* m;
  int64_t n;  // rows * cols
  float weight_decay, update_scale;
  bf16_bits* x;
  const bf16_bits* x_final;
  int64_t first_chunk;
  int64_t chunk_count;
};

// Chunk `begin / kMuonChunk` of table entry `matrix`.
struct MuonChunk {
  int64_t matrix;
  int64_t begin;
};

// The device memory of one update (in the optimizer's arena), filled by the host.
struct MuonDeviceTable {
  const MuonMatrixF32* matrices;
  const MuonChunk* chunks;
  float* partials;  // one per chunk
  int64_t chunk_count;
};

// Where lr and grad_scale come from: `device` (read when the kernels run: lr of group
// `group`; nothing done while skip is set) or, when it is null, the two host values.
struct MuonScalars {
  const ops::DeviceUpdateScalars* device = nullptr;
  int32_t group = 0;
  float lr = 0, grad_scale = 1;
  uint32_t update = 0;  // host form: the rounding's update number (bf16 masters)
};

// One batch: `count` matrices of one shape [rows, cols], consecutive in the table from
// entry `first`, whose chunks are [chunk_begin, chunk_end); its workspace: iterate buffers
// x0, x1 (count slots of stride_x elements) and Gram buffers a, b (stride_a).
struct MuonBatchF32 {
  int64_t rows, cols, first, count;
  int64_t chunk_begin, chunk_end;
  bf16_bits *x0, *x1, *a, *b;
  int64_t stride_x, stride_a;
};

// Step 1 above, over every chunk of the table.
void muon_momentum_f32(const ExecContext& ctx, const MuonDeviceTable& table, const MuonKernelSettings& settings, const MuonScalars& scalars);
// Step 2 above, for one batch.
void muon_orthogonalize_apply_f32(const ExecContext& ctx, const MuonDeviceTable& table, const MuonBatchF32& batch,
                                  const MuonKernelSettings& settings, const MuonScalars& scalars);

// The standalone in-place iteration on one fp32 matrix (ops::newton_schulz on the GPU),
// with `workspace` of newton_schulz_workspace_bytes(rows, cols) (256-byte aligned).
size_t newton_schulz_workspace_bytes(int64_t rows, int64_t cols);
void newton_schulz_f32(const ExecContext& ctx, float* x, int64_t rows, int64_t cols, int steps, float eps, void* workspace);

}  // namespace kiln::cuda
