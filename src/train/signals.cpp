#include "train/signals.h"

#include "core/error.h"

#include <atomic>
#include <cstring>

namespace kiln {

namespace {

// Lock-free so it is async-signal-safe to store from the handler.
std::atomic<int> g_received{0};
std::atomic<bool> g_installed{false};
static_assert(std::atomic<int>::is_always_lock_free);

extern "C" void record_signal(int signal) { g_received.store(signal, std::memory_order_relaxed); }

}  // namespace

StopSignals::StopSignals() {
  KILN_CHECK(!g_installed.exchange(true), "signals", "stop handlers are already installed");
  g_received.store(0);
  struct sigaction sa;
  std::memset(&sa, 0, sizeof(sa));
  sa.sa_handler = record_signal;
  sigemptyset(&sa.sa_mask);
  // SA_RESTART: reads and writes in progress continue instead of failing with EINTR.
  sa.sa_flags = SA_RESETHAND | SA_RESTART;
  sigaction(SIGTERM, &sa, &old_term_);
  sigaction(SIGINT, &sa, &old_int_);
  struct sigaction ignore;
  std::memset(&ignore, 0, sizeof(ignore));
  ignore.sa_handler = SIG_IGN;
  sigemptyset(&ignore.sa_mask);
  sigaction(SIGXFSZ, &ignore, &old_xfsz_);
}

StopSignals::~StopSignals() {
  sigaction(SIGTERM, &old_term_, nullptr);
  sigaction(SIGINT, &old_int_, nullptr);
  sigaction(SIGXFSZ, &old_xfsz_, nullptr);
  g_installed.store(false);
}

int StopSignals::received() const { return g_received.load(std::memory_order_relaxed); }

const char* StopSignals::name(int signal) {
  switch (signal) {
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    default: return "a signal";
  }
}

}  // namespace kiln
