// Loader overhead per training step at the GPT-2 124M shape: micro-batches of 32 x 1024
// = 32768 tokens, context 1024, GPT-2 vocabulary, llm.c uint16 shards (memory-mapped).
//
// The consumer calls BatchStream::next() once per micro-step and then "runs the step":
// it sleeps for the step time (the CPU cannot run the 124M model at GPU speed; the
// reference is the H200 floor of 42.7 ms per 32 x 1024 micro-step from the project's
// numbers). Measured: the time inside next() per step, synchronous (data.prefetch = 0)
// and with the prefetch thread (data.prefetch = K), and the raw packing rate.
//
//   loader_bench [--steps N] [--step-ms 42.7] [--tokens 40000000] [--prefetch 4] [--world 8]
#include "core/rng.h"
#include "data/batch_stream.h"
#include "data/dataset.h"
#include "data/shards/llmc_bin.h"
#include "data/tokenizer.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace kiln;
using Clock = std::chrono::steady_clock;

// GPT-2's vocabulary shape; text is never encoded here.
class Gpt2ShapeTokenizer final : public Tokenizer {
 public:
  std::vector<int32_t> encode(std::string_view) const override { return {}; }
  std::string decode(std::span<const int32_t>) const override { return ""; }
  int32_t vocab_size() const override { return 50257; }
  int32_t bos_id() const override { return 50256; }
  int32_t eos_id() const override { return 50256; }
  int32_t pad_id() const override { return 50256; }
  std::string name() const override { return "gpt2-shape"; }
};

// An llm.c GPT-2 shard of `tokens` tokens: documents of log-normal length (median ~650,
// mean ~1100 tokens, like FineWeb), each preceded by EOT.
void write_corpus(const std::string& path, int64_t tokens) {
  Rng rng(1);
  std::vector<uint16_t> t;
  t.reserve(static_cast<size_t>(tokens));
  while (static_cast<int64_t>(t.size()) < tokens) {
    t.push_back(50256);
    const auto len = static_cast<int64_t>(std::clamp(std::exp(6.5 + 1.0 * rng.normal()), 1.0, 60000.0));
    for (int64_t i = 0; i < len && static_cast<int64_t>(t.size()) < tokens; ++i)
      t.push_back(static_cast<uint16_t>(rng.below(50256)));
  }
  int32_t header[kLlmcHeaderInts] = {kLlmcMagicU16, kLlmcVersionU16, static_cast<int32_t>(t.size())};
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(header), sizeof(header));
  out.write(reinterpret_cast<const char*>(t.data()), static_cast<std::streamsize>(t.size() * 2));
}

struct Stats {
  double mean_ms, median_ms, p99_ms, max_ms;
};
Stats stats(std::vector<double> ms) {
  std::sort(ms.begin(), ms.end());
  const double mean = std::accumulate(ms.begin(), ms.end(), 0.0) / static_cast<double>(ms.size());
  return {mean, ms[ms.size() / 2], ms[std::min(ms.size() - 1, ms.size() * 99 / 100)], ms.back()};
}

// Times next() over `steps` micro-steps, sleeping `step_ms` after each (0: back to back).
std::vector<double> run(BatchStream& stream, int steps, double step_ms) {
  HostBatch batch;
  std::vector<double> ms;
  for (int s = 0; s < steps + 3; ++s) {
    const auto t0 = Clock::now();
    stream.next(batch);
    const double dt = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
    if (s >= 3) ms.push_back(dt);  // the first calls allocate and start the thread
    if (step_ms > 0) std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(step_ms));
  }
  return ms;
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 200;
  double step_ms = 42.7;
  int64_t tokens = 40'000'000;
  int64_t prefetch = 4;
  int64_t world = 8;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--steps") steps = std::stoi(argv[i + 1]);
    else if (a == "--step-ms") step_ms = std::stod(argv[i + 1]);
    else if (a == "--tokens") tokens = std::stoll(argv[i + 1]);
    else if (a == "--prefetch") prefetch = std::stoll(argv[i + 1]);
    else if (a == "--world") world = std::stoll(argv[i + 1]);
  }
  const std::string dir = (std::filesystem::temp_directory_path() / "kiln-loader-bench").string();
  std::filesystem::create_directories(dir);
  const std::string path = dir + "/fineweb_shape_000000.bin";
  write_corpus(path, tokens);

  const Gpt2ShapeTokenizer tok;
  DataConfig data;
  data.path = path;
  data.val_fraction = 0.0;
  auto t0 = Clock::now();
  const TokenDataset ds(data, tok);
  const double open_s = std::chrono::duration<double>(Clock::now() - t0).count();
  const Packer packer(PackerOptions{32768, 1024, LongDocPolicy::split, tok.bos_id(), tok.eos_id(), tok.pad_id()});
  fmt::print("corpus: {} documents, {:.1f}M tokens (llm.c uint16, mmap); opened and validated in {:.3f} s\n",
             ds.num_documents(Split::train), static_cast<double>(ds.num_tokens(Split::train)) / 1e6, open_s);
  fmt::print("shape: micro-batch 32 x 1024 = 32768 tokens, context 1024, step reference {:.1f} ms\n", step_ms);

  {  // Raw packing rate, back to back.
    BatchStream s(ds, Split::train, packer, 1);
    const Stats st = stats(run(s, steps, 0));
    fmt::print("pack only (synchronous, back to back): mean {:.3f} ms/batch = {:.0f}M tokens/s\n", st.mean_ms,
               32768.0 / st.mean_ms / 1e3);
  }
  std::vector<std::pair<std::string, LoaderOptions>> arms = {
      {"synchronous (data.prefetch = 0)", LoaderOptions{0, 1, 0}},
      {fmt::format("prefetch thread (data.prefetch = {})", prefetch), LoaderOptions{0, 1, prefetch}},
      {fmt::format("synchronous, rank 3 of {}", world), LoaderOptions{3, world, 0}},
      {fmt::format("prefetch {}, rank 3 of {}", prefetch, world), LoaderOptions{3, world, prefetch}},
  };
  fmt::print("\n{:<40} {:>10} {:>10} {:>10} {:>10} {:>12}\n", "consumer wait in next() per step", "mean ms", "median",
             "p99", "max", "% of step");
  for (const auto& [name, options] : arms) {
    BatchStream s(ds, Split::train, packer, 1, options);
    const Stats st = stats(run(s, steps, step_ms));
    fmt::print("{:<40} {:>10.4f} {:>10.4f} {:>10.4f} {:>10.4f} {:>11.4f}%\n", name, st.mean_ms, st.median_ms, st.p99_ms,
               st.max_ms, 100.0 * st.mean_ms / step_ms);
    std::fflush(stdout);
  }
  std::filesystem::remove_all(dir);
  return 0;
}
