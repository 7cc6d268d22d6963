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

#include <memory>
#include <string>

namespace kiln::dist {

// Rank 0 makes NCCL's unique id and publishes it through the store under `key`; every
// rank then joins the communicator on its current CUDA device. Collectives run on `exec`'s
// stream.
std::unique_ptr<Communicator> make_nccl_communicator(TcpStore& store, const std::string& key, int rank,
                                                     int world_size, const ExecContext& exec);

}  // namespace kiln::dist
