// ZB-H1's split backward on the CPU (docs/distributed.md, "Pipeline schedules"): times the
// forward (F), the input pass (B), the weight pass (W) and the whole backward (BW) of the
// model's stages, then runs the schedule simulator with those times for 1F1B and ZB-H1 at
// `stages` ranks, 8 and 16 micro-batches. The actions run one after another on one thread:
// this machine cannot run 4 ranks' arithmetic side by side, so the bubble is the
// simulator's, from measured action times, not a pipeline's wall clock.
//
// Usage: pipeline_split_bench [hidden=512] [layers=8] [tokens=1024] [stages=4] [reps=4]
#include "model/model.h"
#include "train/pipeline_model_stage.h"
#include "train/pipeline_schedule.h"
#include "train/pipeline_simulator.h"

#include <fmt/format.h>
#include <omp.h>

#include <chrono>
#include <cstdlib>
#include <random>
#include <vector>

using namespace kiln;
using Clock = std::chrono::steady_clock;

namespace {

HostBatch random_batch(int64_t tokens, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  HostBatch b;
  const int64_t seq = 256;  // packed sequences of 256 tokens
  for (int64_t t = 0; t < tokens; ++t) {
    b.tokens.push_back(static_cast<int32_t>(rng() % vocab));
    b.targets.push_back(static_cast<int32_t>(rng() % vocab));
    b.positions.push_back(static_cast<int32_t>(t % seq));
    if (t % seq == 0) b.cu_seqlens.push_back(static_cast<int32_t>(t));
  }
  b.cu_seqlens.push_back(static_cast<int32_t>(tokens));
  b.max_seqlen = static_cast<int32_t>(std::min(seq, tokens));
  b.target_count = b.document_tokens = tokens;
  return b;
}

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

struct Times {
  std::vector<double> f, b, w;  // per stage, summed over the micro-batches
};

// Micro-batch after micro-batch: every stage's forward, then every stage's backward (last
// stage first), the input pass then the weight pass: one thread plays every rank.
Times run(Model& model, const std::vector<int64_t>& bounds, const std::vector<HostBatch>& batches, bool split) {
  const int stages = static_cast<int>(bounds.size()) - 1, reps = static_cast<int>(batches.size());
  pipeline::ModelStage stage(model, bounds, batches, 1.0 / (static_cast<double>(batches[0].size()) * reps));
  stage.split_backward(split);
  Times t{std::vector<double>(stages), std::vector<double>(stages), std::vector<double>(stages)};
  std::vector<std::vector<unsigned char>> act(static_cast<size_t>(stages) + 1), grad(static_cast<size_t>(stages) + 1);
  for (int s = 0; s <= stages; ++s) {
    act[static_cast<size_t>(s)].resize(static_cast<size_t>(stage.input_bytes(s)));
    grad[static_cast<size_t>(s)].resize(static_cast<size_t>(stage.input_bytes(s)));
  }
  for (int m = 0; m < reps; ++m) {
    for (int s = 0; s < stages; ++s) {
      const auto start = Clock::now();
      stage.forward(m, s, s == 0 ? nullptr : act[static_cast<size_t>(s)].data(),
                    s + 1 < stages ? act[static_cast<size_t>(s) + 1].data() : nullptr);
      t.f[static_cast<size_t>(s)] += seconds_since(start);
    }
    for (int s = stages - 1; s >= 0; --s) {
      auto start = Clock::now();
      stage.backward_input(m, s, s + 1 < stages ? grad[static_cast<size_t>(s) + 1].data() : nullptr,
                           s > 0 ? grad[static_cast<size_t>(s)].data() : nullptr);
      t.b[static_cast<size_t>(s)] += seconds_since(start);
      start = Clock::now();
      stage.backward_weight(m, s);
      t.w[static_cast<size_t>(s)] += seconds_since(start);
    }
  }
  return t;
}

}  // namespace

