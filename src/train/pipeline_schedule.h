// Pipeline-parallel schedules as data: for each rank, the ordered list of what it does
// in one step -- forward a micro-batch through a stage, its backward (whole, or split into
// the input-gradient pass B and the weight-gradient pass W), and the sends and receives of
// activations and gradients between neighbouring stages. A schedule knows nothing of a
// model; the simulator (train/pipeline_simulator.h) checks and times one, and the engine
// (train/pipeline_engine.h) runs one against a stage (kiln's model: pipeline_model_stage.h).
//
// Stages: the model is cut into ranks x stages_per_rank stages. Stage s lives on rank
// s % ranks (Megatron's interleaving: rank r holds stages r, r + ranks, r + 2 ranks, ...);
// with one stage per rank, stage s is rank s.
#pragma once

#include <string>
#include <vector>

namespace kiln::pipeline {

enum class ActionKind {
  kForward,         // the stage's forward of one micro-batch
  kBackward,        // its whole backward: input and weight gradients in one pass
  kBackwardInput,   // B: the gradient of the stage's input only (what the previous stage waits for)
  kBackwardWeight,  // W: the weight gradients, from the inputs and output gradients B kept
  kSendActivation,  // this stage's output to stage + 1 (on the next rank)
  kRecvActivation,  // this stage's input from stage - 1
  kSendGradient,    // the gradient of this stage's input to stage - 1
  kRecvGradient,    // the gradient of this stage's output from stage + 1
};

struct Action {
  ActionKind kind;
  int microbatch = 0;
  int stage = 0;  // the stage the action belongs to: a send's sender, a receive's receiver
  bool operator==(const Action&) const = default;
};

// "F3@1" (forward of micro-batch 3 on stage 1), "B", "W", "BW" (whole backward), "sA", "rA",
// "sG", "rG" for the transfers.
std::string describe(const Action& action);

struct Schedule {
  std::string name;
  int ranks = 1;
  int stages_per_rank = 1;  // v, the virtual stages of the interleaved schedule
  int microbatches = 1;
  std::vector<std::vector<Action>> actions;  // actions[rank], in the order the rank runs them

  int stages() const { return ranks * stages_per_rank; }
  int rank_of(int stage) const { return stage % ranks; }
};

// Every micro-batch's forward through all stages, then every backward (Huang et al. 2019).
// Peak activations: all m micro-batches on every rank.
Schedule build_gpipe(int ranks, int microbatches);

// One forward, one backward (PipeDream-Flush; Megatron's non-interleaved schedule): rank r
// runs min(ranks - r - 1, m) forwards, then alternates forward and backward, then drains
// its backwards. Same bubble as GPipe, at most ranks - r micro-batches in flight on rank r.
Schedule build_1f1b(int ranks, int microbatches);

// Megatron's interleaved 1F1B (Narayanan et al. 2021): each rank holds stages_per_rank
// stages and runs micro-batches in groups of `ranks` through one of its stages before the
// next. Needs micro-batches divisible by ranks (fails naming train.grad_accum otherwise).
Schedule build_interleaved_1f1b(int ranks, int stages_per_rank, int microbatches);

// ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B with each backward split
// into B and W; rank r keeps up to r weight passes waiting and runs them in its cool-down,
// so the input-gradient chain back to rank 0 is not held up by W. At most `ranks`
// micro-batches in flight on any rank (1F1B's peak, reached on rank 0).
Schedule build_zero_bubble_h1(int ranks, int microbatches);

}  // namespace kiln::pipeline
