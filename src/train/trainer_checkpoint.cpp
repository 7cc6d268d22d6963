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
    if (run_dir_) run_dir_->check_restart_without_checkpoint();
    console_.print("resume: no checkpoint in {} yet; starting from step 0\n", where);
    return std::nullopt;
  }
  CheckpointInfo info = read_checkpoint(path);  // every checksum verified
  if (run_dir_) check_same_run(path, info.state.run_id, config_.train.out_dir, run_dir_->run_id());
  run_id_ = info.state.run_id;  // "" for an older checkpoint: the directory's, or a new one
  check_resume_model(path, info.state, info.config, config_, training_build_options(config_, device_).dtype);
  return info;
}

void Trainer::keep_global_batch(const CheckpointInfo& checkpoint) {
  const TrainConfig& saved = checkpoint.config.train;
  TrainConfig& now = config_.train;
  const int64_t saved_world = saved_world_size(checkpoint.state, checkpoint.config);
  const int64_t world = data_ranks();
  const int64_t saved_tokens = saved_world * saved.grad_accum * saved.micro_batch_tokens;
  const int64_t per_accum = world * now.micro_batch_tokens;
  if (saved_world == 0 || saved_tokens == per_accum * now.grad_accum) return;
  if (saved_world == world) {  // the same processes: the config's grad_accum, a change made on purpose
    console_.print("resume: {} tokens per step, the checkpoint's run took {} (train.grad_accum {} -> {})\n",
                   per_accum * now.grad_accum, saved_tokens, saved.grad_accum, now.grad_accum);
    return;
  }
  // Another process count: the global batch (and with it the schedule's tokens and the
  // loss's scale) is kept, by the micro-batches each process accumulates.
  KILN_CHECK(saved_tokens % per_accum == 0, "train.grad_accum",
             "{}: the checkpoint's run took {} tokens per step ({} processes x grad_accum {} x {} micro-batch tokens); "
             "{} processes x {} micro-batch tokens make no such step at any train.grad_accum: resume on a process "
             "count that divides {}",
             checkpoint.path, saved_tokens, saved_world, saved.grad_accum, saved.micro_batch_tokens, world,
             now.micro_batch_tokens, saved_tokens / now.micro_batch_tokens);
  const int64_t grad_accum = saved_tokens / per_accum;
  console_.print("resume: the checkpoint's run took {} tokens per step ({} processes x grad_accum {}); on {} "
                 "processes train.grad_accum {} -> {} keeps them\n",
                 saved_tokens, saved_world, saved.grad_accum, world, now.grad_accum, grad_accum);
  now.grad_accum = grad_accum;
}

void Trainer::claim_run_directory(const TrainOptions& options) {
  if (options.overwrite) run_dir_->remove_earlier_run();
  // A resumed run is the checkpoint's; a restart keeps the directory's; else a new one.
  const std::string in_dir = run_dir_->run_id();
  if (run_id_.empty()) run_id_ = !in_dir.empty() && !options.overwrite ? in_dir : new_run_id();
  if (run_id_ != in_dir) run_dir_->write_run_id(run_id_);
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
  if (saved.loss_scaler) scaler_.restore(*saved.loss_scaler);  // else (not scaled before) from loss_scale_init
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

void Trainer::start_from(const InitialWeights& source) {
  const std::vector<std::string> differences = load_initial_weights(source, config_, *model_);
  console_.print("init: weights from {} ({}); optimizer, step count, schedule and data position start fresh\n",
                 source.dir, source.hugging_face ? "Hugging Face " + source.model_type : std::string("kiln model"));
  std::string changed;
  for (const std::string& d : differences) changed += (changed.empty() ? "" : ", ") + d;
  if (!changed.empty()) console_.print("init: the model configuration differs from the source's in: {}\n", changed);
}

CheckpointState Trainer::checkpoint_state() const {
  CheckpointState s;
  s.progress = progress_;
  if (run_start_ > 0) s.progress.elapsed_seconds = now_seconds() - run_start_;  // the run's clock at the save
  s.optimizer_steps = optimizer_->steps_taken();
  s.stream = stream_->get_state();
  s.guard = guard_.state();
  if (scaler_.enabled()) s.loss_scaler = scaler_.state();
  s.precision = std::string(dtype_name(model_->options().dtype));
  s.threads = threads_;
  s.config_toml = config_to_toml(config_);
  s.run_id = run_id_;
  s.world_size = data_ranks();  // a pipeline's: its replicas (a replica's stages read one shard)
  return s;
}

std::string Trainer::save_checkpoint() {
  // ZeRO: each rank holds a slice of the optimizer state and writes it to a file of its
  // own; rank 0 writes the rest and commits the checkpoint (CheckpointWriter::save_sharded).
  // Without it rank 0 saves the run alone: every rank holds the same model and state.
  // A pipeline of stage models saves as ZeRO does, each rank its own optimizer state, rank
  // 0 the whole model's weights, the others' gathered to it first (train/stage_weights.h).
  const bool stages = pipeline_ && pipeline_->stage_models();
  const bool sharded = (data_parallel_ && data_parallel_->shards()) || stages;
  if (!sharded && !writes_files()) {
    checkpoint_step_ = progress_.step;
    return (fs::path(checkpoints_->root()) / checkpoint_name(progress_.step)).string();
  }
  const double start = now_seconds();
  std::string path;
  if (stages) {
    const std::vector<GatheredWeight> other_stages = pipeline_->gather_weights();
    ShardedSaveParts parts;
    // Replica 0's ranks write the state; the other replicas' files are empty (the same state).
    // Under ZeRO each replica writes its shard's.
    const bool writes_state = pipeline_->saves_state() || data_parallel_->shards() != nullptr;
    parts.state = writes_state ? saved_state(*model_, *optimizer_) : std::vector<OptimizerStateTensor>{};
    parts.more_weights = &other_stages;
    path = checkpoints_->save_sharded(*model_, *optimizer_, checkpoint_state(), group_->host(), parts);
  } else {
    path = sharded ? checkpoints_->save_sharded(*model_, *optimizer_, checkpoint_state(), group_->host())
                   : checkpoints_->save(*model_, *optimizer_, checkpoint_state());
  }
  checkpoint_step_ = progress_.step;
  if (!writes_files()) return path;
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
