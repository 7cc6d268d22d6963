// CPU threading for the reference backend. OpenMP with static schedules keeps results
// bitwise reproducible for a fixed thread count.
#pragma once

#include <cstdint>
#include <thread>
#include <utility>

namespace kiln {

// Sets the thread count for OpenMP loops and BLAS (0 = all cores). Returns the count used.
// OpenMP's count is the calling thread's own (libgomp keeps it per thread): call it on the
// thread that runs the model, or start model threads with start_cpu_thread.
int set_cpu_threads(int64_t threads);
// The calling thread's OpenMP thread count.
int cpu_threads();
// Sets the calling thread's OpenMP thread count alone (BLAS's is process-wide).
void set_openmp_threads_of_this_thread(int threads);

// A std::thread running `fn` with the OpenMP thread count of the thread that starts it.
// A plain std::thread starts with OpenMP's default (OMP_NUM_THREADS, else every core)
// whatever set_cpu_threads said on the main thread: `kiln serve --threads 1` decoded on
// every core. Every kiln thread that may run OpenMP loops is started with this.
template <typename Fn>
std::thread start_cpu_thread(Fn&& fn) {
  return std::thread([threads = cpu_threads(), fn = std::forward<Fn>(fn)]() mutable {
    set_openmp_threads_of_this_thread(threads);
    fn();
  });
}

}  // namespace kiln
