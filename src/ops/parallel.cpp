#include "ops/parallel.h"

#include "ops/blas.h"

#include <omp.h>

#include <algorithm>

namespace kiln {

int set_cpu_threads(int64_t threads) {
  int n = threads > 0 ? static_cast<int>(threads) : static_cast<int>(std::thread::hardware_concurrency());
  if (n < 1) n = 1;
  omp_set_num_threads(n);
  blas().set_num_threads(n);
  return n;
}

int cpu_threads() { return omp_get_max_threads(); }

void set_openmp_threads_of_this_thread(int threads) { omp_set_num_threads(std::max(threads, 1)); }

}  // namespace kiln
