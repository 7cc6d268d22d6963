// `kiln bench-decode CONFIG`: greedy decoding speed of a model shape through the KV-cache
// decoder (on the GPU: bf16 weights and activations, each decode step a CUDA graph), on
// random weights. For each --batch B: B random prompts of --prompt tokens are prefilled,
// then --tokens greedy steps of B rows are timed, each as a caller sees it: upload of the
// rows, the step, the argmax on the device and B ids back to the host. A first, shorter
// pass does the same untimed (warm-up: graphs captured, cuBLASLt plans made). With --ops,
// a second decoder without the fused kernels (DecoderOptions::fuse = false) is timed too, with
// --plain one whose projections go through linear_forward (DecoderOptions::gemv_rows = 0);
// with --profile, each op's share of an (uncaptured) decode step is printed. On the GPU the
// main decoder is also timed in greedy chains of --chain steps (Decoder::greedy_chain: the
// ids fed back on the device, one host round trip per chain; rows "chainK", checked to give
// the single steps' tokens). The last column, queued ms, is the device's own time per step:
// the same step enqueued back to back without reading its ids.
//
// Beside the time: the weight bytes one step reads (Decoder::weight_bytes), the device's
// copy bandwidth measured in this process, and the floor they give. Convention: a copy of
// N bytes reads N and writes N, so copy bandwidth = 2N / time (the DRAM traffic per
// second a plain copy sustains), and floor = weight bytes / copy bandwidth: a step cannot
// be faster than reading its weights once at that rate.
#include "cli/commands.h"
#include "core/device_memory.h"
#include "core/op_profiler.h"
#include "core/rng.h"
#include "infer/decoder.h"
#include "model/model.h"
#include "ops/parallel.h"
#include "core/device_choice.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>
#include <memory>
#include <numeric>

#if KILN_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace kiln::cli {

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start).count();
}

