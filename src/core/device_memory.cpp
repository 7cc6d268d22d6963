#include "core/device_memory.h"

#include "core/error.h"

#include <cstdlib>
#include <cstring>

#include <fmt/format.h>

#if KILN_WITH_CUDA
#include <cublasLt.h>
#include <cuda_runtime.h>
#include <cudnn.h>
#endif

namespace kiln {

namespace {
size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

#if KILN_WITH_CUDA
void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess) fail("cuda", "{}: {}", what, cudaGetErrorString(status));
}
cudaMemcpyKind copy_kind(Device dst, Device src) {
  if (src == Device::cpu) return dst == Device::cpu ? cudaMemcpyHostToHost : cudaMemcpyHostToDevice;
  return dst == Device::cpu ? cudaMemcpyDeviceToHost : cudaMemcpyDeviceToDevice;
}
#endif

[[noreturn]] void no_cuda(const char* what) { fail("cuda", "{}: this kiln was built without the CUDA backend", what); }
}  // namespace

void* device_alloc(Device device, size_t bytes) {
  if (bytes == 0) bytes = kAlignment;
  if (device == Device::cpu) {
    void* p = std::aligned_alloc(kAlignment, round_up(bytes, kAlignment));
    if (!p) fail("memory", "cannot allocate {} bytes on the host", bytes);
    return p;
  }
#if KILN_WITH_CUDA
  void* p = nullptr;
  check_cuda(cudaMalloc(&p, bytes), "cudaMalloc");
  return p;
#else
  no_cuda("device_alloc");
#endif
}

void device_free(Device device, void* ptr) {
  if (device == Device::cpu) {
    std::free(ptr);
    return;
  }
#if KILN_WITH_CUDA
  cudaFree(ptr);
#endif
}

void device_copy(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  if (bytes == 0) return;
  if (dst_device == Device::cpu && src_device == Device::cpu) {
    std::memcpy(dst, src, bytes);
    return;
  }
#if KILN_WITH_CUDA
  check_cuda(cudaMemcpy(dst, src, bytes, copy_kind(dst_device, src_device)), "cudaMemcpy");
#else
  no_cuda("device_copy");
#endif
}

void device_memset_zero(void* ptr, Device device, size_t bytes) {
  if (device == Device::cpu) {
    std::memset(ptr, 0, bytes);
    return;
  }
#if KILN_WITH_CUDA
  check_cuda(cudaMemset(ptr, 0, bytes), "cudaMemset");
#else
  no_cuda("device_memset_zero");
#endif
}

#if KILN_WITH_CUDA
namespace cuda {
cudaStream_t stream();  // core/cuda_context.h, without its cuBLAS include
inline cudaStream_t stream(const ExecContext& ctx) {
  return ctx.stream ? static_cast<cudaStream_t>(ctx.stream) : stream();
}
}
#endif

void* pinned_alloc(size_t bytes) {
#if KILN_WITH_CUDA
  void* p = nullptr;
  check_cuda(cudaMallocHost(&p, bytes == 0 ? kAlignment : bytes), "cudaMallocHost");
  return p;
#else
  (void)bytes;
  no_cuda("pinned_alloc");
#endif
}

void pinned_free(void* ptr) {
#if KILN_WITH_CUDA
  cudaFreeHost(ptr);
#else
  (void)ptr;
#endif
}

#if KILN_WITH_CUDA
namespace {
void copy_async(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream) {
  check_cuda(cudaMemcpyAsync(dst, src, bytes, kind, stream), "cudaMemcpyAsync");
}
}  // namespace
#endif

void copy_on_device_async(const ExecContext& ctx, void* device_dst, const void* device_src, size_t bytes) {
#if KILN_WITH_CUDA
  copy_async(device_dst, device_src, bytes, cudaMemcpyDeviceToDevice, cuda::stream(ctx));
#else
  (void)ctx, (void)device_dst, (void)device_src, (void)bytes;
  no_cuda("copy_on_device_async");
#endif
}

void copy_to_device_async(const ExecContext& ctx, void* device_dst, const void* host_src, size_t bytes) {
#if KILN_WITH_CUDA
  copy_async(device_dst, host_src, bytes, cudaMemcpyHostToDevice, cuda::stream(ctx));
#else
  (void)ctx, (void)device_dst, (void)host_src, (void)bytes;
  no_cuda("copy_to_device_async");
#endif
}

void copy_to_host_async(const ExecContext& ctx, void* host_dst, const void* device_src, size_t bytes) {
#if KILN_WITH_CUDA
  copy_async(host_dst, device_src, bytes, cudaMemcpyDeviceToHost, cuda::stream(ctx));
#else
  (void)ctx, (void)host_dst, (void)device_src, (void)bytes;
  no_cuda("copy_to_host_async");
#endif
}

void synchronize_stream(const ExecContext& ctx) {
#if KILN_WITH_CUDA
  check_cuda(cudaStreamSynchronize(cuda::stream(ctx)), "cudaStreamSynchronize");
#else
  (void)ctx;
  no_cuda("synchronize_stream");
#endif
}

// The process-wide stream's (process_exec()).
void copy_to_device_async(void* device_dst, const void* host_src, size_t bytes) {
  copy_to_device_async(process_exec(), device_dst, host_src, bytes);
}

void copy_to_host_async(void* host_dst, const void* device_src, size_t bytes) {
  copy_to_host_async(process_exec(), host_dst, device_src, bytes);
}

void synchronize_stream() { synchronize_stream(process_exec()); }

bool cuda_available() {
#if KILN_WITH_CUDA
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count > 0;
#else
  return false;
#endif
}

void select_cuda_device(int index) {
#if KILN_WITH_CUDA
  int count = 0;
  check_cuda(cudaGetDeviceCount(&count), "cudaGetDeviceCount");
  KILN_CHECK(count > 0, "cuda", "no CUDA device is visible");
  check_cuda(cudaSetDevice(index % count), "cudaSetDevice");
#else
  (void)index;
  no_cuda("select_cuda_device");
#endif
}

void cuda_memory_info(size_t* free_bytes, size_t* total_bytes) {
  *free_bytes = *total_bytes = 0;
#if KILN_WITH_CUDA
  if (cuda_available()) cudaMemGetInfo(free_bytes, total_bytes);
#endif
}

const char* cuda_device_name() {
#if KILN_WITH_CUDA
  static cudaDeviceProp prop;
  static bool loaded = false;
  int device = 0;
  if (!loaded && cuda_available() && cudaGetDevice(&device) == cudaSuccess)
    loaded = cudaGetDeviceProperties(&prop, device) == cudaSuccess;
  return loaded ? prop.name : "";
#else
  return "";
#endif
}

std::string cuda_library_versions() {
#if KILN_WITH_CUDA
  if (!cuda_available()) return "";
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);
  return fmt::format("CUDA runtime {}.{}, driver {}.{}, cuBLASLt {}, cuDNN {}", runtime / 1000, runtime % 1000 / 10,
                     driver / 1000, driver % 1000 / 10, cublasLtGetVersion(), cudnnGetVersion());
#else
  return "";
#endif
}

}  // namespace kiln
