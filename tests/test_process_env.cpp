// Where a rank sits, from each launcher's environment (dist/process_env.h).
#include "dist/process_env.h"
#include "test_util.h"

#include <map>

using namespace kiln;
using namespace kiln::dist;
using kiln::test::error_of;

namespace {

EnvLookup env_of(std::map<std::string, std::string> vars) {
  return [vars = std::move(vars)](const char* name) -> std::optional<std::string> {
    const auto it = vars.find(name);
    if (it == vars.end()) return std::nullopt;
    return it->second;
  };
}

}  // namespace

TEST(ProcessEnv, NoLauncherMeansASingleProcess) { EXPECT_FALSE(process_placement(env_of({})).has_value()); }

TEST(ProcessEnv, Torchrun) {
  const auto p = process_placement(env_of({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"},
                                           {"LOCAL_WORLD_SIZE", "4"}, {"MASTER_ADDR", "node3"}, {"MASTER_PORT", "1234"}}));
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->convention, "torchrun");
  EXPECT_EQ(p->rank, 5);
  EXPECT_EQ(p->world_size, 8);
  EXPECT_EQ(p->local_rank, 1);
  EXPECT_EQ(p->local_world_size, 4);
  EXPECT_EQ(p->master_addr, "node3");
  EXPECT_EQ(p->master_port, 1234);
}

TEST(ProcessEnv, TorchrunOnOneNodeNeedsNoAddress) {
  const auto p = process_placement(env_of({{"RANK", "1"}, {"WORLD_SIZE", "2"}}));
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->local_rank, 1);
  EXPECT_EQ(p->local_world_size, 2);
  EXPECT_EQ(p->master_addr, "127.0.0.1");
  EXPECT_EQ(p->master_port, 29500);
}

TEST(ProcessEnv, Slurm) {
  const auto p = process_placement(env_of({{"SLURM_PROCID", "6"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "2"},
                                           {"SLURM_NTASKS_PER_NODE", "4"}, {"SLURM_JOB_NODELIST", "gpu[07-08]"},
                                           {"MASTER_PORT", "29600"}}));
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->convention, "slurm");
  EXPECT_EQ(p->rank, 6);
  EXPECT_EQ(p->world_size, 8);
  EXPECT_EQ(p->local_rank, 2);
  EXPECT_EQ(p->local_world_size, 4);
  EXPECT_EQ(p->master_addr, "gpu07");
  EXPECT_EQ(p->master_port, 29600);
  // SLURM_TASKS_PER_NODE when --ntasks-per-node was not given.
  const auto q = process_placement(env_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "6"}, {"SLURM_LOCALID", "0"},
                                           {"SLURM_TASKS_PER_NODE", "3(x2)"}, {"SLURM_NNODES", "2"},
                                           {"SLURM_JOB_NODELIST", "a1,a2"}}));
  ASSERT_TRUE(q.has_value());
  EXPECT_EQ(q->local_world_size, 3);
  EXPECT_EQ(q->master_addr, "a1");
}

TEST(ProcessEnv, OpenMpi) {
  const auto p = process_placement(env_of({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "4"},
                                           {"OMPI_COMM_WORLD_LOCAL_RANK", "3"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}}));
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->convention, "openmpi");
  EXPECT_EQ(p->rank, 3);
  EXPECT_EQ(p->master_addr, "127.0.0.1");
  // Several nodes: rank 0's host must be named.
  EXPECT_NE(error_of([] {
              process_placement(env_of({{"OMPI_COMM_WORLD_RANK", "3"}, {"OMPI_COMM_WORLD_SIZE", "8"},
                                        {"OMPI_COMM_WORLD_LOCAL_RANK", "3"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "4"}}));
            }).find("set MASTER_ADDR"),
            std::string::npos);
}

