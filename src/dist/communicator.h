// Collectives over the ranks of a run, on one kind of memory: the host (Gloo, the CPU
// backend) or the GPU (NCCL, on kiln's CUDA stream, so they order with the kernels around
// them and can be captured into a step's CUDA graph). Every rank calls the same
// collectives in the same order; `what` names the collective in errors ("gradients",
// "step targets"), so a lost rank is reported with what the others were waiting for.
#pragma once

#include "core/dtype.h"

#include <cstdint>
#include <string_view>

namespace kiln::dist {

enum class ReduceOp : uint8_t { sum, max };

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual Device device() const = 0;  // where the buffers of its collectives live
  virtual std::string_view backend() const = 0;

  // In place over `count` elements: every rank ends with the same reduction of all ranks'.
  virtual void all_reduce(void* data, int64_t count, DType dtype, ReduceOp op, std::string_view what) = 0;
  // `bytes` from rank `root` to every rank, in place.
  virtual void broadcast(void* data, int64_t bytes, int root, std::string_view what) = 0;
  // In place over world_size() chunks of `bytes_per_rank`: rank r's chunk starts at
  // data + r * bytes_per_rank; every rank ends with every rank's chunk.
  virtual void all_gather(void* data, int64_t bytes_per_rank, std::string_view what) = 0;
};

}  // namespace kiln::dist
