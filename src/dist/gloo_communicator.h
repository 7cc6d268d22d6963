// The CPU backend of the collectives: Gloo (Debian's libgloo) over TCP, connected through
// the run's rendezvous store. Its timeout bounds every collective: a rank that died or
// hangs makes the others throw within it, naming the collective, its number and the
// rank(s) it waited for (dist/rank_progress.h).
#pragma once

#include "dist/communicator.h"
#include "dist/rank_progress.h"
#include "dist/tcp_store.h"

#include <chrono>
#include <memory>
#include <string>

namespace gloo {
class Context;
}

namespace kiln::dist {

// Where this rank's Gloo listens for its peers. `interface` (GLOO_SOCKET_IFNAME, as torch
// reads it) wins over `host`; both empty: the address this host's name resolves to.
struct GlooEndpoint {
  std::string host, interface;
  std::string prefix;  // keeps the store's keys of several communicators of one run apart
};

class GlooCommunicator final : public Communicator {
 public:
  // `progress` (this rank's record) outlives the communicator.
  GlooCommunicator(TcpStore& store, const GlooEndpoint& endpoint, int rank, int world_size,
                   std::chrono::milliseconds timeout, RankProgress& progress);
  ~GlooCommunicator() override;

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  Device device() const override { return Device::cpu; }
  std::string_view backend() const override { return "gloo"; }
  void all_reduce(void* data, int64_t count, DType dtype, ReduceOp op, std::string_view what) override;
  void broadcast(void* data, int64_t bytes, int root, std::string_view what) override;
  void all_gather(void* data, int64_t bytes_per_rank, std::string_view what) override;

 private:
  // The number of the collective a call enters (from 1, the same on every rank): its tag + 1.
  int64_t enter();
  [[noreturn]] void lost(std::string_view what, int64_t seq, std::chrono::steady_clock::time_point entered,
                         const std::exception& e) const;
  int rank_, world_size_;
  std::chrono::milliseconds timeout_;
  RankProgress& progress_;
  std::shared_ptr<gloo::Context> context_;
  uint32_t tag_ = 0;  // Gloo pairs collectives by tag: one per call, the same on every rank
};

}  // namespace kiln::dist
