// Where this process sits in a multi-process run, read from the environment its launcher
// set: torchrun (and `kiln launch`), Slurm's srun, or Open MPI's mpirun. The first
// convention present wins, in that order: torchrun inside a Slurm job sets RANK itself,
// and mpirun under Slurm sets both OMPI_* and SLURM_* (its ranks are the OMPI ones).
#pragma once

#include <functional>
#include <optional>
#include <string>

namespace kiln::dist {

// The most ranks (and ranks per node) kiln takes from the environment: far past any run,
// and refused before Gloo allocates per rank. `kiln launch --nproc` stops at 1024.
inline constexpr int kMaxWorldSize = 65536;

struct ProcessPlacement {
  int rank = 0, world_size = 1;
  int local_rank = 0, local_world_size = 1;  // among the ranks of this node
  std::string master_addr = "127.0.0.1";      // where rank 0 serves the rendezvous
  int master_port = 29500;
  std::string convention;  // "torchrun", "slurm" or "openmpi": named in messages
};

// Looks a variable up; nullopt when unset (or empty). Tests pass their own.
using EnvLookup = std::function<std::optional<std::string>(const char*)>;
std::optional<std::string> process_env(const char* name);

// nullopt when no launcher's variables are set: a single process of its own. Throws
// kiln::Error naming the variable when one is malformed or inconsistent (RANK >=
// WORLD_SIZE, a missing MASTER_ADDR on several nodes, ...).
std::optional<ProcessPlacement> process_placement(const EnvLookup& env = process_env);

// The first host of a Slurm node list: "gpu[03-05,9],cpu1" -> "gpu03", "node7" -> "node7".
std::string first_slurm_host(const std::string& nodelist);

}  // namespace kiln::dist
