// The gradients of a pipeline whose ranks build only their stages' models
// (dist.pipeline_model = "stages"; train/pipeline_trainer_step.h). Within a replica every
// parameter lives on one rank, but for a tied head's table: the first stage's rank holds
// it for the lookup, the last stage's for the head, and each accumulates its own share of
// its gradient over the step's micro-batches. The step's exchange:
// - first the table's two holders in each replica swap their shares and each adds the
//   other's (exchange_table): a + b on one rank and b + a on the other, the same bits, and
//   with one replica the bits of the whole-model pipeline's all-reduce (whose other ranks
//   add zeros). No other gradient crosses stages: no other parameter has a second holder.
// - then, with D > 1 replicas, each stage's gradients (reduce_over_replicas) and its layers'
//   step statistics (reduce_statistics) summed over its D replicas, on the stage's own
//   communicator (train/pipeline_layout.h: a stage's replicas are consecutive ranks). Under
//   ZeRO (train/data_parallel.h) the stage's parameters are sharded over those replicas, and
//   ZeRO-2 reduce-scatters the gradients there instead of reduce_over_replicas; the table's
//   two holders then shard it each over its own stage's replicas, both from the same summed
//   gradient, so both update it alike.
// sum_of_squares(): this rank's part of the whole model's sum of squared gradients, the
// table counted on the first stage's rank only, and (`counted`) only replica 0's ranks
// counting where the replicas hold the same sums -- every rank under ZeRO-2, each holding its
// shard's -- so the sum over all ranks is the whole model's (added up in another order than
// one arena's: equal up to rounding).
#pragma once

#include "dist/communicator.h"
#include "model/model.h"

namespace kiln {

class StageGradients {
 public:
  // `pipeline`: the replica's pipeline (rank = pipeline rank; point to point only);
  // `first`, `last`: the pipeline ranks holding the first and the last stage; `replicas`:
  // this stage's replicas (null with one); `counted`: this rank's squares count (replica 0,
  // or every rank where each holds its own shard of the gradients).
  StageGradients(Model& model, dist::Communicator& pipeline, int first, int last, dist::Communicator* replicas,
                 bool counted);

  void exchange_table();
  void reduce_over_replicas();
  void reduce_statistics();
  dist::Communicator* replicas() const { return replicas_; }
  double sum_of_squares() const;
  // Whether this rank's copy of a parameter is the one a whole-model sum counts: all but
  // the tied table on the last stage's rank.
  bool counts(const Parameter& parameter) const { return &parameter != table_ || counts_table_; }

 private:
  Model& model_;
  dist::Communicator& pipeline_;
  dist::Communicator* replicas_;  // the stage's replicas; null with one
  bool counted_;                  // its squares are the norm's
  const Parameter* table_ = nullptr;  // the tied table, where another rank holds it too
  int peer_ = -1;                     // that rank
  bool counts_table_ = true;
};

}  // namespace kiln
