// Checkpoint building blocks, in process: the XXH64 checksum against the reference
// implementation's values, the save/verify/load round trip, retention, damaged files,
// the resume guards, the fault guard, the memory check and metrics truncation.
#include "fault_test_util.h"

#include "core/checksum.h"
#include "core/device_memory.h"
#include "io/durable_io.h"
#include "io/safetensors.h"
#include "train/checkpoint.h"
#include "config/config_fields.h"
#include "train/memory_check.h"
#include "ops/optim/step_rules.h"
#include "train/metrics.h"
#include "train/optimizer_groups.h"

#include <cmath>
#include <functional>
#include <set>

namespace kiln {
namespace {

namespace fs = std::filesystem;

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected kiln::Error";
  return {};
}

// ---- checksum -----------------------------------------------------------------------

TEST(Checksum, Xxh64MatchesTheReferenceImplementation) {
  // Values from libxxhash 0.8.1 (XXH64(data, len, seed)).
  EXPECT_EQ(xxh64_string("", 0), 0xef46db3751d8e999ull);
  EXPECT_EQ(xxh64_string("a", 0), 0xd24ec4f1a98c6e5bull);
  EXPECT_EQ(xxh64_string("abc", 0), 0x44bc2cf5ad770999ull);
  EXPECT_EQ(xxh64_string("Nobody inspects the spammish repetition", 0), 0xfbcea83c8a378bf1ull);
  EXPECT_EQ(xxh64_string("", 12345), 0x95584af7701f808dull);
  EXPECT_EQ(xxh64_string("a", 12345), 0x747b860523d69ab6ull);
  std::string long_input;
  for (int r = 0; r < 3; ++r)
    for (int i = 0; i < 256; ++i) long_input += static_cast<char>(i);
  long_input += "xyz";  // 771 bytes: stripes plus every tail length path
  EXPECT_EQ(xxh64_string(long_input, 0), 0xe921a1b45bd779f8ull);
  EXPECT_EQ(xxh64_string(long_input, 12345), 0x6b1b5d671fb93b43ull);
  // Streaming in odd pieces gives the one-shot value.
  for (size_t piece : {1u, 3u, 31u, 32u, 33u, 100u}) {
    Xxh64 h;
    for (size_t i = 0; i < long_input.size(); i += piece) h.update(long_input.data() + i, std::min(piece, long_input.size() - i));
    EXPECT_EQ(h.digest(), 0xe921a1b45bd779f8ull) << piece;
  }
  EXPECT_EQ(parse_hex64(hex64(0x0123456789abcdefull), "t"), 0x0123456789abcdefull);
  EXPECT_THROW(parse_hex64("12345", "t"), Error);
}

// ---- a tiny model and optimizer, saved and loaded ------------------------------------

Config tiny_config(const std::string& out_dir) {
  Config c;
  c.model.hidden = 32;
  c.model.layers = 1;
  c.model.heads = 2;
  c.model.kv_heads = 1;
  c.model.head_dim = 16;
  c.model.ffn_hidden = 64;
  c.model.max_seq_len = 64;
  c.train.micro_batch_tokens = 128;
  c.train.out_dir = out_dir;
  // Absolute, as load_config resolves it: a saved config.toml's relative paths would read
  // relative to the checkpoint's directory.
  c.data.path = std::filesystem::absolute(c.data.path).string();
  c.checkpoint.keep_last = 0;
  return c;
}

struct Trained {
  std::unique_ptr<Model> model;
  Arena state{"optimizer", Device::cpu};
  std::unique_ptr<Optimizer> optimizer;

