// Weak or unbounded inputs, through the real binary: each is refused at once with one line
// naming the key or the file, before anything large is allocated or any data is read
// (they used to end in internal errors naming nothing, run for half a minute, train on
// defaults, read without end or print raw bytes to the terminal).
#include "fault_test_util.h"


namespace kiln {
namespace {

namespace fs = std::filesystem;

class InputBounds : public test::TinyRunTest {
 protected:
  InputBounds() : test::TinyRunTest("kiln-bounds", 20) {}
  std::string one_line_error(const std::string& command, double seconds = 10) {
    return test::one_line_error(command, seconds);
  }
  std::string train(const std::string& extra) { return test::tiny_train(corpus_, dir_ + "/run", extra); }
};

TEST_F(InputBounds, HugeValuesAreRefusedByKeyBeforeAnythingIsAllocated) {
  struct Case {
    const char* set;
    const char* message;
  };
  const Case cases[] = {
      {"train.micro_batch_tokens=4611686018427387904",  // 2^62
       "[config] train.micro_batch_tokens must be <= 2147483647 (positions and offsets are 32-bit), got "
       "4611686018427387904"},
      {"data.prefetch=1000000000", "[config] data.prefetch must be <= 65536 (each is a micro-batch held in memory)"},
      {"train.spike_window=9223372036854775807", "[config] train.spike_window must be <= 100000"},
      {"model.layers=1000000", "[config] model.layers must be <= 1024"},
      {"model.hidden=1099511627776", "[config] model.hidden must be <= 65536"},
      {"model.vocab_size=4294967296", "[config] model.vocab_size must be <= 16777216"},
      {"train.grad_accum=1000000000", "[config] train.grad_accum must be <= 65536"},
      {"train.threads=1000000000", "[config] train.threads must be <= 4096"},
      {"train.eval_batches=1000000000", "[config] train.eval_batches must be <= 65536"},
      // 2^31 experts was 16 s and then "internal error: std::bad_alloc", naming no key.
      {"model.mlp=moe --set model.moe.experts=2147483648",
       "[config] model.moe.experts must be <= 4096 (10x the most experts in use; each is allocated), got 2147483648"},
      // A billion Sinkhorn passes made the first step endless (and SIGTERM waits for its end).
      {"model.mlp=moe --set model.moe.router=sinkhorn --set model.moe.sinkhorn_iterations=1000000000",
       "[config] model.moe.sinkhorn_iterations must be <= 1000 (each is a pass over the routing matrix in every step)"},
      // 1e300 cast a capacity past INT64_MAX: "capacity -9223372036854775808".
      {"model.mlp=moe --set model.moe.capacity_factor=1e300",
       "[config] model.moe.capacity_factor must be <= 4096 (from E / k on nothing is dropped, and E <= 4096), got "
       "1e+300"},
      // Accepted, then Gloo's "Invalid timeout" after the rendezvous (1e308 s overflows its milliseconds).
      {"dist.timeout=1e308", "[config] dist.timeout must be <= 604800 (a week; a collective waiting longer is hung)"},
      {"model.rope.scaling=yarn --set model.rope.factor=4 --set model.rope.original_max_seq_len=16 "
       "--set model.rope.attention_factor=1e300",
       "[config] model.rope.attention_factor must be <= 16"},
      // Within its field's range, but not within the sample's context (BOS + "ROMEO:").
      {"train.sample_tokens=1000000000",
       "[train.sample_tokens] 1000000000 tokens after the 7-token prompt (BOS + train.sample_prompt) exceed "
       "model.max_seq_len (64); at most 57 fit"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.set);
    // model.layers = 1000000 used to plan a million layers first: 28 s and 6 GB.
    EXPECT_CONTAINS(one_line_error(train(std::string("--set ") + c.set), 5), c.message);
  }
  EXPECT_FALSE(fs::exists(dir_ + "/run/metrics.jsonl")) << "a refused run started";
}

// WORLD_SIZE=1000000000 grew Gloo's context to 9 GB before the rendezvous, past
// dist.timeout; a WORLD_SIZE without RANK trained alone.
TEST_F(InputBounds, LauncherEnvironmentBeyondItsBoundsIsRefusedBeforeTheRendezvous) {
  EXPECT_CONTAINS(one_line_error("env RANK=0 WORLD_SIZE=1000000000 " + train(""), 5),
                  "kiln: error: [dist] environment WORLD_SIZE='1000000000' is not an integer in 1..65536");
  EXPECT_CONTAINS(one_line_error("env -u RANK WORLD_SIZE=4 " + train(""), 5),
                  "kiln: error: [dist] environment WORLD_SIZE=4 is set but RANK is not");
  // It waited out dist.timeout, then blamed rank 0: "no answer".
  EXPECT_CONTAINS(one_line_error("env RANK=1 WORLD_SIZE=2 MASTER_ADDR=no-such-host.invalid " +
                                     train("--set dist.timeout=3"),
                                 6),
                  "kiln: error: [dist] rendezvous: MASTER_ADDR 'no-such-host.invalid' does not resolve");
  EXPECT_FALSE(fs::exists(dir_ + "/run/metrics.jsonl")) << "a refused run started";
}

TEST_F(InputBounds, AConfigPathThatIsNoConfigFileIsRefused) {
  const std::string kiln = test::kiln_binary() + " train ";
  // A directory used to train on the defaults; /dev/zero used to be read without end.
  EXPECT_CONTAINS(one_line_error(kiln + dir_), "kiln: error: [config] " + dir_ + ": is a directory, not a config file");
  EXPECT_CONTAINS(one_line_error(kiln + "/dev/zero", 5),
                  "kiln: error: [config] /dev/zero: is a character device, not a config file");
  const std::string large = dir_ + "/large.toml";
  test::write_file(large, "");
  fs::resize_file(large, (size_t{4} << 20) + 1);  // sparse: no disk used
  EXPECT_CONTAINS(one_line_error(kiln + large, 5),
                  "kiln: error: [config] " + large + ": larger than 4194304 bytes: not a config file");
}

TEST_F(InputBounds, ACorruptLatestFileIsShownEscapedAndCut) {
  const std::string ckpt = dir_ + "/ckpt";
  std::string garbage = "\x1b[31m\x1b]0;owned\x07";
  garbage += std::string(1, '\0') + "\xff\xfe";
  garbage += std::string(5000, 'A');  // past what a `latest` can be
  test::write_file(ckpt + "/latest", garbage);
  std::string line = one_line_error(train("--resume " + ckpt));
  EXPECT_CONTAINS(line, "kiln: error: [checkpoint] " + ckpt + "/latest: larger than 4096 bytes");

  test::write_file(ckpt + "/latest", garbage.substr(0, 200) + "\n");
  line = one_line_error(train("--resume " + ckpt));
  EXPECT_CONTAINS(line, "kiln: error: [checkpoint] " + ckpt +
                            "/latest: does not name a checkpoint ('\\x1b[31m\\x1b]0;owned\\x07\\x00\\xff\\xfe");
  EXPECT_CONTAINS(line, "... (200 bytes)')");
  for (const char c : line) EXPECT_TRUE(c == '\n' || (c >= 0x20 && c < 0x7f)) << "raw byte " << int(c) << " shown";
}

}  // namespace
}  // namespace kiln
