#include "core/error.h"
#include "test_util.h"
#include "config/cadence_keys.h"
#include "config/config.h"
#include "config/config_fields.h"
#include "config/layer_pattern.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <set>

namespace kiln {
namespace {

// Runs `fn`, expects a kiln::Error and returns its message.
std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected kiln::Error";
  return {};
}

class ConfigFile : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = test::temp_dir("kiln-config"); }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string write(const std::string& text, const std::string& name = "run.toml") {
    const std::string path = dir_ + "/" + name;
    test::write_file(path, text);
    return path;
  }
  std::string load_error(const std::string& text) {
    const std::string path = write(text);
    return error_of([&] { load_config(path); });
  }
  std::string dir_;
};

#define EXPECT_HAS(haystack, needle) EXPECT_NE(std::string(haystack).find(needle), std::string::npos) << (haystack)

// `c` as load_config resolves it when no file gives its paths: the relative ones (the
// defaults data.path and train.out_dir) against the working directory.
Config resolved(Config c) {
  const auto in_cwd = [](std::string& p) {
    if (!p.empty()) p = std::filesystem::absolute(p).lexically_normal().string();
  };
  for (std::string* p : {&c.data.path, &c.data.val_path, &c.train.out_dir, &c.checkpoint.dir}) in_cwd(*p);
  return c;
}

// ---- field table --------------------------------------------------------------------

TEST(ConfigFields, TableIsConsistent) {
  std::set<std::string> names;
  const auto sections = config_sections();
  size_t section_index = 0;
  for (const ConfigField& f : config_fields()) {
    EXPECT_TRUE(names.insert(f.name()).second) << "duplicate " << f.name();
    EXPECT_FALSE(f.help.empty()) << f.name();
    // Grouped by section, in config_sections() order.
    while (section_index < sections.size() && sections[section_index] != f.section) ++section_index;
    ASSERT_LT(section_index, sections.size()) << f.name() << " out of section order";
    EXPECT_EQ(find_config_field(f.section, f.key), &f);
  }
  EXPECT_EQ(find_config_field("model", "nope"), nullptr);
  EXPECT_TRUE(names.count("model.layers"));
  EXPECT_TRUE(names.count("checkpoint.save_final"));
}

TEST(ConfigFields, EveryFieldHasADistinctAddress) {
  Config c;
  std::set<const void*> addresses;
  for (const ConfigField& f : config_fields())
    std::visit([&](auto* p) { EXPECT_TRUE(addresses.insert(p).second) << f.name(); }, f.get(c));
}

// ---- defaults and files -------------------------------------------------------------

TEST(Config, DefaultsAreValid) {
  const Config c = load_config("");
  EXPECT_TRUE(config_equal(c, resolved(Config{})));
  EXPECT_NO_THROW(validate_config(Config{}));
}

TEST(Config, DefaultTomlLoadsAndValidates) {
  const std::string path = std::string(KILN_SOURCE_DIR) + "/configs/default.toml";
  ASSERT_TRUE(std::filesystem::exists(path)) << path;
  Config c;
  ASSERT_NO_THROW(c = load_config(path));
  EXPECT_EQ(c.data.doc_separator, "\n\n");
  EXPECT_NO_THROW(validate_config(c));
}

