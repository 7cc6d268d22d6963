// The ranks of one multi-process run, joined through the rendezvous of their launcher's
// environment (dist/process_env.h): the store, a host communicator (Gloo: the step's
// control values and the checks at start) and the communicator of the gradients (NCCL on
// the GPU, the host one on the CPU).
#pragma once

#include "dist/communicator.h"
#include "dist/process_env.h"
#include "dist/rank_progress.h"
#include "dist/tcp_store.h"

#include <chrono>
#include <map>
#include <memory>
#include <string>

namespace kiln::dist {

class ProcessGroup {
 public:
  // Every rank calls this at start, with the same `device` and timeout. Throws naming the
  // address or variable when the rendezvous fails. On the GPU, this rank's device is the
  // node's GPU number local_rank (modulo the GPUs it sees), chosen before NCCL starts.
  ProcessGroup(const ProcessPlacement& placement, Device device, std::chrono::milliseconds timeout);
  ~ProcessGroup();

  const ProcessPlacement& placement() const { return placement_; }
  int rank() const { return placement_.rank; }
  int world_size() const { return placement_.world_size; }
  bool is_root() const { return placement_.rank == 0; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  Communicator& host() { return *host_; }
  Communicator& device() { return device_ ? *device_ : *host_; }
  // A second host communicator of the same ranks on a Gloo context of its own, made on the
  // first call (every rank calls it at the same point: it connects them), for a pipeline's
  // point-to-point transfers: on the CPU the gradients' collectives run on host(), and
  // Gloo's reduce-scatter (its older, pair-bound algorithm) sharing a context with unbound
  // point-to-point buffers hung a pipeline run with ZeRO-2.
  Communicator& pipeline();
  // A host communicator of the consecutive ranks [first, first + count) alone (a pipeline
  // stage's data-parallel replicas, train/pipeline_layout.h) on a Gloo context of its own,
  // its ranks numbered from 0; made on the first call for `first`, which every rank of it
  // makes at the same point. A stuck collective's diagnosis reads the whole run's records
  // (dist/rank_progress.h), as the pipeline's communicator's does.
  Communicator& subgroup(int first, int count);

  // Every rank must hold the same `text` as rank 0 (the resolved config, the data's
  // fingerprint): otherwise every rank throws, a differing one quoting its first differing
  // line and rank 0's, the others naming the first rank that differs.
  void require_same_as_root(const std::string& text, const std::string& what);

 private:
  ProcessPlacement placement_;
  std::chrono::milliseconds timeout_;
  std::unique_ptr<TcpStore> store_;
  std::unique_ptr<RankProgress> progress_;  // after the store, before the communicators that use it
  std::unique_ptr<Communicator> host_, device_;
  std::unique_ptr<Communicator> pipeline_;  // pipeline(); destroyed first, its sends drained
  std::map<int, std::unique_ptr<Communicator>> subgroups_;  // subgroup(first, ...), by first rank
};

// The timeout of collectives and the rendezvous ([dist] timeout, in seconds).
std::chrono::milliseconds collective_timeout(double seconds);

}  // namespace kiln::dist
