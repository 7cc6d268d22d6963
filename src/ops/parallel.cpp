#include "ops/parallel.h"

#include <omp.h>

#include <thread>

extern "C" void openblas_set_num_threads(int);

namespace kiln {

int set_cpu_threads(int64_t threads) {
  int n = threads > 0 ? static_cast<int>(threads) : static_cast<int>(std::thread::hardware_concurrency());
  if (n < 1) n = 1;
  omp_set_num_threads(n);
  openblas_set_num_threads(n);
  return n;
}

int cpu_threads() { return omp_get_max_threads(); }

}  // namespace kiln