  Trained(const Config& c, uint64_t seed) {
    BuildOptions o;
    o.max_tokens = c.train.micro_batch_tokens;
    model = std::make_unique<Model>(c.model, o);
    optimizer = make_optimizer(model->exec(), c.optim, model->parameters(), 1.0);
    optimizer->plan(state);
    model->allocate();
    state.allocate();
    model->init_weights(seed);
    uint64_t s = seed;
    for (const OptimizerStateTensor& t : optimizer->state_tensors())
      copy_tensor(*test::random_tensor(DType::f32, t.tensor.shape(), ++s, 0.01), t.tensor);
    optimizer->set_steps_taken(static_cast<int64_t>(seed));
  }
};

std::string bytes_of(const Tensor& t) {
  std::string out(t.nbytes(), '\0');
  device_copy(out.data(), Device::cpu, t.raw(), t.device(), t.nbytes());
  return out;
}

CheckpointState state_at(const Config& c, int64_t step) {
  CheckpointState s;
  s.progress.step = step;
  s.progress.tokens = 1000 * step;
  s.progress.elapsed_seconds = 0.1 + 1.0 / 3.0;
  s.progress.window_loss = 2.0 / 7.0;
  s.optimizer_steps = step;
  s.stream = {1, 2, 3, 0xfedcba9876543210ull};
  s.guard.total_skips = 2;
  s.guard.recent_loss = {1.0 / 3.0, 5e-324, 1e300};
  s.guard.recent_grad_norm = {0.1, 0.2, 0.3};
  s.threads = 2;
  s.config_toml = config_to_toml(c);
  return s;
}

class Checkpoints : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = test::temp_dir("kiln-ckpt");
    config_ = tiny_config(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string save(CheckpointWriter& w, const Trained& t, int64_t step) {
    return w.save(*t.model, *t.optimizer, state_at(config_, step));
  }
  std::string dir_;
  Config config_;
  FaultInjector none_;
};

TEST_F(Checkpoints, SaveVerifyLoadRoundTripsEveryBit) {
  const Trained a(config_, 7);
  CheckpointWriter writer(config_, none_);
  writer.prepare();
  const std::string path = save(writer, a, 5);
  EXPECT_EQ(path, dir_ + "/checkpoints/step-00000005");
  EXPECT_EQ(test::latest_of(dir_), "step-00000005");
  EXPECT_EQ(resolve_checkpoint(writer.root()), path);
  for (const char* f : {"model.safetensors", "optimizer.safetensors", "state.json", "config.toml", "manifest.json"})
    EXPECT_TRUE(fs::exists(path + "/" + f)) << f;

  // Whole-model names only, one tensor per parameter (the fused q/k/v storage is not
  // visible), so any device or process layout can load it.
  std::set<std::string> names;
  for (const auto& p : a.model->parameters()) names.insert(p->name());
  const auto stored = io::SafetensorsFile::open(path + "/model.safetensors").names();
  EXPECT_EQ(std::set<std::string>(stored.begin(), stored.end()), names);
  EXPECT_TRUE(names.count("layers.0.attn.q_proj.weight"));

  const CheckpointInfo info = read_checkpoint(path);
  const CheckpointState expected = state_at(config_, 5);
  EXPECT_EQ(info.state.progress, expected.progress);
  EXPECT_EQ(info.state.stream, expected.stream);
  EXPECT_EQ(info.state.guard, expected.guard);  // doubles round-trip exactly, subnormals too
  EXPECT_EQ(info.state.optimizer_steps, 5);
  EXPECT_TRUE(config_equal(info.config, config_));

  Trained b(config_, 99);  // different weights, state and step count
  load_checkpoint_tensors(info, *b.model, *b.optimizer);
  for (size_t i = 0; i < a.model->parameters().size(); ++i)
    EXPECT_EQ(bytes_of(a.model->parameters()[i]->value()), bytes_of(b.model->parameters()[i]->value()))
        << a.model->parameters()[i]->name();
  const auto sa = a.optimizer->state_tensors(), sb = b.optimizer->state_tensors();
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) EXPECT_EQ(bytes_of(sa[i].tensor), bytes_of(sb[i].tensor)) << sa[i].name;
  EXPECT_EQ(sa[0].name, "embed.weight.exp_avg");
  EXPECT_EQ(b.optimizer->steps_taken(), 5);
}

