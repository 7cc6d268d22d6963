// Resumable checkpoints: written so that a crash at any instant leaves the previous
// checkpoint usable, and verified so that a damaged one is refused by name.
//
// Layout of checkpoint.dir (default <train.out_dir>/checkpoints):
//   step-00000100/
//     model.safetensors      fp32 master weights under whole-model names (no device,
//                            fusion or sharding layout baked in); `kiln sample` loads it
//     optimizer.safetensors  optimizer state by name ("<param>.exp_avg", ...), metadata
//                            optimizer name and step count; or, from a ZeRO run, instead:
//     optimizer.rank-RRRRR-of-WWWWW.safetensors
//                            each rank's slices of it, written by that rank
//                            (train/optimizer_shard_files.h); the manifest's
//                            "optimizer_shards" is W (0 or absent: the whole file)
//     state.json             step, tokens, schedule position, data loader position,
//                            fault-guard window, precision, resolved config (checkpoint_state.h)
//     config.toml            the resolved configuration (same text as in state.json)
//     manifest.json          written last: format version, step, size and XXH64 of each
//                            file above, and an XXH64 of the manifest itself
//   latest                   "step-00000100": the newest complete checkpoint
//   best                     the checkpoint of the best validation loss (checkpoint.keep_best)
//
// Save protocol: everything is written into .tmp-step-N/ and fsynced, the manifest last;
// the directory is fsynced and renamed to step-N/ (atomic), the parent fsynced; only
// then is `latest` replaced (write latest.tmp, fsync, rename). Old checkpoints are
// deleted after that, by renaming them to .trash-* first, so a half-deleted directory is
// never mistaken for a checkpoint. Leftover .tmp-*/.trash-* are removed at the next start.
// A sharded save (save_sharded) keeps the protocol: rank 0 makes .tmp-step-N/, every rank
// writes and fsyncs its shard file there, rank 0 writes the manifest only once every rank
// has reported its file durable (with its size and XXH64), so a rank that dies mid-save
// leaves no manifest, and the previous checkpoint stays `latest`. (The ranks must share
// the checkpoint directory's file system.)
#pragma once

#include "model/model.h"
#include "train/checkpoint_state.h"
#include "train/fault_inject.h"
#include "train/optimizer.h"
#include "train/stage_weights.h"

#include <nlohmann/json_fwd.hpp>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace kiln::dist {
class Communicator;
}

namespace kiln {

// checkpoint.dir, or <train.out_dir>/checkpoints when it is empty.
std::string checkpoint_root(const Config& config);
// "step-00000100".
std::string checkpoint_name(int64_t step);

// What a rank of a sharded save (CheckpointWriter::save_sharded) writes beyond the default.
struct ShardedSaveParts {
  // The state tensors this rank writes; none: all of the optimizer's.
  std::optional<std::vector<OptimizerStateTensor>> state;
  // Rank 0: weights its model does not hold (a pipeline's other stages,
  // train/stage_weights.h), written into model.safetensors beside its own.
  const std::vector<GatheredWeight>* more_weights = nullptr;
};

class CheckpointWriter {
 public:
  CheckpointWriter(const Config& config, const FaultInjector& faults);
  const std::string& root() const { return root_; }

  // Before training: creates the root, proves it writable, removes leftovers of
  // interrupted saves. Throws "[checkpoint.dir] DIR: ..." when it cannot be used.
  void prepare();
  // Writes a complete checkpoint and moves `latest` to it, then applies retention
  // (a failed delete only warns). On failure throws "[checkpoint] DIR: save failed: ...",
  // having removed its temporary directory; the previous checkpoint and `latest` are
  // untouched. Returns the checkpoint's path. Rank 0's (or the only process's) call.
  std::string save(const Model& model, const Optimizer& optimizer, const CheckpointState& state);
  // ZeRO, or a pipeline of models built per stage: every rank calls it at once (host
  // collectives on `comm`); each writes its own optimizer shard file, rank 0 the rest and the
  // manifest (above). Fails on every rank, with rank 0's message, when the save fails on
  // any; returns the checkpoint's path.
  std::string save_sharded(const Model& model, const Optimizer& optimizer, const CheckpointState& state,
                           dist::Communicator& comm, const ShardedSaveParts& parts = {});
  // Names the checkpoint of `step` (saved before) as the best (DIR/best, replaced
  // atomically): retention keeps it until another takes its place.
  void mark_best(int64_t step);

 private:
  // Everything but the manifest; the whole optimizer file unless `sharded`.
  void write_files(const std::string& tmp, const Model& model, const Optimizer& optimizer,
                   const CheckpointState& state, bool sharded, const std::vector<GatheredWeight>* more_weights = nullptr);
  // The manifest, last: every file in `tmp` it lists, `shards` (name -> size and XXH64, as
  // their ranks reported them) among them.
  void write_manifest(const std::string& tmp, const CheckpointState& state, const nlohmann::json& shards);
  // Removes and makes `tmp` empty.
  void make_empty(const std::string& tmp);
  // Moves a written `tmp` to `final_dir` (replacing an abandoned one of the same step).
  void publish(const std::string& tmp, const std::string& final_dir, int64_t step);
  // Then: `latest` names it, and retention runs.
  void point_latest(const std::string& final_dir, int64_t step);
  void apply_retention(int64_t newest);
  void remove_quietly(const std::string& path);

  std::string root_;
  std::string optimizer_name_;
  std::string tokenizer_;  // data.tokenizer: a trained tokenizer's files go into each checkpoint
  int64_t keep_last_, keep_every_;
  const FaultInjector& faults_;
  int64_t saves_ = 0;
};

// Complete checkpoints (with a manifest) in `root`, oldest first: (step, path).
std::vector<std::pair<int64_t, std::string>> list_checkpoints(const std::string& root);

// The checkpoint `path` names: a checkpoint directory itself, or a root, whose `latest`
// is followed (when `latest` is missing, the newest complete checkpoint is used). Returns
// "" for a root that holds no checkpoint yet; throws when `path` does not exist.
std::string resolve_checkpoint(const std::string& path);

struct CheckpointInfo {
  std::string path;
  // A ZeRO run's optimizer shard files (rank order); empty: optimizer.safetensors.
  std::vector<std::string> optimizer_shards;
  CheckpointState state;
  Config config;  // the saving run's resolved configuration
};

// Verifies the manifest and the size and checksum of every file, then parses state.json
// and config.toml. Errors name the file: "[checkpoint] DIR/model.safetensors: checksum
// mismatch ...", "... truncated ...", "[checkpoint] DIR: incomplete (no manifest.json)".
CheckpointInfo read_checkpoint(const std::string& path);

// Copies the weights and optimizer state of a verified checkpoint into an allocated model
// and optimizer; every tensor must be present with its exact shape, and no other (but for
// a pipeline stage's model, which reads its part of the whole model's).
void load_checkpoint_tensors(const CheckpointInfo& checkpoint, Model& model, Optimizer& optimizer);

}  // namespace kiln
