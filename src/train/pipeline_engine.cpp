#include "train/pipeline_engine.h"

#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"

namespace kiln::pipeline {
namespace {

using Bytes = std::vector<unsigned char>;
using Key = std::pair<int, int>;  // (micro-batch, stage)

// The boundary buffers of one step on one rank, by what they hold.
struct StepBuffers {
  std::map<Key, Bytes> input;        // activation into the stage: received or handed over
  std::map<Key, Bytes> output;       // activation out of it, until sent
  std::map<Key, Bytes> output_grad;  // gradient of its output: received or handed over
  std::map<Key, Bytes> input_grad;   // gradient of its input, until sent
};

class StepRunner {
 public:
  StepRunner(const Schedule& schedule, PipelineStage& stage, dist::Communicator& comm)
      : schedule_(schedule), stage_(stage), comm_(comm), rank_(comm.rank()), last_(schedule.stages() - 1) {}

  void run(const Action& a) {
    KILN_CHECK(a.stage >= 0 && a.stage <= last_ && schedule_.rank_of(a.stage) == rank_, "pipeline",
               "rank {}: schedule '{}' gives it {}, a stage of rank {}", rank_, schedule_.name, describe(a),
               schedule_.rank_of(a.stage));
    const Key key{a.microbatch, a.stage};
    const int m = a.microbatch, s = a.stage;
    switch (a.kind) {
      case ActionKind::kRecvActivation: {
        Bytes& in = fresh(buffers_.input, key, stage_.input_bytes(s), a);
        comm_.recv(in.data(), size(in), schedule_.rank_of(s - 1), transfer_tag(m, s - 1, false, last_ + 1),
                   label(a));
        break;
      }
      case ActionKind::kSendActivation: {
        Bytes out = take(buffers_.output, key, "its output activation", a);
        comm_.send(out.data(), size(out), schedule_.rank_of(s + 1), transfer_tag(m, s, false, last_ + 1), label(a));
        break;
      }
      case ActionKind::kRecvGradient: {
        Bytes& grad = fresh(buffers_.output_grad, key, stage_.output_bytes(s), a);
        comm_.recv(grad.data(), size(grad), schedule_.rank_of(s + 1), transfer_tag(m, s, true, last_ + 1), label(a));
        break;
      }
      case ActionKind::kSendGradient: {
        Bytes grad = take(buffers_.input_grad, key, "its input gradient", a);
        comm_.send(grad.data(), size(grad), schedule_.rank_of(s - 1), transfer_tag(m, s - 1, true, last_ + 1),
                   label(a));
        break;
      }
      case ActionKind::kForward: forward(a, key); break;
      case ActionKind::kBackward:
        backward_input(a, key);
        stage_.backward_weight(m, s);
        break;
      case ActionKind::kBackwardInput: backward_input(a, key); break;
      case ActionKind::kBackwardWeight: stage_.backward_weight(m, s); break;
    }
  }

  // Every buffer made in the step was used: otherwise the schedule lost a transfer.
  void check_all_used() const {
    for (const auto* map : {&buffers_.input, &buffers_.output, &buffers_.output_grad, &buffers_.input_grad})
      if (!map->empty()) {
        const Key& k = map->begin()->first;
        fail("pipeline", "rank {}: schedule '{}' ended its step with {} boundary buffer(s) unused, the first of "
             "micro-batch {} on stage {}", rank_, schedule_.name, map->size(), k.first, k.second);
      }
  }

 private:
  void forward(const Action& a, const Key& key) {
    const int s = a.stage;
    Bytes in;
    if (s > 0) in = take(buffers_.input, key, "its input activation (received, or from the stage before)", a);
    Bytes* out = nullptr;
    if (s < last_) out = &fresh(buffers_.output, key, stage_.output_bytes(s), a);
    stage_.forward(a.microbatch, s, s > 0 ? in.data() : nullptr, out != nullptr ? out->data() : nullptr);
    // The next stage on this rank (a one-rank pipeline) takes the output in memory.
    if (s < last_ && schedule_.rank_of(s + 1) == rank_)
      buffers_.input[{a.microbatch, s + 1}] = take(buffers_.output, key, "its output activation", a);
  }

  void backward_input(const Action& a, const Key& key) {
    const int s = a.stage;
    Bytes out_grad;
    if (s < last_) out_grad = take(buffers_.output_grad, key, "its output gradient (received, or from the stage after)", a);
    Bytes* in_grad = nullptr;
    if (s > 0) in_grad = &fresh(buffers_.input_grad, key, stage_.input_bytes(s), a);
    stage_.backward_input(a.microbatch, s, s < last_ ? out_grad.data() : nullptr,
                          in_grad != nullptr ? in_grad->data() : nullptr);
    if (s > 0 && schedule_.rank_of(s - 1) == rank_)
      buffers_.output_grad[{a.microbatch, s - 1}] = take(buffers_.input_grad, key, "its input gradient", a);
  }

  Bytes& fresh(std::map<Key, Bytes>& map, const Key& key, int64_t bytes, const Action& a) {
    KILN_CHECK(bytes >= 0, "pipeline", "rank {}: stage {} gives a negative buffer size ({})", rank_, key.second, bytes);
    auto [it, added] = map.try_emplace(key, static_cast<size_t>(bytes));
    KILN_CHECK(added, "pipeline", "rank {}: schedule '{}' runs {} twice (its buffer is still there)", rank_,
               schedule_.name, describe(a));
    return it->second;
  }

  Bytes take(std::map<Key, Bytes>& map, const Key& key, const char* what, const Action& a) {
    auto it = map.find(key);
    KILN_CHECK(it != map.end(), "pipeline", "rank {}: schedule '{}' runs {} before it has {}", rank_, schedule_.name,
               describe(a), what);
    Bytes bytes = std::move(it->second);
    map.erase(it);
    return bytes;
  }

  static int64_t size(const Bytes& b) { return static_cast<int64_t>(b.size()); }
  std::string label(const Action& a) const { return "pipeline " + describe(a); }

  const Schedule& schedule_;
  PipelineStage& stage_;
  dist::Communicator& comm_;
  const int rank_, last_;
  StepBuffers buffers_;
};

}  // namespace

int transfer_tag(int microbatch, int lower, bool gradient, int stages) {
  return (microbatch * stages + lower) * 2 + (gradient ? 1 : 0);
}

void run_pipeline_step(const Schedule& schedule, PipelineStage& stage, dist::Communicator& comm) {
  KILN_CHECK(comm.world_size() == schedule.ranks, "pipeline",
             "schedule '{}' is for {} ranks, the communicator has {}", schedule.name, schedule.ranks,
             comm.world_size());
  // NCCL's sends wait for their receives (dist/communicator.h): the schedules' crossing
  // transfers (a send to the next rank while it sends back) would deadlock until grouped.
  KILN_CHECK(comm.device() == Device::cpu, "pipeline",
             "the pipeline engine runs on the host communicator only for now, not '{}'", comm.backend());
  StepRunner runner(schedule, stage, comm);
  for (const Action& a : schedule.actions.at(static_cast<size_t>(comm.rank()))) runner.run(a);
  runner.check_all_used();
}

}  // namespace kiln::pipeline
