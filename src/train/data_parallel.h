// Data parallelism of the trainer. Each of W ranks takes grad_accum micro-batches of the
// global stream per step (rank r: micro-batches r, r + W, ...; data/batch_stream.h), and
// the step is the one a single process would take over all W x grad_accum of them:
// every gradient is scaled by 1 / (the target tokens of all ranks), the gradients and
// loss sums are summed over the ranks before the norm, guard, clip and update, and the
// components' step statistics (nn/step_statistics.h) are combined before they act on them.
// Every rank then holds the same gradients, takes the same decisions and keeps the same
// weights, so rank 0's checkpoint is the run's.
//
// With dist.bucket_mb > 0, the gradients of a step's last micro-batch are reduced in
// buckets while its backward still runs: on the CPU by Gloo on a thread of its own
// (train/gradient_buckets.h), on the GPU by NCCL on a communication stream (train/
// stream_gradient_buckets.h); with 0, in one reduction after backward.
//
// With dist.zero = 1 (ZeRO-1) the gradients are still summed whole, so the
// norm, guard and clip see the whole model, but each rank's optimizer updates only its
// shard of the parameters (train/parameter_shards.h) and keeps state for it alone; the
// updated shards are then all-gathered, so every rank again holds the same weights.
//
// With dist.zero = 2 (ZeRO-2) the gradients are reduce-scattered instead: each rank ends
// the step's synchronization with the summed gradients of its own shard, and every other
// rank's shard of its gradients zeroed. The norm is then each rank's sum of squares summed
// over the ranks (gradient_norm): the shards partition the trainable parameters, so this
// is the whole model's sum of squares, only added up in another order. The guard and clip
// act on that norm as before; the optimizer reads only its own shard's gradients. On the
// CPU (Gloo), with dist.bucket_mb > 0 every micro-batch's finished buckets are
// reduce-scattered during its backward, on the communication thread DDP's buckets use, and
// the other ranks' pages of the gradient arena given back (train/sharded_gradients.h); the
// next micro-batch's backward and the step's norm wait for them. With 0, the whole arena
// after the last backward.
// Either way in rounds through the all-gather's buffer (train/gradient_reduce_scatter.h).
// On the GPU (NCCL) the whole arena stays allocated (device memory gives no pages back):
// with dist.bucket_mb > 0 the last micro-batch's finished buckets are reduce-scattered on
// the communication stream during its backward, as DDP's are all-reduced (train/
// stream_gradient_buckets.h), the earlier micro-batches having accumulated in the whole
// arena; with 0, the whole arena on the model's stream after the last backward. The norm's
// sum of squares is summed over the ranks in device memory (sum_shard_squares_on_device),
// so a captured step waits for nothing on the host.
#pragma once

#include "dist/process_group.h"
#include "model/model.h"
#include "train/gradient_buckets.h"
#include "train/gradient_reduce_scatter.h"
#include "train/parameter_shards.h"
#include "train/sharded_gradients.h"
#include "train/stage_gradients.h"
#include "train/stream_gradient_buckets.h"

#include <cstdint>
#include <memory>
#include <optional>

namespace kiln {

struct DataParallelOptions {
  // dist.bucket_mb: the gradients' buckets, and ZeRO's all-gather and reduce-scatter rounds
  // (0: no buckets, one round of the largest shard).
  double bucket_mb = 0;
  // Buckets reduced while backward runs; false: one reduction after the last backward (a
  // pipeline's, after its schedule), ZeRO's rounds still of bucket_mb.
  bool backward_buckets = true;
  bool shard_gradients = false;  // ZeRO-2's reduce-scatter (dist.zero = 2; needs shards)
  // The ranks ZeRO's shards span: every rank of the group (null) or a pipeline stage's
  // replicas (ProcessGroup::subgroup) when each rank builds only its stages' model.
  dist::Communicator* shard_ranks = nullptr;
};

class DataParallel {
 public:
  // shards: ZeRO's (dist.zero >= 1), null without.
  DataParallel(dist::ProcessGroup& group, Model& model, const DataParallelOptions& options,
               std::unique_ptr<ParameterShards> shards = nullptr);
  ~DataParallel();

  int rank() const { return group_.rank(); }
  int world_size() const { return group_.world_size(); }
  bool is_root() const { return group_.is_root(); }