// Copy bandwidth (read + write bytes per second) of `bytes`-sized copies on `device`: the
// best of several timed copies after one untimed (device: CUDA events around a
// device-to-device cudaMemcpy; host: memcpy).
double copy_bandwidth(Device device, size_t bytes, int repeats) {
  double best_ms = 1e30;
  if (device == Device::cpu) {
    std::vector<char> src(bytes, 1), dst(bytes, 0);
    for (int i = 0; i <= repeats; ++i) {
      const auto start = Clock::now();
      std::memcpy(dst.data(), src.data(), bytes);
      if (i > 0) best_ms = std::min(best_ms, ms_since(start));
    }
    return 2.0 * static_cast<double>(bytes) / (best_ms * 1e-3);
  }
#if KILN_WITH_CUDA
  OwnedTensor src(DType::f32, Device::cuda, Shape{static_cast<int64_t>(bytes / 4)});
  OwnedTensor dst(DType::f32, Device::cuda, src->shape());
  cudaEvent_t start = nullptr, stop = nullptr;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  for (int i = 0; i <= repeats; ++i) {
    cudaEventRecord(start, nullptr);
    cudaMemcpyAsync(dst->raw(), src->raw(), src->nbytes(), cudaMemcpyDeviceToDevice, nullptr);
    cudaEventRecord(stop, nullptr);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    if (i > 0) best_ms = std::min(best_ms, static_cast<double>(ms));
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  const cudaError_t status = cudaGetLastError();
  KILN_CHECK(status == cudaSuccess, "bench-decode", "copy bandwidth: {}", cudaGetErrorString(status));
  return 2.0 * static_cast<double>(src->nbytes()) / (best_ms * 1e-3);
#else
  fail("bench-decode", "this kiln was built without CUDA");
#endif
}

struct DecodeTiming {
  double prefill_ms = 0, decode_ms = 0;
  std::vector<std::vector<int32_t>> generated;  // per sequence
};

// Prefills `prompts` (sequence i in slot i) in chunks of the decoder's max_rows, then runs
// `steps` greedy steps of one row per sequence; times the two phases separately. With
// `profile`, kiln's op profiler is on for the decode steps only (they then run uncaptured);
// with `chain` > 1 the steps run in Decoder::greedy_chain calls of up to `chain` steps.
DecodeTiming generate(Decoder& decoder, const std::vector<std::vector<int32_t>>& prompts, int64_t steps,
                      bool profile = false, int64_t chain = 1) {
  const auto batch = static_cast<int32_t>(prompts.size());
  DecodeTiming t;
  t.generated.resize(prompts.size());
  std::vector<int32_t> tok, slot, pos, rows, last(prompts.size()), next;
  for (int32_t s = 0; s < batch; ++s) decoder.reset_slot(s);  // new sequences (a warm-up ran in these slots)
  const auto prefill_start = Clock::now();
  for (int32_t s = 0; s < batch; ++s) {
    const auto& p = prompts[static_cast<size_t>(s)];
    for (size_t i = 0; i < p.size(); ++i) {
      tok.push_back(p[i]), slot.push_back(s), pos.push_back(static_cast<int32_t>(i));
      const bool last_row = i + 1 == p.size();
      if (last_row) rows.push_back(static_cast<int32_t>(tok.size() - 1));
      if (static_cast<int64_t>(tok.size()) == decoder.max_rows() || (last_row && s + 1 == batch)) {
        decoder.forward(tok, slot, pos);
        if (!rows.empty()) {
          decoder.greedy(rows, next);
          // Rows with logits in this chunk belong to the sequences whose prompts ended in it.
          for (size_t j = 0; j < rows.size(); ++j) last[static_cast<size_t>(slot[static_cast<size_t>(rows[j])])] = next[j];
        }
        tok.clear(), slot.clear(), pos.clear(), rows.clear();
      }
    }
  }
  t.prefill_ms = ms_since(prefill_start);
  rows.resize(prompts.size());
  std::iota(rows.begin(), rows.end(), 0);
  slot = rows;
  OpProfiler::set_enabled(profile);
  const auto decode_start = Clock::now();
  std::vector<int32_t> chained;
  for (int64_t step = 0; step < steps;) {
    tok.assign(last.begin(), last.end());
    pos.clear();
    for (int32_t s = 0; s < batch; ++s) {
      t.generated[static_cast<size_t>(s)].push_back(last[static_cast<size_t>(s)]);
      pos.push_back(static_cast<int32_t>(prompts[static_cast<size_t>(s)].size() + static_cast<size_t>(step)));
    }
    decoder.forward(tok, slot, pos);
    if (chain <= 1) {
      decoder.greedy(rows, last);
      ++step;
      continue;
    }
    // k steps in one call: the ids of all but the last were fed back as inputs.
    const int64_t k = std::min(chain, steps - step);
    decoder.greedy_chain(k, chained);
    for (int64_t c = 0; c < k; ++c)
      for (int32_t s = 0; s < batch; ++s) {
        const int32_t id = chained[static_cast<size_t>(c * batch + s)];
        if (c + 1 < k) t.generated[static_cast<size_t>(s)].push_back(id);
        else last[static_cast<size_t>(s)] = id;
      }
    step += k;
  }
  t.decode_ms = ms_since(decode_start);
  OpProfiler::set_enabled(false);
  return t;
}

// The device's own time per decode step: `steps` steps of the generated sequences' last
// tokens, at the last position (rewritten each time), enqueued back to back without reading
// their ids, then one wait. What ms/step adds to it is the argmax and the host's round trip
// per step (inputs up, ids back, the wait between).
double queued_step_ms(Decoder& decoder, const DecodeTiming& t, int64_t prompt, int64_t steps) {
  std::vector<int32_t> tok, slot, pos;
  for (size_t s = 0; s < t.generated.size(); ++s) {
    tok.push_back(t.generated[s].back());
    slot.push_back(static_cast<int32_t>(s));
    pos.push_back(static_cast<int32_t>(prompt + steps - 1));
  }
  decoder.forward(tok, slot, pos);
  if (decoder.device() == Device::cuda) synchronize_stream();
  const auto start = Clock::now();
  for (int64_t step = 0; step < steps; ++step) decoder.forward(tok, slot, pos);
  if (decoder.device() == Device::cuda) synchronize_stream();
  return ms_since(start) / static_cast<double>(steps);
}

}  // namespace

