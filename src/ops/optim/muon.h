// The numerical core of the Muon optimizer (Keller Jordan's; Moonlight's update scaling is
// the caller's update_scale): momentum, an orthogonalized update by a quintic
// Newton-Schulz iteration, decoupled weight decay. Per 2-D matrix P [rows, cols] with
// gradient G and momentum M:
//   g = grad_scale G                      (the global clip factor; 1 = none)
//   M = mu M + g                          (settings.ema: M = mu M + (1 - mu) g)
//   U = nesterov ? g + mu M : M           (ema with nesterov: U = (1 - mu) g + mu M)
//   X = NS^ns_steps(U / (||U||_F + eps))  (newton_schulz below)
//   P = P (1 - lr wd) - lr update_scale X
// The CPU reference runs in the tensors' dtype (f32 or f64), matrix by matrix. The GPU
// takes fp32 parameters, gradients and momentum; the iteration runs on bf16 operands with
// fp32 accumulation (cuBLASLt), same-shape matrices together as strided-batched GEMMs.
// Momentum on the GPU has the bits of the f32 CPU reference (elementwise, no contraction);
// the orthogonalized update agrees with it to bf16's precision.
#pragma once

#include "core/arena.h"
#include "core/exec_context.h"
#include "core/tensor.h"
#include "ops/optim/update_scalars.h"

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace kiln::ops {

// The settings fixed for a run (the optimizer config's): momentum mu, Nesterov's lookahead,
// the EMA form of the buffer (Moonlight's (1 - mu) g), the iteration's steps and the eps
// of its normalization.
struct MuonSettings {
  double momentum = 0.95;
  bool nesterov = true;
  bool ema = false;
  int ns_steps = 5;
  double ns_eps = 1e-7;
};

// The quintic p(s) = a s + b s^3 + c s^5 of Keller Jordan's Newton-Schulz iteration: tuned
// to lift small singular values fast rather than converge to 1, so after five steps the
// singular values of the result lie in a band around 1 (tests/test_muon.cpp measures it).
inline constexpr double kNewtonSchulzA = 3.4445, kNewtonSchulzB = -4.7750, kNewtonSchulzC = 2.0315;

// Bounds on one batch of same-shape matrices orthogonalized together on the GPU, so the
// workspace of a model with many large matrices stays bounded: a bucket larger than this
// runs as several batches that share one workspace.
inline constexpr int64_t kMuonMaxBatchMatrices = 64;
inline constexpr size_t kMuonMaxBatchBytes = size_t{1} << 30;

// One matrix of an update: param, grad and momentum of one shape [rows, cols] and dtype
// (each may be a contiguous row range of a fused tensor, Tensor::rows), with its own
// weight decay and update scale (Keller Jordan's sqrt(max(1, rows / cols)), Moonlight's
// 0.2 sqrt(max(rows, cols)), or 1: the caller's choice).
struct MuonMatrix {
  Tensor param, grad, momentum;
  double weight_decay = 0;
  double update_scale = 1;
  // A bf16 param is a bf16 master (optim.master_weights): grad and momentum fp32, the new
  // weight computed in fp32 and rounded stochastically with the bits of this stream
  // (ops/optim/stochastic_round.h), the update number and the element's index.
  uint64_t rounding_stream = 0;
};

// In place, x [rows, cols]: x <- NS^steps(x / (||x||_F + eps)), where one step is
//   wide (rows <= cols): A = X X^T; B = b A + c A A; X = a X + B X
//   tall (rows > cols):  A = X^T X; B = b A + c A A; X = a X + X B
// (the tall form is the wide one on X^T, without transposing anything). CPU: f32 or f64,
// computed in that dtype. GPU: f32 in and out, the iteration on bf16 operands with fp32
// accumulation. Allocates its scratch on each call (a tool and test entry point; the
// optimizer's update, MuonUpdate, keeps its own).
void newton_schulz(const ExecContext& ctx, const Tensor& x, int steps, double eps = 1e-7);

// The update of a fixed list of matrices (shapes given at construction, in order). Each
// optimizer instance owns one, with its scratch (CPU) or its workspace and device tables
// (GPU, in the arena given to plan()): no process-wide state, so two optimizers' updates
// in one captured step never touch each other's. Movable (its planned tensors live on the
// heap and do not move with it); not copyable.
class MuonUpdate {
 public:
  MuonUpdate(MuonSettings settings, std::vector<Shape> shapes, Device device);
  ~MuonUpdate();
  MuonUpdate(MuonUpdate&&) noexcept;
  MuonUpdate& operator=(MuonUpdate&&) noexcept;
  MuonUpdate(const MuonUpdate&) = delete;
  MuonUpdate& operator=(const MuonUpdate&) = delete;

  // Reserves the GPU workspace, device tables and norm partials in `arena` (the optimizer
  // state arena, so `kiln plan` counts them); usable once the arena is allocated. CPU:
  // reserves nothing (the scratch lives in this object, sized at the first step).
  void plan(Arena& arena);
  // The bytes plan() reserves (alignment included; 0 on the CPU): what `kiln plan` adds.
  size_t planned_bytes() const;
  // The bf16 workspace of one batch of `count` same-shape [rows, cols] matrices (two
  // iterate buffers of rows x cols and two Gram-sized ones of min(rows, cols)^2 each,
  // every slot padded to 128 elements); the GPU workspace is the largest of these over the
  // batches, count capped by batch_capacity.
  static size_t batch_workspace_bytes(int64_t rows, int64_t cols, int64_t count);
  // How many [rows, cols] matrices one batch takes: kMuonMaxBatchMatrices, fewer when their
  // workspace would pass kMuonMaxBatchBytes, at least 1.
  static int64_t batch_capacity(int64_t rows, int64_t cols);

  // One update with host scalars (CPU or GPU): lr and grad_scale as given. `matrices`
  // follows the constructor's shapes, in order.
  // `update` (1-based) keys the stochastic rounding of bf16 masters.
  void step(const ExecContext& ctx, const std::vector<MuonMatrix>& matrices, double lr, double grad_scale = 1.0,
            int64_t update = 0);
  // The GPU update with its scalars in device memory, read when the kernels run (a
  // captured training step): lr = scalars->group[group].lr, grad_scale =
  // scalars->grad_scale, the rounding's update number scalars->group[group].update; while
  // scalars->skip != 0 nothing changes (param, momentum).
  // Capturable: no host sync, allocation or read of device data; fixed pointers (the
  // device table is rewritten only when the list changes, which bumps the capture
  // generation, core/step_graphs.h). Same kernels as step(): the same bits for the same
  // scalar values.
  void step_on_device(const ExecContext& ctx, const std::vector<MuonMatrix>& matrices, const DeviceUpdateScalars* scalars,
                      int group);

  const MuonSettings& settings() const;
  const std::vector<Shape>& shapes() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace kiln::ops
