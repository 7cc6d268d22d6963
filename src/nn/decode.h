// The decode side of the component contract: what a KV-cache decoder (infer/decoder.h)
// asks of the modules it drives. Each module type that can run in a decode step makes a
// decoder object for one decode context: the object plans its decode state (a KV cache,
// or a fixed-size recurrent state per slot) and scratch when it is made, chooses
// its kernels then (fused or not, by the context's options), and afterwards only enqueues
// work: no allocation, no synchronization, so a decode step can be captured as a CUDA graph.
//
// A decode step runs rows: row i is token tokens[i] of the sequence in cache slot slots[i]
// at position positions[i]; positions below it in that slot are already in the state.
// Prefill chunks (several rows of one sequence) and decode tokens (one row of each of many
// sequences) mix in one step.
#pragma once

#include "core/arena.h"
#include "core/exec_context.h"

#include <memory>

namespace kiln {

// What every decoder object of one Decoder shares: where its state lives and what it may use.
struct DecodeContext {
  Arena& state;           // decode state and per-step buffers (allocated once by the decoder)
  Workspace& workspace;   // scratch taken inside one step (reserve_peak when planning)
  const ExecContext& exec;  // where the decoder's ops run (core/exec_context.h)
  Device device;
  DType dtype;            // compute dtype: activations, caches, the weights GEMMs read
  DType wide;             // residual stream, gains, statistics (f32, or f64 on the CPU reference)
  int64_t slots = 0;      // sequences held at once
  int64_t max_len = 0;    // positions per slot (<= model.max_seq_len)
  int64_t max_rows = 0;   // rows of one step
  // The GPU's fused decode kernels (DecoderOptions): off runs every module on its ops one
  // by one, the reference the fusions are checked against.
  bool fuse = false;
  // Steps of at most this many rows that compute their logits (the captured decode steps)
  // may run whole branches on the fused decode projections (0: never).
  int64_t fused_branch_rows = 0;
  // Those steps' attention, when their rows are distinct sequences, may be one kernel.
  bool one_kernel_attention = false;

  bool mixed() const { return dtype != wide; }
};

// The rows of the step being run (device i32 views of the decoder's input buffers).
struct DecodeRows {
  Tensor tokens, slots, positions;  // i32 [n]
  int64_t count = 0;
  bool distinct_slots = false;      // every row a different sequence (a decode step)
  // The step runs its branches on the fused decode projections where they have one (see
  // DecodeContext::fused_branch_rows).
  bool fused_branches = false;
};

// A pre-norm's decode side: y = norm(x), with the residual step before it folded in.
class NormDecoder {
 public:
  virtual ~NormDecoder() = default;
  // x += add (in place; skipped when add is undefined), then y = norm(x). x [n, C] is the
  // wide residual stream, add and y [n, C] compute dtype.
  virtual void add_norm(const Tensor& x, const Tensor& add, const Tensor& y) = 0;
};

// A branch's decode side: out = branch(h) for the step's rows.
class BranchDecoder {
 public:
  virtual ~BranchDecoder() = default;
  // h [n, C] (normalized, compute dtype) -> out [n, C] (compute dtype). Reads and writes
  // the branch's decode state (a cache) at the rows' slots and positions.
  virtual void forward(const Tensor& h, const DecodeRows& rows, const Tensor& out) = 0;
  // The whole branch with its pre-norm folded in, on fused kernels: x (wide residual
  // [n, C]) += branch(norm(x)). Only called when fused_branch() is true and
  // rows.fused_branches is set.
  virtual bool fused_branch() const { return false; }
  virtual void forward_fused(const Tensor& x, const DecodeRows& rows) {
    (void)x, (void)rows;
  }

  // The slot contract: what a branch keeps between steps is indexed by slot (helpers in
  // nn/slot_state.h), and the Decoder tells it when a slot's sequence changes. Between
  // steps only; on the GPU they are enqueued in order with the steps. Stateless branches
  // (norms, MLPs) keep the defaults.
  //
  // A new sequence starts in `slot` (the Generator calls it before the slot's first row):
  // a fixed-size state (a recurrent mixer's) starts again from zero. A positional state
  // (a KV cache) needs nothing: each position is written before it is read.
  virtual void reset_slot(int32_t slot) { (void)slot; }
  // Slot `to` continues as slot `from` after its first `positions` rows (a prompt
  // prefilled once for several sequences), bit for bit: a positional state copies those
  // positions, a fixed-size state the whole slot.
  virtual void copy_slot(int32_t from, int32_t to, int64_t positions) { (void)from, (void)to, (void)positions; }
};

// What a norm exposes to the fused decode kernels that fold it into a projection: an
// RMSNorm's gain and eps. Norms without such a form return none, and the branches after
// them run unfused.
struct RmsNormForm {
  Tensor gain;  // [C], wide
  double eps = 0;
};

}  // namespace kiln
