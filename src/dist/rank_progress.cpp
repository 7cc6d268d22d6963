#include "dist/rank_progress.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <sstream>

namespace kiln::dist {

namespace {

using namespace std::chrono_literals;

std::string key_of(int rank) { return "progress/" + std::to_string(rank); }

std::string numbered(int64_t seq) { return seq > 0 ? fmt::format("#{}", seq) : std::string("none yet"); }

std::string who(int rank, const PeerRecord& r) { return fmt::format("rank {} (pid {} on {})", rank, r.pid, r.host); }

// The ranks that collective `seq` waits for, one phrase each.
std::vector<std::string> waited_for(int64_t seq, int self, const std::vector<PeerRecord>& records, double stale_s) {
  std::vector<std::string> out;
  for (int r = 0; r < static_cast<int>(records.size()); ++r) {
    const PeerRecord& p = records[static_cast<size_t>(r)];
    if (r == self) continue;
    if (!p.present) out.push_back(fmt::format("rank {} never wrote its progress record", r));
    else if (p.failed) continue;  // it waited too, and gave up
    else if (p.gone)
      out.push_back(fmt::format("{} died or exited: its connection to the store closed (last entered {})", who(r, p),
                                numbered(p.entered)));
    else if (p.age_s >= stale_s)  // its last heartbeat may predate its last collective by up to 1 s
      out.push_back(fmt::format("{} sent no heartbeat for {:.0f} s: stopped or hung (at its last heartbeat it had entered {})",
                                who(r, p), p.age_s, numbered(p.entered)));
    else if (p.entered < seq && p.finished >= p.entered)  // (inside an earlier one: waiting too)
      out.push_back(fmt::format("{} never entered it (last entered {}) but is alive (heartbeat {:.1f} s ago): slow "
                                "or stuck outside the collectives", who(r, p), numbered(p.entered), p.age_s));
  }
  return out;
}

}  // namespace

std::string describe_waited_for(int64_t seq, int self, const std::vector<PeerRecord>& records, double stale_s) {
  const std::vector<std::string> ranks = waited_for(seq, self, records, stale_s);
  if (ranks.empty())
    return "every rank is alive and inside it or an earlier collective (the connection between ranks broke or "
           "stalled)";
  return fmt::format("{}", fmt::join(ranks, "; "));
}

PeerRecord parse_record(const std::string& value) {
  PeerRecord r;
  std::istringstream in(value);
  std::string state;
  r.present = static_cast<bool>(in >> r.pid >> r.host >> r.entered >> r.finished >> state);
  r.failed = state == "failed";
  return r;
}

RankProgress::RankProgress(TcpStore& rendezvous, const std::string& host, int port, int rank, int world_size,
                           std::chrono::milliseconds timeout)
    : rank_(rank), world_size_(world_size), timeout_(timeout) {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0 || name[0] == '\0') std::snprintf(name, sizeof(name), "unknown-host");
  identity_ = fmt::format("{} {}", ::getpid(), name);
  // 3 s: rank 0's server is up by now, and a later read past it means rank 0 is stuck.
  store_ = std::make_unique<TcpStore>(host, port, false, 3000ms);
  {
    std::lock_guard lock(mutex_);
    publish();
  }
  rank0_ = parse_record(rendezvous.get(key_of(0)));
  heartbeat_ = std::thread([this] { beat(); });
}

RankProgress::~RankProgress() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  heartbeat_.join();
}

void RankProgress::publish() {
  if (broken_) return;
  try {
    // finished first: an entered read after it is never behind it (release/acquire)
    const int64_t finished = finished_.load(std::memory_order_acquire);
    store_->set(key_of(rank_), fmt::format("{} {} {} {}", identity_, entered_.load(std::memory_order_acquire),
                                           finished, failed_ ? "failed" : "ok"));
  } catch (const std::exception&) {
    broken_ = true;  // rank 0 went away: the collectives fail too, and diagnose() says so
  }
}

