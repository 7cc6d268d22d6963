// What a training run records as it goes — steps, validations, samples, skipped updates,
// checkpoints, resumes — and the interface of each place it is written to: metrics.jsonl
// (train/metrics.h) and TensorBoard event files (train/tensorboard_log.h). The trainer
// talks to one RunRecords, which hands each record to every sink of the run (rank 0's;
// the other ranks of a multi-process run have none).
//
// A new kind of record is a method here and its writing in each sink. A record that is
// only named numbers at a step (an evaluation's scores) needs neither: scalars() carries it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace kiln {

using NamedValues = std::vector<std::pair<std::string, double>>;

struct StepMetrics {
  int64_t step = 0;            // 1-based, after the update
  int64_t total_steps = 0;
  double loss = 0;             // mean cross-entropy over the step's target tokens (nats)
  // The other reported loss terms (nn/loss_terms.h) by name, each a mean per target token:
  // "z" (logsumexp^2) when train.z_loss > 0, router losses, ...
  NamedValues terms;
  // The components' diagnostics of the step (Model::component_metrics: an MoE layer's load).
  NamedValues components;
  double lr = 0;
  double grad_norm = 0;        // before clipping
  int64_t tokens = 0;          // positions processed (incl. PAD)
  int64_t document_tokens = 0; // of them, documents' tokens (PAD left out): the real throughput
  int64_t target_tokens = 0;   // tokens with a loss
  double step_seconds = 0;
  double elapsed_seconds = 0;
  double loss_scale = 0;       // the step's dynamic loss scale (train/loss_scaler.h); 0: scaling off
  std::string skipped;         // why the update was skipped (fault guard), "" when applied
  int64_t skipped_total = 0;   // skipped updates so far in the run
  // A log step's record averages over its window: the steps since the last log step.
  // loss is their mean; tokens, document_tokens and step_seconds their sums; the rest is
  // the last step's.
  int64_t window_steps = 1;
  // Model FLOPs utilization per GPU against its bf16 peak (core/peak_flops.h), over the
  // window; NaN where no peak is known (the CPU).
  double mfu = std::nan("");
  int64_t device_memory_used_bytes = 0;  // the GPU's memory in use (every process on it); 0 on the CPU
  int64_t host_peak_rss_bytes = 0;       // this process's peak resident memory so far

  double tokens_per_second() const { return static_cast<double>(tokens) / std::max(step_seconds, 1e-9); }
  double document_tokens_per_second() const {
    return static_cast<double>(document_tokens) / std::max(step_seconds, 1e-9);
  }
};

// One place a run's records go. Each sink handles its own write failures (the policy of
// checkpoint.on_save_error: throw, or warn once and drop later records).
class RunRecordSink {
 public:
  virtual ~RunRecordSink() = default;
  // A log step (every log.every steps and the last): the values averaged over its window.
  virtual void step(const StepMetrics& m) = 0;
  virtual void validation(int64_t step, double loss, double elapsed_seconds) = 0;
  virtual void sample(int64_t step, const std::string& text) = 0;
  // A step whose update the fault guard skipped (the loss may be NaN).
  virtual void skip(int64_t step, const std::string& reason, double loss, double grad_norm) = 0;
  virtual void checkpoint(int64_t step, const std::string& path, double seconds) = 0;
  // The run continues from the checkpoint of `step` at `path`.
  virtual void resume(int64_t step, const std::string& path) = 0;
  // Named numbers of one kind at `step` (kind "eval": {"hellaswag.acc", 0.31}, ...).
  virtual void scalars(int64_t step, const std::string& kind, const NamedValues& values) = 0;
};

// The run's sinks, each record handed to every one in the order they were added.
class RunRecords final : public RunRecordSink {
 public:
  void add(std::unique_ptr<RunRecordSink> sink) { sinks_.push_back(std::move(sink)); }

  void step(const StepMetrics& m) override;
  void validation(int64_t step, double loss, double elapsed_seconds) override;
  void sample(int64_t step, const std::string& text) override;
  void skip(int64_t step, const std::string& reason, double loss, double grad_norm) override;
  void checkpoint(int64_t step, const std::string& path, double seconds) override;
  void resume(int64_t step, const std::string& path) override;
  void scalars(int64_t step, const std::string& kind, const NamedValues& values) override;

 private:
  std::vector<std::unique_ptr<RunRecordSink>> sinks_;
};

}  // namespace kiln
