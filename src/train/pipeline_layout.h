// Where each rank sits in pipeline x data parallel (2-D; docs/distributed.md, "Training
// with a pipeline"): W = stages x D ranks form D pipelines (replicas) of `stages` ranks.
//
// The pipeline is the outer dimension, as Megatron-LM's default order (its pipeline groups
// are ranks i, i + W/P, i + 2W/P, ...) and torchtitan's device mesh ("pp" first) place it:
//   stage = rank / D, replica = rank % D.
// A stage's D replicas are consecutive ranks: once each stage's gradients are summed over
// its replicas alone (with a model built per stage), that heavier traffic stays among
// neighbours and only the pipeline's activations cross the outer dimension. Today the step's
// one all-reduce spans every rank. With D = 1 a rank is its stage, as before 2-D.
#pragma once

#include <memory>

#include "dist/communicator.h"

namespace kiln::pipeline {

struct Layout {
  int stages = 1;
  int replicas = 1;  // D: data-parallel copies of the pipeline

  int stage_of(int rank) const { return rank / replicas; }
  int replica_of(int rank) const { return rank % replicas; }
  int rank_of(int stage, int replica) const { return stage * replicas + replica; }
};

// The point-to-point view of one replica's pipeline over the whole group's communicator:
// rank() is this rank's stage, world_size() the stages, and a send or recv to stage s goes
// to that stage's rank of the same replica. So the engine (train/pipeline_engine.h), which
// speaks of pipeline ranks, runs unchanged, and a replica's messages never reach another's.
// Collectives are the whole group's business (the step's all-reduce): this view refuses them.
std::unique_ptr<dist::Communicator> replica_pipeline(dist::Communicator& group, const Layout& layout);

}  // namespace kiln::pipeline