void RankProgress::beat() {
  std::unique_lock lock(mutex_);
  while (!wake_.wait_for(lock, 1s, [&] { return stopping_; })) publish();
}

std::vector<PeerRecord> RankProgress::read_records(TcpStore::Peek::Status& failure) {
  std::vector<PeerRecord> records(static_cast<size_t>(world_size_));
  failure = TcpStore::Peek::found;
  for (int r = 0; r < world_size_; ++r) {
    const TcpStore::Peek peek = store_->peek(key_of(r));
    if (peek.status == TcpStore::Peek::timed_out || peek.status == TcpStore::Peek::lost) {
      failure = peek.status;
      break;
    }
    if (peek.status == TcpStore::Peek::absent) continue;
    PeerRecord& p = records[static_cast<size_t>(r)] = parse_record(peek.value);
    p.age_s = static_cast<double>(peek.age.count()) / 1000.0;
    p.gone = peek.writer_gone;
  }
  return records;
}

std::string RankProgress::rank0_unreachable(TcpStore::Peek::Status status) const {
  if (status == TcpStore::Peek::timed_out)
    return fmt::format("{}, whose process serves the run's store, did not answer it within {} s: stopped or hung",
                       who(0, rank0_), store_->timeout().count() / 1000.0);
  return fmt::format("{}, whose process serves the run's store, went away: it died or exited", who(0, rank0_));
}

RankProgress::Diagnosis RankProgress::diagnose(int64_t seq, bool timed_out, bool hold_store) {
  // Stopped: no heartbeat for half of dist.timeout (the heartbeat comes every second; at
  // least 2 s, so a loaded host's late beat is not taken for one; at most 5 s).
  const double stale_s = std::clamp(static_cast<double>(timeout_.count()) / 2000.0, 2.0, 5.0);
  std::unique_lock lock(mutex_);
  TcpStore::Peek::Status failure = TcpStore::Peek::found;
  std::vector<PeerRecord> records;
  // A peer that died breaks Gloo's connection as soon as the store's: without a timeout,
  // give the store a moment (2 s at most) to see the closed connection too (until then its
  // record, up to 1 s old, would show it alive and behind).
  const auto settle = std::chrono::steady_clock::now() + (timed_out ? 0s : 2s);
  const auto any_gone = [&] {
    return std::any_of(records.begin(), records.end(), [](const PeerRecord& p) { return p.gone && !p.failed; });
  };
  for (;;) {
    if (broken_) return {rank0_unreachable(TcpStore::Peek::lost), true};
    records = read_records(failure);
    if (failure != TcpStore::Peek::found) return {rank0_unreachable(failure), true};
    if (any_gone() || std::chrono::steady_clock::now() >= settle) break;
    lock.unlock();
    std::this_thread::sleep_for(200ms);
    lock.lock();
  }
  const Diagnosis found{describe_waited_for(seq, rank_, records, stale_s),
                        !waited_for(seq, rank_, records, stale_s).empty()};
  // Rank 0's exit takes the store away: first let the ranks still alive and not failed read
  // it, 5 s at most. Not only those inside this collective: a rank may be failing in a
  // collective of another communicator (a pipeline stage's replicas', ProcessGroup::subgroup),
  // whose sequence numbers its record shares with this one's, so they cannot tell.
  const auto linger = std::chrono::steady_clock::now() + 5s;
  while (hold_store && rank_ == 0 && std::chrono::steady_clock::now() < linger) {
    const bool waiting = std::any_of(records.begin() + 1, records.end(), [&](const PeerRecord& p) {
      return p.present && !p.failed && !p.gone && p.age_s < stale_s;
    });
    if (!waiting) break;
    lock.unlock();
    std::this_thread::sleep_for(100ms);
    lock.lock();
    records = read_records(failure);
    if (failure != TcpStore::Peek::found) break;
  }
  failed_ = true;
  publish();
  return found;
}

}  // namespace kiln::dist
