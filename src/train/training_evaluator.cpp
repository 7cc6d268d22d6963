#include "train/training_evaluator.h"

#include "core/error.h"
#include "infer/decoder.h"
#include "infer/generator.h"

namespace kiln {

eval::EvalSuite TrainingEvaluator::read_suite(const EvalConfig& config) {
  // Errors are "[eval] FILE:LINE: ...": the file, which the [eval] lists name.
  return eval::read_eval_suite(eval::split_file_list(config.tasks), eval::split_file_list(config.texts));
}

TrainingEvaluator::TrainingEvaluator(Model& model, const Tokenizer& tokenizer, const EvalConfig& config,
                                     eval::EvalSuite suite)
    : model_(model), tokenizer_(tokenizer), config_(config), suite_(std::move(suite)) {
  DecoderOptions d;
  d.slots = config.slots;
  d.max_rows = 256;  // prefill chunks: scoring is all prefill
  decoder_ = std::make_unique<Decoder>(model, d);
  generator_ = std::make_unique<Generator>(*decoder_, tokenizer);
}

TrainingEvaluator::~TrainingEvaluator() = default;

std::optional<eval::EvalResults> TrainingEvaluator::evaluate(const std::function<bool()>& stop) {
  model_.refresh_compute_weights();  // the optimizer moved the masters since the last forward
  eval::EvalOptions options;
  options.bos = config_.bos;
  options.limit = config_.limit;
  options.scoring.stop = stop;
  try {
    return eval::run_eval_suite(*generator_, tokenizer_, suite_, options);
  } catch (const eval::EvalStopped&) {
    return std::nullopt;
  }
}

}  // namespace kiln
