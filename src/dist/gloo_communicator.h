// The CPU backend of the collectives: Gloo (Debian's libgloo) over TCP, connected through
// the run's rendezvous store. Its timeout bounds every collective: a rank that died or
// hangs makes the others throw within it, naming the collective, its number and the
// rank(s) it waited for (dist/rank_progress.h).
//
// Point to point: Gloo's unbound buffers, which pair a send with its receive (the data
// moves once both are posted). To make send an isend, it copies the bytes, posts them and
// returns; a thread of the communicator waits for each posted send's receive, in order,
// and frees its copy. A send not received within the timeout fails that thread, and the
// next send or recv on this rank throws naming it (and Gloo closes the connections, so a
// recv already waiting fails too). Host memory: the copies of one step's sends in flight.
// The destructor waits (up to the timeout) for the sends still in flight to be received.
#pragma once

#include "dist/communicator.h"
#include "dist/rank_progress.h"
#include "dist/tcp_store.h"

#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace gloo {
class Context;
}

namespace kiln::dist {

// Where this rank's Gloo listens for its peers. `interface` (GLOO_SOCKET_IFNAME, as torch
// reads it) wins over `host`; both empty: the address this host's name resolves to.
struct GlooEndpoint {
  std::string host, interface;
  std::string prefix;  // keeps the store's keys of several communicators of one run apart
  // How its errors name this rank: "rank R of W" when empty; a subgroup, whose ranks are
  // numbered from 0, says which rank of the run it is too.
  std::string who;
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
  void reduce_scatter(void* data, int64_t count_per_rank, DType dtype, ReduceOp op, std::string_view what) override;
  void send(const void* data, int64_t bytes, int peer, int tag, std::string_view what) override;
  void recv(void* data, int64_t bytes, int peer, int tag, std::string_view what) override;

 private:
  struct PostedSend;  // a send's copy of its bytes and Gloo's buffer over it, until received
  void check_peer(std::string_view verb, std::string_view what, int peer, int tag) const;
  void throw_if_a_send_failed();
  void wait_for_receives();  // the thread behind send
  std::string p2p_failure(std::string_view verb, std::string_view what, int peer, int tag,
                          std::chrono::steady_clock::time_point posted, const std::exception& e) const;

  // The number of the collective a call enters (from 1, the same on every rank): its tag + 1.
  int64_t enter();
  [[noreturn]] void lost(std::string_view what, int64_t seq, std::chrono::steady_clock::time_point entered,
                         const std::exception& e) const;
  int rank_, world_size_;
  std::string who_;  // "rank R of W" (GlooEndpoint::who)
  std::chrono::milliseconds timeout_;
  RankProgress& progress_;
  std::shared_ptr<gloo::Context> context_;
  uint32_t tag_ = 0;  // Gloo pairs collectives by tag: one per call, the same on every rank
  int64_t reduce_scatter_slots_ = 0;  // the context's slots its reduce-scatters have taken

  std::mutex sends_mutex_;
  std::condition_variable sends_changed_;
  std::deque<std::unique_ptr<PostedSend>> sends_;  // posted, oldest first
  std::string send_failure_;                       // the first send that failed; then no more waits
  bool closing_ = false;                           // the destructor: drain the sends, then stop
  std::thread send_waiter_;  // started by the first send
};

}  // namespace kiln::dist