TEST_F(Checkpoints, RetentionKeepsTheLastKPlusEveryMth) {
  config_.checkpoint.keep_last = 2;
  config_.checkpoint.keep_every = 3;
  const Trained a(config_, 1);
  CheckpointWriter writer(config_, none_);
  writer.prepare();
  for (int64_t step = 1; step <= 8; ++step) save(writer, a, step);
  std::vector<int64_t> steps;
  for (const auto& [step, path] : list_checkpoints(writer.root())) steps.push_back(step);
  EXPECT_EQ(steps, (std::vector<int64_t>{3, 6, 7, 8}));
  EXPECT_EQ(test::count_leftovers(dir_), 0);

  // A failed delete warns and training goes on: nothing is lost.
  const FaultInjector failing("checkpoint_delete:fail");
  CheckpointWriter stubborn(config_, failing);
  save(stubborn, a, 9);
  steps.clear();
  for (const auto& [step, path] : list_checkpoints(writer.root())) steps.push_back(step);
  EXPECT_EQ(steps, (std::vector<int64_t>{3, 6, 7, 8, 9}));
  EXPECT_EQ(test::latest_of(dir_), "step-00000009");
}

TEST_F(Checkpoints, DamagedFilesAreRefusedByName) {
  const Trained a(config_, 3);
  CheckpointWriter writer(config_, none_);
  writer.prepare();
  const std::string path = save(writer, a, 2);
  for (const char* name : {"model.safetensors", "optimizer.safetensors", "state.json", "config.toml"}) {
    const std::string file = path + "/" + name, original = test::read_file(file);
    std::string flipped = original;
    flipped[flipped.size() - 3] ^= 0x40;
    test::write_file(file, flipped);
    EXPECT_EQ(error_of([&] { read_checkpoint(path); }).rfind("[checkpoint] " + file + ": checksum mismatch", 0), 0u)
        << name;
    test::write_file(file, original.substr(0, original.size() / 2));
    EXPECT_EQ(error_of([&] { read_checkpoint(path); }).rfind("[checkpoint] " + file + ": truncated", 0), 0u) << name;
    fs::remove(file);
    EXPECT_EQ(error_of([&] { read_checkpoint(path); }), "[checkpoint] " + file + ": missing");
    test::write_file(file, original);
  }
  EXPECT_NO_THROW(read_checkpoint(path));
}

// A run with a trained tokenizer saves its files in every checkpoint (a checkpoint is also a
// model directory), listed in the manifest and checked like the rest.
TEST_F(Checkpoints, TrainedTokenizerFilesTravelAndAreChecked) {
  const std::string tokenizer_dir = dir_ + "/tok";
  fs::create_directories(tokenizer_dir);
  test::write_file(tokenizer_dir + "/tokenizer.json", R"({"model": {"type": "BPE"}, "note": "a stand-in"})");
  test::write_file(tokenizer_dir + "/tokenizer_config.json", R"({"tokenizer_class": "PreTrainedTokenizerFast"})");
  config_.data.tokenizer = tokenizer_dir + "/tokenizer.json";
  const Trained a(config_, 3);
  CheckpointWriter writer(config_, none_);
  writer.prepare();
  const std::string path = save(writer, a, 2);
  EXPECT_FALSE(fs::exists(path + "/special_tokens_map.json"));  // only what the tokenizer has
  for (const char* name : {"tokenizer.json", "tokenizer_config.json"}) {
    const std::string file = path + "/" + name, original = test::read_file(file);
    EXPECT_EQ(original, test::read_file(tokenizer_dir + "/" + name));
    std::string flipped = original;
    flipped[5] ^= 0x20;
    test::write_file(file, flipped);
    EXPECT_EQ(error_of([&] { read_checkpoint(path); }).rfind("[checkpoint] " + file + ": checksum mismatch", 0), 0u)
        << name;
    fs::remove(file);
    EXPECT_EQ(error_of([&] { read_checkpoint(path); }), "[checkpoint] " + file + ": missing");
    test::write_file(file, original);
  }
  EXPECT_NO_THROW(read_checkpoint(path));
  // The byte-level tokenizer has no files: none are saved or listed.
  config_.data.tokenizer = "byte";
  CheckpointWriter bytes(config_, none_);
  const std::string plain = save(bytes, a, 3);
  EXPECT_FALSE(fs::exists(plain + "/tokenizer.json"));
  EXPECT_EQ(test::read_file(plain + "/manifest.json").find("tokenizer"), std::string::npos);
}

