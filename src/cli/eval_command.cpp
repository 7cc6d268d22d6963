// `kiln eval MODEL --task FILE.jsonl --text FILE`: scores multiple-choice tasks by
// log-likelihood (acc, acc_norm) and measures the perplexity of text, as
// lm-evaluation-harness does (eval/), batched over the KV-cache decoder's slots on the CPU
// or the GPU. The same suite runs during training from [eval].
#include "cli/commands.h"
#include "eval/eval_suite.h"
#include "infer/decoder.h"
#include "io/durable_io.h"
#include "io/model_dir.h"
#include "ops/parallel.h"
#include "core/device_choice.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace kiln::cli {

void add_eval_command(CLI::App& app) {
  struct Options {
    std::string model, json;
    std::vector<std::string> tasks, texts;
    int64_t limit = 0, slots = 8, threads = 0, max_length = 0;
    bool no_bos = false, samples = false;
    std::string device = "auto";
  };
  auto o = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand("eval", "score multiple-choice tasks by log-likelihood and the perplexity of text");
  cmd->add_option("model", o->model, "model directory (a run's <out_dir>/model, a checkpoint, or a run)")->required();
  cmd->add_option("--task", o->tasks,
                  "multiple-choice task, JSONL: {\"context\", \"choices\", \"answer\"} per line (repeatable)");
  cmd->add_option("--text", o->texts, "text file (one document) or JSONL (\"text\" per line) to measure (repeatable)");
  cmd->add_option("--limit", o->limit, "examples per task (the first ones); 0 = all")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--max-length", o->max_length,
                  "tokens of context + continuation kept (the last; lm-eval's max_length); 0 = the model's context")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--slots", o->slots, "sequences scored at once")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_flag("--no-bos", o->no_bos, "no BOS before each context (lm-eval's default for a tokenizer that adds none)");
  cmd->add_option("--json", o->json, "write the results here as JSON");
  cmd->add_flag("--samples", o->samples, "with --json: each example's per-choice log-likelihoods too");
  cmd->add_option("--threads", o->threads, "CPU threads (0 = all)")->capture_default_str();
  add_device_option(cmd, o->device);
  cmd->callback([o] {
    KILN_CHECK(!o->tasks.empty() || !o->texts.empty(), "eval", "nothing to evaluate: give --task and/or --text");
    set_cpu_threads(o->threads);
    // Every file is read before the model loads: a typo costs nothing.
    const eval::EvalSuite suite = eval::read_eval_suite(o->tasks, o->texts);
    const std::string dir = io::resolve_model_dir(o->model);
    io::LoadedModel loaded = io::load_for_decoding(dir, resolve_device(o->device));
    DecoderOptions d;
    d.slots = o->slots;
    d.max_rows = 512;
    Decoder decoder(*loaded.model, d);
    const auto tokenizer = io::model_tokenizer(dir);
    Generator generator(decoder, *tokenizer);
    eval::EvalOptions options;
    options.bos = !o->no_bos;
    options.limit = o->limit;
    options.scoring.max_length = o->max_length;
    const eval::EvalResults results = eval::run_eval_suite(generator, *tokenizer, suite, options);
    fmt::print("{}", eval::format_eval_table(results));
    fmt::print("({:.1f} s on the {})\n", results.seconds, decoder.device() == Device::cuda ? "GPU" : "CPU");
    if (!o->json.empty())
      io::replace_file_atomically(o->json, eval::eval_results_json(results, o->samples).dump(2) + "\n", "eval");
  });
}

}  // namespace kiln::cli
