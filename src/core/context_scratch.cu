#include "core/context_scratch.h"

#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "core/error.h"

#include <map>
#include <mutex>
#include <utility>

namespace kiln::cuda {

void* context_scratch(const ExecContext& ctx, const ScratchKind& kind) {
  // Server threads may plan decoders while another runs: the table is shared.
  static std::mutex mutex;
  static std::map<std::pair<cudaStream_t, const ScratchKind*>, void*> buffers;
  const cudaStream_t s = stream(ctx);
  std::lock_guard<std::mutex> lock(mutex);
  auto it = buffers.find({s, &kind});
  if (it != buffers.end()) return it->second;

  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(s, &capturing), kind.name, "cudaStreamIsCapturing");
  KILN_CHECK(capturing == cudaStreamCaptureStatusNone, kind.name,
             "its device scratch ({} bytes) would be allocated inside a CUDA graph capture: run the step once "
             "uncaptured first",
             kind.bytes);
  void* buffer = nullptr;
  check(cudaMalloc(&buffer, kind.bytes), kind.name, "cudaMalloc of its device scratch");
  // Zero, as module-level device memory was; synchronously, so the first kernel sees it.
  check(cudaMemsetAsync(buffer, 0, kind.bytes, s), kind.name, "cudaMemsetAsync");
  check(cudaStreamSynchronize(s), kind.name, "cudaStreamSynchronize");
  buffers.emplace(std::make_pair(s, &kind), buffer);
  return buffer;
}

}  // namespace kiln::cuda
