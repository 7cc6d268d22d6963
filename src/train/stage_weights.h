// A pipeline whose ranks build only their stages' models (dist.pipeline_model = "stages")
// saves the whole model's weights as one process would: each rank's weights go to the
// pipeline's rank 0, which writes model.safetensors (checkpoints, train.out_dir/model)
// under the whole model's names, so a checkpoint loads at another split, in one process or
// under data parallelism. The optimizer state is each rank's own file
// (train/optimizer_shard_files.h), never gathered.
#pragma once

#include "core/dtype.h"
#include "dist/communicator.h"
#include "io/safetensors.h"
#include "model/model.h"
#include "train/optimizer.h"

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kiln {

// A text from one rank to another on `pipeline`: its size under `tag`, then its bytes under
// tag + 1 (the stages' weight headers, the log's component metrics).
void send_text(dist::Communicator& pipeline, int peer, int tag, const std::string& text, std::string_view what);
std::string recv_text(dist::Communicator& pipeline, int peer, int tag, std::string_view what);

struct GatheredWeight {
  std::string name;
  DType dtype = DType::f32;
  std::vector<int64_t> shape;
  std::vector<unsigned char> bytes;
};

// Whether `parameter` of a stage's model is this rank's to save: all but a tied head's
// table on a rank without layer 0 (the first stage's rank saves it; both hold the same).
bool saves_weight(const Model& model, const Parameter& parameter);

// Every rank of the pipeline calls it at once (point to point on `pipeline`, the replica's
// view: rank = pipeline rank). Returns, on pipeline rank 0, the weights the other ranks
// save (f32, or bf16 masters as they are); elsewhere nothing.
std::vector<GatheredWeight> gather_stage_weights(const Model& model, dist::Communicator& pipeline);

// The gathered weights into a writer that already holds rank 0's own.
void add_gathered_weights(io::SafetensorsWriter& writer, const std::vector<GatheredWeight>& weights);

// Fills `whole` (a whole model of the same configuration) with `mine`'s weights (a stage's
// model) and the other stages' (`others`, gather_stage_weights'); fails naming a weight
// found in neither.
void load_stage_weights(Model& whole, const Model& mine, const std::vector<GatheredWeight>& others);

// The optimizer state this rank writes to its checkpoint file: all of it but the state of
// the weights it does not save (saves_weight), which the rank that saves them writes.
std::vector<OptimizerStateTensor> saved_state(const Model& model, const Optimizer& optimizer);

}  // namespace kiln
