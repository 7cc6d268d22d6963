// safetensors reader/writer: round trips, conversions, every header corruption, and the
// committed golden files (tests/data/golden, made by scripts/make_golden.py).
#include "export_fixture.h"
#include "io/safetensors.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <set>

namespace kiln {
namespace {

using io::read_into;
using io::read_tensor;
using io::SafetensorsFile;
using io::SafetensorsWriter;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = test::temp_dir("kiln-safetensors"); }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }

  // A file made by hand: 8-byte length, the header text as given, then `data`.
  std::string craft(const std::string& name, const std::string& header, const std::string& data) {
    std::string bytes(8, '\0');
    const uint64_t n = header.size();
    std::memcpy(bytes.data(), &n, 8);
    bytes += header + data;
    test::write_file(path(name), bytes);
    return path(name);
  }

  // The error message open() throws, or "" if it opened.
  std::string open_error(const std::string& file) {
    try {
      SafetensorsFile::open(file);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  }

  std::string dir_;
};

TEST_F(SafetensorsTest, RoundTripAllDtypesAndRanks) {
  OwnedTensor a = test::random_tensor(DType::f32, {3, 4}, 1);
  OwnedTensor b = test::random_tensor(DType::f64, {5}, 2);
  OwnedTensor c(DType::bf16, Device::cpu, {2, 3});
  OwnedTensor d(DType::f16, Device::cpu, {3});  // odd byte count before larger dtypes
  OwnedTensor e(DType::i32, Device::cpu, {7});
  OwnedTensor f(DType::i64, Device::cpu, {2, 2});
  OwnedTensor scalar(DType::f32, Device::cpu, Shape{});
  OwnedTensor empty(DType::f32, Device::cpu, {0, 4});
  for (int i = 0; i < 6; ++i) static_cast<uint16_t*>(c->raw())[i] = float_to_bf16(0.5f * static_cast<float>(i) - 1.f);
  for (int i = 0; i < 3; ++i) static_cast<uint16_t*>(d->raw())[i] = float_to_f16(0.25f * static_cast<float>(i));
  for (int i = 0; i < 7; ++i) e->data<int32_t>()[i] = i * 1000 - 3;
  for (int i = 0; i < 4; ++i) f->data<int64_t>()[i] = (int64_t{1} << 40) + i;
  scalar->data<float>()[0] = 3.5f;
  std::vector<float> rank5(2 * 1 * 3 * 1 * 2);
  for (size_t i = 0; i < rank5.size(); ++i) rank5[i] = static_cast<float>(i);

  SafetensorsWriter w;
  w.add("z.a", *a);
  w.add("b", *b);
  w.add("c.bf16", *c);
  w.add("d.f16", *d);
  w.add("e", *e);
  w.add("f", *f);
  w.add("scalar", *scalar);
  w.add("empty", *empty);
  w.add_raw("rank5", DType::f32, {2, 1, 3, 1, 2}, rank5.data(), rank5.size() * 4);
  EXPECT_THROW(w.add("b", *b), Error);
  w.write(path("t.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(path("t.safetensors.tmp")));

  const auto file = SafetensorsFile::open(path("t.safetensors"));
  EXPECT_EQ(file.names(), (std::vector<std::string>{"b", "c.bf16", "d.f16", "e", "empty", "f", "rank5", "scalar", "z.a"}));
  EXPECT_TRUE(file.metadata().empty());
  const struct {
    const char* name;
    const Tensor& t;
  } cases[] = {{"z.a", *a}, {"b", *b}, {"c.bf16", *c}, {"d.f16", *d}, {"e", *e}, {"f", *f}, {"scalar", *scalar}, {"empty", *empty}};
  for (const auto& tc : cases) {
    SCOPED_TRACE(tc.name);
    const auto& info = file.info(tc.name);
    EXPECT_EQ(info.dtype, tc.t.dtype());
    EXPECT_TRUE(info.kiln_shape() == tc.t.shape());
    ASSERT_EQ(info.nbytes(), tc.t.nbytes());
    if (tc.t.nbytes()) EXPECT_EQ(std::memcmp(file.data(tc.name), tc.t.raw(), tc.t.nbytes()), 0);
    // Data start is 8-aligned and data is ordered by element size: all aligned.
    EXPECT_EQ(reinterpret_cast<uintptr_t>(file.data(tc.name)) % dtype_size(tc.t.dtype()), 0u);
  }
  EXPECT_EQ(file.info("scalar").shape, std::vector<int64_t>{});
  EXPECT_EQ(file.info("rank5").shape, (std::vector<int64_t>{2, 1, 3, 1, 2}));
  EXPECT_EQ(std::memcmp(file.data("rank5"), rank5.data(), rank5.size() * 4), 0);
  EXPECT_THROW(file.info("rank5").kiln_shape(), Error);

  // Typed reads with the same dtype copy exactly.
  OwnedTensor a2 = read_tensor(file, "z.a", DType::f32);
  EXPECT_EQ(std::memcmp(a2->raw(), a->raw(), a->nbytes()), 0);
  OwnedTensor f2 = read_tensor(file, "f", DType::i64);
  EXPECT_EQ(f2->data<int64_t>()[3], (int64_t{1} << 40) + 3);

  // The header is padded with spaces to a multiple of 8 and its keys are sorted.
  const std::string raw = test::read_file(path("t.safetensors"));
  uint64_t n;
  std::memcpy(&n, raw.data(), 8);
  EXPECT_EQ(n % 8, 0u);
  const auto header = nlohmann::json::parse(raw.substr(8, n));
  std::vector<std::string> keys;
  for (const auto& [k, v] : header.items()) keys.push_back(k);
  EXPECT_TRUE(std::is_sorted(keys.begin(), keys.end()));
}

TEST_F(SafetensorsTest, Metadata) {
  OwnedTensor a = test::random_tensor(DType::f32, {2}, 3);
  SafetensorsWriter w;
  w.add("a", *a);
  w.set_metadata("format", "pt");
  w.set_metadata("config", R"({"hidden": 64, "name": "tiny \"q\""})");
  w.set_metadata("format", "kiln");  // last value wins
  w.write(path("m.safetensors"));
  const auto file = SafetensorsFile::open(path("m.safetensors"));
  EXPECT_EQ(file.metadata().size(), 2u);
  EXPECT_EQ(file.metadata("format"), "kiln");
  EXPECT_EQ(nlohmann::json::parse(file.metadata("config"))["name"], "tiny \"q\"");
  EXPECT_EQ(file.names(), std::vector<std::string>{"a"});
  try {
    file.metadata("nope");
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing metadata key 'nope'"), std::string::npos);
  }
  // A file with only metadata and no tensors is valid.
  SafetensorsWriter w2;
  w2.set_metadata("k", "v");
  w2.write(path("only_meta.safetensors"));
  EXPECT_EQ(SafetensorsFile::open(path("only_meta.safetensors")).metadata("k"), "v");
}

TEST_F(SafetensorsTest, MissingTensorAndShapeMismatch) {
  OwnedTensor a = test::random_tensor(DType::f32, {3, 4}, 4);
  SafetensorsWriter w;
  w.add("x", *a);
  w.write(path("s.safetensors"));
  const auto file = SafetensorsFile::open(path("s.safetensors"));
  OwnedTensor dst(DType::f32, Device::cpu, {4, 3});
  try {
    read_into(file, "x", *dst);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()),
              "[safetensors] " + path("s.safetensors") + ": tensor 'x' has shape [3, 4], expected [4, 3]");
  }
  try {
    read_into(file, "y", *dst);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), "[safetensors] " + path("s.safetensors") + ": missing tensor 'y'");
  }
  OwnedTensor ints(DType::i32, Device::cpu, {3, 4});
  EXPECT_THROW(read_into(file, "x", *ints), Error);  // float into int is refused
}

