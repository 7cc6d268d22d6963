// The named scalars a step's objectives add to: the LM head's cross-entropy, logsumexp^2
// and target count, router losses, multi-token prediction depths. Each
// objective reserves its slots when it is built; the trainer, the fault guard, the log
// line and metrics.jsonl read them by name through this table, not by position.
//
// A slot holds a sum over a step's target tokens, added micro-batch by micro-batch in
// order: on the host (the op-by-op step) or in device memory (train/step_program.h keeps
// kMaxLossSlots doubles per micro-batch and per step). A reported term's value is its sum
// divided by the step's target tokens. Slot 0 is always the main loss: the value logged
// as "loss", checked by the fault guard, and the one validation reports.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kiln {

class Tensor;

// The LM head's 3, a router's few, 3 per multi-token prediction depth (at most 8).
inline constexpr int kMaxLossSlots = 32;
using LossSlotSums = std::array<double, kMaxLossSlots>;

// The slot sums of one micro-batch (or step), with the LM head's named: it reserves the
// first three slots (the main loss, logsumexp^2, the target count).
struct LossSums {
  LossSlotSums slot{};
  double loss = 0;     // slot 0: the main loss (sum of cross-entropy, nats)
  double z = 0;        // sum of logsumexp^2
  int64_t count = 0;   // tokens with a target
};

struct LossTerm {
  // How a step's value is formed from the slot's sum: per target token (the LM head's
  // terms: sums over tokens), or per micro-batch (a term computed once per micro-batch,
  // such as the load-balancing loss: the mean over the step's micro-batches), or per step
  // (each micro-batch adds its share of a term defined over the whole step: the sum is the
  // value; the balance loss with model.moe.balance_scope = "step").
  enum class Per { target, micro_batch, step };
  std::string name;       // its key in the log line and metrics.jsonl ("loss", "z", ...)
  bool reported = true;   // false: bookkeeping (the target count), not a value to show
  Per per = Per::target;
  // >= 0: the value is divided by that slot's sum instead of the step's targets (a term
  // over fewer tokens than the main loss: a multi-token prediction depth's own targets).
  int count_slot = -1;
};

class LossTerms {
 public:
  // The value of a slot over a step: its sum divided by the step's targets, its count
  // slot's sum, or the step's micro-batches (a per-step term: the sum itself).
  double value(int slot, const LossSlotSums& sums, int64_t targets, int64_t micro_batches) const;
  // Reserves consecutive slots, one per term; returns the first. Throws past kMaxLossSlots
  // or on a name taken twice.
  int reserve(const std::vector<LossTerm>& terms);
  const std::vector<LossTerm>& slots() const { return slots_; }
  int find(std::string_view name) const;  // -1 when no such term

 private:
  std::vector<LossTerm> slots_;
};

// Where the objectives of the current micro-batch add their sums and how their gradients
// are scaled (the model sets it before each forward). Objectives other than the LM head
// (a router's losses) hold a reference from when they are built.
struct LossContext {
  LossTerms terms;
  bool backward = false;                // this forward is followed by a backward
  // The backbone runs a recomputed block's forward again before its backward: objectives
  // must not count that forward's losses (or load) twice.
  bool recomputing = false;
  double per_target_scale = 1;          // gradient scale of per-target terms: 1 / the step's targets
  double per_micro_batch_scale = 1;     // of per-micro-batch terms: 1 / the step's micro-batches
  // The loss scale S (train/loss_scaler.h), a power of two that per_target_scale already
  // holds (S / targets): the objectives inside the backbone (the router losses) multiply
  // their gradients by it, so the step's division by S leaves them as without scaling. A
  // captured step reads S from device memory instead (loss_scale_on_device, GPU only; set
  // for its forward and backward alone), so one graph replays for every S.
  double loss_scale = 1;
  const double* loss_scale_on_device = nullptr;
  LossSlotSums* host_sums = nullptr;    // the op-by-op step: this micro-batch's slot sums
  // The step on the device (train/step_program.h): this micro-batch's slot sums, kMaxLossSlots
  // doubles in device memory that objectives add to (+=) without a host read; null
  // otherwise. When set, it replaces host_sums.
  double* device_sums = nullptr;
  // model.moe.balance_scope = "step" (nn/moe/moe_mlp.cpp): each sparse layer's buffer of the
  // step's routed counts, f64 [E + 1] on the model's device (choices per expert, then the
  // routed tokens), filled by the counting pass (Model::count_step_routes) before the step's
  // first backward and summed over the ranks; empty otherwise.
  std::vector<Tensor*> step_routes;
  bool counting_routes = false;  // this forward is the counting pass: routes counted, no loss or load
};

}  // namespace kiln
