// This process's memory as the operating system counts it (the host side; a GPU's memory
// is core/device_memory.h's cuda_memory_info).
#pragma once

#include <cstdint>

namespace kiln {

// The most resident memory this process has held so far (getrusage's ru_maxrss), in bytes.
int64_t host_peak_rss_bytes();

}  // namespace kiln
