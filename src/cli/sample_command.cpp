// `kiln sample MODEL`: text from a saved model through the KV-cache decoder. Several
// --prompt values (and --count samples of each) run as one batch over the cache's slots.
// On the GPU (--device, default auto) the decoder computes in bf16 and replays each step
// shape as a CUDA graph; sampling itself runs on the host.
#include "cli/commands.h"
#include "infer/generator.h"
#include "io/model_dir.h"
#include "ops/parallel.h"
#include "core/device_choice.h"

#include <fmt/format.h>

namespace kiln::cli {

void add_sample_command(CLI::App& app) {
  struct Options {
    std::string model_dir;
    std::vector<std::string> prompts;
    std::vector<std::string> stop;
    SamplingParams sampling;
    int64_t tokens = 200;
    uint64_t seed = 1;
    int64_t count = 1;
    int64_t threads = 0;
    int64_t slots = 8;
    bool ignore_eos = false;
    std::string device = "auto";
  };
  auto o = std::make_shared<Options>();
  o->sampling.temperature = 0.8;
  o->sampling.top_k = 40;
  CLI::App* cmd = app.add_subcommand("sample", "generate text from a saved model (KV-cache decoding, batched)");
  cmd->add_option("model", o->model_dir, "model directory (a run's <out_dir>/model, a checkpoint, or a run)")
      ->required();
  cmd->add_option("-p,--prompt", o->prompts, "text to continue (repeat for a batch of prompts; default: a newline)");
  cmd->add_option("-n,--tokens", o->tokens, "tokens to generate (at most the context minus the prompt)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("-t,--temperature", o->sampling.temperature, "sampling temperature (0 = greedy)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("-k,--top-k", o->sampling.top_k, "sample among the k most likely tokens (0 = all)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  cmd->add_option("--top-p", o->sampling.top_p, "nucleus: the most likely tokens covering this probability")
      ->capture_default_str();
  cmd->add_option("--min-p", o->sampling.min_p, "drop tokens below min-p x the top probability")->capture_default_str();
  cmd->add_option("--repetition-penalty", o->sampling.repetition_penalty, "penalize tokens already in the context (>1)")
      ->capture_default_str();
  cmd->add_option("--stop", o->stop, "stop when the generated text contains this string (repeatable)");
  cmd->add_flag("--ignore-eos", o->ignore_eos, "keep generating past the end-of-sequence token");
  cmd->add_option("--seed", o->seed, "random seed (sample i of a prompt uses seed + i)")->capture_default_str();
  cmd->add_option("--count", o->count, "samples per prompt")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--slots", o->slots, "sequences decoded at once")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--threads", o->threads, "CPU threads (0 = all)")->capture_default_str();
  add_device_option(cmd, o->device);
  cmd->callback([o] {
    set_cpu_threads(o->threads);
    o->sampling.validate();
    if (o->prompts.empty()) o->prompts.push_back("\n");
    const std::string dir = io::resolve_model_dir(o->model_dir);
    DecoderOptions d;
    d.slots = std::min<int64_t>(o->slots, static_cast<int64_t>(o->prompts.size()) * o->count);
    d.max_rows = 256;
    io::LoadedModel loaded = io::load_for_decoding(dir, resolve_device(o->device));
    Decoder decoder(*loaded.model, d);
    const auto tokenizer = io::model_tokenizer(dir);
    Generator generator(decoder, *tokenizer);
    std::vector<GenerationRequest> requests;
    for (const std::string& prompt : o->prompts) {
      for (int64_t i = 0; i < o->count; ++i) {
        GenerationRequest r;
        r.prompt.push_back(tokenizer->bos_id());
        for (int32_t id : tokenizer->encode(prompt)) r.prompt.push_back(id);
        const int64_t room = decoder.max_len() - static_cast<int64_t>(r.prompt.size());
        KILN_CHECK(room > 0, "sample", "the prompt ({} tokens) fills the model's context of {}", r.prompt.size(),
                   decoder.max_len());
        if (o->tokens > room)
          fmt::print(stderr, "kiln sample: generating {} tokens, not {}: the context holds {}\n", room, o->tokens,
                     decoder.max_len());
        r.max_tokens = std::min(o->tokens, room);
        r.sampling = o->sampling;
        r.seed = o->seed + static_cast<uint64_t>(i);
        r.stop = o->stop;
        r.stop_at_eos = !o->ignore_eos;
        requests.push_back(std::move(r));
      }
    }
    const std::vector<GenerationResult> results = generator.run(std::move(requests));
    size_t k = 0;
    for (const std::string& prompt : o->prompts)
      for (int64_t i = 0; i < o->count; ++i, ++k) {
        if (k > 0) fmt::print("---\n");
        fmt::print("{}{}\n", prompt, results[k].text);
      }
    for (size_t i = 0; i < results.size(); ++i)
      KILN_CHECK(results[i].error.empty(), "sample", "sample {} failed: {}", i, results[i].error);
  });
}

}  // namespace kiln::cli
