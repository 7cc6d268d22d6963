// Will the run fit? Compared before anything large is allocated: the planned bytes of
// parameters, gradients, optimizer state, activations and workspace (exact: the arenas
// are planned, not estimated) against what the device has free. A run that would not
// fit stops at once with the breakdown and the largest micro-batch that would.
#pragma once

#include "core/dtype.h"
#include "config/config.h"

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace kiln {

struct MemoryBudget {
  size_t parameters = 0, gradients = 0, optimizer = 0, activations = 0, workspace = 0;
  size_t batches = 0;  // host micro-batches (a step's, prefetched, validation); counted on the CPU only
  size_t total() const { return parameters + gradients + optimizer + activations + workspace + batches; }
};

// A pipeline rank's stages, the layer ranges of the model it builds (BuildOptions::layers,
// dist.pipeline_model = "stages"); empty: the whole model.
using StageLayers = std::vector<std::pair<int64_t, int64_t>>;

// The plan for `config` on `device`, built without allocating (as `kiln plan` does): the
// whole model's, or `layers`' alone.
MemoryBudget plan_training_memory(const Config& config, Device device, const StageLayers& layers = {});

// ZeRO-1 at `world_size` ranks (train/parameter_shards.h): the optimizer state of the rank
// that keeps the most, and the buffer the updated shards are all-gathered through
// (about dist.bucket_mb; ParameterShards::gather_chunk).
// ZeRO-2 (dist.zero = 2; train/sharded_gradients.h) also bounds the gradient memory a rank
// holds on the CPU: the largest shard's gradients, plus what backward writes before its
// buckets' reduce-scatters end (two blocks' gradients -- the one reduce-scattered while
// backward computes the next -- the heads' and the embedding table's, whose gradient a tied
// head writes first); with dist.bucket_mb = 0 the whole arena. On the GPU the whole arena,
// always (it stays allocated), and under a pipeline too (its gradients are summed once after
// its schedule, never in buckets during backward).
// `layers`: a pipeline stage's model, sharded over the stage's `world_size` replicas.
struct ZeroBudget {
  size_t optimizer = 0, gather_buffer = 0;
  size_t zero2_gradients = 0;
};
ZeroBudget plan_zero_memory(const Config& config, Device device, int world_size, const StageLayers& layers = {});

// What one of `world_size` data-parallel ranks needs (the trainer's check): the whole plan,
// with ZeRO's shard of the optimizer state and the gather's buffer (dist.zero >= 1) and
// ZeRO-2's bound of the gradients (dist.zero = 2) in place of the whole. With `layers`, a
// pipeline rank's model built per stage, ZeRO sharding it over `world_size` replicas.
MemoryBudget plan_rank_memory(const Config& config, Device device, int world_size, const StageLayers& layers = {});

struct AvailableMemory {
  size_t bytes = 0;
  std::string source;  // "MemAvailable", "cgroup memory.max", "cudaMemGetInfo"
};
// CPU: MemAvailable from /proc/meminfo, capped by the cgroup's memory.max - memory.current
// when a limit is set (containers). CUDA: free bytes from cudaMemGetInfo.
AvailableMemory available_memory(Device device);

// The largest train.micro_batch_tokens (>= model.max_seq_len) whose plan fits in
// `available` bytes, or 0 when not even model.max_seq_len does.
int64_t largest_fitting_micro_batch(const Config& config, Device device, size_t available);

// The same, searched above the config's own train.micro_batch_tokens too (doubling it until
// a plan no longer fits, up to the 32-bit limit on positions): `kiln plan --fit-memory`.
int64_t largest_micro_batch(const Config& config, Device device, size_t available);

// Throws "[memory] ..." (one line: the breakdown, what is available, the largest
// micro-batch that fits) when `plan` exceeds `available`.
void check_memory_fits(const Config& config, Device device, const MemoryBudget& plan, const AvailableMemory& available);

}  // namespace kiln