TEST_F(SafetensorsTest, ConvertsOnRead) {
  // bf16 -> f32 / f64, f16 -> f32, f32 -> f64, f32 -> bf16, i64 -> i32.
  const std::vector<float> values = {0.f, 1.f, -2.5f, 3.140625f, 1e-3f, -65504.f};
  std::vector<uint16_t> bf(values.size()), hf(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    bf[i] = float_to_bf16(values[i]);
    hf[i] = float_to_f16(values[i]);
  }
  const std::vector<int64_t> big = {1, -2, int64_t{1} << 40};
  SafetensorsWriter w;
  w.add_raw("bf", DType::bf16, {2, 3}, bf.data(), bf.size() * 2);
  w.add_raw("hf", DType::f16, {6}, hf.data(), hf.size() * 2);
  w.add_raw("f", DType::f32, {6}, values.data(), values.size() * 4);
  w.add_raw("small", DType::i64, {2}, big.data(), 16);
  w.add_raw("big", DType::i64, {3}, big.data(), 24);
  w.write(path("c.safetensors"));
  const auto file = SafetensorsFile::open(path("c.safetensors"));

  OwnedTensor f32(DType::f32, Device::cpu, {2, 3});
  read_into(file, "bf", *f32);
  for (size_t i = 0; i < values.size(); ++i) EXPECT_EQ(f32->data<float>()[i], bf16_to_float(bf[i])) << i;
  EXPECT_EQ(f32->data<float>()[3], 3.140625f);  // exactly representable in bf16
  EXPECT_NEAR(f32->data<float>()[4], 1e-3f, 1e-5f);

  OwnedTensor f64(DType::f64, Device::cpu, {2, 3});
  read_into(file, "bf", *f64);
  for (size_t i = 0; i < values.size(); ++i) EXPECT_EQ(f64->data<double>()[i], bf16_to_float(bf[i])) << i;

  OwnedTensor h32 = read_tensor(file, "hf", DType::f32);
  for (size_t i = 0; i < values.size(); ++i) EXPECT_EQ(h32->data<float>()[i], f16_to_float(hf[i])) << i;
  EXPECT_EQ(h32->data<float>()[5], -65504.f);

  OwnedTensor d64 = read_tensor(file, "f", DType::f64);
  for (size_t i = 0; i < values.size(); ++i) EXPECT_EQ(d64->data<double>()[i], static_cast<double>(values[i]));
  OwnedTensor b16 = read_tensor(file, "f", DType::bf16);
  for (size_t i = 0; i < values.size(); ++i) EXPECT_EQ(static_cast<uint16_t*>(b16->raw())[i], bf[i]);

  OwnedTensor i32 = read_tensor(file, "small", DType::i32);
  EXPECT_EQ(i32->data<int32_t>()[1], -2);
  EXPECT_THROW(read_tensor(file, "big", DType::i32), Error);  // 2^40 does not fit
}