void add_bench_decode_command(CLI::App& app) {
  struct Options {
    std::string config;
    std::vector<std::string> overrides;
    std::vector<int64_t> batches;
    int64_t prompt = 128, tokens = 256, warmup = 16, copy_mib = 2048;
    int64_t gemv_rows = DecoderOptions{}.gemv_rows;
    int64_t chain = 16;
    bool ops = false, plain = false, profile = false, three_kernel_attention = false;
    std::string json;
  };
  auto o = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand("bench-decode", "time greedy KV-cache decoding of a model shape (random weights)");
  cmd->add_option("config", o->config, "TOML config (e.g. configs/bench-0.6b.toml)")->required();
  cmd->add_option("--set", o->overrides, "override a key (repeatable)")->take_all();
  cmd->add_option("--batch", o->batches, "sequences decoded together (repeatable; default 1 and 8)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--prompt", o->prompt, "prompt tokens per sequence")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--tokens", o->tokens, "timed greedy steps")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--warmup", o->warmup, "greedy steps of the untimed first pass")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--copy-mib", o->copy_mib, "size of the copy that measures bandwidth (MiB)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_flag("--ops", o->ops, "also time the unfused step (each op through its front end; GPU)");
  cmd->add_option("--gemv-rows", o->gemv_rows, "steps of up to this many rows run the fused decode projections (0-8)")
      ->capture_default_str()
      ->check(CLI::Range(0, 8));
  cmd->add_option("--chain", o->chain,
                  "also time greedy chains of this many steps per host round trip (Decoder::greedy_chain; 1 = no)")
      ->capture_default_str()
      ->check(CLI::Range(1, 256));
  cmd->add_flag("--three-kernel-attention", o->three_kernel_attention,
                "decode steps keep q/k norm + cache write, attention and split merge as three kernels (GPU)");
  cmd->add_flag("--plain", o->plain, "also time the fused step with plain projections (gemv rows 0; GPU)");
  cmd->add_flag("--profile", o->profile, "then time each op of 16 uncaptured decode steps per batch size");
  cmd->add_option("--json", o->json, "also append one JSON line per batch size to this file");
  cmd->callback([o] {
    if (o->batches.empty()) o->batches = {1, 8};
    const Config config = load_config(o->config, o->overrides);
    const Device device = resolve_device(config.train.device);
    set_cpu_threads(config.train.threads);
    const int64_t max_len = o->prompt + std::max(o->tokens, o->warmup);
    KILN_CHECK(max_len <= config.model.max_seq_len, "bench-decode",
               "--prompt {} plus --tokens {} exceed model.max_seq_len {}", o->prompt, o->tokens,
               config.model.max_seq_len);
    BuildOptions build;  // fp32 masters with bf16 compute copies on the GPU (what the decoder reads)
    build.device = device;
    build.dtype = device == Device::cuda ? DType::bf16 : DType::f32;
    build.training = false;
    build.max_tokens = 1;
    build.loss_chunk_rows = 1;
    Model model(config.model, build);
    model.allocate();
    model.init_weights(config.train.seed);
    DecoderOptions d;
    d.slots = *std::max_element(o->batches.begin(), o->batches.end());
    d.max_len = max_len;
    d.max_rows = 256;
    d.logit_rows = std::max<int64_t>(64, d.slots);
    d.graph_rows = std::max<int64_t>(16, d.slots);
    d.gemv_rows = o->gemv_rows;
    d.one_kernel_attention = !o->three_kernel_attention;
    d.chain_steps = std::max<int64_t>(o->chain, 1);
    auto decoder = std::make_unique<Decoder>(model, d);

    const double bandwidth = copy_bandwidth(device, static_cast<size_t>(o->copy_mib) << 20, 5);
    const size_t weight_bytes = decoder->weight_bytes();
    const double floor_ms = 1e3 * static_cast<double>(weight_bytes) / bandwidth;
    const std::string where =
        device == Device::cuda
            ? fmt::format("cuda ({}, {} decoder, CUDA graphs)", cuda_device_name(), dtype_name(decoder->dtype()))
            : fmt::format("cpu ({})", dtype_name(decoder->dtype()));
    fmt::print("bench-decode {} on {}: {} parameters, prompt {}, {} timed greedy steps (after a {}-step warm-up)\n",
               config.model.name, where, model.parameter_count(), o->prompt, o->tokens, o->warmup);
    fmt::print("  weights read per step {:.3f} GB | copy bandwidth {:.0f} GB/s (read + write bytes of a {} MiB copy "
               "/ time) | floor {:.3f} ms per step\n",
               static_cast<double>(weight_bytes) / 1e9, bandwidth / 1e9, o->copy_mib, floor_ms);
    fmt::print("  {:<7} {:>5} | {:>9} | {:>10} | {:>10} | {:>8} | {:>7} | {:>9}\n", "step", "batch", "ms/step",
               "tokens/s", "prefill ms", "floor ms", "x floor", "queued ms");

    // One row of the table (and of --json) for a timed generation.
    auto report = [&](const Decoder& dec, const std::string& variant, int64_t batch, const DecodeTiming& t,
                      double queued_ms) {
      const double step_ms = t.decode_ms / static_cast<double>(o->tokens);
      const double tokens_per_second = static_cast<double>(batch) * 1e3 / step_ms;
      fmt::print("  {:<7} {:>5} | {:>9.3f} | {:>10.0f} | {:>10.2f} | {:>8.3f} | {:>7.2f} | {:>9.3f}\n", variant, batch,
                 step_ms, tokens_per_second, t.prefill_ms, floor_ms, step_ms / floor_ms, queued_ms);
      if (o->json.empty()) return;
      const auto shown = static_cast<std::ptrdiff_t>(std::min<int64_t>(8, o->tokens));
      std::ofstream out(o->json, std::ios::app);
      out << nlohmann::json{{"who", "kiln"},
                            {"variant", variant},
                            {"model", config.model.name},
                            {"device", where},
                            {"batch", batch},
                            {"prompt", o->prompt},
                            {"tokens", o->tokens},
                            {"ms_per_token", step_ms},
                            {"tokens_per_second", tokens_per_second},
                            {"prefill_ms", t.prefill_ms},
                            {"weight_bytes", weight_bytes},
                            {"copy_bandwidth_gbs", bandwidth / 1e9},
                            {"floor_ms", floor_ms},
                            {"x_floor", step_ms / floor_ms},
                            {"queued_ms_per_step", queued_ms},
                            {"graphs", dec.graphs()},
                            {"first_tokens", std::vector<int32_t>(t.generated[0].begin(),
                                                                  t.generated[0].begin() + shown)}}
                 .dump()
          << '\n';
      out.close();
      KILN_CHECK(!out.fail(), "bench-decode", "{}: cannot write: {}", o->json, std::strerror(errno));
    };
    // Times every batch size on `dec`; `variant` names its step (fused kernels or ops).
    auto bench = [&](Decoder& dec, const char* variant, bool chains) {
      Rng rng(config.train.seed);  // the same prompts for every variant
      for (const int64_t batch : o->batches) {
        std::vector<std::vector<int32_t>> prompts(static_cast<size_t>(batch));
        for (auto& p : prompts)
          for (int64_t i = 0; i < o->prompt; ++i)
            p.push_back(static_cast<int32_t>(rng.below(static_cast<uint64_t>(config.model.vocab_size))));
        generate(dec, prompts, o->warmup);
        const DecodeTiming t = generate(dec, prompts, o->tokens);
        const double queued_ms = queued_step_ms(dec, t, o->prompt, o->tokens);
        report(dec, variant, batch, t, queued_ms);
        if (chains && o->chain > 1 && dec.device() == Device::cuda) {
          generate(dec, prompts, o->warmup, false, o->chain);
          const DecodeTiming chained = generate(dec, prompts, o->tokens, false, o->chain);
          KILN_CHECK(chained.generated == t.generated, "bench-decode",
                     "greedy chains of {} steps generated other tokens than single steps (batch {})", o->chain, batch);
          report(dec, fmt::format("chain{}", o->chain), batch, chained, queued_ms);
        }
        if (o->profile) {  // where a step's time goes, op by op (uncaptured: launch gaps included)
          OpProfiler::reset();
          const int64_t steps = std::min<int64_t>(16, o->tokens);
          const double ms = generate(dec, prompts, steps, true).decode_ms / static_cast<double>(steps);
          fmt::print("    per op of a {:.3f} ms uncaptured step (ms per step, calls per step):\n", ms);
          for (const OpTime& op : OpProfiler::collect())
            fmt::print("      {:<24} {:>8.3f} ms {:>5.1f}% {:>6}\n", op.op, op.milliseconds / steps,
                       100 * op.milliseconds / steps / ms, op.calls / steps);
          OpProfiler::reset();
        }
      }
    };
    bench(*decoder, device == Device::cuda ? "fused" : "ops", true);
    fmt::print("  {} step graph(s) captured; decoder memory {:.2f} GiB (cache, activations, bf16 weight copies)\n",
               decoder->graphs(), static_cast<double>(decoder->memory_bytes()) / 1073741824.0);
    if (o->plain && device == Device::cuda) {  // the projections through linear_forward
      decoder.reset();
      DecoderOptions plain = d;
      plain.gemv_rows = 0;
      Decoder plain_decoder(model, plain);
      bench(plain_decoder, "plain", false);
    }
    if (o->ops && device == Device::cuda) {  // the reference step: every op through its front end
      decoder.reset();
      d.fuse = false;
      Decoder ops_decoder(model, d);
      bench(ops_decoder, "ops", false);
    }
  });
}

}  // namespace kiln::cli
