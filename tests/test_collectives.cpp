// The rendezvous store and the Gloo collectives, with ranks as threads of one process
// (thread_ranks.h; the training tests run them as processes: test_distributed.cpp).
#include "dist/gloo_communicator.h"
#include "dist/process_group.h"
#include "dist/free_port.h"
#include "dist/rank_progress.h"
#include "dist/tcp_store.h"
#include "ops/attention/logit_key.h"
#include "test_util.h"
#include "thread_ranks.h"

#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <thread>

using namespace kiln;
using namespace kiln::dist;
using kiln::test::error_of;
using kiln::test::placement;
using kiln::test::run_ranks;
using namespace std::chrono_literals;

TEST(TcpStore, GetWaitsForTheKeyAndTimesOutNamingIt) {
  const int port = free_loopback_port();
  TcpStore root("127.0.0.1", port, true, 2000ms);
  TcpStore other("127.0.0.1", port, false, 300ms);
  std::thread setter([&] {
    std::this_thread::sleep_for(50ms);
    root.set("k", std::string("v\0w", 3));
  });
  EXPECT_EQ(other.get("k"), std::string("v\0w", 3));  // waits for the set
  setter.join();
  EXPECT_NE(error_of([&] { other.get("never"); }).find("'never' was not set by any rank within 0.3 s"),
            std::string::npos);
}

TEST(TcpStore, NoRankZeroIsAnErrorNamingTheAddress) {
  const int port = free_loopback_port();
  EXPECT_NE(error_of([&] { TcpStore("127.0.0.1", port, false, 200ms); }).find("no answer from rank 0 at 127.0.0.1:"),
            std::string::npos);
}

// Issue 38: it waited out the timeout and then said "no answer from rank 0".
TEST(TcpStore, AnAddressThatDoesNotResolveIsNamed) {
  const auto start = std::chrono::steady_clock::now();
  const std::string error = error_of([&] { TcpStore("no-such-host.invalid", free_loopback_port(), false, 3000ms); });
  EXPECT_NE(error.find("[dist] rendezvous: MASTER_ADDR 'no-such-host.invalid' does not resolve"), std::string::npos)
      << error;
  // At once where a resolver answers; a resolver that cannot be reached is retried until the timeout.
  EXPECT_LT(std::chrono::steady_clock::now() - start, 5s);
}