TEST_F(Checkpoints, OtherFormatVersionsAreRefused) {
  const Trained a(config_, 3);
  CheckpointWriter writer(config_, none_);
  writer.prepare();
  const std::string path = save(writer, a, 2);
  auto manifest = nlohmann::json::parse(test::read_file(path + "/manifest.json"));
  manifest["format_version"] = 2;
  manifest.erase("manifest_xxh64");
  manifest["manifest_xxh64"] = hex64(xxh64_string(manifest.dump()));  // a well-formed future manifest
  test::write_file(path + "/manifest.json", manifest.dump());
  EXPECT_EQ(error_of([&] { read_checkpoint(path); }),
            "[checkpoint] " + path + "/manifest.json: checkpoint format version 2 (this kiln reads version 1)");
  // A well-formed manifest that lists a file outside the checkpoint's folder.
  manifest["format_version"] = 1;
  manifest["files"]["../model.safetensors"] = manifest["files"]["model.safetensors"];
  manifest.erase("manifest_xxh64");
  manifest["manifest_xxh64"] = hex64(xxh64_string(manifest.dump()));
  test::write_file(path + "/manifest.json", manifest.dump());
  EXPECT_EQ(error_of([&] { read_checkpoint(path); }),
            "[checkpoint] " + path + "/manifest.json: lists '../model.safetensors', which is not a file of the "
            "checkpoint's folder");
  std::string state = state_to_json(state_at(config_, 2));
  state.replace(state.find("\"format_version\": 1"), 19, "\"format_version\": 7");
  EXPECT_EQ(error_of([&] { state_from_json(state, "S"); }),
            "[checkpoint] S: checkpoint format version 7 (this kiln reads version 1)");
}

TEST_F(Checkpoints, ResolveFollowsLatestOrFallsBackToTheNewestComplete) {
  const Trained a(config_, 3);
  CheckpointWriter writer(config_, none_);
  writer.prepare();
  EXPECT_EQ(resolve_checkpoint(writer.root()), "");  // nothing yet
  save(writer, a, 2);
  const std::string p4 = save(writer, a, 4);
  fs::remove(writer.root() + "/latest");
  EXPECT_EQ(resolve_checkpoint(writer.root()), p4);
  test::write_file(writer.root() + "/latest", "step-00000009\n");  // dangling
  EXPECT_EQ(resolve_checkpoint(writer.root()), p4);
  test::write_file(writer.root() + "/latest", "garbage\n");
  EXPECT_EQ(error_of([&] { resolve_checkpoint(writer.root()); }),
            "[checkpoint] " + writer.root() + "/latest: does not name a checkpoint ('garbage')");
  // Leftovers of an interrupted save are removed by the next prepare().
  fs::create_directories(writer.root() + "/.tmp-step-00000006");
  test::write_file(writer.root() + "/latest.tmp", "x");
  writer.prepare();
  EXPECT_EQ(test::count_leftovers(dir_), 0);
}

// ---- resume guards --------------------------------------------------------------------

TEST(ResumeGuards, ModelShapeVocabularyAndPrecisionChangesAreListed) {
  const Config saved = tiny_config("x");
  Config now = saved;
  now.model.vocab_size = 300;
  now.model.layers = 2;
  now.model.name = "renamed";     // a label: allowed
  now.optim.lr = 1e-4;            // allowed, reported as a change
  const CheckpointState state = state_at(saved, 1);
  EXPECT_EQ(error_of([&] { check_resume_model("C", state, saved, now, DType::f64); }),
            "[checkpoint] C: cannot resume, the run differs from the checkpoint in: model.vocab_size (259 -> 300), "
            "model.layers (1 -> 2), precision (f32 -> f64)");
  EXPECT_NO_THROW(check_resume_model("C", state, saved, saved, DType::f32));
  const auto all = config_differences(saved, now);
  EXPECT_EQ(all.size(), 4u);
  EXPECT_NE(std::find(all.begin(), all.end(), "optim.lr (0.003 -> 0.0001)"), all.end());
}

