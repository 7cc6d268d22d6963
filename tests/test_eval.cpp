// Evaluation (src/eval/): lm-evaluation-harness's pair encoding, rolling windows and word
// count; multiple-choice log-likelihoods, accuracies and perplexity equal to references
// computed here from the full (training-path) forward; the task file's errors; a stop
// cutting an evaluation short; and `kiln eval` end to end.
#include "eval/eval_suite.h"
#include "export_fixture.h"
#include "full_forward.h"
#include "infer/decoder.h"
#include "io/model_dir.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>

namespace kiln {
namespace {

namespace fs = std::filesystem;
using eval::Continuation;

std::vector<int32_t> bytes(const std::string& s) {
  std::vector<int32_t> ids;
  for (const unsigned char c : s) ids.push_back(c);
  return ids;
}

std::vector<int32_t> concat(std::vector<int32_t> a, const std::vector<int32_t>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// A tokenizer with one merge: "ab" is one token (id 300), so a pair whose border falls
// inside "ab" shows where lm-eval puts the spanning token.
class MergingTokenizer final : public Tokenizer {
 public:
  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> ids;
    for (size_t i = 0; i < text.size(); ++i) {
      if (text.substr(i, 2) == "ab") ids.push_back(300), ++i;
      else ids.push_back(static_cast<unsigned char>(text[i]));
    }
    return ids;
  }
  std::string decode(std::span<const int32_t>) const override { return ""; }
  int32_t vocab_size() const override { return 301; }
  int32_t bos_id() const override { return 256; }
  int32_t eos_id() const override { return 257; }
  int32_t pad_id() const override { return 258; }
  std::string name() const override { return "merging"; }
};

TEST(EvalEncoding, PairsAreEncodedAsLmEvalEncodesThem) {
  const ByteTokenizer byte;
  // The context's trailing whitespace moves to the continuation.
  Continuation c = eval::encode_pair(byte, "Q: a \t", "b", true);
  EXPECT_EQ(c.context, concat({ByteTokenizer::kBos}, bytes("Q: a")));
  EXPECT_EQ(c.continuation, bytes(" \tb"));
  c = eval::encode_pair(byte, "Q: a", " b", false);
  EXPECT_EQ(c.context, bytes("Q: a"));
  EXPECT_EQ(c.continuation, bytes(" b"));
  // An empty context is BOS, with or without BOS asked for.
  for (const bool bos : {true, false}) {
    c = eval::encode_pair(byte, "", "xy", bos);
    EXPECT_EQ(c.context, std::vector<int32_t>{ByteTokenizer::kBos});
    EXPECT_EQ(c.continuation, bytes("xy"));
  }
  // A token spanning the border belongs to the continuation: whole = [x, ab, c], the
  // context alone [x, a], so the continuation is what follows two tokens: [c].
  const MergingTokenizer merging;
  c = eval::encode_pair(merging, "xa", "bc", false);
  EXPECT_EQ(c.context, (std::vector<int32_t>{'x', 'a'}));
  EXPECT_EQ(c.continuation, (std::vector<int32_t>{'c'}));
}

TEST(EvalEncoding, RollingWindowsPredictEveryTokenOnceAsLmEval) {
  std::vector<int32_t> t(10);
  std::iota(t.begin(), t.end(), 0);
  // lm-eval's get_rolling_token_windows(t, prefix=99, max_seq_len=4, context_len=1) and
  // make_disjoint_window, worked out by hand.
  const std::vector<Continuation> w = eval::rolling_windows(t, 99, 4);
  ASSERT_EQ(w.size(), 3u);
  EXPECT_EQ(w[0].context, std::vector<int32_t>{99});
  EXPECT_EQ(w[0].continuation, (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(w[1].context, std::vector<int32_t>{3});
  EXPECT_EQ(w[1].continuation, (std::vector<int32_t>{4, 5, 6, 7}));
  EXPECT_EQ(w[2].context, (std::vector<int32_t>{5, 6, 7}));  // the short last window sees more
  EXPECT_EQ(w[2].continuation, (std::vector<int32_t>{8, 9}));
  EXPECT_TRUE(eval::rolling_windows({}, 99, 4).empty());
  // Every length and window: each token predicted once, in order, with its true context
  // (the tokens right before it), and no window longer than window + 1.
  for (int64_t n = 1; n <= 23; ++n)
    for (int64_t window = 1; window <= 7; ++window) {
      std::vector<int32_t> tokens(static_cast<size_t>(n));
      std::iota(tokens.begin(), tokens.end(), 0);
      int32_t next = 0;
      for (const Continuation& c : eval::rolling_windows(tokens, -1, window)) {
        EXPECT_LE(c.context.size() + c.continuation.size(), static_cast<size_t>(window + 1));
        ASSERT_FALSE(c.context.empty());
        EXPECT_EQ(c.context.back(), next - 1);  // -1: the prefix before token 0
        for (const int32_t id : c.continuation) EXPECT_EQ(id, next++);
      }
      EXPECT_EQ(next, n) << "n " << n << " window " << window;
    }
}

TEST(EvalEncoding, WordsCountAsPythonsSplitOnWhitespace) {
  EXPECT_EQ(eval::count_words("one two  three"), 3);
  EXPECT_EQ(eval::count_words("one\n\ntwo"), 2);
  EXPECT_EQ(eval::count_words(" lead"), 2);  // re.split gives ['', 'lead']
  EXPECT_EQ(eval::count_words("trail\n"), 2);
  EXPECT_EQ(eval::count_words("single"), 1);
}

TEST(EvalEncoding, MeanAndStandardErrorAsLmEval) {
  const eval::MeanWithError m = eval::mean_with_error({1, 0, 1, 1});
  EXPECT_DOUBLE_EQ(m.mean, 0.75);
  EXPECT_NEAR(m.standard_error, 0.25, 1e-12);  // sample variance 0.75/3, so sd 0.5, over sqrt(4)
  EXPECT_TRUE(std::isnan(eval::mean_with_error({1}).standard_error));
  EXPECT_EQ(eval::split_file_list(" a.jsonl, b.jsonl ,,"), (std::vector<std::string>{"a.jsonl", "b.jsonl"}));
}

// A random model saved as a kiln model directory, loaded twice: the decoder's model and the
// reference's full forward.
struct EvalFixture {
  std::string dir;
  io::LoadedModel decoder_model, reference;
  std::unique_ptr<Decoder> decoder;
  std::unique_ptr<Generator> generator;
  ByteTokenizer tokenizer;
  EvalFixture() {
    dir = test::save_random_model(test::tiny_config(true, true, false), test::temp_dir("eval") + "/model");
    decoder_model = io::load_for_inference(dir, 64);
    reference = io::load_for_inference(dir, 64);
    DecoderOptions d;
    d.slots = 3;    // requests wait for slots and share steps
    d.max_rows = 7; // prompts prefill in chunks that mix sequences
    decoder = std::make_unique<Decoder>(*decoder_model.model, d);
    generator = std::make_unique<Generator>(*decoder, tokenizer);
  }

  // Sum of log p(tokens[t] | tokens[..t]) for t >= first, from the full forward's logits,
  // in double; the last `keep` tokens only (the context), as lm-eval truncates.
  double reference_logprob(std::vector<int32_t> tokens, size_t first, size_t keep = 64) {
    if (tokens.size() > keep) {
      const size_t cut = tokens.size() - keep;
      tokens.erase(tokens.begin(), tokens.begin() + static_cast<std::ptrdiff_t>(cut));
      first -= cut;
    }
    Model& m = *reference.model;
    const std::vector<float> logits = test::full_forward_logits(m, tokens, 0, static_cast<int64_t>(tokens.size()));
    const auto vocab = static_cast<size_t>(m.config().vocab_size);
    double sum = 0;
    for (size_t t = first; t < tokens.size(); ++t) {
      const float* row = logits.data() + (t - 1) * vocab;
      double max = row[0], total = 0;
      for (size_t v = 0; v < 259; ++v) max = std::max<double>(max, row[v]);  // the tokenizer's ids
      for (size_t v = 0; v < 259; ++v) total += std::exp(row[v] - max);
      sum += row[static_cast<size_t>(tokens[t])] - max - std::log(total);
    }
    return sum;
  }
  double reference_logprob(const Continuation& c, size_t keep = 64) {
    return reference_logprob(concat(c.context, c.continuation), c.context.size(), keep);
  }
};

eval::MultipleChoiceTask sample_task() {
  eval::MultipleChoiceTask task;
  task.name = "sample";
  task.path = "sample.jsonl";
  const std::vector<std::string> contexts = {"The sky is", "Two and two make ", "", "To be or not",
                                             std::string(80, 'z') + " long context"};
  for (size_t i = 0; i < contexts.size(); ++i)
    task.examples.push_back({contexts[i], {" blue", " green and far longer", "x", " 4"}, static_cast<int64_t>(i % 4)});
  return task;
}

TEST(Eval, MultipleChoiceEqualsTheFullForward) {
  EvalFixture f;
  const eval::MultipleChoiceTask task = sample_task();
  const eval::MultipleChoiceResult r = eval::evaluate_multiple_choice(*f.generator, f.tokenizer, task, true);
  ASSERT_EQ(r.examples, 5);
  ASSERT_EQ(r.scores.size(), 5u);
  EXPECT_EQ(r.truncated, 1);  // the 80-byte context + choice exceed 64 positions
  std::vector<double> correct, correct_norm;
  for (size_t i = 0; i < task.examples.size(); ++i) {
    const auto& e = task.examples[i];
    size_t best = 0, best_norm = 0;
    std::vector<double> lls;
    for (size_t c = 0; c < e.choices.size(); ++c) {
      const Continuation pair = eval::encode_pair(f.tokenizer, e.context, e.choices[c], true);
      const double want = f.reference_logprob(pair);
      EXPECT_NEAR(r.scores[i][c].logprob, want, 2e-4 * std::max(1.0, std::abs(want))) << i << " " << c;
      EXPECT_EQ(r.scores[i][c].tokens, static_cast<int64_t>(pair.continuation.size()));
      lls.push_back(want);
      if (want > lls[best]) best = c;
      if (want / e.choices[c].size() > lls[best_norm] / e.choices[best_norm].size()) best_norm = c;
    }
    correct.push_back(static_cast<int64_t>(best) == e.answer);
    correct_norm.push_back(static_cast<int64_t>(best_norm) == e.answer);
  }
  const eval::MeanWithError acc = eval::mean_with_error(correct), acc_norm = eval::mean_with_error(correct_norm);
  EXPECT_DOUBLE_EQ(r.acc, acc.mean);
  EXPECT_DOUBLE_EQ(r.acc_stderr, acc.standard_error);
  EXPECT_DOUBLE_EQ(r.acc_norm, acc_norm.mean);
  // A choice is greedy when each of its tokens is the argmax: "x" after "To be or not" is
  // one token; check the flag against the reference's own argmax.
  const Continuation one = eval::encode_pair(f.tokenizer, "To be or not", "x", true);
  const std::vector<float> last = test::full_forward_last(*f.reference.model, one.context);
  const auto argmax = std::max_element(last.begin(), last.begin() + 259) - last.begin();
  EXPECT_EQ(r.scores[3][2].greedy, argmax == 'x');
  // A shorter max length (lm-eval's max_length) cuts more contexts, each as the reference.
  const eval::MultipleChoiceResult shorter =
      eval::evaluate_multiple_choice(*f.generator, f.tokenizer, task, true, 0, {.max_length = 24});
  EXPECT_EQ(shorter.truncated, 4);  // all but the empty context (BOS + at most 21 bytes: 22)
  for (size_t i = 0; i < task.examples.size(); ++i)
    for (size_t c = 0; c < task.examples[i].choices.size(); ++c) {
      const double want = f.reference_logprob(eval::encode_pair(f.tokenizer, task.examples[i].context,
                                                                task.examples[i].choices[c], true), 24);
      EXPECT_NEAR(shorter.scores[i][c].logprob, want, 2e-4 * std::max(1.0, std::abs(want))) << i << " " << c;
    }
  EXPECT_THROW(eval::evaluate_multiple_choice(*f.generator, f.tokenizer, task, true, 0, {.max_length = 65}), Error);
  // --limit: the first examples only, the same scores.
  const eval::MultipleChoiceResult first = eval::evaluate_multiple_choice(*f.generator, f.tokenizer, task, true, 2);
  ASSERT_EQ(first.examples, 2);
  EXPECT_DOUBLE_EQ(first.scores[1][1].logprob, r.scores[1][1].logprob);
}

TEST(Eval, PerplexityEqualsTheFullForward) {
  EvalFixture f;
  const std::string text = "It was the best of times, it was the worst of times, it was the age of wisdom, "
                           "it was the age of foolishness, it was the epoch of belief.";  // 137 bytes: 3 windows
  const eval::PerplexityResult r = eval::evaluate_perplexity(*f.generator, f.tokenizer, "dickens", {text, ""});
  EXPECT_EQ(r.documents, 1);  // the empty one has no token
  EXPECT_EQ(r.tokens, static_cast<int64_t>(text.size()));
  EXPECT_EQ(r.bytes, static_cast<int64_t>(text.size()));
  EXPECT_EQ(r.words, 30);
  // The windows of 63 tokens (the context of 64 less one), each from the full forward.
  double want = 0;
  const std::vector<Continuation> windows = eval::rolling_windows(bytes(text), ByteTokenizer::kBos, 63);
  ASSERT_EQ(windows.size(), 3u);
  for (const Continuation& w : windows) want += f.reference_logprob(w);
  EXPECT_NEAR(r.logprob, want, 2e-4 * std::abs(want));
  EXPECT_NEAR(r.token_perplexity, std::exp(-want / static_cast<double>(text.size())), 1e-3 * r.token_perplexity);
  EXPECT_NEAR(r.word_perplexity, std::exp(-want / 30.0), 1e-3 * r.word_perplexity);
  EXPECT_NEAR(r.bits_per_byte, -want / static_cast<double>(text.size()) / std::log(2.0), 1e-4);
}

TEST(Eval, AStopEndsTheEvaluationAndFreesTheGenerator) {
  EvalFixture f;
  int polls = 0;
  EXPECT_THROW(eval::evaluate_multiple_choice(*f.generator, f.tokenizer, sample_task(), true, 0,
                                              {0, [&polls] { return ++polls >= 2; }}),
               eval::EvalStopped);
  EXPECT_EQ(polls, 2);
  EXPECT_TRUE(f.generator->idle());
  // The generator is whole again: the next evaluation runs.
  EXPECT_EQ(eval::evaluate_multiple_choice(*f.generator, f.tokenizer, sample_task(), true).examples, 5);
}

TEST(Eval, BadTaskFilesAreErrorsNamingFileAndLine) {
  const std::string dir = test::temp_dir("eval-bad");
  const std::string ok = R"({"context": "a", "choices": [" b", " c"], "answer": 1})";
  auto message = [&](const std::string& body) {
    const std::string path = dir + "/task.jsonl";
    test::write_file(path, body);
    try {
      eval::read_multiple_choice_task(path);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string path = dir + "/task.jsonl";
  test::write_file(path, ok + "\n\n" + ok + "\r\n");  // blank lines skipped, CRLF read
  EXPECT_EQ(eval::read_multiple_choice_task(path).examples.size(), 2u);
  EXPECT_NE(message(ok + "\n{\"context\": 1, \"choices\": [\"a\", \"b\"], \"answer\": 0}\n").find(path + ":2: 'context'"),
            std::string::npos);
  EXPECT_NE(message(ok + "\n" + ok + "\n{\"context\": \"a\", \"choices\": [\"a\"], \"answer\": 0}").find(path + ":3: 'choices'"),
            std::string::npos);
  EXPECT_NE(message(R"({"context": "a", "choices": ["a", "b"], "answer": 2})").find(":1: 'answer' 2 is not the index"),
            std::string::npos);
  // 2^64 - 1 was read as -1 (nlohmann's unsigned integers wrap in get<int64_t>): shown as given.
  EXPECT_NE(message(R"({"context": "a", "choices": ["a", "b"], "answer": 18446744073709551615})")
                .find(":1: 'answer' 18446744073709551615 is not the index of one of the 2 choices"),
            std::string::npos);
  EXPECT_NE(message(R"({"context": "a", "choices": ["a", "b"], "answer": 1e300})").find(":1: 'answer' must be an integer"),
            std::string::npos);
  EXPECT_NE(message(R"({"context": "a", "choices": ["a", ""], "answer": 0})").find(":1: every one of 'choices'"),
            std::string::npos);
  EXPECT_NE(message("{not json\n").find(":1: not JSON"), std::string::npos);
  EXPECT_NE(message("\n\n").find("no examples"), std::string::npos);
  EXPECT_NE(message(std::string("{\"context\": \"\xff\"}")).find(":1: the line is not valid UTF-8"), std::string::npos);
  EXPECT_NE(message("").find("no examples"), std::string::npos);
  try {
    eval::read_multiple_choice_task(dir + "/missing.jsonl");
    ADD_FAILURE() << "a missing file was read";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing.jsonl: cannot open"), std::string::npos) << e.what();
  }
  // Two files of one name would write one tag twice.
  fs::create_directories(dir + "/other");
  test::write_file(dir + "/task.jsonl", ok);
  test::write_file(dir + "/other/task.jsonl", ok);
  EXPECT_THROW(eval::read_eval_suite({dir + "/task.jsonl", dir + "/other/task.jsonl"}, {}), Error);
}

TEST(EvalCli, ScoresTasksAndTextAsTheLibraryDoes) {
  EvalFixture f;
  const std::string dir = test::temp_dir("eval-cli");
  std::string lines;
  const eval::MultipleChoiceTask task = sample_task();
  for (const auto& e : task.examples)
    lines += nlohmann::json{{"context", e.context}, {"choices", e.choices}, {"answer", e.answer}}.dump() + "\n";
  test::write_file(dir + "/sample.jsonl", lines);
  const std::string text = "the quick brown fox jumps over the lazy dog, again and again and again, until it is tired.";
  test::write_file(dir + "/fox.txt", text);
  std::string out;
  const int rc = test::run_command(test::kiln_binary() + " eval " + f.dir + " --device cpu --task " + dir +
                                       "/sample.jsonl --text " + dir + "/fox.txt --json " + dir + "/out.json --samples",
                                   &out);
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("sample"), std::string::npos) << out;
  EXPECT_NE(out.find("bits_per_byte"), std::string::npos) << out;
  const nlohmann::json j = nlohmann::json::parse(test::read_file(dir + "/out.json"));
  const eval::MultipleChoiceResult want = eval::evaluate_multiple_choice(*f.generator, f.tokenizer, task, true);
  EXPECT_DOUBLE_EQ(j["tasks"]["sample"]["acc"].get<double>(), want.acc);
  EXPECT_DOUBLE_EQ(j["tasks"]["sample"]["acc_norm"].get<double>(), want.acc_norm);
  EXPECT_EQ(j["tasks"]["sample"]["examples"].get<int64_t>(), 5);
  for (size_t i = 0; i < want.scores.size(); ++i)
    for (size_t c = 0; c < want.scores[i].size(); ++c)
      EXPECT_NEAR(j["tasks"]["sample"]["samples"][i][c][0].get<double>(), want.scores[i][c].logprob, 1e-4);
  const eval::PerplexityResult ppl = eval::evaluate_perplexity(*f.generator, f.tokenizer, "fox", {text});
  EXPECT_NEAR(j["texts"]["fox"]["logprob"].get<double>(), ppl.logprob, 1e-4 * std::abs(ppl.logprob));
  EXPECT_EQ(j["texts"]["fox"]["tokens"].get<int64_t>(), static_cast<int64_t>(text.size()));
  // Nothing to evaluate, or a bad file: one line naming it, exit 1, before the model loads.
  EXPECT_EQ(test::run_command(test::kiln_binary() + " eval " + f.dir, &out), 1);
  EXPECT_NE(out.find("nothing to evaluate"), std::string::npos) << out;
  test::write_file(dir + "/bad.jsonl", "{\"context\": \"a\"}\n");
  EXPECT_EQ(test::run_command(test::kiln_binary() + " eval /nonexistent --task " + dir + "/bad.jsonl", &out), 1);
  EXPECT_NE(out.find("bad.jsonl:1: 'choices'"), std::string::npos) << out;
}

}  // namespace
}  // namespace kiln
