#include "train/memory_check.h"

#include "core/device_memory.h"
#include "core/error.h"
#include "model/model.h"
#include "nn/mup.h"
#include "train/optimizer_groups.h"
#include "train/parameter_shards.h"
#include "train/training_build.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <limits>
#include <map>
#include <string>

namespace kiln {

namespace {

std::string gib(size_t bytes) {
  const double b = static_cast<double>(bytes);
  if (b >= 1073741824.0) return fmt::format("{:.2f} GiB", b / 1073741824.0);
  return fmt::format("{:.1f} MiB", b / 1048576.0);
}

// A number from a cgroup v2 file ("max" = no limit).
size_t read_cgroup(const char* path) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text) || text == "max") return std::numeric_limits<size_t>::max();
  try {
    return static_cast<size_t>(std::stoull(text));
  } catch (...) {
    return std::numeric_limits<size_t>::max();
  }
}

}  // namespace

namespace {

BuildOptions planned_build(const Config& config, Device device, const StageLayers& layers) {
  BuildOptions build = training_build_options(config, device);
  build.layers = layers;
  return build;
}

}  // namespace

MemoryBudget plan_training_memory(const Config& config, Device device, const StageLayers& layers) {
  const Model model(config.model, planned_build(config, device, layers));  // plans arenas, allocates nothing
  Arena optimizer_state("optimizer", device);
  make_optimizer(model.exec(), config.optim, model.parameters(), mup_width_ratio(config.model))
      ->plan(optimizer_state);
  const MemoryPlan plan = model.memory_plan();
  MemoryBudget b;
  b.parameters = plan.parameters;
  b.gradients = plan.gradients;
  b.optimizer = optimizer_state.planned_bytes();
  b.activations = plan.activations;
  b.workspace = plan.workspace;
  if (device == Device::cpu) {
    // tokens, targets, positions and cu_seqlens (i32) of every host micro-batch kept: a
    // step's, the prefetched ones and the validation set.
    const auto batches =
        static_cast<size_t>(config.train.grad_accum + config.data.prefetch + config.train.eval_batches);
    b.batches = batches * static_cast<size_t>(config.train.micro_batch_tokens + 1) * 4 * sizeof(int32_t);
  }
  return b;
}

ZeroBudget plan_zero_memory(const Config& config, Device device, int world_size, const StageLayers& layers) {
  const Model model(config.model, planned_build(config, device, layers));
  const ParameterShards shards =
      make_parameter_shards(config.optim, model.parameters(), mup_width_ratio(config.model), world_size);
  ZeroBudget b;
  for (int r = 0; r < world_size; ++r) {
    Arena state("optimizer", device);
    make_optimizer(model.exec(), config.optim, model.parameters(), mup_width_ratio(config.model), &shards, r)
        ->plan(state);
    b.optimizer = std::max(b.optimizer, state.planned_bytes());
  }
  b.gather_buffer = static_cast<size_t>(world_size) * static_cast<size_t>(shards.gather_chunk(config.dist.bucket_mb)) *
                    dtype_size(shards.dtype());
  // Backward's events (model/gradient_ready.h): a block's buckets go out at its end, the
  // heads' after them, the table's at the end, each reduce-scattered on the communication
  // thread while backward computes the next block (train/sharded_gradients.h); held at once
  // at most: two blocks (bounded by the two largest), the heads and the table.
  std::map<int, int64_t> held;  // -1: the heads and the final norm, -2: the table, l: block l
  for (int r = 0; r < world_size; ++r)
    for (const ParameterPiece& piece : shards.pieces(r)) {
      const std::string& name = piece.parameter->names().kiln;
      const int group = name == "embed.weight" ? -2 : name.rfind("layers.", 0) == 0 ? std::stoi(name.substr(7)) : -1;
      held[group] += piece.count;
    }
  int64_t largest_block = 0, second_block = 0;
  for (const auto& [group, elements] : held) {
    if (group < 0) continue;
    second_block = std::max(second_block, std::min(largest_block, elements));
    largest_block = std::max(largest_block, elements);
  }
  // (A pipeline's backward hands out no buckets: the whole arena until its one reduction.)
  const bool buckets_in_backward = config.dist.bucket_mb > 0 && config.dist.pipeline_stages <= 1;
  const int64_t elements = buckets_in_backward
                               ? shards.largest() + largest_block + second_block + held[-1] + held[-2]
                               : shards.total();
  b.zero2_gradients = static_cast<size_t>(std::min(elements, shards.total())) * dtype_size(shards.dtype());
  // The GPU's ZeRO-2 keeps the whole arena allocated (train/data_parallel.h): device memory
  // gives no pages back.
  if (device == Device::cuda) b.zero2_gradients = model.memory_plan().gradients;
  return b;
}

