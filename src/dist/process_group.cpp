#include "dist/process_group.h"

#include "core/device_memory.h"
#include "core/error.h"
#include "dist/gloo_communicator.h"
#if KILN_WITH_CUDA
#include "dist/nccl_communicator.h"
#endif

#include <fmt/format.h>

#include <sstream>
#include <vector>

namespace kiln::dist {

namespace {

// Where Gloo listens: the loopback when every rank is on this node, else the address of
// GLOO_SOCKET_IFNAME's interface or of this host's name.
GlooEndpoint gloo_endpoint(const ProcessPlacement& p) {
  GlooEndpoint e;
  e.prefix = "gloo/";
  if (const std::optional<std::string> iface = process_env("GLOO_SOCKET_IFNAME")) e.interface = *iface;
  else if (p.local_world_size == p.world_size) e.host = "127.0.0.1";
  return e;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

}  // namespace

std::chrono::milliseconds collective_timeout(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0));
}

ProcessGroup::ProcessGroup(const ProcessPlacement& placement, Device device, std::chrono::milliseconds timeout)
    : placement_(placement), timeout_(timeout) {
  store_ = std::make_unique<TcpStore>(placement.master_addr, placement.master_port, placement.rank == 0, timeout);
  progress_ = std::make_unique<RankProgress>(*store_, placement.master_addr, placement.master_port, placement.rank,
                                             placement.world_size, timeout);
  host_ = std::make_unique<GlooCommunicator>(*store_, gloo_endpoint(placement), placement.rank, placement.world_size,
                                             timeout, *progress_);
  if (device == Device::cuda) {
#if KILN_WITH_CUDA
    select_cuda_device(placement.local_rank);
    // Collectives on the process-wide stream, where the model runs (core/exec_context.h).
    device_ = make_nccl_communicator(*store_, "nccl/id", placement.rank, placement.world_size, process_exec(),
                                     timeout);
#else
    fail("dist", "a GPU run needs the CUDA backend");
#endif
  }
}

ProcessGroup::~ProcessGroup() = default;

Communicator& ProcessGroup::pipeline() {
  if (!pipeline_) {
    GlooEndpoint endpoint = gloo_endpoint(placement_);
    endpoint.prefix = "gloo-pipeline/";
    pipeline_ = std::make_unique<GlooCommunicator>(*store_, endpoint, placement_.rank, placement_.world_size, timeout_,
                                                   *progress_);
  }
  return *pipeline_;
}

Communicator& ProcessGroup::subgroup(int first, int count) {
  KILN_CHECK(first >= 0 && count > 0 && first + count <= world_size() && first <= rank() && rank() < first + count,
             "dist", "rank {} of {}: a subgroup of ranks [{}, {}) without it", rank(), world_size(), first, first + count);
  std::unique_ptr<Communicator>& made = subgroups_[first];
  if (!made) {
    GlooEndpoint endpoint = gloo_endpoint(placement_);
    endpoint.prefix = fmt::format("gloo-subgroup-{}-{}/", first, count);
    endpoint.who = fmt::format("rank {} of {} (rank {} of the subgroup of ranks {}..{})", rank(), world_size(),
                               rank() - first, first, first + count - 1);
    made = std::make_unique<GlooCommunicator>(*store_, endpoint, rank() - first, count, timeout_, *progress_);
  }
  KILN_CHECK(made->world_size() == count, "dist", "the subgroup from rank {} has {} ranks, not {}", first,
             made->world_size(), count);
  return *made;
}

void ProcessGroup::require_same_as_root(const std::string& text, const std::string& what) {
  int64_t size = static_cast<int64_t>(text.size());
  host_->broadcast(&size, sizeof(size), 0, what);
  std::string root = is_root() ? text : std::string(static_cast<size_t>(size), '\0');
  host_->broadcast(root.data(), size, 0, what);
  std::string difference;
  if (root != text) {
    const std::vector<std::string> mine = lines_of(text), theirs = lines_of(root);
    size_t i = 0;
    while (i < mine.size() && i < theirs.size() && mine[i] == theirs[i]) ++i;
    const std::string a = i < mine.size() ? mine[i] : "(end)", b = i < theirs.size() ? theirs[i] : "(end)";
    difference = fmt::format("'{}' here, '{}' on rank 0", a, b);
  }
  // How many ranks differ, and the first of them, so rank 0 can name it.
  int64_t verdict[2] = {difference.empty() ? 0 : 1, difference.empty() ? world_size() : rank()};
  host_->all_reduce(&verdict[0], 1, DType::i64, ReduceOp::sum, what);
  verdict[1] = -verdict[1];
  host_->all_reduce(&verdict[1], 1, DType::i64, ReduceOp::max, what);  // max of -rank: the lowest rank
  if (verdict[0] == 0) return;
  KILN_CHECK(difference.empty(), "dist", "rank {}: its {} differs from rank 0's: {}", rank(), what, difference);
  fail("dist", "rank {}: {} of {} ranks hold another {} than rank 0 (the first, rank {}, says where)", rank(),
       verdict[0], world_size(), what, -verdict[1]);
}

}  // namespace kiln::dist
