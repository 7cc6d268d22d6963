#include "cli/commands.h"
#include "data/tokenizer.h"
#include "infer/sampler.h"
#include "io/model_io.h"
#include "ops/parallel.h"

#include <fmt/format.h>

namespace kiln::cli {

void add_sample_command(CLI::App& app) {
  struct Options {
    std::string model_dir;
    std::string prompt = "\n";
    SampleOptions sample;
    int64_t count = 1;
    int64_t threads = 0;
  };
  auto o = std::make_shared<Options>();
  o->sample.seed = 1;
  CLI::App* cmd = app.add_subcommand("sample", "generate text from a saved model");
  cmd->add_option("model", o->model_dir, "model directory (a run's <out_dir>/model)")->required();
  cmd->add_option("-p,--prompt", o->prompt, "text to continue")->capture_default_str();
  cmd->add_option("-n,--tokens", o->sample.max_tokens, "tokens to generate")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("-t,--temperature", o->sample.temperature, "sampling temperature (0 = greedy)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("-k,--top-k", o->sample.top_k, "sample among the k most likely tokens (0 = all)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--seed", o->sample.seed, "random seed")->capture_default_str();
  cmd->add_option("--count", o->count, "number of samples")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--threads", o->threads, "CPU threads (0 = all)")->capture_default_str();
  cmd->callback([o] {
    set_cpu_threads(o->threads);
    BuildOptions build;
    build.training = false;
    io::LoadedModel loaded = io::load_model(o->model_dir, [&] {
      // Size the inference buffers for the context only.
      const Config c = load_config(o->model_dir + "/config.toml");
      build.max_tokens = c.model.max_seq_len;
      build.loss_chunk_rows = 1;
      return build;
    }());
    const auto tokenizer = make_tokenizer("byte");
    for (int64_t i = 0; i < o->count; ++i) {
      SampleOptions s = o->sample;
      s.seed += static_cast<uint64_t>(i);
      const std::string text = generate(*loaded.model, *tokenizer, o->prompt, s);
      fmt::print("{}{}\n", o->prompt, text);
      if (i + 1 < o->count) fmt::print("---\n");
    }
  });
}

}  // namespace kiln::cli
