// `kiln tokenize INPUT -o DIR`: a corpus of documents (text/JSONL, .zst/.gz too, Parquet,
// Arrow and Hugging Face save_to_disk folders; a file, directory or glob)
// -> kiln shards + manifest.json, which `kiln train` reads with data.path = DIR.
#include "cli/commands.h"
#include "data/tokenize.h"
#include "data/tokenizer.h"
#include "config/config.h"

#include <fmt/format.h>

#include <chrono>
#include <cstdio>

namespace kiln::cli {

namespace {

std::string human(double n) {
  if (n >= 1e9) return fmt::format("{:.2f}B", n / 1e9);
  if (n >= 1e6) return fmt::format("{:.2f}M", n / 1e6);
  if (n >= 1e3) return fmt::format("{:.1f}k", n / 1e3);
  return fmt::format("{:.0f}", n);
}

}  // namespace

void add_tokenize_command(CLI::App& app) {
  struct Options {
    std::string input;
    std::string out;
    std::string config;
    std::vector<std::string> overrides;
    int64_t shard_tokens = int64_t{1} << 27;
    int64_t threads = 0;
    bool quiet = false;
  };
  auto o = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand("tokenize", "tokenize a text/JSONL/Parquet/Arrow corpus into kiln shards (streaming, parallel)");
  cmd->add_option("input", o->input, "file, directory or glob of text/JSONL (.zst/.gz too), Parquet or Arrow files, or a save_to_disk folder")->required();
  cmd->add_option("-o,--out", o->out, "output directory for the shards and manifest.json")->required();
  cmd->add_option("--config", o->config, "TOML config whose [data] keys (tokenizer, format, text_key, doc_separator, "
                                         "val_fraction, lenient) apply");
  cmd->add_option("--set", o->overrides, "override a key: --set data.val_fraction=0.01 (repeatable)")->take_all();
  cmd->add_option("--shard-tokens", o->shard_tokens, "tokens per shard (documents are never cut)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--threads", o->threads, "tokenizer threads (0 = all cores)")->capture_default_str();
  cmd->add_flag("-q,--quiet", o->quiet, "no progress lines");
  cmd->callback([o] {
    std::vector<std::string> overrides = o->overrides;
    overrides.push_back("data.path=" + o->input);
    const Config config = load_config(o->config, overrides);
    const auto tokenizer = tokenizer_from_config(config.data.tokenizer);
    TokenizeOptions options;
    options.data = config.data;
    options.out_dir = o->out;
    options.shard_tokens = o->shard_tokens;
    options.threads = o->threads;
    double last = 0;
    const TokenizeReport r = tokenize_to_shards(options, *tokenizer, [&](const TokenizeReport& p) {
      if (o->quiet || p.seconds - last < 5.0) return;
      last = p.seconds;
      fmt::print("tokenize: {} documents, {} bytes, {} tokens | {}/s\n", human(static_cast<double>(p.input_documents)),
                 human(static_cast<double>(p.input_bytes)),
                 human(static_cast<double>(p.manifest.train.tokens + p.manifest.validation.tokens)),
                 human(static_cast<double>(p.input_bytes) / std::max(p.seconds, 1e-9)) + "B");
      std::fflush(stdout);
    });
    const Manifest& m = r.manifest;
    fmt::print("tokenized {} documents ({} bytes) with tokenizer {} (vocab {}) in {:.1f} s ({}B/s)\n",
               r.input_documents, r.input_bytes, m.tokenizer_name, m.vocab_size, r.seconds,
               human(static_cast<double>(r.input_bytes) / std::max(r.seconds, 1e-9)));
    fmt::print("train:      {} documents, {} tokens, {} shards\n", m.train.documents, m.train.tokens, m.train.shards.size());
    fmt::print("validation: {} documents, {} tokens, {} shards (data.val_fraction = {})\n", m.validation.documents,
               m.validation.tokens, m.validation.shards.size(), config.data.val_fraction);
    fmt::print("skipped bad input: {}\n", r.skipped_summary);
    fmt::print("wrote {}/manifest.json (train with data.path = \"{}\")\n", o->out, o->out);
  });
}

}  // namespace kiln::cli