TEST_F(SafetensorsTest, TruncatedFiles) {
  OwnedTensor a = test::random_tensor(DType::f32, {4, 4}, 5);
  SafetensorsWriter w;
  w.add("a", *a);
  w.set_metadata("k", "v");
  w.write(path("full.safetensors"));
  const std::string full = test::read_file(path("full.safetensors"));
  uint64_t n;
  std::memcpy(&n, full.data(), 8);

  test::write_file(path("empty.safetensors"), "");
  EXPECT_NE(open_error(path("empty.safetensors")).find("truncated header"), std::string::npos);
  test::write_file(path("short.safetensors"), full.substr(0, 5));
  EXPECT_NE(open_error(path("short.safetensors")).find("truncated header"), std::string::npos);
  test::write_file(path("mid_header.safetensors"), full.substr(0, 8 + n / 2));
  EXPECT_NE(open_error(path("mid_header.safetensors")).find("truncated header"), std::string::npos);
  test::write_file(path("mid_data.safetensors"), full.substr(0, full.size() - 3));
  const std::string err = open_error(path("mid_data.safetensors"));
  EXPECT_NE(err.find("data_offsets [0, 64] out of range"), std::string::npos) << err;
  EXPECT_NE(err.find(path("mid_data.safetensors")), std::string::npos) << err;
  // Extra bytes after the last tensor are refused too.
  test::write_file(path("long.safetensors"), full + "xyz");
  EXPECT_NE(open_error(path("long.safetensors")).find("cover"), std::string::npos);
  EXPECT_NE(open_error(path("does_not_exist")).find("cannot open"), std::string::npos);
}

