// KV-cache decoding: the Decoder's next-token logits equal the full forward's
// (Model::logits) for prefill chunks, single-token steps and batches that mix sequences;
// fp64 to ~1e-12, fp32 to ~1e-5. Plus the Generator's batching invariance, stop strings,
// prompt logprobs and limits.
#include "export_fixture.h"
#include "greedy_steps.h"
#include "infer/generator.h"
#include "full_forward.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <numeric>

namespace kiln {
namespace {

using test::full_forward_last;
using test::scaled_diff;
using test::random_tokens;

ModelConfig small_config(bool qk_norm, bool tied, bool bias, const std::string& position = "rope") {
  ModelConfig c;
  c.vocab_size = 259;
  c.hidden = 48;
  c.layers = 2;
  c.heads = 4;
  c.kv_heads = 2;
  c.head_dim = 16;  // != hidden / heads
  c.ffn_hidden = 96;
  c.max_seq_len = 96;
  c.qk_norm = qk_norm;
  c.tie_embeddings = tied;
  c.attention_bias = bias;
  c.position = position;
  return c;
}

// Every parameter random (norm gains around 1), so no part of the math is trivial.
void randomize(Model& model, uint64_t seed) {
  int i = 0;
  for (const auto& p : model.parameters()) {
    const Tensor v = p->value();
    const bool gain = p->name().find("norm") != std::string::npos;
    OwnedTensor r = test::random_tensor(v.dtype(), v.shape(), seed + static_cast<uint64_t>(i++), gain ? 0.2 : 0.3);
    for (int64_t j = 0; gain && j < v.numel(); ++j) {
      if (v.dtype() == DType::f32) r->data<float>()[j] += 1.0f;
      else r->data<double>()[j] += 1.0;
    }
    copy_tensor(*r, v);
  }
}

// An inference-only model of `config` on the CPU (fp32), every parameter random from
// `seed` (randomize); seed 0 leaves the weights as allocated.
std::unique_ptr<Model> inference_model(const ModelConfig& config, uint64_t seed, int64_t max_tokens = 8) {
  BuildOptions o;
  o.training = false;
  o.max_tokens = max_tokens;
  auto model = std::make_unique<Model>(config, o);
  model->allocate();
  if (seed != 0) randomize(*model, seed);
  return model;
}

// Three sequences decoded together in a cache of 3 slots: prompts prefilled in chunks of at
// most 5 rows that mix sequences, then single-token steps for all three at once. Each new
// row's logits must equal the full forward over that sequence's prefix.
void check_decoder_matches(const ModelConfig& config, DType dtype, double tolerance) {
  BuildOptions o;
  o.dtype = dtype;
  o.training = false;
  o.max_tokens = config.max_seq_len;
  o.loss_chunk_rows = 16;
  Model model(config, o);
  model.allocate();
  randomize(model, 11);
  DecoderOptions d;
  d.slots = 3;
  d.max_rows = 5;
  d.logit_rows = 2;  // several logit chunks per call
  Decoder decoder(model, d);
  const size_t bytes = decoder.memory_bytes();
  // The attention components' decode state: a K and a V cache per layer, nothing else.
  const auto cache_elems = 2 * config.layers * d.slots * config.max_seq_len * config.kv_heads * config.head_dim;
  const size_t cache_bytes = static_cast<size_t>(cache_elems) * dtype_size(dtype);
  EXPECT_GE(decoder.state_bytes(), cache_bytes);
  EXPECT_LT(decoder.state_bytes(), cache_bytes + 2 * config.layers * kAlignment);  // each tensor aligned

  std::vector<std::vector<int32_t>> seqs = {random_tokens(7, 1), random_tokens(3, 2), random_tokens(12, 3)};
  const std::vector<size_t> prompt = {7, 3, 12};
  std::vector<size_t> cached(3, 0);
  double worst = 0;
  int checked = 0;
  // Prefill: walk through the prompts 5 rows at a time across sequences.
  for (;;) {
    std::vector<int32_t> tok, slot, pos, rows;
    std::vector<int> owner;
    for (int s = 0; s < 3 && tok.size() < 5; ++s)
      while (cached[s] < prompt[s] && tok.size() < 5) {
        tok.push_back(seqs[s][cached[s]]), slot.push_back(s), pos.push_back(static_cast<int32_t>(cached[s]));
        owner.push_back(s);
        ++cached[s];
      }
    if (tok.empty()) break;
    rows.resize(tok.size());
    std::iota(rows.begin(), rows.end(), 0);
    decoder.forward(tok, slot, pos);
    std::vector<float> logits;
    decoder.logits(rows, logits);
    for (size_t r = 0; r < tok.size(); ++r) {
      const std::vector<int32_t> prefix(seqs[owner[r]].begin(), seqs[owner[r]].begin() + pos[r] + 1);
      const std::vector<float> want = full_forward_last(model, prefix);
      worst = std::max(worst, scaled_diff(logits.data() + r * want.size(), want.data(), static_cast<int64_t>(want.size())));
      ++checked;
    }
  }
  // Decode: 6 steps, one new token per sequence per step (greedy from the decoder).
  std::vector<float> logits;
  for (int step = 0; step < 6; ++step) {
    std::vector<int32_t> tok, slot, pos, rows = {0, 1, 2};
    for (int s = 0; s < 3; ++s) {
      tok.push_back(seqs[s].back()), slot.push_back(s), pos.push_back(static_cast<int32_t>(seqs[s].size() - 1));
    }
    if (step > 0) {
      decoder.forward(tok, slot, pos);
      decoder.logits(rows, logits);
      for (int s = 0; s < 3; ++s) {
        const std::vector<float> want = full_forward_last(model, seqs[s]);
        worst = std::max(worst, scaled_diff(logits.data() + s * want.size(), want.data(), 259));
        ++checked;
      }
    } else {  // the last prompt rows again: rewrites the same K/V, gives the first logits
      decoder.forward(tok, slot, pos);
      decoder.logits(rows, logits);
    }
    for (int s = 0; s < 3; ++s) {
      const float* row = logits.data() + s * 259;
      seqs[s].push_back(static_cast<int32_t>(std::max_element(row, row + 259) - row));
    }
  }
  EXPECT_LT(worst, tolerance) << "decoder logits vs full forward";
  EXPECT_EQ(checked, 22 + 15);
  EXPECT_EQ(decoder.memory_bytes(), bytes);
  std::printf("%s %s: %d logit rows, worst scaled error %.2e\n", dtype == DType::f64 ? "f64" : "f32",
              config.qk_norm ? "qk_norm" : "no qk_norm", checked, worst);
}

// A window shorter than the sequences (up to 18 tokens here) and both softcaps, small enough
// to bite: the cache's attention and the head must apply them as the full forward does.
ModelConfig windowed_softcapped_config() {
  ModelConfig c = small_config(true, false, false);
  c.sliding_window = 5;
  c.attention_softcap = 2.0;
  c.logit_softcap = 8.0;
  return c;
}

// A per-layer pattern over 3 layers: layers 0 and 2 windowed (5 tokens), layer 1 full
// attention and NoPE, layer 2's MLP a GeGLU, every norm a LayerNorm with bias (or, with
// `rms`, the RMSNorm the GPU's fused decode kernels fold in).
ModelConfig layer_pattern_config(bool rms = false) {
  ModelConfig c = small_config(true, false, false);
  c.layers = 3;
  c.sliding_window = 5;
  c.full_attention_layers = "1";
  c.nope_layers = "1";
  c.alt_mlp = "geglu";
  c.alt_mlp_layers = "from:2";
  if (!rms) c.norm = "layernorm";
  return c;
}

// Gemma's RMSNorm (and its sqrt(hidden) embedding scale) or DyT as every norm and as the q/k
// norm, with an ungated MLP in every layer but the last (a gated one there: the two kinds
// side by side).
ModelConfig breadth_config(const std::string& norm, const std::string& mlp) {
  ModelConfig c = small_config(true, false, false);
  c.layers = 3;
  c.norm = norm;
  c.qk_norm_type = norm;
  c.mlp = mlp;
  c.ungated_ffn_hidden = 80;
  c.alt_mlp = "swiglu";
  c.alt_mlp_layers = "from:2";
  if (norm == "gemma_rmsnorm") c.embed_scale = std::sqrt(static_cast<double>(c.hidden));  // Gemma's
  return c;
}

// Partial rotary: a quarter of the 16 head dims rotated, by YaRN-scaled tables whose
// pass-through columns the decode path must read as the full forward does.
ModelConfig partial_rotary_config() {
  ModelConfig c = small_config(true, false, false);
  c.rope = {.scaling = "yarn", .factor = 4.0, .original_max_seq_len = 8, .fraction = 0.25};
  return c;
}

// Gemma 2/3's block shape: sandwich norms of Gemma's RMSNorm around a GeGLU MLP, windowed
// layers rotating by a local base of their own (Gemma 3) beside a global layer.
ModelConfig gemma_config() {
  ModelConfig c = small_config(true, false, false);
  c.layers = 3;
  c.norm = "gemma_rmsnorm";
  c.qk_norm_type = "gemma_rmsnorm";
  c.mlp = "geglu";
  c.sandwich_norms = true;
  c.embed_scale = std::sqrt(static_cast<double>(c.hidden));
  c.sliding_window = 5;
  c.full_attention_layers = "every:3";
  c.rope_theta = 1e6;
  c.rope.local_theta = 10.0;
  return c;
}

TEST(Decoder, SandwichNormsAndLocalRopeBaseMatchFullForward) {
  check_decoder_matches(gemma_config(), DType::f64, 1e-12);
  check_decoder_matches(gemma_config(), DType::f32, 2e-5);
  ModelConfig rms = gemma_config();  // the norm whose fused decode kernels the GPU folds in
  rms.norm = "rmsnorm";
  check_decoder_matches(rms, DType::f64, 1e-12);
}

// Attention sinks (GPT-OSS): the cache's softmax takes each head's sink as the full
// forward's does, with a window and softcaps (windowed_softcapped_config) and without.
TEST(Decoder, AttentionSinksMatchFullForward) {
  for (bool windowed : {false, true}) {
    SCOPED_TRACE(windowed ? "windowed, softcapped" : "plain");
    ModelConfig c = windowed ? windowed_softcapped_config() : small_config(true, false, false);
    c.attention_sinks = true;
    check_decoder_matches(c, DType::f64, 1e-12);
    check_decoder_matches(c, DType::f32, 2e-5);
  }
}

TEST(Decoder, PartialRotaryMatchesFullForward) {
  check_decoder_matches(partial_rotary_config(), DType::f64, 1e-12);
  check_decoder_matches(partial_rotary_config(), DType::f32, 2e-5);
}

// The DyT model's f32 bar is wider: DyT rescales nothing (q and k included) and relu2
// squares, so rounding differences between the decoder's one-row products and the full
// forward's batched ones grow more than in a normalized model. Measured 3.4e-6 with
// OpenBLAS's SkylakeX kernels and 7.0e-5 with its Haswell ones (an AMD EPYC); the f64 check
// at 1e-12 is the one that says decode computes the same function.
TEST(Decoder, BreadthComponentsMatchFullForward) {
  for (const auto& [norm, mlp] : {std::pair<const char*, const char*>{"gemma_rmsnorm", "gelu"}, {"dyt", "relu2"}}) {
    SCOPED_TRACE(fmt::format("{} {}", norm, mlp));
    check_decoder_matches(breadth_config(norm, mlp), DType::f64, 1e-12);
    check_decoder_matches(breadth_config(norm, mlp), DType::f32, std::string(norm) == "dyt" ? 2e-4 : 2e-5);
  }
}

TEST(Decoder, MatchesFullForwardF64) {
  check_decoder_matches(small_config(true, true, false), DType::f64, 1e-12);
  check_decoder_matches(small_config(false, false, true), DType::f64, 1e-12);
  check_decoder_matches(small_config(false, true, false, "none"), DType::f64, 1e-12);
  check_decoder_matches(windowed_softcapped_config(), DType::f64, 1e-12);
  check_decoder_matches(layer_pattern_config(), DType::f64, 1e-12);
  check_decoder_matches(layer_pattern_config(true), DType::f64, 1e-12);
}

TEST(Decoder, MatchesFullForwardF32) {
  check_decoder_matches(small_config(true, false, false), DType::f32, 2e-5);
  check_decoder_matches(small_config(false, true, true), DType::f32, 2e-5);
  check_decoder_matches(windowed_softcapped_config(), DType::f32, 2e-5);
  check_decoder_matches(layer_pattern_config(), DType::f32, 2e-5);
}

TEST(Decoder, RejectsBadSteps) {
  const auto model = inference_model(small_config(true, true, false), 0);
  DecoderOptions d;
  d.slots = 2;
  d.max_rows = 4;
  d.max_len = 16;
  Decoder decoder(*model, d);
  EXPECT_EQ(decoder.max_len(), 16);
  const std::vector<int32_t> one{5}, zero{0};
  EXPECT_THROW(decoder.forward(one, std::vector<int32_t>{2}, zero), Error);              // slot out of range
  EXPECT_THROW(decoder.forward(one, zero, std::vector<int32_t>{16}), Error);             // position past the cache
  EXPECT_THROW(decoder.forward(std::vector<int32_t>(5, 1), std::vector<int32_t>(5, 0),  // more rows than planned
                               std::vector<int32_t>(5, 0)),
               Error);
  EXPECT_THROW(decoder.forward(std::vector<int32_t>{300}, zero, zero), Error);           // token outside the vocab
}

// greedy_chain(k) yields the tokens of k greedy steps taken one by one, and refuses what
// it cannot chain. (On the CPU it takes them one by one as well; tests/gpu checks the
// device's chain against single steps.)
TEST(Decoder, GreedyChainEqualsSingleSteps) {
  const auto model = inference_model(small_config(true, true, false), 5);
  DecoderOptions d;
  d.slots = 3;
  d.max_rows = 32;
  d.max_len = 40;
  d.chain_steps = 4;
  Decoder decoder(*model, d);
  const std::vector<std::vector<int32_t>> prompts = {random_tokens(7, 1), random_tokens(3, 2), random_tokens(11, 3)};
  const std::vector<int32_t> single = test::greedy_tokens(decoder, prompts, 10, 1);
  EXPECT_EQ(test::greedy_tokens(decoder, prompts, 10, 4), single);  // chains of 4, 4 and 2
  EXPECT_EQ(test::greedy_tokens(decoder, prompts, 10, 3), single);
  std::vector<int32_t> ids;
  EXPECT_THROW(decoder.greedy_chain(0, ids), Error);
  EXPECT_THROW(decoder.greedy_chain(5, ids), Error);  // past chain_steps
  const std::vector<int32_t> two{1, 2}, same_slot{0, 0}, at{0, 1};
  decoder.forward(two, same_slot, at);  // two rows of one sequence: not a decode step
  EXPECT_THROW(decoder.greedy_chain(2, ids), Error);
  decoder.forward(std::vector<int32_t>{1}, std::vector<int32_t>{0}, std::vector<int32_t>{38});
  EXPECT_NO_THROW(decoder.greedy_chain(2, ids));  // positions 38 and 39
  decoder.forward(std::vector<int32_t>{1}, std::vector<int32_t>{0}, std::vector<int32_t>{38});
  EXPECT_THROW(decoder.greedy_chain(3, ids), Error);  // position 40 is past the cache
}

// ---- sampling ---------------------------------------------------------------------------

TEST(Sampling, ProcessorsFollowTheirDefinitions) {
  Sampler sampler;
  Rng rng(7);
  const std::vector<float> base = {std::log(0.5f), std::log(0.3f), std::log(0.2f)};
  auto draw = [&](SamplingParams p, int n, std::vector<int32_t> context = {}) {
    std::vector<int> counts(3, 0);
    for (int i = 0; i < n; ++i) {
      std::vector<float> l = base;
      ++counts[static_cast<size_t>(sampler.sample(l, context, p, rng))];
    }
    return counts;
  };
  SamplingParams p;
  auto c = draw(p, 20000);  // plain sampling follows the softmax
  EXPECT_NEAR(c[0] / 20000.0, 0.5, 0.015);
  EXPECT_NEAR(c[1] / 20000.0, 0.3, 0.015);
  EXPECT_NEAR(c[2] / 20000.0, 0.2, 0.015);
  p.top_k = 2;
  EXPECT_EQ(draw(p, 2000)[2], 0);
  p = {};
  p.top_p = 0.75;  // 0.5 + 0.3 reaches 0.75
  c = draw(p, 4000);
  EXPECT_EQ(c[2], 0);
  EXPECT_NEAR(c[0] / 4000.0, 0.5 / 0.8, 0.03);
  p = {};
  p.min_p = 0.5;  // 0.2 < 0.5 * 0.5
  c = draw(p, 2000);
  EXPECT_EQ(c[2], 0);
  EXPECT_GT(c[1], 0);
  p = {};
  p.temperature = 0;
  EXPECT_EQ(draw(p, 10)[0], 10);
  p.repetition_penalty = 4;  // token 0 seen: 0.5 -> log(0.5) * 4 (negative logit multiplied)
  EXPECT_EQ(draw(p, 10, {0, 0})[1], 10);
  p = {};
  p.temperature = 0.05;  // sharpened: almost always the best
  EXPECT_GT(draw(p, 1000)[0], 990);
  SamplingParams bad;
  bad.top_p = 0;
  EXPECT_THROW(bad.validate(), Error);
}

TEST(Sampling, SameSeedSameDraws) {
  Sampler a, b;
  Rng ra(3), rb(3);
  SamplingParams p;
  p.top_k = 50;
  p.top_p = 0.95;
  const std::vector<int32_t> none;
  for (int i = 0; i < 200; ++i) {
    std::vector<float> la(259);
    for (size_t j = 0; j < la.size(); ++j) la[j] = static_cast<float>(std::sin(0.37 * (j + 1) * (i + 1)));
    std::vector<float> lb = la;
    EXPECT_EQ(a.sample(la, none, p, ra), b.sample(lb, none, p, rb));
  }
}

// ---- generator ----------------------------------------------------------------------------

struct GenFixture {
  std::unique_ptr<Model> model;
  std::unique_ptr<Decoder> decoder;
  ByteTokenizer tokenizer;
  GenFixture(int64_t slots, int64_t max_rows) {
    model = inference_model(small_config(true, true, false), 5, 96);
    DecoderOptions d;
    d.slots = slots;
    d.max_rows = max_rows;
    decoder = std::make_unique<Decoder>(*model, d);
  }
};

GenerationRequest greedy(const std::string& text, int64_t n) {
  GenerationRequest r;
  r.prompt.push_back(ByteTokenizer::kBos);
  for (unsigned char c : text) r.prompt.push_back(c);
  r.max_tokens = n;
  r.sampling.temperature = 0;
  r.stop_at_eos = false;
  return r;
}

TEST(Generator, BatchedEqualsAloneAndStopsWhereAsked) {
  GenFixture batched(3, 8), alone(1, 8);
  Generator gb(*batched.decoder, batched.tokenizer), ga(*alone.decoder, alone.tokenizer);
  const std::vector<std::string> prompts = {"Hello there", "x", "a much longer prompt than the others", "zz"};
  std::vector<GenerationRequest> requests;
  for (const auto& p : prompts) requests.push_back(greedy(p, 12));
  // 4 requests on 3 slots: the fourth waits for a free slot; prefill chunks of 8 rows.
  const auto together = gb.run(requests);
  for (size_t i = 0; i < prompts.size(); ++i) {
    const auto single = ga.run({requests[i]});
    EXPECT_EQ(together[i].tokens, single[0].tokens) << prompts[i];
    EXPECT_EQ(together[i].tokens.size(), 12u);
    EXPECT_EQ(together[i].finish_reason, "length");
  }
  // A stop string taken from the greedy continuation cuts the text before it.
  const std::string text = together[0].text;
  ASSERT_GE(text.size(), 6u);
  GenerationRequest r = requests[0];
  r.stop = {text.substr(3, 2)};
  const auto stopped = ga.run({r});
  EXPECT_EQ(stopped[0].finish_reason, "stop");
  EXPECT_EQ(stopped[0].text, text.substr(0, text.find(text.substr(3, 2))));
  EXPECT_TRUE(gb.idle());
  // Greedy rows without logprobs take the decoder's argmax; with logprobs their logits come
  // back and the sampler picks: the same tokens, and each reported logprob is the row's best.
  std::vector<GenerationRequest> with_logprobs = requests;
  for (auto& q : with_logprobs) q.logprobs = true, q.top_logprobs = 2;
  const auto sampled = gb.run(with_logprobs);
  for (size_t i = 0; i < prompts.size(); ++i) {
    EXPECT_EQ(sampled[i].tokens, together[i].tokens) << prompts[i];
    ASSERT_EQ(sampled[i].logprobs.size(), sampled[i].tokens.size());
    for (const TokenLogprob& lp : sampled[i].logprobs) {
      ASSERT_FALSE(lp.top.empty());
      EXPECT_EQ(lp.top[0].first, lp.token);
    }
  }
}

TEST(Generator, PromptLogprobsEqualTheFullForward) {
  GenFixture f(2, 4);
  Generator g(*f.decoder, f.tokenizer);
  GenerationRequest r = greedy("logprobs!", 0);
  r.prompt_logprobs = true;
  r.top_logprobs = 3;
  const auto result = g.run({r})[0];
  ASSERT_EQ(result.prompt_logprobs.size(), r.prompt.size());
  EXPECT_TRUE(std::isnan(result.prompt_logprobs[0].logprob));
  EXPECT_TRUE(result.tokens.empty());
  for (size_t p = 1; p < r.prompt.size(); ++p) {
    const std::vector<int32_t> prefix(r.prompt.begin(), r.prompt.begin() + static_cast<std::ptrdiff_t>(p));
    std::vector<double> lp;
    log_softmax(full_forward_last(*f.model, prefix), lp);
    EXPECT_NEAR(result.prompt_logprobs[p].logprob, lp[static_cast<size_t>(r.prompt[p])], 1e-4);
    ASSERT_EQ(result.prompt_logprobs[p].top.size(), 3u);
    EXPECT_GE(result.prompt_logprobs[p].top[0].second, result.prompt_logprobs[p].top[1].second);
  }
}

TEST(Generator, RefusesWhatCannotRun) {
  GenFixture f(1, 4);
  Generator g(*f.decoder, f.tokenizer);
  EXPECT_NO_THROW(g.submit(greedy("", 0), nullptr));  // BOS alone is a prompt
  GenerationRequest empty;
  EXPECT_THROW(g.submit(empty, nullptr), Error);
  EXPECT_THROW(g.submit(greedy(std::string(90, 'a'), 10), nullptr), Error);  // 91 + 10 > 96
  GenerationRequest bad = greedy("a", 1);
  bad.prompt.push_back(259);
  EXPECT_THROW(g.submit(bad, nullptr), Error);
}

// `kiln sample` with a batch: two prompts x two samples, greedy, so each prompt's two samples
// agree and every output starts with its prompt.
TEST(SampleCli, BatchOfPromptsGreedy) {
  const std::string root = test::temp_dir("kiln-sample-cli");
  const std::string model = test::save_random_model(test::tiny_config(true, true, false), root + "/model");
  std::string out;
  ASSERT_EQ(test::run_command(test::kiln_binary() + " sample " + model +
                                  " -p 'ab' -p 'xyz' --count 2 -t 0 -n 6 --ignore-eos --threads 1 --stop QQ",
                              &out),
            0)
      << out;
  std::vector<std::string> parts;
  for (size_t at = 0;;) {
    const size_t next = out.find("---\n", at);
    parts.push_back(out.substr(at, next == std::string::npos ? std::string::npos : next - at));
    if (next == std::string::npos) break;
    at = next + 4;
  }
  ASSERT_EQ(parts.size(), 4u) << out;
  EXPECT_EQ(parts[0].rfind("ab", 0), 0u);
  EXPECT_EQ(parts[2].rfind("xyz", 0), 0u);
  EXPECT_EQ(parts[0], parts[1]);
  EXPECT_EQ(parts[2], parts[3]);
  std::filesystem::remove_all(root);
}

// `kiln bench-decode` on the CPU: one table row and one JSON line per batch size, with the
// step time, the queued steps' time and the floor they are compared with.
TEST(BenchDecodeCli, ReportsEachBatchWithItsQueuedTime) {
  const std::string root = test::temp_dir("kiln-bench-decode-cli");
  const std::string json = root + "/decode.jsonl";
  std::string out;
  ASSERT_EQ(test::run_command(test::kiln_binary() + " bench-decode " + test::source_dir() +
                                  "/configs/default.toml --batch 1 --batch 3 --prompt 5 --tokens 4 --warmup 2 "
                                  "--copy-mib 8 --set train.threads=1 --json " + json,
                              &out),
            0)
      << out;
  EXPECT_NE(out.find("queued ms"), std::string::npos) << out;
  std::ifstream in(json);
  std::vector<nlohmann::json> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(lines.size(), 2u) << out;
  for (size_t i = 0; i < lines.size(); ++i) {
    const nlohmann::json& r = lines[i];
    EXPECT_EQ(r["batch"], i == 0 ? 1 : 3);
    EXPECT_EQ(r["variant"], "ops");  // the CPU's decoder runs the ops one by one
    EXPECT_GT(r["ms_per_token"].get<double>(), 0.0);
    EXPECT_GT(r["queued_ms_per_step"].get<double>(), 0.0);
    EXPECT_GT(r["floor_ms"].get<double>(), 0.0);
    EXPECT_NEAR(r["x_floor"].get<double>(), r["ms_per_token"].get<double>() / r["floor_ms"].get<double>(), 1e-9);
    EXPECT_EQ(r["first_tokens"].size(), 4u);
  }
  std::filesystem::remove_all(root);
}

}  // namespace
}  // namespace kiln