TEST(ProcessEnv, TorchrunWinsOverTheSchedulersItRunsUnder) {
  const auto p = process_placement(env_of({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"SLURM_PROCID", "0"},
                                           {"SLURM_NTASKS", "1"}, {"SLURM_LOCALID", "0"}}));
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->convention, "torchrun");
  EXPECT_EQ(p->rank, 1);
}

TEST(ProcessEnv, BadValuesAreNamed) {
  EXPECT_EQ(error_of([] { process_placement(env_of({{"RANK", "x"}, {"WORLD_SIZE", "2"}})); }),
            "[dist] environment RANK='x' is not an integer in 0..65536");
  EXPECT_EQ(error_of([] { process_placement(env_of({{"RANK", "2"}, {"WORLD_SIZE", "2"}})); }),
            "[dist] environment RANK=2 is not below the world size 2");
  EXPECT_EQ(error_of([] { process_placement(env_of({{"RANK", "0"}})); }),
            "[dist] RANK is set but WORLD_SIZE is not: the RANK launch is incomplete");
  EXPECT_EQ(error_of([] { process_placement(env_of({{"RANK", "0"}, {"WORLD_SIZE", "1"}, {"MASTER_PORT", "70000"}})); }),
            "[dist] environment MASTER_PORT=70000 is not a TCP port");
}

// Issue 38: WORLD_SIZE=1000000000 sized Gloo's context (9 GB before the rendezvous, past
// dist.timeout); each launcher's sizes stop at kMaxWorldSize.
TEST(ProcessEnv, SizesAboveTheBoundAreRefusedByName) {
  EXPECT_EQ(error_of([] { process_placement(env_of({{"RANK", "0"}, {"WORLD_SIZE", "1000000000"}})); }),
            "[dist] environment WORLD_SIZE='1000000000' is not an integer in 1..65536");
  EXPECT_EQ(error_of([] {
              process_placement(env_of({{"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "65537"},
                                        {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "1"}}));
            }),
            "[dist] environment OMPI_COMM_WORLD_SIZE='65537' is not an integer in 1..65536");
  EXPECT_EQ(error_of([] {
              process_placement(env_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "99999999"}, {"SLURM_LOCALID", "0"}}));
            }),
            "[dist] environment SLURM_NTASKS='99999999' is not an integer in 1..65536");
  const auto p = process_placement(env_of({{"RANK", "65535"}, {"WORLD_SIZE", "65536"}, {"MASTER_ADDR", "h"}}));
  ASSERT_TRUE(p.has_value());
  EXPECT_EQ(p->world_size, 65536);
}

// It used to say "torchrun ranks span several nodes: set MASTER_ADDR", about another thing.
TEST(ProcessEnv, ALocalRankBeyondItsNodeIsNamed) {
  EXPECT_EQ(error_of([] {
              process_placement(env_of({{"RANK", "1"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"},
                                        {"LOCAL_WORLD_SIZE", "2"}}));
            }),
            "[dist] environment LOCAL_RANK=2 is not below the node's 2 ranks");
}

// It used to be ignored: the process trained alone, as if no launcher had started it.
TEST(ProcessEnv, WorldSizeWithoutRankIsRefused) {
  EXPECT_EQ(error_of([] { process_placement(env_of({{"WORLD_SIZE", "4"}})); }),
            "[dist] environment WORLD_SIZE=4 is set but RANK is not: set RANK (0..3) in each process, or use kiln "
            "launch");
  EXPECT_FALSE(process_placement(env_of({{"WORLD_SIZE", "1"}})).has_value());
}

TEST(ProcessEnv, FirstSlurmHost) {
  EXPECT_EQ(first_slurm_host("node7"), "node7");
  EXPECT_EQ(first_slurm_host("gpu[03-05,9],cpu1"), "gpu03");
  EXPECT_EQ(first_slurm_host("a,b"), "a");
  EXPECT_EQ(first_slurm_host("rack1-n[010,012]-ib"), "rack1-n010-ib");
  EXPECT_NE(error_of([] { first_slurm_host("gpu[03-05"); }).find("unclosed"), std::string::npos);
}
