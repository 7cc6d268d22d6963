// Ranks of a process group as threads of one test process (Gloo over loopback): the
// collectives' and the pipeline engine's tests. The training tests run ranks as processes
// (test_distributed.cpp).
#pragma once

#include "dist/process_env.h"

#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace kiln::test {

// Runs body(rank) on `world` threads; the errors they threw, by rank ("" = none).
inline std::vector<std::string> run_ranks(int world, const std::function<void(int)>& body) {
  std::vector<std::string> errors(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  for (std::thread& t : threads) t.join();
  return errors;
}

// Rank `rank` of `world`, all on this host, meeting at the loopback `port`.
inline dist::ProcessPlacement placement(int rank, int world, int port) {
  dist::ProcessPlacement p;
  p.rank = p.local_rank = rank;
  p.world_size = p.local_world_size = world;
  p.master_port = port;
  p.convention = "test";
  return p;
}

}  // namespace kiln::test
