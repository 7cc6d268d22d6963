// Raw memory on a device. Only arenas and Storage call these; the step loop never does.
#pragma once

#include "core/dtype.h"
#include "core/exec_context.h"

#include <cstddef>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>

namespace kiln {

// 256-byte alignment suits AVX-512 loads on the CPU and vectorized/TMA access on GPUs.
constexpr size_t kAlignment = 256;

void* device_alloc(Device device, size_t bytes);
void device_free(Device device, void* ptr);
void device_copy(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes);
void device_memset_zero(void* ptr, Device device, size_t bytes);

// Page-locked host memory, so copies between it and the GPU run asynchronously (a staged
// batch, a step's scalars). CUDA builds only.
void* pinned_alloc(size_t bytes);
void pinned_free(void* ptr);
// Copies enqueued on kiln's CUDA stream: the host does not wait. With pinned host memory
// the copy reads or writes it when the stream runs it, so it must stay untouched until
// then; a copy to the device from pageable memory is staged by the driver before the call
// returns (the source is free again at once).
void copy_to_device_async(void* device_dst, const void* host_src, size_t bytes);
void copy_to_host_async(void* host_dst, const void* device_src, size_t bytes);
// Waits until everything enqueued on kiln's CUDA stream has run.
void synchronize_stream();
// The same on the stream an execution context names (core/exec_context.h).
void copy_to_device_async(const ExecContext& ctx, void* device_dst, const void* host_src, size_t bytes);
void copy_to_host_async(const ExecContext& ctx, void* host_dst, const void* device_src, size_t bytes);
// From device memory to device memory, on the context's stream (a CUDA graph may capture it).
void copy_on_device_async(const ExecContext& ctx, void* device_dst, const void* device_src, size_t bytes);
void synchronize_stream(const ExecContext& ctx);

// A pinned host buffer of `count` values of T.
template <typename T>
class PinnedArray {
 public:
  PinnedArray() = default;
  explicit PinnedArray(size_t count) : data_(static_cast<T*>(pinned_alloc(sizeof(T) * count))), count_(count) {
    static_assert(std::is_trivially_destructible_v<T>, "pinned memory is released without destructors");
    std::uninitialized_value_construct_n(data_, count_);
  }
  ~PinnedArray() {
    if (data_) pinned_free(data_);
  }
  PinnedArray(PinnedArray&& o) noexcept : data_(o.data_), count_(o.count_) { o.data_ = nullptr, o.count_ = 0; }
  PinnedArray& operator=(PinnedArray&& o) noexcept {
    std::swap(data_, o.data_);
    std::swap(count_, o.count_);
    return *this;
  }
  PinnedArray(const PinnedArray&) = delete;
  PinnedArray& operator=(const PinnedArray&) = delete;

  T* data() const { return data_; }
  size_t size() const { return count_; }
  T& operator[](size_t i) const { return data_[i]; }

 private:
  T* data_ = nullptr;
  size_t count_ = 0;
};

// True when this build has the CUDA backend and a device is present.
bool cuda_available();
// Makes visible GPU `index` (modulo their count) this process's device, before any CUDA
// work: a data-parallel rank takes its node-local rank's GPU.
void select_cuda_device(int index);
// Free and total memory of the current CUDA device (0, 0 without CUDA).
void cuda_memory_info(size_t* free_bytes, size_t* total_bytes);
// Name of the current CUDA device, or "" without one.
const char* cuda_device_name();
// The CUDA libraries this process runs with, as loaded (not as built against): e.g.
// "CUDA runtime 13.0, driver 13.0, cuBLASLt 130100, cuDNN 91900"; "" without CUDA.
std::string cuda_library_versions();

}  // namespace kiln