MemoryBudget plan_rank_memory(const Config& config, Device device, int world_size, const StageLayers& layers) {
  MemoryBudget budget = plan_training_memory(config, device, layers);
  if (config.dist.zero == 0) return budget;
  const ZeroBudget zero = plan_zero_memory(config, device, world_size, layers);
  budget.optimizer = zero.optimizer;
  budget.parameters += zero.gather_buffer;
  if (config.dist.zero == 2) budget.gradients = zero.zero2_gradients;
  return budget;
}

AvailableMemory available_memory(Device device) {
  AvailableMemory a;
  if (device == Device::cuda) {
    size_t free_bytes = 0, total = 0;
    cuda_memory_info(&free_bytes, &total);
    return {free_bytes, "cudaMemGetInfo"};
  }
  a.bytes = std::numeric_limits<size_t>::max();
  a.source = "unknown";
  std::ifstream meminfo("/proc/meminfo");
  std::string key, unit;
  size_t kib = 0;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") {
      a.bytes = kib * 1024;
      a.source = "MemAvailable";
      break;
    }
  }
  const size_t limit = read_cgroup("/sys/fs/cgroup/memory.max");
  const size_t used = read_cgroup("/sys/fs/cgroup/memory.current");
  if (limit != std::numeric_limits<size_t>::max() && used != std::numeric_limits<size_t>::max()) {
    const size_t room = limit > used ? limit - used : 0;
    if (room < a.bytes) a = {room, "cgroup memory.max - memory.current"};
  }
  return a;
}

int64_t largest_fitting_micro_batch(const Config& config, Device device, size_t available) {
  // Memory grows with the micro-batch (activations, workspace, batches); the rest is
  // fixed. Binary search over plans, each built without allocating.
  Config c = config;
  auto fits = [&](int64_t tokens) {
    c.train.micro_batch_tokens = tokens;
    return plan_training_memory(c, device).total() <= available;
  };
  int64_t lo = config.model.max_seq_len, hi = config.train.micro_batch_tokens;
  if (!fits(lo)) return 0;
  while (lo < hi) {  // invariant: fits(lo)
    const int64_t mid = lo + (hi - lo + 1) / 2;
    if (fits(mid)) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

int64_t largest_micro_batch(const Config& config, Device device, size_t available) {
  constexpr int64_t most = std::numeric_limits<int32_t>::max();  // positions and offsets are 32-bit
  Config c = config;
  auto fits = [&](int64_t tokens) {
    c.train.micro_batch_tokens = tokens;
    return plan_training_memory(c, device).total() <= available;
  };
  int64_t hi = std::max(config.train.micro_batch_tokens, config.model.max_seq_len);
  while (hi < most && fits(hi)) hi = std::min(most, 2 * hi);
  c.train.micro_batch_tokens = hi;
  return largest_fitting_micro_batch(c, device, available);
}

void check_memory_fits(const Config& config, Device device, const MemoryBudget& plan, const AvailableMemory& available) {
  if (plan.total() <= available.bytes) return;
  const int64_t fit = largest_fitting_micro_batch(config, device, available.bytes);
  const std::string advice =
      fit > 0 ? fmt::format("the largest train.micro_batch_tokens that fits is {} (now {}; raise train.grad_accum to "
                            "keep the tokens per step)",
                            fit, config.train.micro_batch_tokens)
              : fmt::format("not even a micro-batch of model.max_seq_len = {} tokens fits: use a smaller model",
                            config.model.max_seq_len);
  fail("memory",
       "the run needs {} on the {} but {} is available ({}): parameters {}, gradients {}, optimizer state {}, "
       "activations {}, workspace {}{}; {}",
       gib(plan.total()), device_name(device), gib(available.bytes), available.source, gib(plan.parameters),
       gib(plan.gradients), gib(plan.optimizer), gib(plan.activations), gib(plan.workspace),
       plan.batches ? fmt::format(", batches {}", gib(plan.batches)) : std::string(), advice);
}

}  // namespace kiln
