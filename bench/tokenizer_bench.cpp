// kiln's byte-level BPE benchmark (one arm of bench/run_tokenizer_bench.sh; the other is
// bench/tokenizer_peer.py, Hugging Face `tokenizers`). Prints one JSON line per result.
//
//   tokenizer_bench encode TOKENIZER_JSON TEXT --threads N [--repeat R]
//       documents = TEXT split on blank lines; encode_batch over them, R timed runs after
//       one warm-up; reports the median seconds, MB/s and the token count.
//   tokenizer_bench train TEXT --vocab-size V --threads N --out DIR
//       trains a byte-level BPE (qwen2 pattern, <|endoftext|>, min frequency 2) from the
//       file read into memory; reports count, merge and total seconds.
#include "data/bpe/bpe_trainer.h"
#include "data/tokenizer.h"

#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string option(int argc, char** argv, const std::string& name, const std::string& fallback) {
  for (int i = 1; i + 1 < argc; ++i)
    if (argv[i] == name) return argv[i + 1];
  return fallback;
}

int encode(int argc, char** argv) {
  const std::string tokenizer_path = argv[2], text_path = argv[3];
  const int threads = std::stoi(option(argc, argv, "--threads", "1"));
  const int repeat = std::stoi(option(argc, argv, "--repeat", "5"));
  omp_set_num_threads(threads);
  const std::string text = read_file(text_path);
  std::vector<std::string_view> docs;
  for (size_t pos = 0; pos <= text.size();) {
    size_t end = text.find("\n\n", pos);
    if (end == std::string::npos) end = text.size();
    docs.push_back(std::string_view(text).substr(pos, end - pos));
    pos = end + 2;
  }
  const double t_load = now();
  const auto tokenizer = kiln::tokenizer_from_config(tokenizer_path);
  const double load_s = now() - t_load;
  size_t tokens = 0;
  std::vector<double> times;
  for (int r = 0; r <= repeat; ++r) {
    const double t0 = now();
    const auto ids = tokenizer->encode_batch(docs);
    const double dt = now() - t0;
    if (r == 0) {
      tokens = 0;
      for (const auto& d : ids) tokens += d.size();
    } else {
      times.push_back(dt);
    }
  }
  std::sort(times.begin(), times.end());
  const double median = times[times.size() / 2];
  fmt::print(R"({{"arm": "kiln", "task": "encode", "threads": {}, "docs": {}, "bytes": {}, "tokens": {}, )"
             R"("seconds": {:.4f}, "mb_per_s": {:.2f}, "load_seconds": {:.3f}}})"
             "\n",
             threads, docs.size(), text.size(), tokens, median, static_cast<double>(text.size()) / 1e6 / median, load_s);
  return 0;
}

int train(int argc, char** argv) {
  const std::string text_path = argv[2];
  const int threads = std::stoi(option(argc, argv, "--threads", "1"));
  omp_set_num_threads(threads);
  kiln::bpe::BpeTrainerOptions options;
  options.vocab_size = std::stoll(option(argc, argv, "--vocab-size", "32000"));
  const std::string out = option(argc, argv, "--out", "");
  const double t0 = now();
  kiln::bpe::BpeTrainer trainer(options);
  trainer.add_text(read_file(text_path));
  const double t1 = now();
  const auto result = trainer.train();
  const double t2 = now();
  if (!out.empty()) kiln::bpe::write_tokenizer_files(result, out, "<|endoftext|>", "<|endoftext|>", "<|endoftext|>", 4096);
  fmt::print(R"({{"arm": "kiln", "task": "train", "threads": {}, "vocab": {}, "merges": {}, "distinct_words": {}, )"
             R"("count_seconds": {:.3f}, "merge_seconds": {:.3f}, "seconds": {:.3f}}})"
             "\n",
             threads, result.tokens.size(), result.merges.size(), trainer.unique_words(), t1 - t0, t2 - t1, t2 - t0);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc >= 4 && std::string(argv[1]) == "encode") return encode(argc, argv);
    if (argc >= 3 && std::string(argv[1]) == "train") return train(argc, argv);
    fmt::print(stderr, "usage: tokenizer_bench encode TOKENIZER_JSON TEXT --threads N [--repeat R]\n"
                       "       tokenizer_bench train TEXT --vocab-size V --threads N [--out DIR]\n");
    return 2;
  } catch (const std::exception& e) {
    fmt::print(stderr, "tokenizer_bench: {}\n", e.what());
    return 1;
  }
}