TEST(ResumeGuards, ChangedDataNeedsTheOverride) {
  const Config saved = tiny_config("x");
  const CheckpointState state = state_at(saved, 1);
  EXPECT_TRUE(check_resume_data("C", state, saved, saved, state.stream.fingerprint, false));
  Config now = saved;
  now.data.val_fraction = 0.25;
  EXPECT_EQ(error_of([&] { check_resume_data("C", state, saved, now, 42, false); }),
            "[checkpoint] C: the training data differs from the checkpoint's (fingerprint fedcba9876543210 -> "
            "000000000000002a; changed: data.val_fraction); pass --allow-data-change to continue on the new data "
            "from its start");
  EXPECT_FALSE(check_resume_data("C", state, saved, now, 42, true));
}

// ---- fault guard -----------------------------------------------------------------------

TEST(FaultGuard, SkipsNonFiniteAndSpikesAndStopsAfterTooManyInARow) {
  TrainConfig c;
  c.max_consecutive_skips = 3;
  c.spike_window = 2;
  FaultGuard guard(c);
  EXPECT_EQ(guard.check(std::nan(""), 1.0), "non-finite loss nan");
  EXPECT_EQ(guard.check(2.0, INFINITY), "non-finite gradient norm inf");
  EXPECT_EQ(guard.check(100.0, 100.0), "");  // the window is not full yet
  guard.accept(2.0, 1.0);
  guard.accept(2.0, 3.0);
  EXPECT_EQ(guard.check(3.9, 19.9), "");
  EXPECT_EQ(guard.check(4.1, 1.0), "loss spike 4.1 > 2 x recent mean 2");
  EXPECT_EQ(guard.check(2.0, 20.1), "gradient norm spike 20.1 > 10 x recent mean 2");
  guard.skip(5, "x");
  guard.skip(6, "x");
  EXPECT_EQ(error_of([&] { guard.skip(7, "non-finite loss nan"); }).rfind("[train] step 7: 3 consecutive updates skipped", 0), 0u);
  guard.accept(2.0, 1.0);
  EXPECT_EQ(guard.state().consecutive_skips, 0);
  EXPECT_EQ(guard.state().total_skips, 3);
  EXPECT_EQ(guard.state().recent_grad_norm, (std::vector<double>{3.0, 1.0}));

  FaultGuardState long_window;
  long_window.recent_loss = {1, 2, 3, 4};
  long_window.recent_grad_norm = {5, 6, 7, 8};
  guard.restore(long_window);  // train.spike_window shrank to 2: the newest are kept
  EXPECT_EQ(guard.state().recent_loss, (std::vector<double>{3, 4}));
  EXPECT_EQ(guard.state().recent_grad_norm, (std::vector<double>{7, 8}));
}

// The device step reaches its verdict with ops::step_verdict and the guard's limits; the
// host words it with reason(). Both must say what check() says, rule for rule.
TEST(FaultGuard, TheDeviceVerdictIsWordedAsTheHostChecksIt) {
  TrainConfig c;
  c.spike_window = 2;
  FaultGuard guard(c);
  guard.accept(2.0, 1.0);
  guard.accept(2.0, 3.0);
  double loss_limit = 0, grad_limit = 0;
  guard.spike_limits(&loss_limit, &grad_limit);
  EXPECT_EQ(loss_limit, 4.0);
  EXPECT_EQ(grad_limit, 20.0);
  const std::pair<double, double> cases[] = {{std::nan(""), 1.0}, {2.0, INFINITY}, {4.1, 1.0}, {2.0, 20.1}, {3.9, 19.9}};
  const ops::StepVerdict expected[] = {ops::StepVerdict::non_finite_loss, ops::StepVerdict::non_finite_grad_norm,
                                       ops::StepVerdict::loss_spike, ops::StepVerdict::grad_spike,
                                       ops::StepVerdict::apply};
  for (size_t i = 0; i < std::size(cases); ++i) {
    const auto [loss, norm] = cases[i];
    const ops::StepVerdict verdict = ops::step_verdict(loss, norm, loss_limit, grad_limit);
    EXPECT_EQ(verdict, expected[i]) << i;
    EXPECT_EQ(guard.reason(verdict, loss, norm), guard.check(loss, norm)) << i;
  }
  EXPECT_TRUE(ops::clip_applies(1.0, 1.5));
  EXPECT_FALSE(ops::clip_applies(1.0, 1.0));
  EXPECT_FALSE(ops::clip_applies(0.0, 1e9));  // 0: off
  EXPECT_EQ(ops::clip_factor(1.0, 2.0), 1.0 / (2.0 + 1e-6));
}

