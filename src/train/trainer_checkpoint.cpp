// The trainer's side of checkpoints: finding and verifying the checkpoint to resume,
// putting its state back into the model, optimizer, data stream and counters, and
// gathering that state when saving. Kept apart from trainer.cpp so the loop stays short.
#include "train/trainer.h"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <filesystem>

namespace kiln {

namespace fs = std::filesystem;

namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

std::optional<CheckpointInfo> Trainer::find_resume_checkpoint(const TrainOptions& options) {
  if (options.resume.empty()) return std::nullopt;
  const bool latest = options.resume == "latest";
  const std::string where = latest ? checkpoints_->root() : options.resume;
  const std::string path = resolve_checkpoint(where);
  if (path.empty()) {
    // A scheduler may restart every attempt with --resume; the first has nothing yet.
    KILN_CHECK(latest, "checkpoint", "{}: holds no complete checkpoint", where);
    console_.print("resume: no checkpoint in {} yet; starting from step 0\n", where);
    return std::nullopt;
  }
  CheckpointInfo info = read_checkpoint(path);  // every checksum verified
  check_resume_model(path, info.state, info.config, config_, model_->options().dtype);
  return info;
}

void Trainer::restore(const CheckpointInfo& checkpoint, bool allow_data_change) {
  const CheckpointState& saved = checkpoint.state;
  const bool same_data = check_resume_data(checkpoint.path, saved, checkpoint.config, config_,
                                           stream_->get_state().fingerprint, allow_data_change);
  std::string changed;
  for (const std::string& d : config_differences(checkpoint.config, config_)) changed += (changed.empty() ? "" : ", ") + d;
  if (!changed.empty()) console_.print("resume: configuration changed since the checkpoint: {}\n", changed);
  if (saved.threads != threads_)
    console_.warn("", fmt::format("the checkpoint was written with {} CPU threads, this run uses {}: the run "
                                  "continues, but its losses are not bitwise those of an uninterrupted run",
                                  saved.threads, threads_));
  if (saved.kiln_version != KILN_VERSION)
    console_.print("resume: checkpoint written by kiln {}, this is kiln {}\n", saved.kiln_version, KILN_VERSION);

  load_checkpoint_tensors(checkpoint, *model_, *optimizer_);
  if (same_data) {
    stream_->set_state(saved.stream);
  } else {
    console_.warn("", fmt::format("{}: the data changed (--allow-data-change): reading the new data from its start",
                     checkpoint.path));
  }
  guard_.restore(saved.guard);
  progress_ = saved.progress;
  checkpoint_step_ = progress_.step;
  if (progress_.step >= config_.train.steps)
    console_.print("resume: the checkpoint is at step {}, train.steps is {}: nothing left to train\n", progress_.step,
                   config_.train.steps);
  // The crashed run may have logged steps past its checkpoint; they are run again.
  if (!writes_files()) return;  // rank 0 keeps the metrics file
  const std::string metrics = (fs::path(config_.train.out_dir) / config_.log.metrics_file).string();
  truncate_metrics_after(metrics, progress_.step);
  best_validation_ = best_validation_in(metrics);  // the best so far carries on
}

CheckpointState Trainer::checkpoint_state() const {
  CheckpointState s;
  s.progress = progress_;
  s.optimizer_steps = optimizer_->steps_taken();
  s.stream = stream_->get_state();
  s.guard = guard_.state();
  s.precision = std::string(dtype_name(model_->options().dtype));
  s.threads = threads_;
  s.config_toml = config_to_toml(config_);
  return s;
}

std::string Trainer::save_checkpoint() {
  if (!writes_files()) {  // rank 0 saves the run: every rank holds the same state
    checkpoint_step_ = progress_.step;
    return (fs::path(checkpoints_->root()) / checkpoint_name(progress_.step)).string();
  }
  const double start = now_seconds();
  const std::string path = checkpoints_->save(*model_, *optimizer_, checkpoint_state());
  checkpoint_step_ = progress_.step;
  const double seconds = now_seconds() - start;
  records_.checkpoint(progress_.step, path, seconds);
  console_.print("checkpoint: step {} saved to {} ({:.2f}s)\n", progress_.step, path, seconds);
  std::fflush(stdout);
  return path;
}

void Trainer::save_checkpoint_or_warn(TrainResult& result) {
  try {
    result.checkpoint = save_checkpoint();
  } catch (const Error& e) {
    if (config_.checkpoint.on_save_error == "stop") throw;
    console_.warn("", fmt::format("{} (checkpoint.on_save_error = continue: training goes on; the previous "
                                  "checkpoint is intact)",
                                  e.what()));
  }
}

}  // namespace kiln
