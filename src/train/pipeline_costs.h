// Per-layer costs for the pipeline split (train/pipeline_split.h), estimated from the config
// without allocating: each block is planned on its own, as the model plans it, so a dense,
// MoE, KDA or hybrid model gets uneven costs where its layers differ. Measured times and
// memory instead: train/pipeline_costs_measured.h (dist.pipeline_costs = "measure").
#pragma once

#include "config/config.h"
#include "core/dtype.h"
#include "train/pipeline_split.h"

namespace kiln {

// time: training FLOPs per token at model.max_seq_len, counted as Model::flops_per_token
// counts them for MFU (3 x (2 x active matmul parameters + the mixer's extra work)); the
// embedding lookup counts 0, the head and multi-token prediction go to the last stage.
// memory: bytes of parameters (and their bf16 copies), gradients, optimizer state (the
// model's per parameter, spread by parameter count), saved activations of one micro-batch
// of train.micro_batch_tokens (the block's and its residual-stream input; also LayerCost::
// activations, which a stage keeps once per micro-batch in flight), the embedding on
// the first stage and, tied, again on the last (the head reads it). The workspace (scratch
// every stage needs its own peak of) and the host batches are not in it. Throws naming
// model.attn_res_block for Block Attention Residuals (every layer reads every earlier one).
PipelineCosts pipeline_costs_from_config(const Config& config, Device device);

}  // namespace kiln
