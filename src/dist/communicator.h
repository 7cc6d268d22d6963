// Collectives over the ranks of a run, on one kind of memory: the host (Gloo, the CPU
// backend) or the GPU (NCCL, on kiln's CUDA stream, so they order with the kernels around
// them and can be captured into a step's CUDA graph). Every rank calls the same
// collectives in the same order; `what` names the collective in errors ("gradients",
// "step targets"), so a lost rank is reported with what the others were waiting for.
//
// Point to point (send, recv) is between two ranks only, for the pipeline's activations
// and gradients (train/pipeline_engine.h): a message is matched by its peer and `tag`.
#pragma once

#include "core/dtype.h"
#include "core/exec_context.h"

#include <cstdint>
#include <string_view>

namespace kiln::dist {

// max_unsigned: the maximum of integer elements (i32, i64) read as unsigned, as QK-Clip's
// logit keys order (ops/attention/logit_key.h: a positive logit's key has the top bit set,
// and 0, "no logit yet", is the least), which a signed max would misorder.
enum class ReduceOp : uint8_t { sum, max, max_unsigned };

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual Device device() const = 0;  // where the buffers of its collectives live
  virtual std::string_view backend() const = 0;

  // In place over `count` elements: every rank ends with the same reduction of all ranks'.
  virtual void all_reduce(void* data, int64_t count, DType dtype, ReduceOp op, std::string_view what) = 0;
  // The same on `exec`'s stream instead of the communicator's own, for a backend whose
  // collectives run on a stream (NCCL): a communication stream beside the model's
  // (train/stream_gradient_buckets.h). A host backend has no stream and ignores `exec`.
  virtual void all_reduce_on(const ExecContext& exec, void* data, int64_t count, DType dtype, ReduceOp op,
                             std::string_view what) {
    (void)exec;
    all_reduce(data, count, dtype, op, what);
  }
  // Bounds the work enqueued on `exec`'s stream so far (a replayed graph's collectives
  // among it) by the collectives' timeout, for a backend whose collectives run on a stream
  // (NCCL's watchdog, dist/collective_watchdog.h); `what` names it if it is late. A host
  // backend's collectives bound themselves: nothing to do.
  virtual void watch(const ExecContext& exec, std::string_view what) {
    (void)exec;
    (void)what;
  }
  // `bytes` from rank `root` to every rank, in place.
  virtual void broadcast(void* data, int64_t bytes, int root, std::string_view what) = 0;
  // In place over world_size() chunks of `bytes_per_rank`: rank r's chunk starts at
  // data + r * bytes_per_rank; every rank ends with every rank's chunk.
  virtual void all_gather(void* data, int64_t bytes_per_rank, std::string_view what) = 0;
  // In place over world_size() chunks of `count_per_rank` elements: rank r ends with the
  // reduction of every rank's chunk r in its own chunk (data + r * count_per_rank); the other
  // chunks are left as scratch, their contents unspecified. The chunks are equal, as NCCL's
  // are: a caller with uneven shares pads them (train/data_parallel.h, ZeRO-2). The order of
  // the reduction is the backend's and may differ from all_reduce's, so a float sum may
  // differ from all_reduce's in its last bits (beyond two ranks, where a + b = b + a).
  virtual void reduce_scatter(void* data, int64_t count_per_rank, DType dtype, ReduceOp op, std::string_view what) = 0;
  // The same on `exec`'s stream (ZeRO-2's buckets on a communication stream); a host
  // backend ignores `exec`, as all_reduce_on.
  virtual void reduce_scatter_on(const ExecContext& exec, void* data, int64_t count_per_rank, DType dtype, ReduceOp op,
                                 std::string_view what) {
    (void)exec;
    reduce_scatter(data, count_per_rank, dtype, op, what);
  }

  // `bytes` to rank `peer`, to be matched by its recv with this rank and the same `tag`
  // (>= 0); messages of one tag between two ranks arrive in the order sent. A send is
  // posted and returns (an isend, as the pipeline simulator assumes): `data` may be reused
  // at once, and a send whose receive never comes fails a later send or recv (Gloo) within
  // the timeout. So a rank never waits on its own sends, only on what it receives, and a
  // schedule the simulator passes cannot deadlock on them. (NCCL, untested: ncclSend and
  // ncclRecv on the stream; NCCL has no tags, so messages between two ranks match in the
  // order issued, and a large send waits on the GPU for its receive: the pipeline engine
  // refuses it until sends and receives are grouped.)
  virtual void send(const void* data, int64_t bytes, int peer, int tag, std::string_view what) = 0;
  // Waits for `bytes` from rank `peer`'s send with `tag`, into `data`.
  virtual void recv(void* data, int64_t bytes, int peer, int tag, std::string_view what) = 0;
};

}  // namespace kiln::dist
