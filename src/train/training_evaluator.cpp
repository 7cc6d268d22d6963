#include "train/training_evaluator.h"

#include "core/error.h"
#include "eval/multiple_choice.h"
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
  // Every choice encoded and measured now, before the first step: a choice too long for the
  // context used to fail after the last step, as a warning, and the run exited 0.
  const int64_t max_len = eval::scoring_length(*generator_, {});
  for (const eval::MultipleChoiceTask& task : suite_.tasks) eval::encode_task(tokenizer_, task, config_.bos, config_.limit, max_len);
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
