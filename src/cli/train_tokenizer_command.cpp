// `kiln train-tokenizer INPUT... --vocab-size N --out DIR`: trains a byte-level BPE and
// writes Hugging Face tokenizer.json + tokenizer_config.json (docs/data.md). Inputs are
// what data.path takes: files, directories or globs of text and JSONL (plain or .zst/.gz),
// Parquet and Arrow (Hugging Face save_to_disk folders); the document in --text-key, as
// data.text_key.
#include "cli/commands.h"
#include "core/error.h"
#include "data/bad_input.h"
#include "data/bpe/bpe_tokenizer.h"
#include "data/bpe/bpe_trainer.h"
#include "data/bpe/pretokenizer.h"
#include "data/data_format.h"
#include "data/readers/glob.h"
#include "data/document_reader.h"
#include "ops/parallel.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>

namespace kiln::cli {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Counts one input's text into the trainer; returns its bytes of text. A text file is
// counted whole, in blocks (pretokens may span what the text reader would call documents,
// as Hugging Face's trainer reads a file); a JSONL, Parquet or Arrow file by its
// documents, so the JSON (or other columns) around them is never learned. Pre-tokenized files are refused by name.
size_t add_input(bpe::BpeTrainer& trainer, const std::string& input, const std::string& text_key, size_t* files) {
  size_t bytes = 0;
  for (const std::string& file : expand_data_path(input)) {
    ++*files;
    const DataFormat format = format_of_file(file);
    if (format == DataFormat::text) {
      bytes += trainer.add_file(file);
      continue;
    }
    KILN_CHECK(!is_token_format(format), "train-tokenizer",
               "'{}' is {} (pre-tokenized); it reads text, JSONL, Parquet or Arrow", file, format_name(format));
    BadInputLog strict;
    DataConfig config;
    config.text_key = text_key;
    const std::unique_ptr<DocumentSource> source = open_document_file(file, format, config, strict);
    for (Document doc; source->next(doc);) {
      trainer.add_text(doc.text);
      bytes += doc.text.size();
    }
  }
  return bytes;
}

}  // namespace

void add_train_tokenizer_command(CLI::App& app) {
  struct Options {
    std::vector<std::string> inputs;
    std::string text_key = "text";
    std::string out_dir;
    bpe::BpeTrainerOptions trainer;
    std::string pattern = "qwen2";
    std::string bos, eos, pad;
    int64_t model_max_length = 4096;
    int64_t threads = 0;
  };
  auto o = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand("train-tokenizer", "train a byte-level BPE tokenizer (writes tokenizer.json)");
  cmd->add_option("inputs", o->inputs, "text, JSONL, Parquet or Arrow files, directories or globs (as data.path)")->required();
  cmd->add_option("--text-key", o->text_key, "JSONL field / Parquet or Arrow column holding the document (as data.text_key)")
      ->capture_default_str();
  cmd->add_option("--vocab-size", o->trainer.vocab_size, "vocabulary size, special tokens included")
      ->required()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--out", o->out_dir, "output folder for tokenizer.json and tokenizer_config.json")->required();
  cmd->add_option("--special-tokens", o->trainer.special_tokens, "special tokens, ids 0.. in this order")
      ->capture_default_str();
  cmd->add_option("--pattern", o->pattern, "pre-tokenizer split: qwen2 | gpt2 | llama3 | a regex")->capture_default_str();
  cmd->add_option("--min-frequency", o->trainer.min_frequency, "merge only pairs seen at least this often")
      ->capture_default_str();
  cmd->add_flag("--nfc", o->trainer.nfc, "NFC-normalize text (writes an NFC normalizer)");
  cmd->add_option("--bos-token", o->bos, "BOS for tokenizer_config.json (default: the EOS token)");
  cmd->add_option("--eos-token", o->eos, "EOS (default: the first special token)");
  cmd->add_option("--pad-token", o->pad, "PAD (default: the EOS token)");
  cmd->add_option("--model-max-length", o->model_max_length, "model_max_length in tokenizer_config.json")
      ->capture_default_str();
  cmd->add_option("--threads", o->threads, "CPU threads (0 = all)")->capture_default_str();
  cmd->callback([o] {
    // Both used to be taken: -5 merged every pair, and -1 was written into tokenizer_config.json.
    KILN_CHECK(o->trainer.min_frequency >= 1, "train-tokenizer", "--min-frequency {} must be >= 1",
               o->trainer.min_frequency);
    KILN_CHECK(o->model_max_length >= 1, "train-tokenizer", "--model-max-length {} must be >= 1", o->model_max_length);
    const int threads = set_cpu_threads(o->threads);
    const std::string_view named = bpe::named_pattern(o->pattern);
    o->trainer.pattern = named.empty() ? o->pattern : std::string(named);
    KILN_CHECK(!o->trainer.special_tokens.empty(), "train-tokenizer", "at least one special token (the EOS) is needed");
    if (o->eos.empty()) o->eos = o->trainer.special_tokens.front();
    if (o->bos.empty()) o->bos = o->eos;
    if (o->pad.empty()) o->pad = o->eos;
    for (const std::string* t : {&o->bos, &o->eos, &o->pad})
      if (std::find(o->trainer.special_tokens.begin(), o->trainer.special_tokens.end(), *t) ==
          o->trainer.special_tokens.end())
        o->trainer.special_tokens.push_back(*t);

    const auto t0 = std::chrono::steady_clock::now();
    bpe::BpeTrainer trainer(o->trainer);
    size_t bytes = 0, files = 0;
    for (const std::string& input : o->inputs) bytes += add_input(trainer, input, o->text_key, &files);
    const double count_s = seconds_since(t0);
    fmt::print("train-tokenizer: {} files, {:.1f} MB, {} pretokens ({} distinct) counted in {:.2f} s on {} threads\n",
               files, static_cast<double>(bytes) / 1e6, trainer.total_words(), trainer.unique_words(),
               count_s, threads);
    std::fflush(stdout);
    const bpe::TrainedBpe result = trainer.train();
    const double total_s = seconds_since(t0);
    bpe::write_tokenizer_files(result, o->out_dir, o->bos, o->eos, o->pad, o->model_max_length);
    if (static_cast<int64_t>(result.tokens.size()) < o->trainer.vocab_size)
      fmt::print("train-tokenizer: note: only {} tokens reached --vocab-size {} (no pair left with count >= {})\n",
                 result.tokens.size(), o->trainer.vocab_size, o->trainer.min_frequency);
    // Read the files back, so what was written is known to load.
    const auto check = bpe::load_tokenizer_json(o->out_dir);
    fmt::print("train-tokenizer: {} merges, vocabulary {} in {:.2f} s (merging {:.2f} s); wrote {}/tokenizer.json\n",
               result.merges.size(), check->vocab_size(), total_s, total_s - count_s, o->out_dir);
  });
}

}  // namespace kiln::cli
