#include "dist/process_env.h"

#include "core/error.h"
#include "core/printable.h"

#include <algorithm>
#include <charconv>
#include <cstdlib>

namespace kiln::dist {

namespace {

// An integer variable; nullopt when unset. `minimum` guards ranks (0) and sizes (1); every
// value is at most kMaxWorldSize, checked here, before Gloo sizes its context by it (a
// WORLD_SIZE of 1e9 grew to 9 GB before the rendezvous, past dist.timeout).
std::optional<int> env_int(const EnvLookup& env, const char* name, int minimum) {
  const std::optional<std::string> value = env(name);
  if (!value) return std::nullopt;
  int v = 0;
  const char* end = value->data() + value->size();
  const auto [ptr, ec] = std::from_chars(value->data(), end, v);
  KILN_CHECK(ec == std::errc() && ptr == end && v >= minimum && v <= kMaxWorldSize, "dist",
             "environment {}='{}' is not an integer in {}..{}", name, printable(*value, 40), minimum, kMaxWorldSize);
  return v;
}

int required_int(const EnvLookup& env, const char* name, int minimum, const char* convention) {
  const std::optional<int> v = env_int(env, name, minimum);
  KILN_CHECK(v.has_value(), "dist", "{} is set but {} is not: the {} launch is incomplete", convention, name,
             convention);
  return *v;
}

void check_placement(const ProcessPlacement& p, const char* rank_name, const char* local_name) {
  KILN_CHECK(p.rank < p.world_size, "dist", "environment {}={} is not below the world size {}", rank_name, p.rank,
             p.world_size);
  KILN_CHECK(p.local_rank < p.local_world_size, "dist", "environment {}={} is not below the node's {} ranks",
             local_name, p.local_rank, p.local_world_size);
}

// MASTER_ADDR and MASTER_PORT where set; a single-node run defaults to this host.
void rendezvous_address(const EnvLookup& env, ProcessPlacement& p, const std::string& fallback_host) {
  if (const std::optional<std::string> addr = env("MASTER_ADDR")) p.master_addr = *addr;
  else if (!fallback_host.empty()) p.master_addr = fallback_host;
  else
    KILN_CHECK(p.local_world_size == p.world_size, "dist",
               "{} ranks span several nodes: set MASTER_ADDR to the host of rank 0", p.convention);
  if (const std::optional<std::string> port = env("MASTER_PORT")) {
    const char* end = port->data() + port->size();
    const auto [ptr, ec] = std::from_chars(port->data(), end, p.master_port);
    KILN_CHECK(ec == std::errc() && ptr == end && p.master_port > 0 && p.master_port < 65536, "dist",
               "environment MASTER_PORT={} is not a TCP port", printable(*port, 40));
  }
}

std::optional<ProcessPlacement> torchrun(const EnvLookup& env) {
  const std::optional<int> rank = env_int(env, "RANK", 0);
  if (!rank) {
    // A WORLD_SIZE meant for kiln without the RANK that goes with it used to be ignored:
    // the run trained alone. WORLD_SIZE=1 says the same as nothing.
    const std::optional<int> world = env_int(env, "WORLD_SIZE", 1);
    KILN_CHECK(!world || *world == 1, "dist",
               "environment WORLD_SIZE={} is set but RANK is not: set RANK (0..{}) in each process, or use kiln launch",
               *world, *world - 1);
    return std::nullopt;
  }
  ProcessPlacement p;
  p.convention = "torchrun";
  p.rank = *rank;
  p.world_size = required_int(env, "WORLD_SIZE", 1, "RANK");
  p.local_rank = env_int(env, "LOCAL_RANK", 0).value_or(p.rank);
  p.local_world_size = env_int(env, "LOCAL_WORLD_SIZE", 1).value_or(p.world_size);
  check_placement(p, "RANK", "LOCAL_RANK");  // before the address: a bad LOCAL_RANK is not "several nodes"
  rendezvous_address(env, p, "");
  return p;
}

std::optional<ProcessPlacement> openmpi(const EnvLookup& env) {
  const std::optional<int> rank = env_int(env, "OMPI_COMM_WORLD_RANK", 0);
  if (!rank) return std::nullopt;
  ProcessPlacement p;
  p.convention = "openmpi";
  p.rank = *rank;
  p.world_size = required_int(env, "OMPI_COMM_WORLD_SIZE", 1, "OMPI_COMM_WORLD_RANK");
  p.local_rank = required_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0, "OMPI_COMM_WORLD_RANK");
  p.local_world_size = required_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1, "OMPI_COMM_WORLD_RANK");
  check_placement(p, "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK");
  rendezvous_address(env, p, "");  // mpirun does not say where rank 0 runs
  return p;
}

