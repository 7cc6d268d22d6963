// `kiln bench CONFIG`: end-to-end training-step throughput of a model shape on synthetic
// tokens laid out as the PyTorch peer lays them out (micro_batch_tokens / max_seq_len
// sequences of max_seq_len tokens), so both arms do the same work. Routing as training
// sees it (docs/moe-routers.md): --tokens data times the run's own training micro-batches
// (train/training_data.h), and train.init_from (--init) starts from trained weights, so an
// MoE's router is a trained one rather than a fresh one spreading random tokens evenly.
#include "cli/bench_imbalance.h"
#include "cli/bench_trace.h"
#include "cli/commands.h"
#include "core/peak_flops.h"
#include "core/device_memory.h"
#include "core/op_profiler.h"
#include "data/mixture.h"
#include "model/model.h"
#include "nn/mup.h"
#include "ops/blas.h"
#include "ops/parallel.h"
#include "train/init_from.h"
#include "train/optimizer_groups.h"
#include "train/step_program.h"
#include "train/synthetic_batch.h"
#include "core/device_choice.h"
#include "train/training_build.h"
#include "train/training_data.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <optional>

namespace kiln::cli {

namespace {

constexpr double kPeakFlops = kGpuPeakFlops;

// The sparse layers' busiest-expert loads / the mean, "1.21-1.64 load_max over 15 layers"
// ("" for a dense model).
std::string load_range(const Model& model) {
  double lo = INFINITY, hi = 0;
  int layers = 0;
  for (const auto& [name, value] : model.component_metrics())
    if (name.ends_with(".load_max")) lo = std::min(lo, value), hi = std::max(hi, value), ++layers;
  return layers ? fmt::format("load_max {:.2f}-{:.2f} over {} layers", lo, hi, layers) : "";
}

// What --tokens data reads: data.path, or the sources of data.sources.
std::string data_name(const Config& c) {
  if (c.data.sources.empty()) return c.data.path;
  std::string names;
  for (const DataSource& s : c.data.sources) names += (names.empty() ? "" : ", ") + source_name(s);
  return "mixture " + names;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

void add_bench_command(CLI::App& app) {
  struct Options {
    std::string config;
    std::vector<std::string> overrides;
    int64_t steps = 10, warmup = 3;
    double imbalance = 0;
    std::string json, trace, init, tokens = "random";
  };
  auto o = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand("bench", "time full training steps of a model shape (synthetic tokens, or the run's data: --tokens)");
  cmd->add_option("config", o->config, "TOML config (e.g. configs/bench-124m.toml)")->required();
  cmd->add_option("--set", o->overrides, "override a key (repeatable)")->take_all();
  cmd->add_option("--steps", o->steps, "timed steps")->capture_default_str()->check(CLI::PositiveNumber);
  cmd->add_option("--warmup", o->warmup, "untimed steps first")->capture_default_str()->check(CLI::NonNegativeNumber);
  cmd->add_option("--json", o->json, "also write the result as one JSON line to this file");
  cmd->add_option("--trace", o->trace,
                  "also write a Chrome/Perfetto trace of one step's phases, ops and kernels to this file "
                  "(cli/bench_trace.h)");
  cmd->add_option("--imbalance", o->imbalance,
                  "hold each sparse layer's busiest expert at this x the mean load (sigmoid_bias routing; "
                  "sets optim.lr=1e-9 and model.moe.bias_rate=0: cli/bench_imbalance.h)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--tokens", o->tokens,
                  "random: synthetic uniform tokens; data: each step the run's next training micro-batches "
                  "(data.path / data.sources, packed as kiln train packs them)")
      ->capture_default_str()
      ->check(CLI::IsMember({"random", "data"}));
  cmd->add_option("--init", o->init,
                  "start from these weights (sets train.init_from: a model directory, checkpoint or run "
                  "directory, or a Hugging Face folder)");
  cmd->callback([o] {
    std::vector<std::string> overrides = o->overrides;
    if (o->imbalance > 0)  // the steered bias and the router it was set for stay (bench_imbalance.h)
      overrides.insert(overrides.end(), {"model.moe.bias_rate=0", "optim.lr=1e-9"});
    Config config = load_config(o->config, overrides);
    if (!o->init.empty()) config.train.init_from = o->init;
    const bool data_tokens = o->tokens == "data";
    if (!o->trace.empty()) {  // refused now rather than after the timed steps (app: an existing file is kept)
      std::ofstream probe(o->trace, std::ios::app);
      KILN_CHECK(probe.good(), "bench", "--trace {}: cannot write: {}", o->trace, std::strerror(errno));
    }
    // Found, and the data read, before anything is allocated: a bad path fails at once.
    const std::optional<InitialWeights> initial = find_initial_weights(config);
    TrainingData data;
    if (data_tokens) data = open_training_data(config);
    const Device device = resolve_device(config.train.device);
    set_cpu_threads(config.train.threads);
    const BuildOptions build = training_build_options(config, device);
    Model model(config.model, build);
    Arena optimizer_state("optimizer", device);
    auto optimizer =
        make_optimizer(model.exec(), config.optim, model.parameters(), mup_width_ratio(config.model));
    optimizer->plan(optimizer_state);
    size_t free_before = 0, total = 0;
    cuda_memory_info(&free_before, &total);
    model.allocate();
    optimizer_state.allocate();
    if (initial) load_initial_weights(*initial, config, model);  // as the trainer starts from it
    else model.init_weights(config.train.seed);

    // One optimizer step of grad_accum micro-batches, as the trainer runs it: captured on
    // the GPU (unless train.cuda_graphs = false), with no fault guard limits.
    StepProgram program(model, *optimizer, config.train.grad_accum,
                        choose_step_execution(device, config.train.cuda_graphs, *optimizer));
    // Random tokens: one synthetic micro-batch, every step. Data: each step the stream's
    // next grad_accum micro-batches, packed before the step's clock starts (the trainer
    // packs ahead with data.prefetch), with their own target counts (padding has none).
    std::vector<HostBatch> batches(static_cast<size_t>(config.train.grad_accum));
    if (!data_tokens) std::fill(batches.begin(), batches.end(), synthetic_batch(config));
    int64_t targets = 0;
    auto next_batches = [&] {
      if (data_tokens)
        for (HostBatch& b : batches) data.stream->next(b);
      targets = 0;
      for (const HostBatch& b : batches) targets += b.target_count;
    };
    StepPlan step_plan;
    step_plan.lr = config.optim.lr;
    step_plan.loss_limit = step_plan.grad_limit = std::numeric_limits<double>::infinity();
    step_plan.clip = config.optim.grad_clip;
    double step_seconds = 0;  // the steps' own time, batch packing left out
    auto step = [&] {         // the step's mean loss per target
      next_batches();
      const auto start = std::chrono::steady_clock::now();
      const double sum = program.run(batches, targets, step_plan).step_sums[0];  // read: synchronized
      step_seconds += seconds_since(start);
      return sum / static_cast<double>(targets);
    };
    std::string imbalance;
    if (o->imbalance > 0) imbalance = describe(hold_imbalance(model, o->imbalance, [&] { step(); }));
    for (int64_t i = 0; i < o->warmup; ++i) step();
    step_seconds = 0;
    double first_loss = 0, loss = 0;
    for (int64_t i = 0; i < o->steps; ++i) {
      loss = step();
      if (i == 0) first_loss = loss;
    }
    const double seconds = step_seconds;
    const std::string routing = load_range(model);  // the last timed step's, read after the clock stopped
    size_t free_after = 0;
    cuda_memory_info(&free_after, &total);

    const int64_t tokens = config.train.micro_batch_tokens * config.train.grad_accum * o->steps;
    const double tokens_per_second = static_cast<double>(tokens) / seconds;
    const double flops = model.flops_per_token(std::min(config.model.max_seq_len, config.train.micro_batch_tokens));
    const double tflops = flops * tokens_per_second / 1e12;
    const MemoryPlan plan = model.memory_plan();
    const double planned_gib = static_cast<double>(plan.total() + optimizer_state.planned_bytes()) / 1073741824.0;
    const double device_gib = static_cast<double>(free_before - free_after) / 1073741824.0;
    const std::string precision = build.recipe().describe();
    const std::string where = device == Device::cuda ? fmt::format("cuda ({}, {})", cuda_device_name(), precision)
                                                     : fmt::format("cpu ({}, {})", precision, blas_summary());
    const std::string token_source = data_tokens ? "training data " + data_name(config) : "random tokens";
    const std::string weights = initial ? "weights from " + initial->dir : "fresh weights";
    fmt::print("bench {} on {}: {} parameters, {} tokens per step ({}, {}), {} kernels, {}\n", config.model.name,
               where, model.parameter_count(), config.train.micro_batch_tokens * config.train.grad_accum, token_source,
               weights,
               build.deterministic ? "deterministic" : "non-deterministic (train.deterministic = false)",
               program.execution() == StepExecution::captured
                   ? fmt::format("CUDA graphs ({} captured, {} launches)", program.graphs_captured(),
                                 program.graph_launches())
                   : "op by op");
    const std::string libraries = cuda_library_versions();
    if (!libraries.empty()) fmt::print("  {}\n", libraries);
    if (!imbalance.empty()) fmt::print("  routing held uneven: {}\n", imbalance);
    if (!routing.empty()) fmt::print("  routing in the last timed step: {}\n", routing);
    // MFU against the H100/H200 bf16 peak means nothing for a CPU run: none is printed there.
    const bool on_gpu = device == Device::cuda;
    fmt::print("  {:.1f} ms per step | {:.0f} tokens/s | {:.{}f} model TFLOP/s{}\n",
               1e3 * seconds / static_cast<double>(o->steps), tokens_per_second, tflops, on_gpu ? 1 : 4,
               on_gpu ? fmt::format(" | MFU {:.1f}% of {:.0f} TFLOP/s bf16 peak", 100 * tflops * 1e12 / kPeakFlops,
                                    kPeakFlops / 1e12)
                      : "");
    fmt::print("  memory: planned {:.2f} GiB{} | loss first {:.4f}, last {:.4f} (an untrained model: ~ln(vocab) = {:.2f})\n",
               planned_gib, device == Device::cuda ? fmt::format(", device in use {:.2f} GiB", device_gib) : "",
               first_loss, loss, std::log(static_cast<double>(config.model.vocab_size)));
    fmt::print("  FLOPs per token {:.4g} = 6 x matmul parameters (incl. LM head) + 6 x layers x heads x head_dim x seq\n",
               flops);
    // Where the time goes: two more steps with every op front end timed (CUDA events).
    OpProfiler::set_enabled(true);
    OpProfiler::reset();
    step_seconds = 0;
    for (int i = 0; i < 2; ++i) step();
    const std::vector<OpTime> ops = OpProfiler::collect();
    const double profiled_ms = 1e3 * step_seconds / 2;
    OpProfiler::set_enabled(false);
    double op_ms = 0;
    for (const OpTime& t : ops) op_ms += t.milliseconds / 2;
    fmt::print("  per op (ms per step, share of the {:.1f} ms profiled step; the rest is host work and gaps):\n",
               profiled_ms);
    // Per step over the two profiled steps: an op run once in the two (a plan built at the
    // first call) shows 0.5, not 0.
    for (const OpTime& t : ops)
      fmt::print("    {:<20} {:>9.2f} ms {:>6.1f}%  {:>6g} calls\n", t.op, t.milliseconds / 2,
                 100 * t.milliseconds / 2 / profiled_ms, static_cast<double>(t.calls) / 2);
    fmt::print("    {:<20} {:>9.2f} ms {:>6.1f}%\n", "(all ops)", op_ms, 100 * op_ms / profiled_ms);
    if (!o->json.empty()) {
      std::ofstream out(o->json, std::ios::app);
      out << nlohmann::json{{"model", config.model.name},       {"device", where},
                            {"tokens_per_second", tokens_per_second}, {"ms_per_step", 1e3 * seconds / o->steps},
                            {"tflops", tflops},                    {"mfu", on_gpu ? nlohmann::json(tflops * 1e12 / kPeakFlops) : nlohmann::json()},
                            {"planned_gib", planned_gib},          {"device_gib", device_gib},
                            {"parameters", model.parameter_count()}, {"libraries", cuda_library_versions()},
                            {"deterministic", build.deterministic},
                            {"tokens", o->tokens},
                            {"data", data_tokens ? data_name(config) : ""},
                            {"init_from", initial ? initial->dir : ""},
                            {"first_loss", first_loss},
                            {"last_loss", loss},
                            {"imbalance", imbalance},
                            {"routing", routing},
                            {"ops", [&] {
                               nlohmann::json j = nlohmann::json::object();
                               for (const OpTime& t : ops) j[t.op] = t.milliseconds / 2;
                               return j;
                             }()}}
                 .dump()
          << '\n';
      out.close();
      KILN_CHECK(!out.fail(), "bench", "{}: cannot write: {}", o->json, std::strerror(errno));
    }
    if (!o->trace.empty()) {
      BenchTraceRun run;
      run.step = [&] { step(); };
      run.device = device;
      run.cuda_graphs = program.execution() == StepExecution::captured;
      run.graph_launches = [&] { return program.graph_launches(); };
      run.exec = model.exec();
      write_bench_trace(o->trace, run);
    }
  });
}

}  // namespace kiln::cli
