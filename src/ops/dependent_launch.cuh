// Programmatic dependent launch (Hopper and later): a kernel launched with launch_dependent()
// may start while the kernel before it on the stream is still running, once every block of
// that one has called allow_dependents() (or exited). It must call wait_for_producer()
// before it touches anything the earlier kernels write; what it does before (reading
// weights, which nothing in the step writes) overlaps their tail. Chains of such kernels
// stay ordered: a kernel completes only after its own wait, so each wait covers every
// kernel before it. The decode step uses this to stream each projection's weights while
// attention and the small kernels before it run, and CUDA graphs keep the edges.
// On GPUs before sm_90 both device calls compile to nothing and launches are ordinary.
// CUDA translation units only.
#pragma once

#include "core/cuda_check.h"
#include "core/cuda_context.h"

#include <utility>

namespace kiln::cuda {

__device__ __forceinline__ void wait_for_producer() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

// kernel<<<grid, block, smem, stream>>>(args...) that may overlap the previous kernel
// (see above); `what` names it in a launch error. cluster > 1 launches thread-block clusters
// of that many blocks along x (grid.x a multiple of it; sm_90 and later).
template <typename... Params, typename... Args>
void launch_dependent_clusters_on(cudaStream_t stream, const char* op, const char* what, void (*kernel)(Params...),
                                  dim3 grid, dim3 block, size_t smem, unsigned cluster, Args&&... args) {
  cudaLaunchAttribute attributes[2]{};
  attributes[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[0].val.programmaticStreamSerializationAllowed = 1;
  attributes[1].id = cudaLaunchAttributeClusterDimension;
  attributes[1].val.clusterDim.x = cluster;
  attributes[1].val.clusterDim.y = 1;
  attributes[1].val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attributes;
  config.numAttrs = cluster > 1 ? 2 : 1;
  check(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...), op, what);
}

template <typename... Params, typename... Args>
void launch_dependent_on(cudaStream_t stream, const char* op, const char* what, void (*kernel)(Params...), dim3 grid,
                         dim3 block, size_t smem, Args&&... args) {
  launch_dependent_clusters_on(stream, op, what, kernel, grid, block, smem, 1, std::forward<Args>(args)...);
}

}  // namespace kiln::cuda
