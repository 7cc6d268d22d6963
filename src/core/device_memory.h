// Raw memory on a device. Only arenas and Storage call these; the step loop never does.
#pragma once

#include "core/dtype.h"

#include <cstddef>
#include <string>

namespace kiln {

// 256-byte alignment suits AVX-512 loads on the CPU and vectorized/TMA access on GPUs.
constexpr size_t kAlignment = 256;

void* device_alloc(Device device, size_t bytes);
void device_free(Device device, void* ptr);
void device_copy(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes);
void device_memset_zero(void* ptr, Device device, size_t bytes);

// True when this build has the CUDA backend and a device is present.
bool cuda_available();
// Free and total memory of the current CUDA device (0, 0 without CUDA).
void cuda_memory_info(size_t* free_bytes, size_t* total_bytes);
// Name of the current CUDA device, or "" without one.
const char* cuda_device_name();
// The CUDA libraries this process runs with, as loaded (not as built against): e.g.
// "CUDA runtime 13.0, driver 13.0, cuBLASLt 130100, cuDNN 91900"; "" without CUDA.
std::string cuda_library_versions();

}  // namespace kiln
