// CPU threading for the reference backend. OpenMP with static schedules keeps results
// bitwise reproducible for a fixed thread count.
#pragma once

#include <cstdint>

namespace kiln {

// Sets the thread count for OpenMP loops and BLAS (0 = all cores). Returns the count used.
int set_cpu_threads(int64_t threads);
int cpu_threads();

}  // namespace kiln