int main(int argc, char** argv) {
  const auto arg = [&](int i, int64_t fallback) { return argc > i ? std::atoll(argv[i]) : fallback; };
  const int64_t hidden = arg(1, 512), layers = arg(2, 8), tokens = arg(3, 1024), stages = arg(4, 4), reps = arg(5, 4);
  omp_set_num_threads(1);
  ModelConfig c;
  c.name = "split-bench";
  c.vocab_size = 4096;
  c.hidden = hidden;
  c.layers = layers;
  c.heads = static_cast<int>(hidden / 64);
  c.kv_heads = c.heads;
  c.head_dim = 64;
  c.ffn_hidden = hidden * 3;
  c.max_seq_len = 256;
  c.tie_embeddings = false;
  BuildOptions o;
  o.max_tokens = tokens;
  Model model(c, o);
  model.allocate();
  model.init_weights(1);
  model.set_micro_batches(reps);
  model.enable_activation_frames(static_cast<int>(stages), {{0, layers}});  // one pair in flight a stage
  std::vector<int64_t> bounds;
  for (int64_t s = 0; s <= stages; ++s) bounds.push_back(s * layers / stages);
  std::vector<HostBatch> batches;
  for (int64_t m = 0; m < reps; ++m) batches.push_back(random_batch(tokens, c.vocab_size, static_cast<uint32_t>(m)));

  run(model, bounds, batches, true);  // warm-up: pages touched, caches filled
  const Times whole = run(model, bounds, batches, false), split = run(model, bounds, batches, true);
  fmt::print("hidden {}, {} layers, {} tokens a micro-batch, {} stages, 1 thread; ms per micro-batch:\n", hidden,
             layers, tokens, stages);
  fmt::print("| stage | F | BW (whole) | B (split) | W (split) | B + W |\n| --- | --- | --- | --- | --- | --- |\n");
  const auto ms = [&](double total) { return 1e3 * total / static_cast<double>(reps); };
  for (int64_t s = 0; s < stages; ++s) {
    const auto i = static_cast<size_t>(s);
    fmt::print("| {} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} |\n", s, ms(whole.f[i]), ms(whole.b[i]),
               ms(split.b[i]), ms(split.w[i]), ms(split.b[i] + split.w[i]));
  }
  // The simulator takes one cost per action kind: the middle stages' (blocks only; the
  // first's embedding and the last's LM head differ), in units of F.
  double f = 0, bw = 0, b = 0, w = 0;
  int middle = 0;
  for (int64_t s = 1; s + 1 < stages; ++s, ++middle) {
    const auto i = static_cast<size_t>(s);
    f += whole.f[i], bw += whole.b[i], b += split.b[i], w += split.w[i];
  }
  fmt::print("\nmiddle stages, relative to F: BW {:.2f}, B {:.2f}, W {:.2f}\n", bw / f, b / f, w / f);
  fmt::print("| schedule | m | costs (F, B, W) | step (F) | bubble |\n| --- | --- | --- | --- | --- |\n");
  const int p = static_cast<int>(stages);
  for (int m : {8, 16}) {
    const struct {
      pipeline::Schedule s;
      pipeline::Costs costs;
      const char* label;
    } rows[] = {
        {pipeline::build_1f1b(p, m), {1, bw / f, 0, 0}, "1F1B, whole backward"},
        {pipeline::build_zero_bubble_h1(p, m), {1, bw / f, 0, 0}, "ZB-H1, whole backward at B"},
        {pipeline::build_zero_bubble_h1(p, m), {1, b / f, w / f, 0}, "ZB-H1, split"},
    };
    for (const auto& row : rows) {
      const pipeline::Simulation sim = pipeline::simulate(row.s, row.costs);
      if (!sim.ok) return fmt::print(stderr, "{}\n", sim.problem), 1;
      fmt::print("| {} | {} | 1, {:.2f}, {:.2f} | {:.2f} | {:.3f} |\n", row.label, m, row.costs.backward_input,
                 row.costs.backward_weight, sim.makespan, sim.bubble);
    }
  }
  return 0;
}
