// Resumable checkpoints: written so that a crash at any instant leaves the previous
// checkpoint usable, and verified so that a damaged one is refused by name.
//
// Layout of checkpoint.dir (default <train.out_dir>/checkpoints):
//   step-00000100/
//     model.safetensors      fp32 master weights under whole-model names (no device,
//                            fusion or sharding layout baked in); `kiln sample` loads it
//     optimizer.safetensors  optimizer state by name ("<param>.exp_avg", ...), metadata
//                            optimizer name and step count
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
#pragma once

#include "model/model.h"
#include "train/checkpoint_state.h"
#include "train/fault_inject.h"
#include "train/optimizer.h"

#include <string>
#include <utility>
#include <vector>

namespace kiln {

// checkpoint.dir, or <train.out_dir>/checkpoints when it is empty.
std::string checkpoint_root(const Config& config);
// "step-00000100".
std::string checkpoint_name(int64_t step);

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
  // untouched. Returns the checkpoint's path. `whole_state`: the optimizer's state tensors
  // joined over ZeRO's ranks (train/zero_state.h); null: optimizer.state_tensors().
  std::string save(const Model& model, const Optimizer& optimizer, const CheckpointState& state,
                   const std::vector<OptimizerStateTensor>* whole_state = nullptr);
  // Names the checkpoint of `step` (saved before) as the best (DIR/best, replaced
  // atomically): retention keeps it until another takes its place.
  void mark_best(int64_t step);

 private:
  void write_files(const std::string& tmp, const Model& model, const Optimizer& optimizer,
                   const CheckpointState& state, const std::vector<OptimizerStateTensor>& optimizer_state);
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
  CheckpointState state;
  Config config;  // the saving run's resolved configuration
};

// Verifies the manifest and the size and checksum of every file, then parses state.json
// and config.toml. Errors name the file: "[checkpoint] DIR/model.safetensors: checksum
// mismatch ...", "... truncated ...", "[checkpoint] DIR: incomplete (no manifest.json)".
CheckpointInfo read_checkpoint(const std::string& path);

// Copies the weights and optimizer state of a verified checkpoint into an allocated model
// and optimizer; every tensor must be present with its exact shape, and no other.
void load_checkpoint_tensors(const CheckpointInfo& checkpoint, Model& model, Optimizer& optimizer);

}  // namespace kiln
