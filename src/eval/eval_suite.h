// An evaluation suite: the multiple-choice tasks and the texts whose perplexity one
// evaluation measures, read once and run as often as asked (`kiln eval`, and [eval] during
// training), with its results as a table, as JSON and as named scalars for the run's
// metrics and TensorBoard.
#pragma once

#include "eval/multiple_choice.h"
#include "eval/perplexity.h"

#include <nlohmann/json_fwd.hpp>

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace kiln::eval {

// The documents of a text file (one document: the whole file) or of a JSONL file (one per
// line, its "text"), whose perplexity is measured.
struct TextSet {
  std::string name;  // the file's stem
  std::string path;
  std::vector<std::string> documents;
};
TextSet read_text_set(const std::string& path);

struct EvalSuite {
  std::vector<MultipleChoiceTask> tasks;
  std::vector<TextSet> texts;
  bool empty() const { return tasks.empty() && texts.empty(); }
};
// Reads every file; an unreadable or malformed one is an error naming it. Two files with
// one name (a/x.jsonl, b/x.jsonl) are an error: their scalars would share a tag.
EvalSuite read_eval_suite(const std::vector<std::string>& task_files, const std::vector<std::string>& text_files);

struct EvalResults {
  std::vector<MultipleChoiceResult> tasks;
  std::vector<PerplexityResult> texts;
  double seconds = 0;
};

struct EvalOptions {
  bool bos = true;     // BOS before every context
  int64_t limit = 0;   // examples per task; 0 = all
  ScoringOptions scoring;
};
EvalResults run_eval_suite(Generator& generator, const Tokenizer& tokenizer, const EvalSuite& suite,
                           const EvalOptions& options);

// "<task>/acc", "<task>/acc_norm", "<text>/bits_per_byte", ...: what the trainer records
// as an "eval" record (TensorBoard's "eval/<task>/acc").
std::vector<std::pair<std::string, double>> eval_scalars(const EvalResults& results);
// The aligned table `kiln eval` prints (and the trainer, after an evaluation).
std::string format_eval_table(const EvalResults& results);
// Every metric, and with `samples` each example's per-choice log-likelihoods.
nlohmann::json eval_results_json(const EvalResults& results, bool samples);

// "a.jsonl, b.jsonl" -> {"a.jsonl", "b.jsonl"} (whitespace around each trimmed; empty
// entries dropped): the lists of [eval] tasks and texts.
std::vector<std::string> split_file_list(const std::string& list);

}  // namespace kiln::eval
