// Multiple-choice tasks scored by log-likelihood, as lm-evaluation-harness scores
// HellaSwag, ARC or PIQA: each choice is a continuation of the context; the model's answer
// is the choice it finds most likely (acc), or most likely per character of the choice
// (acc_norm: lm-eval's length normalization, which stops long choices losing by length).
//
// A task file is JSONL, one example per line:
//   {"context": "The capital of France is", "choices": [" Paris", " Rome"], "answer": 0}
// The choices are scored exactly as written: put the space between context and choice in
// the choice (lm-eval's target_delimiter " " does the same). Other keys are ignored.
#pragma once

#include "eval/loglikelihood.h"

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace kiln::eval {

// The cap on a task file and on a plain-text eval file, each read whole: HellaSwag's
// validation set is 11 MB, wikitext-103's test set 1.3 MB.
inline constexpr size_t kMaxEvalFileBytes = size_t{256} << 20;

struct MultipleChoiceExample {
  std::string context;
  std::vector<std::string> choices;  // at least two
  int64_t answer = 0;                // index into choices
  int64_t line = 0;                  // in the task file, for errors
};

struct MultipleChoiceTask {
  std::string name;  // the file's stem: "arc_easy" for tasks/arc_easy.jsonl
  std::string path;
  std::vector<MultipleChoiceExample> examples;
};

// Reads a task file; a malformed line is an error "[eval] PATH:LINE: ..." naming the key.
// Blank lines are skipped; a file with no example is an error.
MultipleChoiceTask read_multiple_choice_task(const std::string& path);

struct MultipleChoiceResult {
  std::string task;
  int64_t examples = 0;
  double acc = 0, acc_stderr = 0;            // stderr: the sample standard deviation / sqrt(n), as lm-eval
  double acc_norm = 0, acc_norm_stderr = 0;  // NaN when n = 1
  int64_t truncated = 0;                     // examples with a choice cut on the left to fit the context
  // Per example, each choice's log-likelihood (nats) and whether it was the greedy
  // continuation: what lm-eval logs as its samples' resps.
  std::vector<std::vector<ContinuationScore>> scores;
};

// The scoring requests of the first `limit` examples (all when 0), one per choice in
// order. A choice with no token of its own, or too long to be scored in `max_len` tokens,
// is refused naming the file and line ("[eval] PATH:LINE: choice 1 has 100000 tokens ...").
// Training calls it at startup, so a bad task file costs no training.
std::vector<Continuation> encode_task(const Tokenizer& tokenizer, const MultipleChoiceTask& task, bool bos,
                                     int64_t limit, int64_t max_len);

// Scores the first `limit` examples (all when 0) with BOS first when `bos`.
MultipleChoiceResult evaluate_multiple_choice(Generator& generator, const Tokenizer& tokenizer,
                                              const MultipleChoiceTask& task, bool bos, int64_t limit = 0,
                                              const ScoringOptions& options = {});

// lm-eval's mean and its standard error (sample standard deviation over sqrt(n)).
struct MeanWithError {
  double mean = 0, standard_error = 0;
};
MeanWithError mean_with_error(const std::vector<double>& values);

}  // namespace kiln::eval
