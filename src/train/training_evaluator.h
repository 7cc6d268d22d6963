// The trainer's downstream evaluation ([eval]: eval/eval_suite.h): the tasks and texts of
// `kiln eval`, scored every eval.every steps and at the end of the run on the model being
// trained, through the same KV-cache Decoder and Generator as `kiln eval` and `kiln serve`,
// on the device the model is on.
//
// The suite's files are read when the run starts (a bad file costs no training). The
// decoder is built once, before the first step, like the sampler's: its cache is planned
// and allocated with the run's other memory, and it reads the model's own weights in place
// (each evaluation first refreshes the GPU's bf16 compute copies from the masters).
//
// In a multi-process run every rank evaluates the whole suite (the same numbers on each;
// rank 0 records them): simple, and no rank waits at a collective meanwhile.
#pragma once

#include "config/config.h"
#include "data/tokenizer.h"
#include "eval/eval_suite.h"
#include "model/model.h"

#include <functional>
#include <memory>
#include <optional>

namespace kiln {

class Decoder;
class Generator;

class TrainingEvaluator {
 public:
  // The [eval] files, read and checked; throws naming the bad file. An empty suite (no
  // tasks, no texts) means no evaluation.
  static eval::EvalSuite read_suite(const EvalConfig& config);

  // The model must be allocated and outlive the evaluator.
  TrainingEvaluator(Model& model, const Tokenizer& tokenizer, const EvalConfig& config, eval::EvalSuite suite);
  ~TrainingEvaluator();
  TrainingEvaluator(const TrainingEvaluator&) = delete;
  TrainingEvaluator& operator=(const TrainingEvaluator&) = delete;

  // The suite's results at the model's current weights; nullopt when `stop` (polled
  // between decoder steps) ended it first.
  std::optional<eval::EvalResults> evaluate(const std::function<bool()>& stop);

 private:
  Model& model_;
  const Tokenizer& tokenizer_;
  const EvalConfig& config_;
  eval::EvalSuite suite_;
  std::unique_ptr<Decoder> decoder_;
  std::unique_ptr<Generator> generator_;
};

}  // namespace kiln