TEST(Gloo, AllReduceSumAndMaxOfEachTypeAndBroadcast) {
  const int world = 3, port = free_loopback_port();
  std::vector<std::vector<double>> sums(world);
  std::vector<std::vector<int32_t>> maxes(world);
  std::vector<int64_t> broadcast(world);
  const auto errors = run_ranks(world, [&](int r) {
    ProcessGroup group(placement(r, world, port), Device::cpu, 10000ms);
    std::vector<double> s = {1.0 * r, 0.5, -2.0 * r};
    group.host().all_reduce(s.data(), 3, DType::f64, ReduceOp::sum, "test sum");
    std::vector<int32_t> m = {r, -r, 7};
    group.device().all_reduce(m.data(), 3, DType::i32, ReduceOp::max, "test max");
    float f = 0.25f * static_cast<float>(r + 1);
    group.host().all_reduce(&f, 1, DType::f32, ReduceOp::sum, "test f32");
    EXPECT_FLOAT_EQ(f, 1.5f);
    int64_t b = r == 0 ? 424242 : -1;
    group.host().broadcast(&b, sizeof(b), 0, "test broadcast");
    sums[static_cast<size_t>(r)] = s;
    maxes[static_cast<size_t>(r)] = m;
    broadcast[static_cast<size_t>(r)] = b;
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(errors[static_cast<size_t>(r)], "");
    EXPECT_EQ(sums[static_cast<size_t>(r)], (std::vector<double>{3.0, 1.5, -6.0}));
    EXPECT_EQ(maxes[static_cast<size_t>(r)], (std::vector<int32_t>{2, 0, 7}));
    EXPECT_EQ(broadcast[static_cast<size_t>(r)], 424242);
  }
}

// QK-Clip's logit keys (ops/attention/logit_key.h) order as unsigned: a positive logit's
// key (top bit set) beats a negative one's and "none" (0), where a signed max would pick
// the negative logit. Ranks: a positive logit, a negative one, none.
TEST(Gloo, AnUnsignedMaxOrdersLogitKeysAsTheLogits) {
  const int world = 3, port = free_loopback_port();
  const std::vector<float> logits = {2.5f, -1.0f};
  std::vector<std::vector<int32_t>> got(world);
  const auto errors = run_ranks(world, [&](int r) {
    ProcessGroup group(placement(r, world, port), Device::cpu, 10000ms);
    // Column 0: rank r's logit (rank 2 measured none); column 1: only rank 1's.
    std::vector<int32_t> keys = {r < 2 ? static_cast<int32_t>(ops::logit_key(logits[static_cast<size_t>(r)])) : 0,
                                 r == 1 ? static_cast<int32_t>(ops::logit_key(-3.0f)) : 0};
    group.device().all_reduce(keys.data(), 2, DType::i32, ReduceOp::max_unsigned, "test logit keys");
    got[static_cast<size_t>(r)] = keys;
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(errors[static_cast<size_t>(r)], "");
    ASSERT_EQ(got[static_cast<size_t>(r)].size(), 2u);
    EXPECT_EQ(ops::logit_of_key(static_cast<uint32_t>(got[static_cast<size_t>(r)][0])), 2.5f);
    EXPECT_EQ(ops::logit_of_key(static_cast<uint32_t>(got[static_cast<size_t>(r)][1])), -3.0f);
  }
}

// In place: each rank writes only its own chunk, and every rank ends with all of them.
TEST(Gloo, AllGatherInPlaceGivesEveryRankEveryChunk) {
  const int world = 3, port = free_loopback_port();
  std::vector<std::vector<int32_t>> gathered(world);
  const auto errors = run_ranks(world, [&](int r) {
    ProcessGroup group(placement(r, world, port), Device::cpu, 10000ms);
    std::vector<int32_t> chunks(6, -1);  // 2 values per rank; the others' left at -1 here
    chunks[static_cast<size_t>(2 * r)] = 10 * r;
    chunks[static_cast<size_t>(2 * r + 1)] = 10 * r + 1;
    group.host().all_gather(chunks.data(), 2 * sizeof(int32_t), "test gather");
    gathered[static_cast<size_t>(r)] = chunks;
  });
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(errors[static_cast<size_t>(r)], "");
    EXPECT_EQ(gathered[static_cast<size_t>(r)], (std::vector<int32_t>{0, 1, 10, 11, 20, 21}));
  }
}

// In place over equal chunks: each rank ends with the sum (or max) of every rank's chunk r
// in its own chunk. 3 ranks (not a power of two: Gloo's halving-doubling crosses binary
// blocks) and 4, with chunks of 1 and 5 elements (5: Gloo halves a buffer of 15 or 20 into
// uneven parts); integers, so the sums are exact whatever Gloo's order.
TEST(Gloo, ReduceScatterInPlaceLeavesEachRankItsChunksReduction) {
  for (const int world : {3, 4})
    for (const int64_t chunk : {int64_t{1}, int64_t{5}}) {
      const int port = free_loopback_port();
      const int64_t n = chunk * world;
      std::vector<std::vector<int64_t>> sums(world), maxes(world);
      std::vector<std::vector<double>> doubles(world);
      const auto errors = run_ranks(world, [&](int r) {
        ProcessGroup group(placement(r, world, port), Device::cpu, 10000ms);
        std::vector<int64_t> s(static_cast<size_t>(n)), m(static_cast<size_t>(n));
        std::vector<double> d(static_cast<size_t>(n));
        for (int64_t i = 0; i < n; ++i) {
          s[static_cast<size_t>(i)] = 1000 * r + i;
          m[static_cast<size_t>(i)] = (r * 7 + i * 3) % 11;
          d[static_cast<size_t>(i)] = 0.5 * r - static_cast<double>(i);
        }
        group.host().reduce_scatter(s.data(), chunk, DType::i64, ReduceOp::sum, "test reduce-scatter");
        group.host().reduce_scatter(m.data(), chunk, DType::i64, ReduceOp::max, "test reduce-scatter max");
        group.device().reduce_scatter(d.data(), chunk, DType::f64, ReduceOp::sum, "test reduce-scatter f64");
        // Halving-doubling lets a rank finish before its peers have all they need from it: a
        // rank whose thread ends closes its connections, which would fail a peer still
        // waiting. One all-reduce more keeps every rank until all are done (a training step
        // always has collectives after its reduce-scatter).
        int32_t done = 1;
        group.device().all_reduce(&done, 1, DType::i32, ReduceOp::sum, "test done");
        const auto own = [&](const auto& v) {
          return std::vector(v.begin() + chunk * r, v.begin() + chunk * (r + 1));
        };
        sums[static_cast<size_t>(r)] = own(s);
        maxes[static_cast<size_t>(r)] = own(m);
        doubles[static_cast<size_t>(r)] = own(d);
      });
      for (int r = 0; r < world; ++r) {
        SCOPED_TRACE(fmt::format("{} ranks, chunk {}, rank {}", world, chunk, r));
        EXPECT_EQ(errors[static_cast<size_t>(r)], "");
        for (int64_t k = 0; k < chunk; ++k) {
          const int64_t i = chunk * r + k;
          int64_t sum = 0, most = 0;
          double dsum = 0;
          for (int q = 0; q < world; ++q) {
            sum += 1000 * q + i;
            most = std::max<int64_t>(most, (q * 7 + i * 3) % 11);
            dsum += 0.5 * q - static_cast<double>(i);
          }
          EXPECT_EQ(sums[static_cast<size_t>(r)][static_cast<size_t>(k)], sum) << "element " << i;
          EXPECT_EQ(maxes[static_cast<size_t>(r)][static_cast<size_t>(k)], most) << "element " << i;
          EXPECT_EQ(doubles[static_cast<size_t>(r)][static_cast<size_t>(k)], dsum) << "element " << i;  // halves: exact
        }
      }
    }
}

// Issue 38: the error named the collective, not the rank it waited for. Rank 1 is alive
// (its heartbeat goes on) but never calls the collective: named as such.
TEST(Gloo, ARankThatNeverComesTimesTheOthersOutNamingTheCollectiveAndTheRank) {
  const int world = 2, port = free_loopback_port();
  std::atomic<bool> done{false};
  const auto errors = run_ranks(world, [&](int r) {
    ProcessGroup group(placement(r, world, port), Device::cpu, 500ms);
    if (r == 1) {  // joins, then never calls the collective
      while (!done) std::this_thread::sleep_for(10ms);
      return;
    }
    double x = 1;
    try {
      group.host().all_reduce(&x, 1, DType::f64, ReduceOp::sum, "gradients");
    } catch (...) {
      done = true;
      throw;
    }
    done = true;
  });
  EXPECT_NE(errors[0].find(fmt::format("[dist] rank 0 of 2: the collective 'gradients' (#1) did not finish within "
                                       "dist.timeout = 0.5 s: rank 1 (pid {} on ", getpid())),
            std::string::npos)
      << errors[0];
  EXPECT_NE(errors[0].find("never entered it (last entered none yet) but is alive (heartbeat "), std::string::npos)
      << errors[0];
}

// Point to point: each rank sends to the next and receives from the one before, sending
// first (a blocking send would deadlock the ring; send is an isend), three messages, two
// of one tag (matched in order) and one received before an earlier-sent tag.
TEST(Gloo, SendAndRecvAroundARingSendingFirst) {
  const int world = 3, port = free_loopback_port();
  std::vector<std::vector<double>> got(world);
  const auto errors = run_ranks(world, [&](int r) {
    ProcessGroup group(placement(r, world, port), Device::cpu, 10000ms);
    Communicator& comm = group.host();
    const int next = (r + 1) % world, prev = (r + world - 1) % world;
    std::vector<double> a = {1.0 * r, 10.0 + r}, b = {100.0 + r, -1.0 * r}, c = {1000.0 + r};
    comm.send(a.data(), 16, next, 7, "first");
    comm.send(b.data(), 16, next, 7, "second");
    comm.send(c.data(), 8, next, 9, "third");
    a.assign(2, -5.0);  // send copied: changing the buffer now changes nothing sent
    std::vector<double> x(2), y(2), z(1);
    comm.recv(z.data(), 8, prev, 9, "third");
    comm.recv(x.data(), 16, prev, 7, "first");
    comm.recv(y.data(), 16, prev, 7, "second");
    got[static_cast<size_t>(r)] = {x[0], x[1], y[0], y[1], z[0]};
    group.host().all_reduce(x.data(), 1, DType::f64, ReduceOp::sum, "after");  // collectives still pair up
  });
  for (int r = 0; r < world; ++r) {
    const double p = (r + world - 1) % world;
    EXPECT_EQ(errors[static_cast<size_t>(r)], "");
    EXPECT_EQ(got[static_cast<size_t>(r)], (std::vector<double>{p, 10.0 + p, 100.0 + p, -p, 1000.0 + p}));
  }
}

TEST(Gloo, ARecvWhosePeerNeverSendsTimesOutNamingThePeer) {
  const int world = 2, port = free_loopback_port();
  std::atomic<bool> done{false};
  const auto errors = run_ranks(world, [&](int r) {
    ProcessGroup group(placement(r, world, port), Device::cpu, 500ms);
    if (r == 1) {  // alive, never sends
      while (!done) std::this_thread::sleep_for(10ms);
      return;
    }
    double x = 0;
    try {
      group.host().recv(&x, sizeof(x), 1, 3, "pipeline rA0@1");
    } catch (...) {
      done = true;
      throw;
    }
    done = true;
  });
  EXPECT_NE(errors[0].find("[dist] rank 0 of 2: the receive 'pipeline rA0@1' (tag 3) from rank 1 did not finish "
                           "within dist.timeout = 0.5 s: rank 1 did not send it"),
            std::string::npos)
      << errors[0];
}

// A send never received fails the sender's next point-to-point call, naming the peer.
TEST(Gloo, ASendNeverReceivedFailsTheNextCallNamingThePeer) {
  const int world = 2, port = free_loopback_port();
  std::atomic<bool> done{false};
  const auto errors = run_ranks(world, [&](int r) {
    ProcessGroup group(placement(r, world, port), Device::cpu, 300ms);
    if (r == 1) {
      while (!done) std::this_thread::sleep_for(10ms);
      return;
    }
    double x = 1;
    group.host().send(&x, sizeof(x), 1, 4, "pipeline sG2@1");  // returns at once
    std::this_thread::sleep_for(800ms);
    try {
      group.host().send(&x, sizeof(x), 1, 5, "later");
    } catch (...) {
      done = true;
      throw;
    }
    done = true;
  });
  EXPECT_NE(errors[0].find("[dist] rank 0 of 2: the send 'pipeline sG2@1' (tag 4) to rank 1 did not finish within "
                           "dist.timeout = 0.3 s: rank 1 did not receive it"),
            std::string::npos)
      << errors[0];
}

// The store stamps each write with its age and marks the keys of a connection that closed:
// what tells a stopped or dead rank from a live one.
TEST(TcpStore, PeekGivesAKeysAgeAndWhetherItsWriterIsGone) {
  const int port = free_loopback_port();
  TcpStore root("127.0.0.1", port, true, 2000ms);
  EXPECT_EQ(root.peek("k").status, TcpStore::Peek::absent);
  {
    TcpStore writer("127.0.0.1", port, false, 2000ms);
    writer.set("k", "v");
    root.get("k");
    const TcpStore::Peek live = root.peek("k");
    EXPECT_EQ(live.status, TcpStore::Peek::found);
    EXPECT_EQ(live.value, "v");
    EXPECT_FALSE(live.writer_gone);
    std::this_thread::sleep_for(300ms);
    EXPECT_GE(root.peek("k").age, 300ms);
  }
  const auto deadline = std::chrono::steady_clock::now() + 2s;
  while (!root.peek("k").writer_gone && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(10ms);
  EXPECT_TRUE(root.peek("k").writer_gone);
}

TEST(RankProgress, RecordsParseAndTheRanksWaitedForAreNamedByState) {
  EXPECT_FALSE(parse_record("garbage").present);
  const PeerRecord base = parse_record("1234 hostA 57 57 ok");
  ASSERT_TRUE(base.present);
  EXPECT_EQ(base.pid, 1234);
  EXPECT_EQ(base.host, "hostA");
  EXPECT_EQ(base.entered, 57);
  EXPECT_EQ(base.finished, 57);
  EXPECT_FALSE(base.failed);
  EXPECT_TRUE(parse_record("1 h 3 3 failed").failed);

  std::vector<PeerRecord> records(4, base);  // rank 0 (self) and rank 1: in #57, alive
  EXPECT_EQ(describe_waited_for(57, 0, records, 5),
            "every rank is alive and inside it or an earlier collective (the connection between ranks broke or "
            "stalled)");
  records[2].entered = 56;
  records[2].age_s = 31;  // stopped
  EXPECT_EQ(describe_waited_for(57, 0, records, 5),
            "rank 2 (pid 1234 on hostA) sent no heartbeat for 31 s: stopped or hung (at its last heartbeat it had "
            "entered #56)");
  records[2].age_s = 0.4;  // alive, busy elsewhere
  records[2].finished = 56;
  EXPECT_EQ(describe_waited_for(57, 0, records, 5),
            "rank 2 (pid 1234 on hostA) never entered it (last entered #56) but is alive (heartbeat 0.4 s ago): slow "
            "or stuck outside the collectives");
  records[2].finished = 55;  // still inside #56, waiting like this rank: not the cause
  EXPECT_EQ(describe_waited_for(57, 0, records, 5),
            "every rank is alive and inside it or an earlier collective (the connection between ranks broke or "
            "stalled)");
  records[2] = base;
  records[2].age_s = 12;  // stopped inside it
  records[3].gone = true;
  records[1].failed = true;  // a fellow waiter that gave up: not the cause
  records[1].entered = 3;
  EXPECT_EQ(describe_waited_for(57, 0, records, 5),
            "rank 2 (pid 1234 on hostA) sent no heartbeat for 12 s: stopped or hung (at its last heartbeat it had entered #57); "
            "rank 3 (pid 1234 on hostA) died or exited: its connection to the store closed (last entered #57)");
  records[1] = PeerRecord{};
  EXPECT_EQ(describe_waited_for(1, 2, std::vector<PeerRecord>(records.begin(), records.begin() + 2), 5),
            "rank 1 never wrote its progress record");
}

TEST(ProcessGroup, ARankWhoseTextDiffersIsRefusedOnEveryRank) {
  const int world = 3, port = free_loopback_port();
  const auto errors = run_ranks(world, [&](int r) {
    ProcessGroup group(placement(r, world, port), Device::cpu, 10000ms);
    group.require_same_as_root("a = 1\nb = 2\n", "config");  // the same everywhere: passes
    group.require_same_as_root(r == 2 ? "a = 1\nb = 3\n" : "a = 1\nb = 2\n", "config");
  });
  EXPECT_EQ(errors[2], "[dist] rank 2: its config differs from rank 0's: 'b = 3' here, 'b = 2' on rank 0");
  EXPECT_EQ(errors[0], "[dist] rank 0: 1 of 3 ranks hold another config than rank 0 (the first, rank 2, says where)");
  EXPECT_EQ(errors[1], "[dist] rank 1: 1 of 3 ranks hold another config than rank 0 (the first, rank 2, says where)");
}
