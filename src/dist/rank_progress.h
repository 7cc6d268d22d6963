// Which rank a stuck collective waits for (issue 38). Every rank keeps a record in the
// run's store, "progress/<rank>" = "<pid> <host> <last collective entered> <last finished>
// <ok|failed>",
// rewritten once a second by a small thread (its heartbeat) on a store connection of its
// own. The store stamps each write with when it arrived and marks it when the connection
// that wrote it closes, so a rank whose collective failed tells from rank 0's clock alone
// (no two hosts' clocks compared) which rank never entered it, which is stopped whole (no
// heartbeat: SIGSTOP, a frozen host), which is alive but busy outside the collectives, and
// which died. Cost: two atomic stores (plain moves on x86) per collective on the training thread; one
// ~40-byte store write per rank per second on the heartbeat thread, never awaited.
#pragma once

#include "dist/tcp_store.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace kiln::dist {

// One rank's record as a waiting rank reads it.
struct PeerRecord {
  bool present = false;  // false: it never wrote one
  int64_t pid = 0;
  std::string host;
  int64_t entered = 0;  // the last collective it entered, numbered from 1 (0: none yet)
  int64_t finished = 0;  // the last it finished: below `entered` while inside one
  bool failed = false;  // it gave up on a collective itself: a fellow waiter, not the cause
  double age_s = 0;     // since its last heartbeat reached the store
  bool gone = false;    // its store connection closed: the process died or exited
};

// Who collective number `seq` waits for, one line, from every rank's record (index =
// rank; `self`'s is skipped): each rank that died, is stopped (no heartbeat for
// `stale_s`) or is alive outside the collectives short of it, with its pid, host and last
// collective.
std::string describe_waited_for(int64_t seq, int self, const std::vector<PeerRecord>& records, double stale_s);

// Parses a record's value; nullopt-like (present = false) when it is not one.
PeerRecord parse_record(const std::string& value);

class RankProgress {
 public:
  // Publishes this rank's record and starts its heartbeat on its own connection to the
  // store at host:port (so it never interleaves with the rendezvous' requests); reads rank
  // 0's record from `rendezvous`, to name rank 0 if its store stops answering later.
  RankProgress(TcpStore& rendezvous, const std::string& host, int port, int rank, int world_size,
               std::chrono::milliseconds timeout);
  ~RankProgress();
  RankProgress(const RankProgress&) = delete;
  RankProgress& operator=(const RankProgress&) = delete;

  // Around each collective. A rank can be left inside an earlier one (a ring all-reduce
  // lets some ranks finish it while others still wait for the stopped rank's last part):
  // such a rank is waiting too, not the cause.
  void enter(int64_t seq) { entered_.store(seq, std::memory_order_release); }
  void finish(int64_t seq) { finished_.store(seq, std::memory_order_release); }

  // After collective `seq` failed (`timed_out`: waited out dist.timeout; else a peer's
  // connection broke): who it waited for, read within a few seconds (with `seq` 0, after a
  // point-to-point transfer failed: the ranks that died or stopped). Then marks this rank
  // failed, so the others do not blame it once it exits; rank 0, whose process serves the
  // store, first waits (5 s at most) for the other live ranks that have not failed to read it.
  struct Diagnosis {
    std::string text;
    bool named = false;  // some rank is to blame (else: every rank is alive, in a collective)
  };
  // `hold_store` false: rank 0 does not wait (a point-to-point transfer's failure, whose
  // error names its peer, reported at the rank's next call without delay).
  Diagnosis diagnose(int64_t seq, bool timed_out, bool hold_store = true);

 private:
  void publish();  // with mutex_ held
  void beat();
  std::string rank0_unreachable(TcpStore::Peek::Status status) const;
  std::vector<PeerRecord> read_records(TcpStore::Peek::Status& failure);

  int rank_, world_size_;
  std::chrono::milliseconds timeout_;
  std::string identity_;  // "<pid> <host>"
  PeerRecord rank0_;
  std::atomic<int64_t> entered_{0}, finished_{0};
  std::mutex mutex_;  // the heartbeat's connection, shared with diagnose()
  std::condition_variable wake_;
  bool failed_ = false, stopping_ = false, broken_ = false;
  std::unique_ptr<TcpStore> store_;
  std::thread heartbeat_;
};

}  // namespace kiln::dist
