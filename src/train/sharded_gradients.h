// ZeRO-2's gradient memory on the CPU (dist.zero = 2, train/data_parallel.h). The model's
// gradient arena keeps its addresses (backward writes every parameter's gradient in place),
// but a rank holds physical memory only for the arena's pages that overlap its own shard
// (train/parameter_shards.h) and for the buckets backward is filling: with dist.bucket_mb >
// 0, each micro-batch's backward hands every finished bucket (train/gradient_buckets.h) to
// a reduce-scatter into the owners' shards, and this rank's pages of other ranks' shards
// are then zeroed and given back to the system (madvise MADV_DONTNEED: they read as zeros
// and take no memory until written again). The owner's shard accumulates over the
// micro-batches (DeepSpeed's ZeRO-2): its pages hold the sums of the earlier micro-batches
// on this rank alone (every other rank's copy of them is zero), so the next reduce-scatter
// adds the new gradients of every rank to them. The reduce-scatters run on a communication
// thread (train/gradient_buckets.h: BucketThread, DDP's), overlapped with backward.
#pragma once

#include "dist/communicator.h"
#include "model/model.h"
#include "train/gradient_buckets.h"
#include "train/gradient_reduce_scatter.h"
#include "train/parameter_shards.h"

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace kiln {

class ShardedGradients {
 public:
  // `buffer`: the reduce-scatter's rounds, world_size chunks of `chunk` elements.
  // `measure_resident`: count the arena's resident pages (mincore) at every bucket and
  // backward's end; a diagnostic, off in training (a system call and a page table walk of
  // the whole arena per bucket).
  ShardedGradients(dist::Communicator& comm, int rank, const ParameterShards& shards, Model& model,
                   unsigned char* buffer, int64_t chunk, bool measure_resident = false);

  // The buckets one micro-batch's backward reduce-scatters (empty: none, the whole arena
  // after the step's last backward).
  void plan_buckets(std::vector<GradientBucket> buckets);
  bool bucketed() const { return !buckets_.empty(); }
  const std::vector<GradientBucket>& buckets() const { return buckets_; }
  // A micro-batch's backward begins (the last one's buckets waited for first), reaches
  // `event` (its ready buckets handed to the communication thread, train/gradient_buckets.h,
  // which reduce-scatters them in plan order on every rank while backward goes on; backward
  // first waits for the buckets of the events before, so one event's are in flight at most)
  // and ends (the rest handed over). wait(): every bucket handed over done, and the other ranks'
  // pages of the whole arena given back; before anything reads the gradients or uses the
  // communicator (the same Gloo context), and before the next backward writes them.
  void start();
  void ready(int event);
  void finish();
  void wait();
  // Without buckets: the whole arena, once, after the step's last backward.
  void reduce_scatter_all();
  // A step begins: this rank's shard zeroed, every other page of the arena given back.
  void zero();
  // Bytes of the arena in physical memory now (mincore), and, when measure_resident, the most
  // seen at a bucket's reduce-scatter or a backward's end since the run began (else 0).
  size_t resident_bytes() const;
  bool measures_resident() const { return measure_resident_; }
  size_t peak_resident_bytes() const { return peak_resident_; }
  size_t arena_bytes() const { return arena_bytes_; }
  // Bytes of the arena's pages that overlap this rank's shard (about arena / world_size, plus
  // the pages small tensors of other shards share with it).
  size_t shard_page_bytes() const { return shard_pages_; }

 private:
  // Bucket i reduce-scattered and its pages outside this rank's shard given back (on the
  // communication thread).
  void reduce_scatter_bucket(size_t i);
  // Elements [begin, end) of the arena reduce-scattered into their owners' shards; the
  // other ranks' elements zeroed here (train/gradient_reduce_scatter.h).
  void reduce_scatter_range(int64_t begin, int64_t end);
  // Zeroes the arena's bytes in [lo, hi) outside this rank's shard: whole pages given back,
  // partial ones written with zeros, or with `whole_pages_only` left as they are.
  void release_outside_own(size_t lo, size_t hi, bool whole_pages_only);
  void note_resident();

  const ParameterShards& shards_;
  Model& model_;
  GradientReduceScatter rounds_;
  unsigned char* arena_ = nullptr;
  size_t arena_bytes_ = 0;
  // This rank's shard in the arena: byte ranges, sorted and disjoint (the arena's order of
  // the parameters need not be the shards' flat order: the table may sit elsewhere).
  std::vector<std::pair<size_t, size_t>> own_;
  std::vector<GradientBucket> buckets_;
  std::unique_ptr<BucketThread> thread_;  // over buckets_
  bool in_flight_ = false;                // a backward's buckets handed over, not waited for
  std::vector<bool> reduced_;             // this micro-batch's, per bucket (the thread's)
  bool measure_resident_ = false;
  size_t peak_resident_ = 0;
  size_t shard_pages_ = 0;
};

}  // namespace kiln
