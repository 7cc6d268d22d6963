#include "eval/multiple_choice.h"

#include "core/error.h"
#include "core/json_field.h"
#include "core/small_file.h"
#include "core/utf8.h"

#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <sstream>
#include <limits>

namespace kiln::eval {
namespace {

using nlohmann::json;

MultipleChoiceExample parse_example(const json& j, const std::string& where) {
  KILN_CHECK(j.is_object(), "eval", "{}: an example must be a JSON object", where);
  MultipleChoiceExample e;
  const auto context = j.find("context");
  KILN_CHECK(context != j.end() && context->is_string(), "eval", "{}: 'context' must be a string", where);
  e.context = context->get<std::string>();
  const auto choices = j.find("choices");
  KILN_CHECK(choices != j.end() && choices->is_array() && choices->size() >= 2, "eval",
             "{}: 'choices' must be a list of at least two strings", where);
  for (const json& c : *choices) {
    KILN_CHECK(c.is_string() && !c.get_ref<const std::string&>().empty(), "eval",
               "{}: every one of 'choices' must be a non-empty string", where);
    e.choices.push_back(c.get<std::string>());
  }
  const auto answer = j.find("answer");
  KILN_CHECK(answer != j.end() && answer->is_number_integer(), "eval", "{}: 'answer' must be an integer", where);
  const std::optional<int64_t> index = json_int64(*answer);  // nullopt from 2^63 up
  KILN_CHECK(index && *index >= 0 && *index < static_cast<int64_t>(e.choices.size()), "eval",
             "{}: 'answer' {} is not the index of one of the {} choices", where, answer->dump(), e.choices.size());
  e.answer = *index;
  return e;
}

// lm-eval's acc_norm divides by the choice's length in characters (Python's len: code points).
double characters(const std::string& text) {
  double n = 0;
  for (const unsigned char c : text) n += (c & 0xC0) != 0x80;
  return n;
}

}  // namespace

MultipleChoiceTask read_multiple_choice_task(const std::string& path) {
  // Capped and refused unless a regular file: /dev/zero was one line read without end.
  const std::string text = read_small_file(path, kMaxEvalFileBytes, "task file (JSONL)", "eval");
  MultipleChoiceTask task;
  task.path = path;
  task.name = std::filesystem::path(path).stem().string();
  std::istringstream in(text);
  std::string line;
  for (int64_t number = 1; std::getline(in, line); ++number) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.find_first_not_of(" \t") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(number);
    KILN_CHECK(is_valid_utf8(line), "eval", "{}: the line is not valid UTF-8", where);
    json j;
    try {
      j = json::parse(line);
    } catch (const json::parse_error& e) {
      fail("eval", "{}: not JSON ({})", where, e.what());
    }
    task.examples.push_back(parse_example(j, where));
    task.examples.back().line = number;
  }
  KILN_CHECK(!task.examples.empty(), "eval", "{}: no examples in the task file", path);
  return task;
}

std::vector<Continuation> encode_task(const Tokenizer& tokenizer, const MultipleChoiceTask& task, bool bos,
                                     int64_t limit, int64_t max_len) {
  const size_t count = limit > 0 ? std::min(task.examples.size(), static_cast<size_t>(limit)) : task.examples.size();
  std::vector<Continuation> requests;
  for (size_t i = 0; i < count; ++i) {
    const MultipleChoiceExample& e = task.examples[i];
    for (size_t c = 0; c < e.choices.size(); ++c) {
      requests.push_back(encode_pair(tokenizer, e.context, e.choices[c], bos));
      const size_t tokens = requests.back().continuation.size();
      KILN_CHECK(tokens > 0, "eval", "{}:{}: choice {} has no token to score", task.path, e.line, c);
      // One position more than the choice predicts its first token (score_continuations).
      KILN_CHECK(static_cast<int64_t>(tokens) < max_len, "eval",
                 "{}:{}: choice {} has {} tokens; at most {} fit the model's context of {}", task.path, e.line, c,
                 tokens, max_len - 1, max_len);
    }
  }
  return requests;
}

MeanWithError mean_with_error(const std::vector<double>& values) {
  MeanWithError m;
  const auto n = static_cast<double>(values.size());
  if (values.empty()) return {std::nan(""), std::nan("")};
  for (const double v : values) m.mean += v;
  m.mean /= n;
  if (values.size() < 2) {
    m.standard_error = std::nan("");
    return m;
  }
  double squares = 0;
  for (const double v : values) squares += (v - m.mean) * (v - m.mean);
  m.standard_error = std::sqrt(squares / (n - 1)) / std::sqrt(n);
  return m;
}

MultipleChoiceResult evaluate_multiple_choice(Generator& generator, const Tokenizer& tokenizer,
                                              const MultipleChoiceTask& task, bool bos, int64_t limit,
                                              const ScoringOptions& options) {
  const size_t count = limit > 0 ? std::min(task.examples.size(), static_cast<size_t>(limit)) : task.examples.size();
  const std::vector<Continuation> requests =
      encode_task(tokenizer, task, bos, limit, scoring_length(generator, options));
  const std::vector<ContinuationScore> scores = score_continuations(generator, requests, options);

  MultipleChoiceResult result;
  result.task = task.name;
  result.examples = static_cast<int64_t>(count);
  std::vector<double> correct, correct_norm;
  size_t r = 0;
  for (size_t i = 0; i < count; ++i) {
    const MultipleChoiceExample& e = task.examples[i];
    std::vector<ContinuationScore> mine(scores.begin() + static_cast<std::ptrdiff_t>(r),
                                        scores.begin() + static_cast<std::ptrdiff_t>(r + e.choices.size()));
    r += e.choices.size();
    // The first maximum wins, as numpy's argmax.
    size_t best = 0, best_norm = 0;
    double best_ll = -std::numeric_limits<double>::infinity(), best_ll_norm = best_ll;
    bool truncated = false;
    for (size_t c = 0; c < e.choices.size(); ++c) {
      truncated |= mine[c].truncated;
      if (mine[c].logprob > best_ll) best_ll = mine[c].logprob, best = c;
      const double per_character = mine[c].logprob / characters(e.choices[c]);
      if (per_character > best_ll_norm) best_ll_norm = per_character, best_norm = c;
    }
    correct.push_back(static_cast<int64_t>(best) == e.answer ? 1.0 : 0.0);
    correct_norm.push_back(static_cast<int64_t>(best_norm) == e.answer ? 1.0 : 0.0);
    result.truncated += truncated;
    result.scores.push_back(std::move(mine));
  }
  const MeanWithError acc = mean_with_error(correct), acc_norm = mean_with_error(correct_norm);
  result.acc = acc.mean, result.acc_stderr = acc.standard_error;
  result.acc_norm = acc_norm.mean, result.acc_norm_stderr = acc_norm.standard_error;
  return result;
}

}  // namespace kiln::eval
