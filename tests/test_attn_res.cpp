// Block Attention Residuals (model.attn_res_block, nn/attn_res.h): the depth mix against a
// direct reference (a zero pseudo-query mixes the plain mean) and finite differences; every
// parameter of small models with completed and partial blocks against fp64 finite
// differences; f32 against f64; the decoder against the full forward; a GPU plan; the refusals
// (recompute, MTP, exports) naming the key; and a short training run through the binary that learns.
#include "export_fixture.h"
#include "full_forward.h"
#include "grad_check.h"
#include "infer/decoder.h"
#include "ops/attn_res/attn_res.h"
#include "test_util.h"
#include "tiny_model.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <tuple>
#include <vector>

namespace kiln {
namespace {

using namespace kiln::test;

std::vector<Tensor> views(const std::vector<OwnedTensor>& owned) {
  std::vector<Tensor> v;
  for (const OwnedTensor& o : owned) v.push_back(*o);
  return v;
}

// Four sources of 5 rows x 6 channels at different scales (the RMSNorm of the score sees
// through them), and a query.
std::vector<OwnedTensor> op_sources() {
  std::vector<OwnedTensor> s;
  for (int i = 0; i < 4; ++i) s.push_back(random_f64(Shape{5, 6}, 100 + i, 0.5 + i));
  return s;
}

TEST(AttnResMix, AZeroQueryMixesThePlainMean) {
  const std::vector<OwnedTensor> owned = op_sources();
  const std::vector<Tensor> sources = views(owned);
  const OwnedTensor query = filled_f64(Shape{6}, 0.0), out = nan_f64(Shape{5, 6});
  ops::attn_res_mix_forward(process_exec(), sources, *query, 1e-6, *out);
  const double* o = out->data<double>();
  for (int64_t i = 0; i < 30; ++i) {
    double mean = 0;
    for (const Tensor& s : sources) mean += s.data<double>()[i];
    mean /= 4;
    EXPECT_NEAR(o[i], mean, 1e-14 * (1 + std::abs(mean))) << i;
  }
}

// The softmax over depth by hand for one row, then the backward against finite differences
// of a weighted sum of the outputs, for every source element and the query.
TEST(AttnResMix, MatchesAReferenceAndFiniteDifferences) {
  const std::vector<OwnedTensor> owned = op_sources();
  const std::vector<Tensor> sources = views(owned);
  const OwnedTensor query = random_f64(Shape{6}, 7), out = nan_f64(Shape{5, 6});
  const double eps = 1e-6;
  ops::attn_res_mix_forward(process_exec(), sources, *query, eps, *out);
  const int64_t t = 3;  // one row by hand
  std::vector<double> z;
  for (const Tensor& s : sources) {
    const double* v = s.data<double>() + t * 6;
    double sq = 0, dot = 0;
    for (int j = 0; j < 6; ++j) sq += v[j] * v[j], dot += query->data<double>()[j] * v[j];
    z.push_back(dot / std::sqrt(sq / 6 + eps));
  }
  double total = 0;
  for (double x : z) total += std::exp(x);
  for (int j = 0; j < 6; ++j) {
    double expect = 0;
    for (size_t s = 0; s < sources.size(); ++s) expect += std::exp(z[s]) / total * sources[s].data<double>()[t * 6 + j];
    EXPECT_NEAR(out->data<double>()[t * 6 + j], expect, 1e-13) << j;
  }

  const OwnedTensor weights = random_f64(Shape{5, 6}, 9);
  std::vector<OwnedTensor> grads_owned;
  for (int i = 0; i < 4; ++i) grads_owned.push_back(filled_f64(Shape{5, 6}, 0.0));
  const OwnedTensor dquery = filled_f64(Shape{6}, 0.0);
  ops::attn_res_mix_backward(process_exec(), sources, *query, eps, *weights, views(grads_owned), *dquery);
  const EvalFn eval = [&](std::vector<double>& o) {
    ops::attn_res_mix_forward(process_exec(), sources, *query, eps, *out);
    o = values_of(*out);
  };
  const std::vector<double> w = values_of(*weights);
  const GradCheckOptions opt = model_grad_check_options();  // the five-point stencil
  for (size_t s = 0; s < sources.size(); ++s) {
    const GradCheckReport r = check_gradient(sources[s], values_of(*grads_owned[s]), eval, w, opt);
    EXPECT_TRUE(r.ok()) << "source " << s << ": " << r.str();
  }
  const GradCheckReport r = check_gradient(*query, values_of(*dquery), eval, w, opt);
  EXPECT_TRUE(r.ok()) << "query: " << r.str();
}

ModelConfig attn_res_config(int64_t layers, int64_t block, bool sandwich = false) {
  ModelConfig c = tiny_config(true, true);
  c.layers = layers;
  c.attn_res_block = block;
  c.sandwich_norms = sandwich;
  return c;
}

// Every parameter's gradient (the pseudo-queries included) against fp64 finite differences
// of the loss: 2 layers in blocks of 2 (completed blocks only), of 3 (a partial sum inside
// the first block, a partial block at the final read), and 3 layers in blocks of 4 with
// sandwich norms (the post-norms on the sublayer outputs).
TEST(AttnResModel, EveryParameterMatchesFiniteDifferences) {
  const std::vector<std::tuple<int64_t, int64_t, bool>> cases = {{2, 2, false}, {2, 3, false}, {3, 4, true}};
  for (const auto& [layers, block, sandwich] : cases) {
    SCOPED_TRACE(fmt::format("layers {} block {} sandwich {}", layers, block, sandwich));
    const ModelConfig config = attn_res_config(layers, block, sandwich);
    const HostBatch batch = pack_docs(three_docs(), 4);
    Model m(config, tiny_build(24, 7));
    m.allocate();
    init_tiny_model(m, 11);  // queries away from zero too (rank-1 zeros -> N(0, 0.2))
    m.load_batch(batch);
    const double scale = 1.0 / static_cast<double>(batch.target_count);
    ScopedCpuThreads one_thread(1);
    m.zero_grads();
    m.forward_backward(scale);
    expect_parameter_gradients_match(m, [&] { return m.evaluate_objective().loss * scale; });
    int64_t queries = 0;
    for (const auto& p : m.parameters()) {
      if (p->name().find("attn_res") != std::string::npos) {
        ++queries;
        EXPECT_GT(rms(values_of(p->grad())), 1e-6) << p->name() << " has no gradient";
      }
    }
    // One query per sublayer but the first (it reads the embedding alone) and the final read's.
    EXPECT_EQ(queries, 2 * layers);
    EXPECT_EQ(m.find_parameter("layers.0.attn_res.attn_query"), nullptr);
    EXPECT_NE(m.find_parameter("layers.0.attn_res.mlp_query"), nullptr);
    EXPECT_NE(m.find_parameter("attn_res.final_query"), nullptr);
  }
}

// At initialization (zero queries) layer 0's MLP reads the mean of the embedding and the
// attention's output: half the plain stream's h = embedding + attention output, the block
// weights being the same (they are initialized by index and the queries come after them).
TEST(AttnResModel, ZeroQueriesMixTheMeanOfTheSources) {
  const HostBatch batch = pack_docs(three_docs(), 4);
  Model plain(tiny_config(true, true), tiny_build(24, 7));
  Model mixed(attn_res_config(2, 2), tiny_build(24, 7));
  for (Model* m : {&plain, &mixed}) {
    m->allocate();
    m->init_weights(5);
    m->load_batch(batch);
    m->evaluate();
  }
  const int64_t rows = batch.size();
  const std::vector<double> h = values_of(plain.backbone().blocks()[0]->mlp_input(rows));
  const std::vector<double> mean = values_of(mixed.backbone().blocks()[0]->mlp_input(rows));
  ASSERT_EQ(h.size(), mean.size());
  for (size_t i = 0; i < h.size(); ++i) EXPECT_EQ(mean[i], h[i] / 2) << i;
  EXPECT_NE(plain.evaluate().loss, mixed.evaluate().loss);  // and from there on they differ
}

// The f32 path computes what the f64 one does, to f32's precision: loss and gradients.
TEST(AttnResModel, F32MatchesF64) {
  const HostBatch batch = pack_docs(three_docs(), 4);
  const ModelConfig config = attn_res_config(2, 3);
  BuildOptions o32 = tiny_build(24, 7);
  o32.dtype = DType::f32;
  Model m64(config, tiny_build(24, 7)), m32(config, o32);
  m64.allocate(), m32.allocate();
  init_tiny_model(m64, 11);
  for (size_t i = 0; i < m64.parameters().size(); ++i)
    copy_tensor(*to_f32(m64.parameters()[i]->value()), m32.parameters()[i]->value());
  const double scale = 1.0 / static_cast<double>(batch.target_count);
  for (Model* m : {&m64, &m32}) {
    m->load_batch(batch);
    m->zero_grads();
  }
  const double l64 = m64.forward_backward(scale).loss, l32 = m32.forward_backward(scale).loss;
  EXPECT_NEAR(l32, l64, 1e-5 * std::abs(l64));
  for (size_t i = 0; i < m64.parameters().size(); ++i) {
    const std::vector<double> g64 = values_of(m64.parameters()[i]->grad());
    EXPECT_LT(max_rel_diff(values_of(m32.parameters()[i]->grad()), g64, 1e-2 * rms(g64) + 1e-12), 1e-3)
        << m64.parameters()[i]->name();
  }
}

// The parameter count `kiln plan` prints from the same Model: the queries (2L x hidden), and
// the mixes' FLOPs (6 x hidden per source, forward and twice that back).
TEST(AttnResModel, PlanCountsTheQueriesAndTheMixes) {
  ModelConfig plain = tiny_config(true, true);
  plain.layers = 3;
  ModelConfig with = plain;
  with.attn_res_block = 4;
  const Model a(plain, tiny_build()), b(with, tiny_build());
  EXPECT_EQ(b.parameter_count() - a.parameter_count(), 2 * 3 * plain.hidden);
  // Sources of mixes 1 .. 6 in blocks of 4: 2, 2, 2, 2 (the embedding and block 0), 3, 3.
  EXPECT_DOUBLE_EQ(b.flops_per_token(16) - a.flops_per_token(16), 3.0 * 6.0 * 8 * 14);
  // And through the binary: layers 4 of hidden 192 in configs/default.toml, 8 queries.
  const auto parameters = [](const std::string& extra) {
    std::string output;
    EXPECT_EQ(run_command(kiln_binary() + " plan " + source_dir() + "/configs/default.toml --set train.device=cpu" +
                              extra, &output),
              0)
        << output;
    const size_t at = output.find("parameters ");
    EXPECT_NE(at, std::string::npos) << output;
    int64_t n = 0;
    for (size_t i = at + 11; i < output.size() && output[i] != '('; ++i)
      if (output[i] >= '0' && output[i] <= '9') n = 10 * n + (output[i] - '0');
    return n;
  };
  EXPECT_EQ(parameters(" --set model.attn_res_block=4") - parameters(""), 8 * 192);
}

// Planning a GPU model allocates nothing (no GPU needed): fp32 and the mixed path plan with
// the CPU model's parameters (their numbers: tests/gpu/test_gpu_attn_res.cpp).
TEST(AttnResModel, GpuPlansRecomputeAndMtpAreRefusedNamingTheKey) {
  const Model cpu(attn_res_config(2, 2), tiny_build());
  for (DType dtype : {DType::f32, DType::bf16}) {
    BuildOptions gpu = tiny_build();
    gpu.device = Device::cuda, gpu.dtype = dtype;
    const Model m(attn_res_config(2, 2), gpu);
    ASSERT_EQ(m.parameters().size(), cpu.parameters().size());
    for (size_t i = 0; i < cpu.parameters().size(); ++i) EXPECT_EQ(m.parameters()[i]->name(), cpu.parameters()[i]->name());
  }
  // The GPU kernel mixes at most 32 sources: full AttnRes over 15 layers has 31 at the final
  // read (the embedding and 30 one-sublayer blocks), over 16 layers 33.
  BuildOptions gpu = tiny_build();
  gpu.device = Device::cuda, gpu.dtype = DType::f32;
  EXPECT_NO_THROW({ const Model m(attn_res_config(15, 1), gpu); });
  const std::string e = error_of([&] { const Model m(attn_res_config(16, 1), gpu); });
  EXPECT_EQ(e.rfind("[model.attn_res_block] ", 0), 0u) << e;
  EXPECT_NE(e.find("33 sources"), std::string::npos) << e;
  EXPECT_EQ(std::count(e.begin(), e.end(), '\n'), 0) << e;
  // Neither recompute (it reruns a block from the residual stream) nor MTP yet.
  BuildOptions recompute = tiny_build();
  recompute.recompute_blocks = 1;
  const std::string r = error_of([&] { const Model m(attn_res_config(2, 2), recompute); });
  EXPECT_EQ(r.rfind("[model.attn_res_block] ", 0), 0u) << r;
  ModelConfig mtp = attn_res_config(2, 2);
  mtp.mtp.depth = 1;
  const std::string t = error_of([&] { const Model m(mtp, tiny_build()); });
  EXPECT_EQ(t.rfind("[model.attn_res_block] ", 0), 0u) << t;
}

// The mix runs over depth only, so the decoder needs no cache of its own: each step's rows
// of the slot script (chunked prefill beside single tokens, a reused slot, a fork; see
// full_forward.h) give the full forward's logits of their prefixes. Blocks of 4 over 3
// layers (a partial block at the final read) and of 3 over 2 with sandwich norms.
TEST(AttnResModel, DecoderMatchesFullForward) {
  const std::vector<std::tuple<int64_t, int64_t, bool>> cases = {{3, 4, false}, {2, 3, true}};
  for (const auto& [layers, block, sandwich] : cases) {
    SCOPED_TRACE(fmt::format("layers {} block {} sandwich {}", layers, block, sandwich));
    BuildOptions o = tiny_build(16);
    o.training = false;
    Model model(attn_res_config(layers, block, sandwich), o);
    model.allocate();
    init_tiny_model(model, 3);
    DecoderOptions d;
    d.slots = 2;
    d.max_rows = 6;
    Decoder decoder(model, d);
    const double worst = slot_script_decode_error(model, decoder);
    EXPECT_LT(worst, 1e-6) << "decoder logits vs full forward";  // f64 math, logits as f32
    std::printf("attn_res decode: %d logit rows, worst scaled error %.2e\n", kSlotScriptRows, worst);
  }
}

TEST(AttnResModel, ExportsAreRefusedNamingTheKey) {
  const std::string root = temp_dir("kiln-export-attn-res");
  ModelConfig c = tiny_config(true, false, false);  // export_fixture.h's Qwen3-shaped model
  c.attn_res_block = 2;
  const std::string model = save_random_model(c, root + "/model");
  expect_exports_refused(model, root, "model.attn_res_block = 2");
  std::filesystem::remove_all(root);
}

// A short run on the bundled corpus through the binary: the key parses, the queries train
// (role norm) and the loss falls well below its start.
TEST(AttnResModel, ShortTrainingRunLearns) {
  const std::string dir = temp_dir("kiln-train-attn-res");
  const std::string command =
      kiln_binary() + " train " + source_dir() + "/configs/default.toml --set data.path=" + source_dir() +
      "/data/tinyshakespeare.txt --set train.out_dir=" + dir +
      " --set model.hidden=64 --set model.layers=3 --set model.heads=4 --set model.kv_heads=2"
      " --set model.head_dim=16 --set model.ffn_hidden=128 --set model.max_seq_len=128 --set model.attn_res_block=4"
      " --set train.micro_batch_tokens=1024 --set train.steps=200 --set optim.warmup_steps=20 --set optim.lr=3e-3"
      " --set train.eval_every=0 --set train.eval_batches=2 --set train.sample_every=0 --set train.sample_tokens=0"
      " --set log.every=50 --set train.threads=2 --set checkpoint.every=0";
  std::string output;
  ASSERT_EQ(run_command(command, &output), 0) << output;
  std::vector<double> losses;
  std::ifstream metrics(dir + "/metrics.jsonl");
  std::string line;
  while (std::getline(metrics, line)) {
    const auto j = nlohmann::json::parse(line);
    if (j["kind"] == "train") losses.push_back(j["loss"].get<double>());
  }
  ASSERT_EQ(losses.size(), 4u) << output;  // steps 50, 100, 150, 200
  std::printf("attn_res training losses: %.4f %.4f %.4f %.4f\n", losses[0], losses[1], losses[2], losses[3]);
  EXPECT_GT(losses.front(), losses.back() + 0.3) << output;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace kiln