TEST_F(ConfigFile, LoadsValues) {
  const Config c = load_config(write(R"(
# comment
[model]
layers = 12
norm_eps = 1e-5
rope_theta = 500000          # integer given for a double
qk_norm = false
name = "big"

[data]
doc_separator = "\n---\n"
seed = 99

[optim]
lr = 0.001
)"));
  EXPECT_EQ(c.model.layers, 12);
  EXPECT_DOUBLE_EQ(c.model.norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c.model.rope_theta, 500000.0);
  EXPECT_FALSE(c.model.qk_norm);
  EXPECT_EQ(c.model.name, "big");
  EXPECT_EQ(c.data.doc_separator, "\n---\n");
  EXPECT_EQ(c.data.seed, 99u);
  EXPECT_DOUBLE_EQ(c.optim.lr, 0.001);
  // Untouched keys keep their defaults.
  EXPECT_EQ(c.model.hidden, Config{}.model.hidden);
  EXPECT_EQ(c.train.steps, Config{}.train.steps);
}

// A config's paths are found where the file is, whatever the working directory: a
// relative path in a file is relative to its directory; --set paths (typed in the shell)
// to the working directory. The resolved paths are absolute.
TEST_F(ConfigFile, PathsInAFileAreRelativeToItsDirectory) {
  std::filesystem::create_directories(dir_ + "/sub");
  const std::string path = write(R"(
[data]
path = "corpus.txt"
val_path = "../val.txt"
tokenizer = "tok/tokenizer.json"
[train]
out_dir = "runs/a"
[checkpoint]
dir = "/elsewhere/ck"
[eval]
tasks = "t1.jsonl, /x/t2.jsonl"
)", "sub/run.toml");
  const Config c = load_config(path);
  EXPECT_EQ(c.data.path, dir_ + "/sub/corpus.txt");
  EXPECT_EQ(c.data.val_path, dir_ + "/val.txt");
  EXPECT_EQ(c.data.tokenizer, dir_ + "/sub/tok/tokenizer.json");
  EXPECT_EQ(c.train.out_dir, dir_ + "/sub/runs/a");
  EXPECT_EQ(c.checkpoint.dir, "/elsewhere/ck");
  EXPECT_EQ(c.eval.tasks, dir_ + "/sub/t1.jsonl,/x/t2.jsonl");
  EXPECT_EQ(c.eval.texts, "");  // unset stays unset

  const std::string cwd = std::filesystem::current_path().string();
  const Config set = load_config(path, {"data.path=here.txt", "eval.texts=a.txt,b.txt"});
  EXPECT_EQ(set.data.path, cwd + "/here.txt");
  EXPECT_EQ(set.eval.texts, cwd + "/a.txt," + cwd + "/b.txt");
  // A tokenizer's name is no path.
  EXPECT_EQ(load_config(write("[data]\ntokenizer = \"byte\"\n", "sub/byte.toml")).data.tokenizer, "byte");
}

TEST_F(ConfigFile, EmptyFileIsDefaults) {
  EXPECT_TRUE(config_equal(load_config(write("")), resolved(Config{})));
}

TEST_F(ConfigFile, MissingFile) {
  const std::string path = dir_ + "/absent.toml";
  const std::string e = error_of([&] { load_config(path); });
  EXPECT_HAS(e, "[config] " + path + ": cannot open file");
}

TEST_F(ConfigFile, ParseErrorNamesFileLineAndColumn) {
  const std::string path = write("[model]\nlayers = 4\nhidden = = 3\n");
  const std::string e = error_of([&] { load_config(path); });
  EXPECT_HAS(e, "[config] " + path + ":3:");
  const std::string dup = load_error("[model]\nlayers = 4\nlayers = 5\n");
  EXPECT_HAS(dup, ":3:");
}

TEST_F(ConfigFile, UnknownKey) {
  const std::string path = write("[model]\nfoo = 1\n");
  const std::string e = error_of([&] { load_config(path); });
  EXPECT_EQ(e, "[config] " + path + ": unknown key 'model.foo'");
}

TEST_F(ConfigFile, UnknownKeySuggestsCloseName) {
  EXPECT_HAS(load_error("[model]\nlayer = 1\n"), "unknown key 'model.layer' (did you mean 'model.layers'?)");
  EXPECT_HAS(load_error("[train]\nlr = 0.1\n"), "unknown key 'train.lr' (did you mean 'optim.lr'?)");
  EXPECT_HAS(load_error("[optim]\nlearning_rate = 0.1\n"), "unknown key 'optim.learning_rate'");
  EXPECT_EQ(load_error("[optim]\nlearning_rate = 0.1\n").find("did you mean"), std::string::npos);
}

TEST_F(ConfigFile, AReplacedKeySaysWhatReplacedIt) {
  EXPECT_HAS(load_error("[optim]\ndecay_norms = true\n"),
             "unknown key 'optim.decay_norms' (replaced: write optim.norm.weight_decay = -1 and "
             "optim.bias.weight_decay = -1)");
  EXPECT_HAS(load_error("[optim]\ndecay_embeddings = true\n"), "optim.embedding.weight_decay = -1");
}

// [optim.<role>]: -1 takes the [optim] value; any other value follows the key's rule.
TEST_F(ConfigFile, RoleSectionsTakeMinusOneAsUnset) {
  const Config c = load_config(write("[optim.embedding]\nweight_decay = -1.0\nbeta1 = 0.8\n[optim.muon]\nns_steps = 3\n"));
  EXPECT_EQ(c.optim.embedding.weight_decay, -1);
  EXPECT_EQ(c.optim.embedding.beta1, 0.8);
  EXPECT_EQ(c.optim.muon.ns_steps, 3);
  EXPECT_HAS(load_error("[optim.norm]\nweight_decay = -2.0\n"), "optim.norm.weight_decay must be >= 0, got -2");
  EXPECT_HAS(load_error("[optim.head]\nbeta2 = 1.0\n"), "optim.head.beta2 must be in [0, 1), got 1");
  EXPECT_HAS(load_error("[optim.muon]\nscale = \"rms\"\n"), "optim.muon.scale must be one of moonlight|shape");
}

TEST_F(ConfigFile, UnknownSection) {
  EXPECT_HAS(load_error("[modle]\nlayers = 1\n"), "unknown key 'modle' (did you mean 'model'?)");
  EXPECT_HAS(load_error("[foo]\n"), "unknown key 'foo'");
  EXPECT_HAS(load_error("[model.foo]\nx = 1\n"), "unknown key 'model.foo'");
}

TEST_F(ConfigFile, TopLevelValueIsUnknownKey) {
  const std::string path = write("x = 1\n[model]\nlayers = 2\n");
  EXPECT_EQ(error_of([&] { load_config(path); }), "[config] " + path + ": unknown key 'x'");
  EXPECT_HAS(load_error("model = 1\n"), "'model' must be a table, got integer");
}

TEST_F(ConfigFile, WrongType) {
  const std::string path = write("[model]\nlayers = \"four\"\n");
  EXPECT_EQ(error_of([&] { load_config(path); }),
            "[config] " + path + ": 'model.layers' must be an integer, got string");
  EXPECT_HAS(load_error("[model]\nlayers = 4.0\n"), "'model.layers' must be an integer, got float");
  EXPECT_HAS(load_error("[model]\nqk_norm = 1\n"), "'model.qk_norm' must be a boolean, got integer");
  EXPECT_HAS(load_error("[model]\nname = 3\n"), "'model.name' must be a string, got integer");
  EXPECT_HAS(load_error("[optim]\nlr = \"fast\"\n"), "'optim.lr' must be a number, got string");
  EXPECT_HAS(load_error("[optim]\nlr = [1]\n"), "'optim.lr' must be a number, got array");
  EXPECT_HAS(load_error("[optim]\nlr = inf\n"), "'optim.lr' must be a finite number");
}

TEST_F(ConfigFile, NegativeUnsigned) {
  EXPECT_HAS(load_error("[train]\nseed = -1\n"), "'train.seed' must be a non-negative integer, got -1");
}

TEST_F(ConfigFile, FileValuesAreValidated) {
  EXPECT_HAS(load_error("[model]\nlayers = 0\n"), "model.layers must be > 0, got 0");
}

// ---- overrides ----------------------------------------------------------------------

TEST(ConfigOverride, SetsEachType) {
  Config c;
  apply_override(c, "model.layers=12");
  apply_override(c, "optim.lr=1e-3");
  apply_override(c, "optim.grad_clip=2");
  apply_override(c, "model.qk_norm=false");
  apply_override(c, "model.tie_embeddings=0");
  apply_override(c, "optim.norm.weight_decay=-1");
  apply_override(c, "optim.muon.nesterov=false");
  apply_override(c, "checkpoint.save_final=true");
  apply_override(c, "data.seed=42");
  apply_override(c, "train.out_dir=runs/x y");
  apply_override(c, "train.sample_prompt=\"JULIET: \"");
  apply_override(c, "data.path=a=b.txt");
  EXPECT_EQ(c.model.layers, 12);
  EXPECT_DOUBLE_EQ(c.optim.lr, 1e-3);
  EXPECT_DOUBLE_EQ(c.optim.grad_clip, 2.0);
  EXPECT_FALSE(c.model.qk_norm);
  EXPECT_FALSE(c.model.tie_embeddings);
  EXPECT_EQ(c.optim.norm.weight_decay, -1);
  EXPECT_FALSE(c.optim.muon.nesterov);
  EXPECT_TRUE(c.checkpoint.save_final);
  EXPECT_EQ(c.data.seed, 42u);
  EXPECT_EQ(c.train.out_dir, "runs/x y");
  EXPECT_EQ(c.train.sample_prompt, "JULIET: ");
  EXPECT_EQ(c.data.path, "a=b.txt");
}

TEST(ConfigOverride, AppliedInOrderAfterFile) {
  const Config c = load_config("", {"model.layers=3", "model.layers=5", "train.steps=7"});
  EXPECT_EQ(c.model.layers, 5);
  EXPECT_EQ(c.train.steps, 7);
}

TEST(ConfigOverride, Malformed) {
  Config c;
  EXPECT_EQ(error_of([&] { apply_override(c, "foo"); }), "[config] --set 'foo': expected section.key=value");
  EXPECT_HAS(error_of([&] { apply_override(c, "layers=3"); }), "expected section.key=value");
  EXPECT_HAS(error_of([&] { apply_override(c, "model.=3"); }), "expected section.key=value");
  EXPECT_HAS(error_of([&] { apply_override(c, ".layers=3"); }), "expected section.key=value");
}

TEST(ConfigOverride, UnknownKey) {
  Config c;
  EXPECT_EQ(error_of([&] { apply_override(c, "model.foo=1"); }), "[config] --set: unknown key 'model.foo'");
  EXPECT_EQ(error_of([&] { apply_override(c, "model.layes=1"); }),
            "[config] --set: unknown key 'model.layes' (did you mean 'model.layers'?)");
}

TEST(ConfigOverride, BadValues) {
  Config c;
  const auto set = [&](const char* a) { return error_of([&] { apply_override(c, a); }); };
  EXPECT_EQ(set("model.layers=abc"), "[config] --set model.layers: 'abc' is not an integer");
  EXPECT_HAS(set("model.layers=12x"), "'12x' is not an integer");
  EXPECT_HAS(set("model.layers="), "'' is not an integer");
  EXPECT_HAS(set("model.layers=1.5"), "is not an integer");
  EXPECT_HAS(set("model.layers=99999999999999999999"), "--set model.layers: '99999999999999999999' is out of range");
  EXPECT_HAS(set("optim.lr=abc"), "--set optim.lr: 'abc' is not a number");
  EXPECT_HAS(set("optim.lr=1e-3x"), "is not a number");
  EXPECT_HAS(set("optim.lr=1e999"), "out of range");
  EXPECT_HAS(set("optim.lr=nan"), "not a finite number");
  EXPECT_HAS(set("model.qk_norm=yes"), "--set model.qk_norm: 'yes' is not a boolean");
  EXPECT_HAS(set("data.seed=-1"), "--set data.seed: '-1' is not a non-negative integer");
  EXPECT_HAS(set("data.seed=18446744073709551615"), "out of range");
  // A failed override leaves the value alone.
  EXPECT_EQ(c.model.layers, Config{}.model.layers);
}

// Found by the config fuzz target (tests/fuzz/corpus/config/regression_*): a --set string
// that is not valid UTF-8 was taken, and the config.toml the run then saved did not load
// again (TOML is UTF-8), so --resume, sample, export and serve refused the run's own file.
TEST_F(ConfigFile, OverridesTheSavedConfigCannotHoldAreRefused) {
  Config c;
  EXPECT_EQ(error_of([&] { apply_override(c, "train.out_dir=runs/\xd1\x87\xff"); }),
            "[config] --set train.out_dir: the value is not valid UTF-8 (byte 0xff at offset 7); a TOML config holds "
            "UTF-8 only");
  EXPECT_EQ(c.train.out_dir, Config{}.train.out_dir);
  // What is taken reads back the same from the saved file.
  apply_override(c, "train.out_dir=runs/\xd1\x87 \x01\x7f");
  c = resolved(c);
  EXPECT_TRUE(config_equal(load_config(write(config_to_toml(c))), c));
}

TEST(ConfigOverride, LoadConfigValidatesOverrides) {
  EXPECT_HAS(error_of([] { load_config("", {"model.kv_heads=4"}); }), "model.kv_heads (4)");
}

// ---- round trip ---------------------------------------------------------------------

TEST_F(ConfigFile, RoundTripDefaults) {
  const Config c = resolved(Config{});
  const std::string text = config_to_toml(c);
  EXPECT_EQ(text.rfind("# kiln resolved configuration\n", 0), 0u);
  for (const std::string_view s : config_sections()) EXPECT_HAS(text, fmt::format("[{}]\n", s));
  for (const ConfigField& f : config_fields()) EXPECT_HAS(text, fmt::format("\n{} = ", f.key));
  EXPECT_HAS(text, "doc_separator = \"\\n\\n\"");
  EXPECT_HAS(text, "rope_theta = 10000.0");
  EXPECT_TRUE(config_equal(load_config(write(text)), c));
}

TEST_F(ConfigFile, RoundTripChangedConfig) {
  Config c = resolved(Config{});
  c.model.name = "quote \" back\\slash \t tab \x01 ctl \x7f del é";
  c.model.layers = 17;
  c.model.norm_eps = 1.0 / 3.0;
  c.model.rope_theta = 1e20;
  c.model.init_std = 5e-324;  // smallest subnormal
  c.model.qk_norm = false;
  c.data.doc_separator = "\r\n\r\n";
  c.data.seed = 9223372036854775807ull;
  c.optim.lr = 0.1 + 0.2;
  c.optim.grad_clip = 0.0;
  c.optim.weight_decay = 1.0;
  c.train.z_loss = 1e-4;
  c.train.steps = 123456789;
  c.train.sample_prompt = "";
  c.checkpoint.save_final = false;
  const std::string text = config_to_toml(c);
  const Config back = load_config(write(text));
  EXPECT_TRUE(config_equal(back, c)) << text;
  EXPECT_EQ(back.model.name, c.model.name);
  EXPECT_EQ(back.optim.lr, c.optim.lr);
  EXPECT_EQ(back.model.init_std, c.model.init_std);
  EXPECT_EQ(config_to_toml(back), text);
}

TEST_F(ConfigFile, RoundTripEveryFieldChanged) {
  // Changes every field through the table so a new key is covered automatically.
  Config c;
  for (const ConfigField& f : config_fields()) {
    std::visit(
        [&](auto* p) {
          using T = std::remove_pointer_t<decltype(p)>;
          if constexpr (std::is_same_v<T, bool>) *p = !*p;
          else if constexpr (std::is_same_v<T, std::string>) {
            if (f.rule.path != ConfigRule::kNotPath) *p = "/abs/" + *p + "~\"x\"\n";  // as a saved config has them
            else if (f.rule.kind != ConfigRule::kOneOf) *p += "~\"x\"\n";
          } else if constexpr (std::is_same_v<T, double>) {
            *p = f.rule.unset_allowed && *p == -1 ? 0.375 : *p * 0.5 + 0.125;  // -1: unset ([optim.<role>])
          }
          else *p += 2;
        },
        f.get(c));
  }
  c.model.heads = 8;  // keep heads % kv_heads == 0
  c.model.kv_heads = 4;
  c.model.full_attention_layers = "0";  // layer sets must parse
  c.model.nope_layers = "~1";
  c.model.alt_mlp_layers = "every:2";
  c.model.alt_attention_layers = "every:2";
  c.model.rope.scaling = "yarn";  // a scaling that reads the changed factor (>= 1), of RoPE
  c.model.position = "rope";
  c.model.rope.factor = 4.125;
  c.model.head_dim = 36;  // partial rotary: 0.5 x 36 rotates an even 18 dims
  c.model.rope.fraction = 0.5;
  c.train.loss_scale_init = 32768;  // a power of two, as validation requires
  c.model.moe.groups = 2;  // experts (10) in groups; top_k (4) within the top group's 5
  c.model.moe.top_groups = 1;
  c.model.moe.l1_rate = 1.5;  // a factor > 1
  c.model.mtp.weights = "0.25,0.5";  // one weight per depth (the changed depth is 2)
  c.model.mtp.form = "parallel";
  c.dist.zero = 1;  // the stages built (0, 1)
  for (const CadenceKeys& k : cadence_keys()) k.steps(c) = 0;  // a cadence by steps or by tokens, not both
  const Config back = load_config(write(config_to_toml(c)));
  EXPECT_TRUE(config_equal(back, c)) << config_to_toml(c);
  EXPECT_FALSE(config_equal(back, Config{}));
}

TEST(ConfigEqual, DetectsDifferences) {
  Config a, b;
  EXPECT_TRUE(config_equal(a, b));
  b.optim.beta2 = 0.999;
  EXPECT_FALSE(config_equal(a, b));
}

// ---- validation ---------------------------------------------------------------------

std::string validation_error(const std::function<void(Config&)>& change) {
  Config c;
  change(c);
  return error_of([&] { validate_config(c); });
}

TEST(ConfigValidate, PositiveSizes) {
  for (const char* name : {"model.vocab_size", "model.hidden", "model.layers", "model.heads", "model.kv_heads",
                           "model.head_dim", "model.ffn_hidden", "model.max_seq_len", "train.steps",
                           "train.micro_batch_tokens", "train.grad_accum", "train.loss_chunk_tokens"}) {
    Config c;
    apply_override(c, std::string(name) + "=0");
    EXPECT_HAS(error_of([&] { validate_config(c); }), fmt::format("[config] {} must be > 0, got 0", name));
    apply_override(c, std::string(name) + "=-3");
    EXPECT_HAS(error_of([&] { validate_config(c); }), fmt::format("{} must be > 0, got -3", name));
  }
}

TEST(ConfigValidate, NonNegativeCounts) {
  for (const char* name : {"train.eval_every", "train.sample_every", "train.eval_batches", "train.sample_tokens",
                           "train.threads", "optim.warmup_steps", "model.sliding_window", "model.attention_softcap",
                           "model.logit_softcap", "model.ungated_ffn_hidden"}) {
    Config c;
    apply_override(c, std::string(name) + "=0");
    EXPECT_NO_THROW(validate_config(c)) << name;
    apply_override(c, std::string(name) + "=-1");
    EXPECT_HAS(error_of([&] { validate_config(c); }), fmt::format("{} must be >= 0, got -1", name));
  }
}

// Keys that size something stop far past any real run, so a typo is refused by name before
// a plan is built or anything allocated: the bound passes, one more does not.
TEST(ConfigValidate, UpperBoundsNameTheKey) {
  const std::pair<const char*, int64_t> bounds[] = {
      {"model.vocab_size", int64_t{1} << 24}, {"model.hidden", 65536},          {"model.ffn_hidden", 262144},
      {"model.ungated_ffn_hidden", 262144},
      {"model.layers", 1024},                 {"model.heads", 1024},            {"model.kv_heads", 1024},
      {"model.head_dim", 1024},               {"data.prefetch", 65536},         {"train.grad_accum", 65536},
      {"train.eval_batches", 65536},          {"train.threads", 4096},          {"train.spike_window", 100000},
      {"train.sample_tokens", 2147483647},    {"train.loss_chunk_tokens", 2147483647},
  };
  for (const auto& [name, bound] : bounds) {
    Config c;
    apply_override(c, fmt::format("{}={}", name, bound));
    if (std::string(name).find("heads") != std::string::npos) c.model.heads = c.model.kv_heads = bound;
    EXPECT_NO_THROW(validate_config(c)) << name;
    apply_override(c, fmt::format("{}={}", name, bound + 1));
    EXPECT_HAS(error_of([&] { validate_config(c); }), fmt::format("[config] {} must be <= {} (", name, bound));
  }
  // The positions bound of the micro-batch and the context, and the values that used to end
  // in internal errors.
  Config c;
  apply_override(c, "train.micro_batch_tokens=2147483648");
  EXPECT_HAS(error_of([&] { validate_config(c); }), "train.micro_batch_tokens must be <= 2147483647 (");
  apply_override(c, "train.micro_batch_tokens=2147483647");
  apply_override(c, "model.max_seq_len=2147483648");
  EXPECT_HAS(error_of([&] { validate_config(c); }), "model.max_seq_len must be <= 2147483647 (");
  apply_override(c, "model.max_seq_len=2147483647");
  EXPECT_NO_THROW(validate_config(c));
  EXPECT_EQ(validation_error([](Config& x) { x.train.spike_window = INT64_MAX; }),
            "[config] train.spike_window must be <= 100000 (reserved and saved with checkpoints), got "
            "9223372036854775807");
}

// The routers' keys: each error names the key, the router and why.
TEST(ConfigValidate, MoeRouterKeys) {
  EXPECT_HAS(validation_error([](Config& c) { c.model.moe.capacity_factor = -1; }),
             "model.moe.capacity_factor must be >= 0, got -1");
  EXPECT_HAS(validation_error([](Config& c) { c.model.moe.sinkhorn_iterations = 0; }),
             "model.moe.sinkhorn_iterations must be > 0, got 0");
  EXPECT_HAS(validation_error([](Config& c) { c.model.moe.l1_coef = 0; }), "model.moe.l1_coef must be > 0, got 0");
  EXPECT_HAS(validation_error([](Config& c) { c.model.moe.l1_rate = 1.0; }), "model.moe.l1_rate (1) must be > 1");
  for (const char* router : {"relu", "expert_choice"}) {
    EXPECT_HAS(validation_error([&](Config& c) {
                 c.model.moe.router = router;
                 c.model.moe.aux_loss = 0.01;
                 c.train.sample_tokens = 0;
               }),
               fmt::format("model.moe.aux_loss (0.01) must be 0 with model.moe.router = '{}'", router));
  }
  EXPECT_HAS(validation_error([](Config& c) { c.model.moe.router = "expert_choice"; }),
             "train.sample_tokens (200) must be 0 with model.moe.router = 'expert_choice': it is not causal");
  Config ok;
  ok.model.moe.router = "expert_choice";
  ok.model.moe.capacity_factor = 1.25;
  ok.train.sample_tokens = 0;
  EXPECT_NO_THROW(validate_config(ok));
  ok.model.moe.router = "sinkhorn";
  ok.model.moe.capacity_factor = 1.5;
  ok.train.sample_tokens = 200;
  EXPECT_NO_THROW(validate_config(ok));
}

TEST(ConfigValidate, HeadsMultipleOfKvHeads) {
  EXPECT_EQ(validation_error([](Config& c) {
              c.model.heads = 6;
              c.model.kv_heads = 4;
            }),
            "[config] model.heads (6) must be a multiple of model.kv_heads (4)");
}

TEST(ConfigValidate, SeqLenFitsMicroBatch) {
  EXPECT_HAS(validation_error([](Config& c) {
               c.model.max_seq_len = 512;
               c.train.micro_batch_tokens = 256;
             }),
             "model.max_seq_len (512) must be <= train.micro_batch_tokens (256)");
  Config ok;
  ok.model.max_seq_len = ok.train.micro_batch_tokens;
  EXPECT_NO_THROW(validate_config(ok));
}

// model.rope.local_theta is the windowed layers' base: a model without one is told so.
TEST(ConfigValidate, LocalRopeBaseNeedsAWindowedLayer) {
  EXPECT_HAS(validation_error([](Config& c) { c.model.rope.local_theta = 10000; }),
             "model.rope.local_theta = 10000 applies to windowed layers, but none has a window");
  EXPECT_HAS(validation_error([](Config& c) {
               c.model.rope.local_theta = 10000, c.model.sliding_window = 8, c.model.full_attention_layers = "all";
             }),
             "model.rope.local_theta");
  EXPECT_HAS(validation_error([](Config& c) {
               c.model.rope.local_theta = 10000, c.model.sliding_window = 8, c.model.position = "none";
             }),
             "model.rope.local_theta = 10000 needs model.position = 'rope'");
  EXPECT_HAS(validation_error([](Config& c) { c.model.rope.local_theta = -1; }), "model.rope.local_theta");
  Config ok;
  ok.model.rope.local_theta = 10000, ok.model.sliding_window = 8, ok.model.full_attention_layers = "every:2";
  EXPECT_NO_THROW(validate_config(ok));
}

TEST(ConfigValidate, Ranges) {
  EXPECT_HAS(validation_error([](Config& c) { c.data.val_fraction = 1.0; }), "data.val_fraction must be in [0, 1)");
  EXPECT_HAS(validation_error([](Config& c) { c.data.val_fraction = -0.1; }), "data.val_fraction");
  EXPECT_HAS(validation_error([](Config& c) { c.model.norm_eps = 0; }), "model.norm_eps must be > 0");
  EXPECT_HAS(validation_error([](Config& c) { c.model.dyt_alpha = 0; }), "model.dyt_alpha must be > 0");
  EXPECT_HAS(validation_error([](Config& c) { c.optim.lr = 0; }), "optim.lr must be > 0");
  EXPECT_HAS(validation_error([](Config& c) { c.optim.beta1 = 1.0; }), "optim.beta1 must be in [0, 1)");
  EXPECT_HAS(validation_error([](Config& c) { c.optim.beta2 = -0.5; }), "optim.beta2 must be in [0, 1)");
  EXPECT_HAS(validation_error([](Config& c) { c.optim.eps = 0; }), "optim.eps must be > 0");
  EXPECT_HAS(validation_error([](Config& c) { c.optim.weight_decay = -1; }), "optim.weight_decay must be >= 0");
  EXPECT_HAS(validation_error([](Config& c) { c.optim.grad_clip = -1; }), "optim.grad_clip must be >= 0");
  EXPECT_HAS(validation_error([](Config& c) { c.optim.min_lr_ratio = 1.5; }), "optim.min_lr_ratio must be in [0, 1]");
  EXPECT_HAS(validation_error([](Config& c) { c.train.sample_temperature = -1; }),
             "train.sample_temperature must be >= 0");
  EXPECT_HAS(validation_error([](Config& c) { c.train.z_loss = -1e-4; }), "train.z_loss must be >= 0");

  Config edges;
  edges.data.val_fraction = 0;
  edges.optim.min_lr_ratio = 1;
  edges.optim.beta1 = 0;
  edges.optim.weight_decay = 0;
  edges.optim.grad_clip = 0;
  edges.train.sample_temperature = 0;
  EXPECT_NO_THROW(validate_config(edges));
}

TEST(ConfigValidate, Choices) {
  EXPECT_EQ(validation_error([](Config& c) { c.data.format = "csv"; }),
            "[config] data.format must be one of auto|text|jsonl|parquet|arrow|shards|llmc|raw_u16|raw_u32, got 'csv'");
  EXPECT_HAS(validation_error([](Config& c) { c.data.long_doc = "truncate"; }), "data.long_doc must be one of");
  EXPECT_HAS(validation_error([](Config& c) { c.train.device = "gpu"; }), "train.device must be one of");
  EXPECT_HAS(validation_error([](Config& c) { c.train.device = ""; }), "train.device must be one of");
  EXPECT_EQ(validation_error([](Config& c) { c.model.qk_norm_type = "layernorm"; }),
            "[config] model.qk_norm_type must be one of rmsnorm|gemma_rmsnorm|dyt, got 'layernorm'");
  for (const char* v : {"rmsnorm", "gemma_rmsnorm", "dyt"}) {
    Config c;
    c.model.qk_norm_type = v;
    EXPECT_NO_THROW(validate_config(c)) << v;
  }
  for (const char* v : {"auto", "text", "jsonl"}) {
    Config c;
    c.data.format = v;
    EXPECT_NO_THROW(validate_config(c)) << v;
  }
  for (const char* v : {"split", "drop", "error"}) {
    Config c;
    c.data.long_doc = v;
    EXPECT_NO_THROW(validate_config(c)) << v;
  }
  for (const char* v : {"auto", "cpu", "cuda"}) {
    Config c;
    c.train.device = v;
    EXPECT_NO_THROW(validate_config(c)) << v;
  }
}

TEST(ConfigValidate, DataPathNonEmpty) {
  EXPECT_EQ(validation_error([](Config& c) { c.data.path = ""; }), "[config] data.path must not be empty");
}

// Layer sets: each form, their union and complement, and one-line errors naming the key.
TEST(LayerSet, FormsUnionsAndComplements) {
  auto set = [](std::string_view text, int64_t layers = 8) {
    std::string out;
    const std::vector<bool> m = parse_layer_set("model.nope_layers", text, layers);
    for (size_t l = 0; l < m.size(); ++l) out += m[l] ? '1' : '0';
    return out;
  };
  EXPECT_EQ(set(""), "00000000");
  EXPECT_EQ(set("all"), "11111111");
  EXPECT_EQ(set("3"), "00010000");
  EXPECT_EQ(set("2-4, 7"), "00111001");
  EXPECT_EQ(set("every:3"), "00100100");  // each 3rd layer: 2, 5
  EXPECT_EQ(set("first:2"), "11000000");
  EXPECT_EQ(set("from:6"), "00000011");
  EXPECT_EQ(set("first:10"), "11111111");
  EXPECT_EQ(set("~every:2"), "10101010");
  EXPECT_EQ(set("~ 0,every:4"), "01101110");
  EXPECT_EQ(error_of([&] { set("8"); }),
            "[config] model.nope_layers = '8': '8' names layer 8, but the model has 8 (model.layers) (layer sets: N, "
            "A-B, every:K, first:K, from:K, all; ~ for the complement)");
  for (const char* bad : {"x", "3-1", "every:0", "every:", "some:2", "1,,2", "-1", "1-"})
    EXPECT_NE(error_of([&] { set(bad); }).find("model.nope_layers"), std::string::npos) << bad;
}

TEST(LayerSet, LayerChoicesFollowThePatterns) {
  ModelConfig m;
  m.layers = 6;
  m.sliding_window = 64;
  m.full_attention_layers = "every:3";
  m.nope_layers = "5";
  m.alt_mlp = "geglu";
  m.alt_mlp_layers = "first:1";
  for (int64_t l = 0; l < 6; ++l) {
    const LayerChoices c = layer_choices(m, l);
    EXPECT_EQ(c.window, l == 2 || l == 5 ? 0 : 64) << l;
    EXPECT_EQ(c.rotary, l != 5) << l;
    EXPECT_EQ(c.mlp, l == 0 ? "geglu" : "swiglu") << l;
    EXPECT_EQ(c.mixer, "gqa") << l;
  }
}

// The token mixer is chosen per layer as the MLP is: three layers of one mixer, then full
// attention, every four layers (KDA's pattern), with the windows and NoPE on top.
TEST(LayerSet, LayerChoicesResolveEachLayersTokenMixer) {
  ModelConfig m;
  m.layers = 8;
  m.attention = "kda";
  m.alt_attention = "gqa";
  m.alt_attention_layers = "every:4";
  for (int64_t l = 0; l < 8; ++l) EXPECT_EQ(layer_choices(m, l).mixer, l % 4 == 3 ? "gqa" : "kda") << l;
  m.alt_attention_layers = "~every:4";  // the complement swaps them
  for (int64_t l = 0; l < 8; ++l) EXPECT_EQ(layer_choices(m, l).mixer, l % 4 == 3 ? "kda" : "gqa") << l;
}

TEST(ConfigValidate, LayerPatterns) {
  auto error_with = [](const std::function<void(Config&)>& edit) {
    Config c;
    edit(c);
    return error_of([&] { validate_config(c); });
  };
  EXPECT_NE(error_with([](Config& c) { c.model.nope_layers = "9"; }).find("model.nope_layers = '9'"), std::string::npos);
  EXPECT_EQ(error_with([](Config& c) { c.model.alt_mlp_layers = "0"; }),
            "[config] model.alt_mlp_layers = '0' names layers, but model.alt_mlp (their MLP) is empty");
  EXPECT_EQ(error_with([](Config& c) { c.model.alt_attention_layers = "first:2"; }),
            "[config] model.alt_attention_layers = 'first:2' names layers, but model.alt_attention (their token mixer) "
            "is empty");
  EXPECT_EQ(error_with([](Config& c) {
              c.model.alt_attention = "gqa";
              c.model.alt_attention_layers = "every:x";
            }).rfind("[config] model.alt_attention_layers = 'every:x': 'every:x' needs a positive count", 0),
            0u);
  EXPECT_EQ(error_with([](Config& c) { c.model.full_attention_layers = "0"; }),
            "[config] model.full_attention_layers = '0' exempts layers from a window, but model.sliding_window is 0");
}

}  // namespace
}  // namespace kiln
