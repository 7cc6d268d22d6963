#include "infer/decoder_cuda.h"

#include "core/cuda_check.h"
#include "core/cuda_context.h"
#include "core/op_profiler.h"

#include <cfloat>
#include <cstdio>

namespace kiln::cuda {

StepGraphs::~StepGraphs() {
  for (auto& [key, exec] : graphs_) cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec));
}

void StepGraphs::run(int64_t key, const std::function<void()>& step) {
  if (OpProfiler::enabled()) {  // profiled steps run op by op (their events are on the legacy stream)
    step();
    return;
  }
  if (auto it = graphs_.find(key); it != graphs_.end()) {
    check(cudaGraphLaunch(static_cast<cudaGraphExec_t>(it->second), stream()), "decoder", "cudaGraphLaunch");
    return;
  }
  step();
  if (failed_.count(key)) return;
  try {
    capture(key, step);
  } catch (const Error& e) {
    // The step ran (above); only its graph is missing. Later steps of this row count run
    // uncaptured, slower but correct; say so once rather than fail a working decoder.
    failed_.insert(key);
    std::fprintf(stderr, "kiln: warning: %s; steps of %lld rows run uncaptured\n", e.what(),
                 static_cast<long long>(key));
  }
}

void StepGraphs::capture(int64_t key, const std::function<void()>& step) {
  const cudaStream_t s = stream();
  // Thread-local mode: a call in this thread that could synchronize or allocate while the
  // stream captures fails (and fails the capture) instead of silently escaping the graph;
  // other threads' unrelated CUDA work is not affected.
  check(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), "decoder", "cudaStreamBeginCapture");
  cudaGraph_t graph = nullptr;
  try {
    step();
  } catch (...) {
    cudaStreamEndCapture(s, &graph);
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();  // the capture's error is the one rethrown
    throw;
  }
  check(cudaStreamEndCapture(s, &graph), "decoder", "cudaStreamEndCapture (the step did something a graph cannot hold)");
  cudaGraphExec_t exec = nullptr;
  const cudaError_t status = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  check(status, "decoder", "cudaGraphInstantiate");
  graphs_.emplace(key, exec);
}

namespace {

constexpr int kArgmaxThreads = 512;

// Keeps the larger value; on equal values (and for NaN, which never compares larger) the
// lower index, so the result does not depend on the reduction's order.
__device__ __forceinline__ void better(float& v, int32_t& i, float ov, int32_t oi) {
  if (ov > v || (ov == v && oi < i)) v = ov, i = oi;
}

__global__ void argmax_rows_kernel(const float* __restrict__ logits, int64_t vocab, int32_t* __restrict__ out) {
  const float* row = logits + blockIdx.x * vocab;
  float v = -FLT_MAX;
  int32_t idx = INT32_MAX;
  for (int64_t j = threadIdx.x; j < vocab; j += blockDim.x) better(v, idx, row[j], static_cast<int32_t>(j));
  for (int offset = 16; offset > 0; offset >>= 1)
    better(v, idx, __shfl_xor_sync(0xffffffffu, v, offset), __shfl_xor_sync(0xffffffffu, idx, offset));
  __shared__ float values[kArgmaxThreads / 32];
  __shared__ int32_t indices[kArgmaxThreads / 32];
  const int warp = static_cast<int>(threadIdx.x) >> 5, lane = static_cast<int>(threadIdx.x) & 31;
  if (lane == 0) values[warp] = v, indices[warp] = idx;
  __syncthreads();
  if (threadIdx.x != 0) return;
  for (int w = 1; w < kArgmaxThreads / 32; ++w) better(v, idx, values[w], indices[w]);
  // A row of NaN or -inf only: the first index, as std::max_element would give.
  out[blockIdx.x] = idx == INT32_MAX ? 0 : idx;
}

}  // namespace

void argmax_rows_f32(const float* logits, int64_t rows, int64_t vocab, int32_t* out) {
  if (rows == 0) return;
  argmax_rows_kernel<<<static_cast<unsigned>(rows), kArgmaxThreads, 0, stream()>>>(logits, vocab, out);
  check_launch("decoder", "argmax_rows_kernel");
}

}  // namespace kiln::cuda
