#include "core/process_memory.h"

#include <sys/resource.h>

namespace kiln {

int64_t host_peak_rss_bytes() {
  rusage usage{};
  if (getrusage(RUSAGE_SELF, &usage) != 0) return 0;
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;  // Linux counts KiB
}

}  // namespace kiln
