#include "train/pipeline_schedule.h"

#include <fmt/format.h>

#include <algorithm>
#include <deque>

#include "core/error.h"

namespace kiln::pipeline {
namespace {

void check_sizes(int ranks, int stages_per_rank, int microbatches) {
  KILN_CHECK(ranks >= 1, "pipeline", "needs at least one rank, got {}", ranks);
  KILN_CHECK(stages_per_rank >= 1, "pipeline", "needs at least one stage per rank, got {}", stages_per_rank);
  KILN_CHECK(microbatches >= 1, "train.grad_accum", "a pipeline needs at least one micro-batch, got {}",
             microbatches);
}

Action compute(ActionKind kind, int microbatch, int stage) { return {kind, microbatch, stage}; }

// The builders write only each rank's compute order; this adds the transfers every
// schedule has in the same places: a stage receives its input right before its forward and
// sends its output right after, and likewise for gradients around the backward (B, or the
// whole backward). Sends are posted and the rank goes on (the simulator's model of an
// isend), so a receive placed right before its use is the latest point that cannot delay it.
Schedule with_transfers(Schedule schedule) {
  const int last_stage = schedule.stages() - 1;
  for (auto& list : schedule.actions) {
    std::vector<Action> out;
    out.reserve(list.size() * 3);
    for (const Action& a : list) {
      const bool forward = a.kind == ActionKind::kForward;
      const bool backward = a.kind == ActionKind::kBackward || a.kind == ActionKind::kBackwardInput;
      // Neighbouring stages on one rank (a single-rank pipeline) hand over in memory.
      const bool prev_remote = a.stage > 0 && schedule.rank_of(a.stage - 1) != schedule.rank_of(a.stage);
      const bool next_remote =
          a.stage < last_stage && schedule.rank_of(a.stage + 1) != schedule.rank_of(a.stage);
      if (forward && prev_remote) out.push_back({ActionKind::kRecvActivation, a.microbatch, a.stage});
      if (backward && next_remote) out.push_back({ActionKind::kRecvGradient, a.microbatch, a.stage});
      out.push_back(a);
      if (forward && next_remote) out.push_back({ActionKind::kSendActivation, a.microbatch, a.stage});
      if (backward && prev_remote) out.push_back({ActionKind::kSendGradient, a.microbatch, a.stage});
    }
    list = std::move(out);
  }
  return schedule;
}

Schedule empty_schedule(const char* name, int ranks, int stages_per_rank, int microbatches) {
  check_sizes(ranks, stages_per_rank, microbatches);
  Schedule s;
  s.name = name;
  s.ranks = ranks;
  s.stages_per_rank = stages_per_rank;
  s.microbatches = microbatches;
  s.actions.resize(ranks);
  return s;
}

}  // namespace

std::string describe(const Action& a) {
  const char* tag = "?";
  switch (a.kind) {
    case ActionKind::kForward: tag = "F"; break;
    case ActionKind::kBackward: tag = "BW"; break;
    case ActionKind::kBackwardInput: tag = "B"; break;
    case ActionKind::kBackwardWeight: tag = "W"; break;
    case ActionKind::kSendActivation: tag = "sA"; break;
    case ActionKind::kRecvActivation: tag = "rA"; break;
    case ActionKind::kSendGradient: tag = "sG"; break;
    case ActionKind::kRecvGradient: tag = "rG"; break;
  }
  return fmt::format("{}{}@{}", tag, a.microbatch, a.stage);
}

Schedule build_gpipe(int ranks, int microbatches) {
  Schedule s = empty_schedule("gpipe", ranks, 1, microbatches);
  for (int r = 0; r < ranks; ++r) {
    for (int m = 0; m < microbatches; ++m) s.actions[r].push_back(compute(ActionKind::kForward, m, r));
    for (int m = 0; m < microbatches; ++m) s.actions[r].push_back(compute(ActionKind::kBackward, m, r));
  }
  return with_transfers(std::move(s));
}

Schedule build_1f1b(int ranks, int microbatches) {
  Schedule s = empty_schedule("1f1b", ranks, 1, microbatches);
  for (int r = 0; r < ranks; ++r) {
    auto& list = s.actions[r];
    // Rank r's first backward can start only after the first micro-batch went through the
    // ranks - r - 1 stages after it and back, time enough for that many more forwards.
    const int warmup = std::min(ranks - r - 1, microbatches);
    for (int m = 0; m < warmup; ++m) list.push_back(compute(ActionKind::kForward, m, r));
    for (int k = 0; k < microbatches - warmup; ++k) {
      list.push_back(compute(ActionKind::kForward, warmup + k, r));
      list.push_back(compute(ActionKind::kBackward, k, r));
    }
    for (int m = microbatches - warmup; m < microbatches; ++m) list.push_back(compute(ActionKind::kBackward, m, r));
  }
  return with_transfers(std::move(s));
}

Schedule build_interleaved_1f1b(int ranks, int stages_per_rank, int microbatches) {
  Schedule s = empty_schedule("interleaved-1f1b", ranks, stages_per_rank, microbatches);
  if (microbatches % ranks != 0)
    fail("train.grad_accum", "interleaved 1F1B needs micro-batches ({}) divisible by the pipeline ranks ({})",
         microbatches, ranks);
  const int v = stages_per_rank, group = ranks * v, total = microbatches * v;
  // The k-th forward (or backward) of a rank: micro-batches go in groups of `ranks`, each
  // group through the rank's first stage, then its second, ...; backwards take the stages
  // in reverse. As Megatron-core's get_model_chunk_id / microbatch id.
  auto nth = [&](int k, bool forward, int rank) {
    int chunk = (k % group) / ranks;
    if (!forward) chunk = v - 1 - chunk;
    const int microbatch = (k / group) * ranks + k % ranks;
    return std::pair{microbatch, chunk * ranks + rank};
  };
  for (int r = 0; r < ranks; ++r) {
    auto& list = s.actions[r];
    // Megatron's warm-up: the forwards that fit before rank r's first gradient returns; all
    // of them when there are only as many micro-batches as ranks.
    int warmup = (ranks - r - 1) * 2 + (v - 1) * ranks;
    if (microbatches == ranks) warmup = total;
    warmup = std::min(warmup, total);
    for (int k = 0; k < warmup; ++k) {
      auto [m, stage] = nth(k, true, r);
      list.push_back(compute(ActionKind::kForward, m, stage));
    }
    for (int k = 0; k < total - warmup; ++k) {
      auto [fm, fs] = nth(warmup + k, true, r);
      list.push_back(compute(ActionKind::kForward, fm, fs));
      auto [bm, bs] = nth(k, false, r);
      list.push_back(compute(ActionKind::kBackward, bm, bs));
    }
    for (int k = total - warmup; k < total; ++k) {
      auto [bm, bs] = nth(k, false, r);
      list.push_back(compute(ActionKind::kBackward, bm, bs));
    }
  }
  return with_transfers(std::move(s));
}

Schedule build_zero_bubble_h1(int ranks, int microbatches) {
  Schedule s = empty_schedule("zb-h1", ranks, 1, microbatches);
  for (int r = 0; r < ranks; ++r) {
    auto& list = s.actions[r];
    std::deque<int> waiting_w;  // micro-batches whose B ran and whose W has not
    // Rank r holds back up to r weight passes: the later a rank, the sooner it must return
    // each input gradient (rank 0's chain waits on all of them), and the more cool-down
    // time it has at the end to run them. Rank r then holds ranks - r (1F1B's) + r.
    auto backward = [&](int m) {
      list.push_back(compute(ActionKind::kBackwardInput, m, r));
      waiting_w.push_back(m);
      while (static_cast<int>(waiting_w.size()) > r) {
        list.push_back(compute(ActionKind::kBackwardWeight, waiting_w.front(), r));
        waiting_w.pop_front();
      }
    };
    const int warmup = std::min(ranks - r - 1, microbatches);
    for (int m = 0; m < warmup; ++m) list.push_back(compute(ActionKind::kForward, m, r));
    for (int k = 0; k < microbatches - warmup; ++k) {
      list.push_back(compute(ActionKind::kForward, warmup + k, r));
      backward(k);
    }
    for (int m = microbatches - warmup; m < microbatches; ++m) backward(m);
    for (int m : waiting_w) list.push_back(compute(ActionKind::kBackwardWeight, m, r));
  }
  return with_transfers(std::move(s));
}

}  // namespace kiln::pipeline