TEST_F(SafetensorsTest, BadHeaders) {
  auto error_of = [&](const std::string& header, const std::string& data = std::string(8, '\0')) {
    return open_error(craft("bad.safetensors", header, data));
  };
  auto expect_error = [&](const std::string& header, const std::string& expected) {
    const std::string err = error_of(header);
    EXPECT_NE(err.find(expected), std::string::npos) << "header: " << header << "\nerror: " << err;
    EXPECT_EQ(err.rfind("[safetensors] ", 0), 0u) << err;
  };
  const std::string good = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  EXPECT_EQ(error_of(good), "");
  EXPECT_EQ(error_of(good + "   "), "");  // space padding is fine

  expect_error(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})", "bad header JSON");
  expect_error("not json at all", "bad header JSON");
  expect_error(R"([1, 2])", "bad header JSON");
  expect_error(R"({"a": 3})", "entry is not an object");
  expect_error(R"({"a":{"dtype":"F8","shape":[2],"data_offsets":[0,8]}})", "unsupported dtype 'F8'");
  expect_error(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", "no dtype");
  expect_error(R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", "no shape");
  expect_error(R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", "bad shape");
  expect_error(R"({"a":{"dtype":"F32","shape":[2]}})", "needs data_offsets");
  expect_error(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", "needs data_offsets");
  expect_error(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[-1,8]}})", "needs data_offsets");
  expect_error(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", "data_offsets [0, 16] out of range");
  expect_error(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", "data_offsets [8, 0] out of range");
  expect_error(R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", "hold 8 bytes but F32 [3] needs 12");
  expect_error(R"({"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,8]}})", "overflows");
  expect_error(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
               "overlap");
  expect_error(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", "gap of 4 bytes");
  expect_error(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", "data section is 8 bytes but the tensors cover 4");
  expect_error(R"({"__metadata__":{"k":1},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", "not a string");
  expect_error(R"({"__metadata__":[],"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", "__metadata__ is not");
  // Header length field larger than the file.
  std::string bytes(8, '\0');
  const uint64_t huge = uint64_t{1} << 62;
  std::memcpy(bytes.data(), &huge, 8);
  test::write_file(path("huge.safetensors"), bytes + good + std::string(8, '\0'));
  EXPECT_NE(open_error(path("huge.safetensors")).find("truncated header"), std::string::npos);
}

// Found by the safetensors fuzz target (tests/fuzz/corpus/safetensors/regression_*): the
// header check multiplied the dimensions in uint64, so [2^62, 2, 0] (no bytes) passed,
// and TensorInfo::numel() then overflowed an int64 (undefined behaviour).
TEST_F(SafetensorsTest, ShapesWhoseRunningProductOverflowsAreRefused) {
  const std::string err = open_error(craft("zero.safetensors", R"({"a":{"dtype":"F32","shape":[4611686018427387904,2,0],"data_offsets":[0,0]}})", ""));
  EXPECT_EQ(err, "[safetensors] " + path("zero.safetensors") +
                     ": tensor 'a' shape [4611686018427387904, 2] overflows at dimension 1");
  // A zero first still holds nothing and multiplies safely.
  EXPECT_EQ(open_error(craft("zero_first.safetensors", R"({"a":{"dtype":"F32","shape":[0,4611686018427387904,2],"data_offsets":[0,0]}})", "")), "");
}

// A shape nested 300000 arrays deep: the error message dumped the shape, and dump()
// recursed until the stack overflowed (SIGSEGV) in every command that opens the file.
TEST_F(SafetensorsTest, DeeplyNestedShapesAreRefusedWithoutDumpingThem) {
  const int depth = 300000;
  const std::string header = R"({"a":{"dtype":"F32","shape":)" + std::string(depth, '[') + std::string(depth, ']') +
                             R"(,"data_offsets":[0,0]}})";
  const std::string model = test::save_random_model(test::tiny_config(true, true, false), path("model"));
  craft("model/model.safetensors", header, "");
  std::string output;
  EXPECT_EQ(test::run_command(test::kiln_binary() + " sample " + model + " -n 1", &output), 1) << output;
  EXPECT_EQ(output, "kiln: error: [safetensors] " + model +
                        "/model.safetensors: tensor 'a' has a bad shape: dimension 0 is not a non-negative integer\n");
}

// ---------------------------------------------------------------- golden files

std::vector<std::string> qwen3_tiny_parameter_names(bool tied) {
  std::vector<std::string> names = {"model.embed_tokens.weight", "model.norm.weight"};
  for (int l = 0; l < 2; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    for (const char* s : {"input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                          "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                          "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight",
                          "mlp.up_proj.weight", "mlp.down_proj.weight"})
      names.push_back(p + s);
  }
  if (!tied) names.push_back("lm_head.weight");
  return names;
}

std::vector<int64_t> qwen3_tiny_shape(const std::string& name) {
  const int64_t vocab = 259, d = 64, ff = 128, hd = 16, q = 4 * hd, kv = 2 * hd;
  auto ends = [&](const char* s) { return name.size() >= strlen(s) && name.compare(name.size() - strlen(s), strlen(s), s) == 0; };
  if (ends("embed_tokens.weight") || ends("lm_head.weight")) return {vocab, d};
  if (ends("layernorm.weight") || name == "model.norm.weight") return {d};
  if (ends("q_norm.weight") || ends("k_norm.weight")) return {hd};
  if (ends("q_proj.weight")) return {q, d};
  if (ends("k_proj.weight") || ends("v_proj.weight")) return {kv, d};
  if (ends("o_proj.weight")) return {d, q};
  if (ends("gate_proj.weight") || ends("up_proj.weight")) return {ff, d};
  if (ends("down_proj.weight")) return {d, ff};
  return {};
}

class GoldenFileTest : public ::testing::TestWithParam<bool> {};

TEST_P(GoldenFileTest, NamesShapesAndSanity) {
  const bool tied = GetParam();
  const std::string file_path =
      std::string(KILN_TEST_DATA_DIR) + "/golden/qwen3_tiny_" + (tied ? "tied" : "untied") + ".safetensors";
  ASSERT_TRUE(std::filesystem::exists(file_path)) << file_path;
  EXPECT_LT(std::filesystem::file_size(file_path), 1u << 20);
  const auto file = SafetensorsFile::open(file_path);

  // Metadata: the HF config, versions, and how the file was made.
  const auto config = nlohmann::json::parse(file.metadata("config"));
  EXPECT_EQ(config["vocab_size"], 259);
  EXPECT_EQ(config["hidden_size"], 64);
  EXPECT_EQ(config["num_hidden_layers"], 2);
  EXPECT_EQ(config["head_dim"], 16);
  EXPECT_EQ(config["tie_word_embeddings"], tied);
  EXPECT_FALSE(file.metadata("transformers_version").empty());
  EXPECT_FALSE(file.metadata("torch_version").empty());
  EXPECT_FALSE(file.metadata("generator").empty());

  // Every expected parameter, its gradient, and nothing else.
  std::set<std::string> expected = {"input_ids", "targets", "cu_seqlens", "logits", "loss"};
  for (const auto& name : qwen3_tiny_parameter_names(tied)) {
    SCOPED_TRACE(name);
    expected.insert(name);
    expected.insert("grad." + name);
    const auto& p = file.info(name);
    const auto& g = file.info("grad." + name);
    EXPECT_EQ(p.dtype, DType::f32);
    EXPECT_EQ(g.dtype, DType::f32);
    EXPECT_EQ(p.shape, qwen3_tiny_shape(name));
    EXPECT_EQ(g.shape, p.shape);
    OwnedTensor grad = read_tensor(file, "grad." + name, DType::f64);
    double norm = 0;
    for (int64_t i = 0; i < grad->numel(); ++i) {
      ASSERT_TRUE(std::isfinite(grad->data<double>()[i]));
      norm += grad->data<double>()[i] * grad->data<double>()[i];
    }
    EXPECT_GT(norm, 0.0);  // every parameter is actually exercised
  }
  const auto names = file.names();
  EXPECT_EQ(std::set<std::string>(names.begin(), names.end()), expected);

  // The packed batch: documents in cu_seqlens, BOS/EOS framing, -1 at each document end.
  const auto& ids_info = file.info("input_ids");
  ASSERT_EQ(ids_info.dtype, DType::i32);
  ASSERT_EQ(ids_info.shape.size(), 1u);
  const int64_t n = ids_info.shape[0];
  OwnedTensor ids = read_tensor(file, "input_ids", DType::i32);
  OwnedTensor targets = read_tensor(file, "targets", DType::i32);
  OwnedTensor cu = read_tensor(file, "cu_seqlens", DType::i32);
  ASSERT_EQ(targets->numel(), n);
  const int64_t docs = cu->numel() - 1;
  ASSERT_GE(docs, 2);
  EXPECT_EQ(cu->data<int32_t>()[0], 0);
  EXPECT_EQ(cu->data<int32_t>()[docs], n);
  int64_t counted = 0;
  for (int64_t s = 0; s < docs; ++s) {
    const int32_t b = cu->data<int32_t>()[s], e = cu->data<int32_t>()[s + 1];
    ASSERT_LT(b, e);
    EXPECT_EQ(ids->data<int32_t>()[b], 256);
    EXPECT_EQ(ids->data<int32_t>()[e - 1], 257);
    for (int32_t t = b; t < e; ++t) {
      ASSERT_GE(ids->data<int32_t>()[t], 0);
      ASSERT_LT(ids->data<int32_t>()[t], 259);
      EXPECT_EQ(targets->data<int32_t>()[t], t == e - 1 ? -1 : ids->data<int32_t>()[t + 1]);
      counted += t != e - 1;
    }
  }
  EXPECT_EQ(counted, n - docs);

  EXPECT_EQ(file.info("logits").shape, (std::vector<int64_t>{n, 259}));
  EXPECT_EQ(file.info("loss").shape, std::vector<int64_t>{1});
  OwnedTensor loss = read_tensor(file, "loss", DType::f64);
  const double l = loss->data<double>()[0];
  EXPECT_TRUE(std::isfinite(l));
  // Untrained but not degenerate: near ln(259) = 5.56, and not exactly uniform.
  EXPECT_GT(l, 2.0);
  EXPECT_LT(l, 12.0);
  EXPECT_GT(std::fabs(l - std::log(259.0)), 1e-3);

  // The loss agrees with the stored logits (mean cross-entropy over counted positions).
  OwnedTensor logits = read_tensor(file, "logits", DType::f64);
  double sum = 0;
  for (int64_t t = 0; t < n; ++t) {
    const int32_t y = targets->data<int32_t>()[t];
    if (y < 0) continue;
    const double* row = logits->data<double>() + t * 259;
    double mx = row[0];
    for (int v = 1; v < 259; ++v) mx = std::max(mx, row[v]);
    double z = 0;
    for (int v = 0; v < 259; ++v) z += std::exp(row[v] - mx);
    sum += std::log(z) + mx - row[y];
  }
  EXPECT_NEAR(sum / static_cast<double>(counted), l, 1e-5 * l);
}

INSTANTIATE_TEST_SUITE_P(Variants, GoldenFileTest, ::testing::Values(true, false),
                         [](const auto& info) { return info.param ? std::string("tied") : std::string("untied"); });

}  // namespace
}  // namespace kiln
