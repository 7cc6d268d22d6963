// ZeRO-2's reduce-scatter of a range of the gradient arena into its owners' shards
// (dist.zero = 2, train/data_parallel.h), on the host or enqueued on a CUDA stream. In
// rounds of a chunk per rank through a buffer of world_size chunks (the all-gather's,
// about dist.bucket_mb): every rank copies each rank's part of the range into that rank's
// chunk (a short part's tail zeroed: the collective's chunks are equal, as NCCL's are),
// the buffer is reduce-scattered, and this rank's summed part goes back into its
// gradients. The other ranks' parts of the range are then zeroed here, so the arena holds
// this rank's shard's sums and zeros elsewhere (the norm's sum of squares is then the
// shard's). A rank's part is its shard's pieces inside the range, in flat order. Every
// rank issues the same rounds (they depend only on the shards and the range), as NCCL
// requires.
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"
#include "dist/communicator.h"
#include "train/parameter_shards.h"

#include <cstdint>

namespace kiln {

class GradientReduceScatter {
 public:
  // `arena`: the model's gradient arena (Model::all_gradients); `buffer`: world_size chunks
  // of `chunk` elements, on the arena's device.
  GradientReduceScatter(dist::Communicator& comm, int rank, const ParameterShards& shards, const Tensor& arena,
                        unsigned char* buffer, int64_t chunk);

  // Elements [begin, end) of the arena: on the host (a CPU arena; `exec` unused), or every
  // copy, zeroing and the collective enqueued on `exec`'s stream (a GPU arena; a CUDA graph
  // may capture them).
  void run(const ExecContext& exec, int64_t begin, int64_t end);

 private:
  dist::Communicator& comm_;
  int rank_;
  const ParameterShards& shards_;
  unsigned char* arena_;
  Device device_;
  unsigned char* buffer_;
  int64_t chunk_;
};

}  // namespace kiln
