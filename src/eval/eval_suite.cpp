#include "eval/eval_suite.h"

#include "core/error.h"
#include "core/json_number.h"
#include "core/small_file.h"
#include "core/utf8.h"
#include "data/document_reader.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <set>

namespace kiln::eval {
namespace {

bool is_jsonl(const std::string& path) {
  for (const char* ext : {".jsonl", ".jsonl.zst", ".jsonl.gz"})
    if (path.size() >= std::string_view(ext).size() && path.ends_with(ext)) return true;
  return false;
}

}  // namespace

TextSet read_text_set(const std::string& path) {
  TextSet set;
  set.path = path;
  set.name = std::filesystem::path(path).stem().string();
  if (is_jsonl(path)) {
    if (set.name.ends_with(".jsonl")) set.name.resize(set.name.size() - 6);  // x.jsonl.zst
    DataConfig data;
    data.path = path;
    data.format = "jsonl";
    for (Document& d : read_documents(data)) set.documents.push_back(std::move(d.text));
    return set;
  }
  std::string text = read_small_file(path, kMaxEvalFileBytes, "text file", "eval");
  const size_t bad = find_invalid_utf8(text);
  KILN_CHECK(bad == std::string::npos, "eval", "{}: invalid UTF-8 at byte {}", path, bad);
  KILN_CHECK(!text.empty(), "eval", "{}: the file is empty", path);
  set.documents.push_back(std::move(text));
  return set;
}

EvalSuite read_eval_suite(const std::vector<std::string>& task_files, const std::vector<std::string>& text_files) {
  EvalSuite suite;
  std::set<std::string> names;
  auto unique = [&](const std::string& name, const std::string& path) {
    KILN_CHECK(names.insert(name).second, "eval", "{}: a second task or text named '{}' (its scalars would share a tag)",
               path, name);
  };
  for (const std::string& f : task_files) {
    suite.tasks.push_back(read_multiple_choice_task(f));
    unique(suite.tasks.back().name, f);
  }
  for (const std::string& f : text_files) {
    suite.texts.push_back(read_text_set(f));
    unique(suite.texts.back().name, f);
  }
  return suite;
}

EvalResults run_eval_suite(Generator& generator, const Tokenizer& tokenizer, const EvalSuite& suite,
                           const EvalOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  EvalResults results;
  for (const MultipleChoiceTask& task : suite.tasks)
    results.tasks.push_back(evaluate_multiple_choice(generator, tokenizer, task, options.bos, options.limit, options.scoring));
  for (const TextSet& text : suite.texts)
    results.texts.push_back(evaluate_perplexity(generator, tokenizer, text.name, text.documents, options.scoring));
  results.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return results;
}

std::vector<std::pair<std::string, double>> eval_scalars(const EvalResults& results) {
  std::vector<std::pair<std::string, double>> out;
  for (const MultipleChoiceResult& t : results.tasks) {
    out.emplace_back(fmt::format("{}/acc", t.task), t.acc);
    out.emplace_back(fmt::format("{}/acc_norm", t.task), t.acc_norm);
  }
  for (const PerplexityResult& t : results.texts) {
    out.emplace_back(fmt::format("{}/token_perplexity", t.name), t.token_perplexity);
    out.emplace_back(fmt::format("{}/word_perplexity", t.name), t.word_perplexity);
    out.emplace_back(fmt::format("{}/bits_per_byte", t.name), t.bits_per_byte);
  }
  return out;
}

std::string format_eval_table(const EvalResults& results) {
  std::string out;
  auto plus_minus = [](double v) { return std::isfinite(v) ? fmt::format("± {:.4f}", v) : std::string("± n/a"); };
  if (!results.tasks.empty()) {
    out += fmt::format("{:<24} {:>8} {:>8} {:>10} {:>9} {:>10}\n", "task", "examples", "acc", "", "acc_norm", "");
    for (const MultipleChoiceResult& t : results.tasks) {
      out += fmt::format("{:<24} {:>8} {:>8.4f} {:>10} {:>9.4f} {:>10}", t.task, t.examples, t.acc,
                         plus_minus(t.acc_stderr), t.acc_norm, plus_minus(t.acc_norm_stderr));
      if (t.truncated) out += fmt::format("  ({} cut to fit the context)", t.truncated);
      out += "\n";
    }
  }
  if (!results.texts.empty()) {
    out += fmt::format("{:<24} {:>9} {:>10} {:>10} {:>10} {:>10} {:>13}\n", "text", "documents", "tokens",
                       "token_ppl", "word_ppl", "byte_ppl", "bits_per_byte");
    for (const PerplexityResult& t : results.texts)
      out += fmt::format("{:<24} {:>9} {:>10} {:>10.4f} {:>10.4f} {:>10.4f} {:>13.4f}\n", t.name, t.documents,
                         t.tokens, t.token_perplexity, t.word_perplexity, t.byte_perplexity, t.bits_per_byte);
  }
  return out;
}

nlohmann::json eval_results_json(const EvalResults& results, bool samples) {
  nlohmann::json j = {{"tasks", nlohmann::json::object()}, {"texts", nlohmann::json::object()},
                      {"seconds", results.seconds}};
  for (const MultipleChoiceResult& t : results.tasks) {
    nlohmann::json m = {{"examples", t.examples},         {"acc", json_number(t.acc)},
                        {"acc_stderr", json_number(t.acc_stderr)}, {"acc_norm", json_number(t.acc_norm)},
                        {"acc_norm_stderr", json_number(t.acc_norm_stderr)}, {"truncated", t.truncated}};
    if (samples) {
      nlohmann::json examples = nlohmann::json::array();
      for (const auto& choices : t.scores) {
        nlohmann::json lls = nlohmann::json::array();
        for (const ContinuationScore& c : choices) lls.push_back({c.logprob, c.greedy});
        examples.push_back(std::move(lls));
      }
      m["samples"] = std::move(examples);
    }
    j["tasks"][t.task] = std::move(m);
  }
  for (const PerplexityResult& t : results.texts)
    j["texts"][t.name] = {{"documents", t.documents},
                          {"tokens", t.tokens},
                          {"words", t.words},
                          {"bytes", t.bytes},
                          {"logprob", t.logprob},
                          {"token_perplexity", json_number(t.token_perplexity)},
                          {"word_perplexity", json_number(t.word_perplexity)},
                          {"byte_perplexity", json_number(t.byte_perplexity)},
                          {"bits_per_byte", json_number(t.bits_per_byte)}};
  return j;
}

std::vector<std::string> split_file_list(const std::string& list) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= list.size()) {
    size_t end = list.find(',', start);
    if (end == std::string::npos) end = list.size();
    std::string item = list.substr(start, end - start);
    const size_t first = item.find_first_not_of(" \t"), last = item.find_last_not_of(" \t");
    if (first != std::string::npos) out.push_back(item.substr(first, last - first + 1));
    start = end + 1;
  }
  return out;
}

}  // namespace kiln::eval
