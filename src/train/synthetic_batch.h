// A micro-batch of random tokens for measuring, not training: `kiln bench` without data and
// the pipeline's measured layer costs (train/pipeline_costs_measured.h) time the model on it.
#pragma once

#include "config/config.h"
#include "data/batch.h"

namespace kiln {

// train.micro_batch_tokens tokens drawn uniformly from the vocabulary (train.seed), as
// documents of model.max_seq_len each; every token's target is the next one.
HostBatch synthetic_batch(const Config& config);

}  // namespace kiln
