#include "cli/commands.h"
#include "data/shards/shard_tokenizer.h"
#include "model/model.h"
#include "core/device_memory.h"
#include "core/error.h"
#include "train/memory_check.h"
#include "train/pipeline_costs_measured.h"
#include "train/pipeline_trainer_step.h"
#include "train/training_build.h"

#include <fmt/format.h>

#include <cmath>

namespace kiln::cli {

namespace {
double mib(size_t bytes) { return static_cast<double>(bytes) / 1048576.0; }

// Each rank's memory at `world` data-parallel ranks: DDP keeps everything whole on every
// rank; ZeRO-1 (dist.zero = 1) keeps the optimizer state of one shard, plus the buffer its
// updated parameters are all-gathered through (train/parameter_shards.h); ZeRO-2 (dist.zero
// = 2) also holds at most its shard of the gradients and what backward has not yet
// reduce-scattered on the CPU (train/sharded_gradients.h), the whole arena on the GPU.
void print_per_rank(const Config& config, Device device, const MemoryBudget& plan, int world) {
  fmt::print("per rank at {} data-parallel ranks:\n", world);
  fmt::print("  {:<8} {:>12} {:>12} {:>12} {:>12} {:>12} {:>12}\n", "mode", "parameters", "gradients", "optimizer",
             "gather buf", "activations", "total MiB");
  const size_t rest = plan.activations + plan.workspace + plan.batches;
  const auto row = [&](const char* mode, size_t gradients, size_t optimizer, size_t gather) {
    fmt::print("  {:<8} {:>12.2f} {:>12.2f} {:>12.2f} {:>12.2f} {:>12.2f} {:>12.2f}\n", mode, mib(plan.parameters),
               mib(gradients), mib(optimizer), mib(gather), mib(rest),
               mib(plan.parameters + gradients + optimizer + gather + rest));
  };
  row("DDP", plan.gradients, plan.optimizer, 0);
  try {
    const ZeroBudget zero = plan_zero_memory(config, device, world);
    row("ZeRO-1", plan.gradients, zero.optimizer, zero.gather_buffer);
    row("ZeRO-2", zero.zero2_gradients, zero.optimizer, zero.gather_buffer);
  } catch (const Error& e) {
    fmt::print("  ZeRO     {}\n", e.what());
  }
  fmt::print("  (activations: activations, workspace and host batches; ZeRO-2's gradients: the largest shard's, plus "
             "the two largest blocks', the heads' and the embedding table's, which backward holds before their "
             "buckets are reduce-scattered; the whole arena with dist.bucket_mb = 0; page rounding not counted; "
             "on the GPU the whole arena, which stays allocated)\n");
}

// The pipeline split (train/pipeline_split.h) of the config's layers into `stages` stages,
// or the one given by --pipeline-split, with its predicted balance from the costs
// dist.pipeline_costs names: estimated from the config (train/pipeline_costs.h) or measured
// on the plan's device (train/pipeline_costs_measured.h; the one thing `kiln plan`
// allocates and runs).
void print_pipeline_split(const Config& config, Device device, int64_t stages, const std::string& given,
                          double stage_memory_gib) {
  PipelineCosts costs = pipeline_costs_for(config, device);
  PipelineSplit split;
  // The activations of the micro-batches each stage keeps in flight under the config's
  // schedule (dist.pipeline_schedule, dist.pipeline_activations).
  if (!given.empty()) {
    split = parse_pipeline_split(given, "--pipeline-split");
    validate_pipeline_split(split, config.model.layers, stages, "--pipeline-split");
    costs.stage_in_flight = pipeline_stage_in_flight(config, static_cast<int64_t>(split.size()));
  } else {
    costs.stage_in_flight = pipeline_stage_in_flight(config, stages);
    split = plan_pipeline_split(costs, stages, stage_memory_gib * 1073741824.0, "--pipeline-stages",
                                "--stage-memory-gib");
  }
  fmt::print("pipeline split into {} stages ({}; {}):\n", split.size(),
             given.empty() ? "chosen: the least slowest stage" : "given by --pipeline-split",
             costs.measured ? "layer times measured, dist.pipeline_costs = measure"
                            : "costs estimated from the config, not measured");
  fmt::print("{}", describe_pipeline_balance(costs, pipeline_balance(costs, split)));
}
}  // namespace

void add_plan_command(CLI::App& app) {
  struct Options {
    std::string config;
    std::vector<std::string> overrides;
    double fit_gib = 0;
    int world_size = 0;
    int pipeline_stages = 0;
    std::string pipeline_split;
    double stage_memory_gib = 0;
  };
  auto o = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand("plan", "parameter count, memory and FLOPs of a config, without allocating");
  cmd->add_option("config", o->config, "TOML config file")->required();
  cmd->add_option("--set", o->overrides, "override a key: --set model.layers=8 (repeatable)")->take_all();
  cmd->add_option("--fit-memory", o->fit_gib,
                  "also print the largest train.micro_batch_tokens whose plan fits in this many GiB")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--world-size", o->world_size,
                  "also print each rank's memory at this many data-parallel ranks, without and with ZeRO-1 and ZeRO-2")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--pipeline-stages", o->pipeline_stages,
                  "also print the split of the layers into this many pipeline stages and its predicted balance")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--pipeline-split", o->pipeline_split,
                  "print this split's balance instead: the first layer of each stage, e.g. 0,6,12,18");
  cmd->add_option("--stage-memory-gib", o->stage_memory_gib,
                  "with --pipeline-stages: keep every stage's memory within this many GiB")
      ->check(CLI::PositiveNumber);
  cmd->callback([o] {
    Config config = load_config(o->config, o->overrides);
    adopt_shard_tokenizer(config);  // shards give model.vocab_size
    // The plan of the run this config would make: on the GPU when train.device names it
    // (or "auto" finds one) or train.precision asks for bf16. Planning allocates nothing,
    // so a GPU plan needs no GPU here.
    const TrainConfig& train = config.train;
    const bool gpu = train.device == "cuda" || (train.device == "auto" && cuda_available()) ||
                     (train.device != "cpu" && train.precision == "bf16");
    const BuildOptions build = training_build_options(config, gpu ? Device::cuda : Device::cpu);
    const Model model(config.model, build);  // plans every arena; allocates nothing
    // The memory check's own plan (train/memory_check.h), so plan and train agree to the byte.
    const MemoryBudget plan = plan_training_memory(config, build.device);
    const int64_t params = model.parameter_count(), embed = model.embedding_parameter_count();
    const double flops = model.flops_per_token(config.model.max_seq_len);
    const int64_t step_tokens = config.train.micro_batch_tokens * config.train.grad_accum;
    fmt::print("model {} ({} layers, hidden {}, {} q / {} kv heads of {}, ffn {}, vocab {}, context {})\n",
               config.model.name, config.model.layers, config.model.hidden, config.model.heads,
               config.model.kv_heads, config.model.head_dim, config.model.ffn_hidden, config.model.vocab_size,
               config.model.max_seq_len);
    fmt::print("parameters      {:>14L}  ({} embedding, {} non-embedding)\n", params, embed, params - embed);
    const double active = model.active_parameter_count();
    fmt::print("active          {:>14L}  ({})\n", static_cast<int64_t>(std::llround(active)),
               active < static_cast<double>(params) ? "per token: each expert weighed by top_k / experts"
                                                    : "dense: every parameter, per token");
    int64_t training_only = 0;
    for (const auto& p : model.parameters()) training_only += p->training_only() ? p->shape().numel() : 0;
    if (training_only > 0)
      fmt::print("training only   {:>14L}  (multi-token prediction: not active, not exported)\n", training_only);
    fmt::print("FLOPs per token {:>14.4g}  (6 x active matmul params + attention's 6 x heads x head_dim x context, "
               "windows counted)\n", flops);
    fmt::print("FLOPs per step  {:>14.4g}  ({} tokens)\n", flops * static_cast<double>(step_tokens), step_tokens);
    fmt::print("memory ({} on the {}, micro-batch of {} tokens{}):\n",
               build.dtype == DType::bf16 ? "bf16 mixed" : "fp32", gpu ? "GPU" : "CPU", config.train.micro_batch_tokens,
               build.recompute_blocks > 0 ? fmt::format(", {} blocks recomputed", build.recompute_blocks) : "");
    fmt::print("  parameters      {:>10.2f} MiB\n", mib(plan.parameters));
    fmt::print("  gradients       {:>10.2f} MiB\n", mib(plan.gradients));
    fmt::print("  optimizer state {:>10.2f} MiB\n", mib(plan.optimizer));
    fmt::print("  activations     {:>10.2f} MiB\n", mib(plan.activations));
    fmt::print("  workspace       {:>10.2f} MiB\n", mib(plan.workspace));
    if (plan.batches > 0) fmt::print("  batches         {:>10.2f} MiB  (host micro-batches kept)\n", mib(plan.batches));
    fmt::print("  total           {:>10.2f} MiB\n", mib(plan.total()));
    if (o->world_size > 0) print_per_rank(config, build.device, plan, o->world_size);
    if (o->pipeline_stages > 0 || !o->pipeline_split.empty())
      print_pipeline_split(config, build.device, o->pipeline_stages, o->pipeline_split, o->stage_memory_gib);
    if (o->fit_gib > 0) {
      // The trainer compares this plan with the free bytes it finds once its CUDA context
      // exists (train/memory_check.h), so GIB means free memory, not the card's size.
      const auto bytes = static_cast<size_t>(o->fit_gib * 1073741824.0);
      const int64_t fit = largest_micro_batch(config, build.device, bytes);
      const int64_t seq = config.model.max_seq_len;
      if (fit == 0)
        fmt::print("fits in {:g} GiB: nothing, not even a micro-batch of model.max_seq_len = {} tokens\n", o->fit_gib,
                   seq);
      else
        fmt::print("fits in {:g} GiB: train.micro_batch_tokens up to {} ({} sequences of {} = {} tokens)\n",
                   o->fit_gib, fit, fit / seq, seq, fit / seq * seq);
    }
  });
}

}  // namespace kiln::cli