std::optional<ProcessPlacement> slurm(const EnvLookup& env) {
  const std::optional<int> rank = env_int(env, "SLURM_PROCID", 0);
  if (!rank) return std::nullopt;
  ProcessPlacement p;
  p.convention = "slurm";
  p.rank = *rank;
  p.world_size = required_int(env, "SLURM_NTASKS", 1, "SLURM_PROCID");
  p.local_rank = required_int(env, "SLURM_LOCALID", 0, "SLURM_PROCID");
  // SLURM_NTASKS_PER_NODE is only set with --ntasks-per-node; SLURM_TASKS_PER_NODE
  // ("4(x2),3") always is, but only its first node's count is this node's when they match.
  p.local_world_size = env_int(env, "SLURM_NTASKS_PER_NODE", 1).value_or(0);
  if (p.local_world_size == 0) {
    const std::string tasks = env("SLURM_TASKS_PER_NODE").value_or("");
    const std::optional<int> nodes = env_int(env, "SLURM_NNODES", 1);
    int first = 0;
    std::from_chars(tasks.data(), tasks.data() + tasks.size(), first);
    p.local_world_size = nodes == 1 ? p.world_size : std::max(first, p.local_rank + 1);
  }
  const std::optional<std::string> nodes = env("SLURM_JOB_NODELIST");
  std::string host = nodes ? first_slurm_host(*nodes) : "";
  if (host.empty() && p.local_world_size == p.world_size) host = "127.0.0.1";
  KILN_CHECK(!host.empty() || env("MASTER_ADDR"), "dist",
             "a Slurm launch without SLURM_JOB_NODELIST or MASTER_ADDR: rank 0's host is unknown");
  check_placement(p, "SLURM_PROCID", "SLURM_LOCALID");
  rendezvous_address(env, p, host);
  return p;
}

}  // namespace

std::optional<std::string> process_env(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

std::optional<ProcessPlacement> process_placement(const EnvLookup& env) {
  if (auto p = torchrun(env)) return p;
  if (auto p = openmpi(env)) return p;
  return slurm(env);
}

std::string first_slurm_host(const std::string& nodelist) {
  // The first entry ends at a comma outside brackets.
  size_t end = 0;
  int depth = 0;
  for (; end < nodelist.size(); ++end) {
    if (nodelist[end] == '[') ++depth;
    if (nodelist[end] == ']') --depth;
    if (nodelist[end] == ',' && depth == 0) break;
  }
  const std::string entry = nodelist.substr(0, end);
  const size_t open = entry.find('[');
  if (open == std::string::npos) return entry;
  // "prefix[03-05,9]suffix": the first number of the range list, its zero padding kept.
  const size_t close = entry.find(']', open);
  KILN_CHECK(close != std::string::npos, "dist", "SLURM_JOB_NODELIST '{}' has an unclosed '['", nodelist);
  const std::string ranges = entry.substr(open + 1, close - open - 1);
  const size_t stop = ranges.find_first_of(",-");
  const std::string first = ranges.substr(0, stop);
  KILN_CHECK(!first.empty(), "dist", "SLURM_JOB_NODELIST '{}' has an empty range", nodelist);
  return entry.substr(0, open) + first + entry.substr(close + 1);
}

}  // namespace kiln::dist