// ---- memory, metrics, directories -------------------------------------------------------

TEST(MemoryCheck, TheSuggestedMicroBatchIsTheLargestThatFits) {
  Config c = tiny_config("x");
  c.train.micro_batch_tokens = 8192;
  const MemoryBudget full = plan_training_memory(c, Device::cpu);
  EXPECT_GT(full.activations, 0u);
  EXPECT_GT(full.optimizer, 0u);
  EXPECT_NO_THROW(check_memory_fits(c, Device::cpu, full, {full.total(), "test"}));
  const size_t available = full.total() / 3;
  const int64_t fit = largest_fitting_micro_batch(c, Device::cpu, available);
  ASSERT_GT(fit, c.model.max_seq_len);
  Config at = c;
  at.train.micro_batch_tokens = fit;
  EXPECT_LE(plan_training_memory(at, Device::cpu).total(), available);
  at.train.micro_batch_tokens = fit + 1;
  EXPECT_GT(plan_training_memory(at, Device::cpu).total(), available);
  const std::string e = error_of([&] { check_memory_fits(c, Device::cpu, full, {available, "test"}); });
  EXPECT_EQ(e.rfind("[memory] the run needs ", 0), 0u) << e;
  EXPECT_CONTAINS(e, fmt::format("the largest train.micro_batch_tokens that fits is {} (now 8192", fit));
  EXPECT_CONTAINS(error_of([&] { check_memory_fits(c, Device::cpu, full, {1000, "test"}); }),
                  "not even a micro-batch of model.max_seq_len = 64 tokens fits");
  EXPECT_GT(available_memory(Device::cpu).bytes, 0u);
}

TEST(Metrics, TruncationDropsLaterStepsAndATornLine) {
  const std::string dir = test::temp_dir("kiln-metrics");
  const std::string path = dir + "/metrics.jsonl";
  test::write_file(path,
                   "{\"kind\":\"train\",\"step\":1,\"loss\":3.5}\n{\"kind\":\"validation\",\"step\":2,\"loss\":3}\n"
                   "{\"kind\":\"train\",\"step\":3,\"loss\":3.1}\n{\"kind\":\"train\",\"st");
  truncate_metrics_after(path, 2);
  EXPECT_EQ(test::read_file(path),
            "{\"kind\":\"train\",\"step\":1,\"loss\":3.5}\n{\"kind\":\"validation\",\"step\":2,\"loss\":3}\n");
  fs::remove_all(dir);
}

TEST(DurableIo, UnwritableDirectoriesAreNamed) {
  const std::string dir = test::temp_dir("kiln-durable");
  test::write_file(dir + "/file", "x");
  EXPECT_EQ(error_of([&] { io::ensure_writable_dir(dir + "/file/sub", "k"); }),
            "[k] " + dir + "/file/sub: cannot create: Not a directory");
  EXPECT_NO_THROW(io::ensure_writable_dir(dir + "/new/deeper", "k"));
  io::replace_file_atomically(dir + "/latest", "a\n", "k");
  io::replace_file_atomically(dir + "/latest", "b\n", "k");
  EXPECT_EQ(test::read_file(dir + "/latest"), "b\n");
  EXPECT_FALSE(fs::exists(dir + "/latest.tmp"));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kiln
