// The GPU backend of the collectives: NCCL on the stream of the execution context it is
// given (core/exec_context.h; the model's), so a collective is ordered after the kernels
// that made its buffer and before those that read it, without a host wait, and a step's
// CUDA graph can capture it. Only in CUDA
// builds (nccl_communicator.cu). NVLink SHARP (multicast) is kept off: NCCL_NVLS_ENABLE=0
// is set before the communicator is made unless the environment says otherwise.
#pragma once

#include "core/exec_context.h"
#include "dist/communicator.h"
#include "dist/tcp_store.h"

#include <chrono>
#include <memory>
#include <string>

namespace kiln::dist {

// Rank 0 makes NCCL's unique id and publishes it through the store under `key`; every
// rank then joins the communicator on its current CUDA device. Collectives run on `exec`'s
// stream. A collective enqueued outside a capture, and the work watch() is given, that
// has not finished within `timeout` (dist.timeout) aborts the communicator and ends the
// process with exit status 1, naming the rank and the collective on stderr.
std::unique_ptr<Communicator> make_nccl_communicator(TcpStore& store, const std::string& key, int rank,
                                                     int world_size, const ExecContext& exec,
                                                     std::chrono::milliseconds timeout);

}  // namespace kiln::dist
