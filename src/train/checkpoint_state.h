// What a checkpoint holds besides tensors (its state.json), and the resume guards that
// compare a checkpoint with the run that wants to continue it.
#pragma once

#include "core/dtype.h"
#include "data/batch_stream.h"
#include "config/config.h"
#include "io/checkpoint_manifest.h"
#include "train/fault_guard.h"
#include "train/loss_scaler.h"

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace kiln {

// The checkpoint format version (io/checkpoint_manifest.h), which state.json carries too.
using io::kCheckpointFormatVersion;

// Where training stands at a step boundary.
struct TrainProgress {
  int64_t step = 0;             // steps done (applied or skipped): the next step is step + 1
  int64_t tokens = 0;           // positions processed, PAD included
  int64_t target_tokens = 0;    // positions with a loss
  int64_t document_tokens = 0;  // positions holding a document's token (PAD left out)
  double elapsed_seconds = 0;   // wall time of all runs up to here
  // The log line averages over log.every steps; a run resumed mid-window must continue
  // the same average.
  double window_loss = 0;       // sum of finite step losses in the window
  int64_t window_losses = 0;    // how many
  int64_t window_steps = 0;
  int64_t window_tokens = 0;
  int64_t window_document_tokens = 0;

  bool operator==(const TrainProgress&) const = default;
};

struct CheckpointState {
  int64_t format_version = kCheckpointFormatVersion;
  std::string kiln_version = KILN_VERSION;
  TrainProgress progress;
  // Updates applied: the optimizer's step count (bias correction) and the schedule's
  // position, which skipped steps do not advance. The schedule is a pure function of it.
  int64_t optimizer_steps = 0;
  StreamState stream;           // exact data loader position (its fingerprint: data + seed + packing)
  FaultGuardState guard;
  // The dynamic loss scale's state; absent (nullopt) where the saving run did not scale.
  std::optional<LossScalerState> loss_scaler;
  std::string precision = "f32";  // compute dtype (bf16: fp32 masters and optimizer state)
  int64_t threads = 0;          // CPU threads of the saving run (bitwise resume needs the same)
  std::string config_toml;      // the resolved configuration of the saving run
  // The run the checkpoint belongs to (train/run_directory.h); "" in older checkpoints.
  std::string run_id;
  // Processes whose gradients made a step; 0 when unknown (older checkpoints).
  int64_t world_size = 0;
};

std::string state_to_json(const CheckpointState& state);
// Throws "[checkpoint] PATH: ..." naming the missing or ill-typed key.
CheckpointState state_from_json(const std::string& text, const std::string& path);

// Processes of the saving run: its world_size, or for an older checkpoint what its tokens
// per step tell (tokens / steps / (grad_accum x micro_batch_tokens)); 0 when unknown.
int64_t saved_world_size(const CheckpointState& saved, const Config& saved_config);

// "section.key (saved -> now)" for every field that differs.
std::vector<std::string> config_differences(const Config& saved, const Config& now);
// The differences that make a checkpoint unusable: the architecture and numerics of the
// model (every model.* key but model.name and model.init_std) and optim.name.
std::vector<std::string> incompatible_differences(const Config& saved, const Config& now);

// Resume guards, checked before the checkpoint's tensors are read:
// the model: throws "[checkpoint] PATH: cannot resume, the run differs from the
// checkpoint in: model.hidden (64 -> 32), precision (f32 -> bf16)" listing every field.
void check_resume_model(const std::string& path, const CheckpointState& saved, const Config& saved_config,
                        const Config& now, DType precision);
// the data: a different stream fingerprint (data, data.seed or packing) throws unless
// `allow_data_change`. Returns whether the saved loader position applies (false: the
// new data is read from its start).
bool check_resume_data(const std::string& path, const CheckpointState& saved, const Config& saved_config,
                       const Config& now, uint64_t stream_fingerprint, bool allow_data_change);

}  // namespace kiln