  // Sums `count` step counts (target tokens, document tokens) over every rank, in place (host).
  void sum_counts(int64_t* counts, int count);
  // The signal any rank received (the largest number; 0 = none), so all stop at one step.
  int agree_on_stop(int local_signal);
  // Before each micro-batch's forward and backward: the last of a step reduces its
  // finished gradients in buckets while backward runs, where buckets apply (above).
  void before_backward(bool last_micro_batch);
  // After it: every bucket launched; on the GPU the model's stream then waits for them
  // (inside the micro-batch, where a captured graph must join its communication branch).
  void after_backward();
  // Sums the gradients (or waits for the buckets' sums) and combines the step statistics
  // over the ranks, in place on the model's device (on the GPU: on the model's stream, with
  // no host wait; a step graph may capture it).
  void reduce_gradients();
  // The L2 norm of the step's summed gradients over the whole model, on every rank (after
  // reduce_gradients; host memory). ZeRO-2: the shards' sums of squares summed over the ranks.
  double gradient_norm();
  // The captured step's form of it: `squares` (device memory, this rank's sum of squares)
  // summed over the ranks on the model's stream under ZeRO-2; unchanged without.
  void sum_shard_squares_on_device(double* squares);
  bool shards_gradients() const { return shard_gradients_; }
  // A step begins: the gradients zeroed (ZeRO-2 on the CPU: its shard; the rest of the arena
  // given back).
  void zero_gradients();
  // The clip: the gradients *= factor (ZeRO-2: its shard's, the rest being zero).
  void scale_gradients(double factor);
  // ZeRO-2 with KILN_MEASURE_GRADIENT_MEMORY=1: the most bytes of the gradient arena this
  // rank has held in physical memory (at a bucket's reduce-scatter or a backward's end), and
  // the arena's size; and the arena's pages its shard overlaps. None before its first step,
  // without ZeRO-2 or without the variable (the count is a diagnostic, off the hot path).
  struct GradientMemory {
    size_t peak_resident = 0, arena = 0, shard_pages = 0;
  };
  std::optional<GradientMemory> gradient_memory() const;
  // After a captured step's launch: its collectives bounded by dist.timeout like those
  // enqueued op by op (NCCL's watchdog; Gloo's bound themselves).
  void watch_step();
  // The buckets of the last step's reduction (empty: one reduction after backward).
  std::vector<GradientBucket> buckets() const;
  // Sums `count` doubles over the ranks in place: host memory, or the device's (the device
  // step's loss sums).
  void sum(double* values, int64_t count, Device where);

  // ZeRO: the shards the optimizer updates (null without ZeRO); after an update, every
  // rank's updated shard to every rank (every rank calls it). At a checkpoint each rank
  // writes its own slices of the optimizer state (train/optimizer_shard_files.h).
  const ParameterShards* shards() const { return shards_.get(); }
  // This rank's shard: its rank among the ranks the shards span.
  int shard_rank() const { return shard_group().rank(); }
  size_t gather_buffer_bytes() const { return gathered_.bytes(); }
  void gather_parameters();

  // A pipeline whose ranks build only their stages' models (dist.pipeline_model = "stages";
  // train/stage_gradients.h): reduce_gradients sums each stage's gradients and its layers'
  // step statistics over the stage's replicas alone, after swapping a tied table's shares
  // between its two holders; the norm is the ranks' parts of the sum of squares, summed
  // over them. With ZeRO the shards span the stage's replicas (shard_group, the same
  // communicator): ZeRO-2 reduce-scatters the stage's gradients over them. Not with buckets.
  void use_stage_gradients(std::unique_ptr<StageGradients> stages);
  bool has_stage_models() const { return stages_ != nullptr; }

 private:
  bool bucketed() const { return bucket_mb_ > 0 && backward_buckets_; }
  bool on_gpu() const { return group_.device().device() == Device::cuda; }
  bool host_sharded() const { return shard_gradients_ && !on_gpu(); }  // ZeRO-2 on the CPU
  // The collectives' communicator of ZeRO's shards: a stage's replicas, or every rank's.
  dist::Communicator& shard_group() const { return shard_group_ ? *shard_group_ : group_.device(); }
  int64_t scatter_chunk() const;           // ZeRO-2's elements per rank and round
  ShardedGradients& sharded();             // ZeRO-2's on the CPU, made at its first use
  GradientReduceScatter& device_scatter();  // ZeRO-2's on the GPU, made at its first use

  dist::ProcessGroup& group_;
  Model& model_;
  double bucket_mb_;
  bool backward_buckets_ = true;
  std::unique_ptr<BucketReduction> buckets_;  // made at the first bucketed step
  bool reducing_ = false;                     // this step's buckets are under way
  std::unique_ptr<ParameterShards> shards_;              // ZeRO's; null without
  dist::Communicator* shard_group_ = nullptr;            // what they span; null: group_.device()
  bool shard_gradients_ = false;                         // ZeRO-2
  bool measure_gradient_memory_ = false;                 // ZeRO-2: KILN_MEASURE_GRADIENT_MEMORY=1
  // ZeRO's all-gather buffer (and ZeRO-2's reduce-scatter's): a chunk per rank, on the
  // collectives' device
  Storage gathered_;
  std::unique_ptr<ShardedGradients> sharded_;  // ZeRO-2's gradient memory (CPU)
  std::unique_ptr<GradientReduceScatter> scatter_;  // ZeRO-2's rounds (GPU)
  std::unique_ptr<StageGradients> stages_;  // a pipeline of stage models; null otherwise
};

}  // namespace kiln
