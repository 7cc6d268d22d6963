// The pipeline engine on a toy model: a chain of dense layers y = tanh(W x) in double
// precision, cut into stages over ranks that are threads joined by Gloo. For every
// schedule, its losses and weight gradients must equal, bit for bit, one thread running the
// same chain over the same micro-batches: each layer's arithmetic is one function called by
// both, so only a wrong hand-over (a mixed-up micro-batch, stage or gradient) or a
// different order of accumulation can change a bit.
#include "dist/communicator.h"
#include "dist/free_port.h"
#include "dist/process_group.h"
#include "train/pipeline_engine.h"
#include "train/pipeline_schedule.h"
#include "test_util.h"
#include "thread_ranks.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <map>
#include <thread>

using namespace kiln;
using namespace kiln::pipeline;
using kiln::test::error_of;
using kiln::test::placement;
using kiln::test::run_ranks;
using namespace std::chrono_literals;

namespace {

constexpr int kWidth = 4;           // features of an activation
constexpr int kSamples = 3;         // columns of a micro-batch
constexpr int kLayersPerStage = 2;  // layers l of stage s: s * 2, s * 2 + 1
constexpr int kActivation = kWidth * kSamples;
using Matrix = std::vector<double>;  // row-major; activations kWidth x kSamples

Matrix weight(int layer) {
  Matrix w(kWidth * kWidth);
  for (int i = 0; i < kWidth; ++i)
    for (int j = 0; j < kWidth; ++j) w[i * kWidth + j] = 0.6 * std::sin(1.3 * layer + 0.7 * i + 0.37 * j + 0.1);
  return w;
}
Matrix input(int microbatch) {
  Matrix x(kActivation);
  for (int i = 0; i < kActivation; ++i) x[i] = std::cos(0.9 * microbatch + 0.5 * i);
  return x;
}
Matrix target(int microbatch) {
  Matrix t(kActivation);
  for (int i = 0; i < kActivation; ++i) t[i] = 0.3 * std::sin(0.4 * microbatch - 0.8 * i);
  return t;
}

// The arithmetic, one compiled body each (noinline: no call site gets its own contraction
// into FMAs), shared by the stages and the reference.
[[gnu::noinline]] void layer_forward(const Matrix& w, const Matrix& x, Matrix& y) {
  y.assign(kActivation, 0.0);
  for (int i = 0; i < kWidth; ++i)
    for (int k = 0; k < kSamples; ++k) {
      double z = 0;
      for (int j = 0; j < kWidth; ++j) z += w[i * kWidth + j] * x[j * kSamples + k];
      y[i * kSamples + k] = std::tanh(z);
    }
}
// 0.5 |y - t|^2, and its gradient in y.
[[gnu::noinline]] double loss_of(const Matrix& y, const Matrix& t, Matrix& dy) {
  dy.assign(kActivation, 0.0);
  double loss = 0;
  for (int i = 0; i < kActivation; ++i) {
    dy[i] = y[i] - t[i];
    loss += 0.5 * dy[i] * dy[i];
  }
  return loss;
}
// dz = dy (1 - y^2); dx = W^T dz, unless dx is null (the chain's first layer).
[[gnu::noinline]] void layer_backward_input(const Matrix& w, const Matrix& y, const Matrix& dy, Matrix& dz,
                                            Matrix* dx) {
  dz.assign(kActivation, 0.0);
  for (int i = 0; i < kActivation; ++i) dz[i] = dy[i] * (1.0 - y[i] * y[i]);
  if (dx == nullptr) return;
  dx->assign(kActivation, 0.0);
  for (int j = 0; j < kWidth; ++j)
    for (int k = 0; k < kSamples; ++k) {
      double g = 0;
      for (int i = 0; i < kWidth; ++i) g += w[i * kWidth + j] * dz[i * kSamples + k];
      (*dx)[j * kSamples + k] = g;
    }
}
// grad += dz x^T
[[gnu::noinline]] void layer_weight_grad(const Matrix& dz, const Matrix& x, Matrix& grad) {
  for (int i = 0; i < kWidth; ++i)
    for (int j = 0; j < kWidth; ++j) {
      double g = 0;
      for (int k = 0; k < kSamples; ++k) g += dz[i * kSamples + k] * x[j * kSamples + k];
      grad[i * kWidth + j] += g;
    }
}

struct Result {
  std::vector<double> losses;  // by micro-batch
  std::vector<Matrix> grads;   // by layer
};

// One thread, the whole chain, micro-batch after micro-batch. `weights` by layer.
Result reference(const std::vector<Matrix>& weights, int microbatches) {
  const int layers = static_cast<int>(weights.size());
  Result r{std::vector<double>(microbatches), std::vector<Matrix>(layers, Matrix(kWidth * kWidth, 0.0))};
  for (int m = 0; m < microbatches; ++m) {
    std::vector<Matrix> xs(layers), ys(layers), dzs(layers);
    Matrix x = input(m);
    for (int l = 0; l < layers; ++l) {
      xs[l] = x;
      layer_forward(weights[l], xs[l], ys[l]);
      x = ys[l];
    }
    Matrix dy;
    r.losses[m] = loss_of(x, target(m), dy);
    for (int l = layers - 1; l >= 0; --l) {
      Matrix dx;
      layer_backward_input(weights[l], ys[l], dy, dzs[l], l > 0 ? &dx : nullptr);
      dy = dx;
    }
    for (int l = 0; l < layers; ++l) layer_weight_grad(dzs[l], xs[l], r.grads[l]);
  }
  return r;
}

std::vector<Matrix> chain_weights(int layers) {
  std::vector<Matrix> w;
  for (int l = 0; l < layers; ++l) w.push_back(weight(l));
  return w;
}

// The stages of the chain on one rank, accumulating each weight gradient as W comes.
class ToyStages final : public PipelineStage {
 public:
  ToyStages(const Schedule& schedule, int rank) : schedule_(schedule) {
    for (int s = 0; s < schedule.stages(); ++s)
      if (schedule.rank_of(s) == rank)
        for (int l = s * kLayersPerStage; l < (s + 1) * kLayersPerStage; ++l) {
          weights_[l] = weight(l);
          grads[l] = Matrix(kWidth * kWidth, 0.0);
        }
  }
  int64_t input_bytes(int) const override { return kActivation * sizeof(double); }
  int64_t output_bytes(int) const override { return kActivation * sizeof(double); }

  void forward(int m, int s, const void* in, void* out) override {
    Saved& saved = saved_[{m, s}];
    Matrix x = input(m);
    if (s > 0) std::memcpy(x.data(), in, kActivation * sizeof(double));
    for (int i = 0; i < kLayersPerStage; ++i) {
      const int l = s * kLayersPerStage + i;
      saved.xs[i] = x;
      layer_forward(weights_.at(l), saved.xs[i], saved.ys[i]);
      x = saved.ys[i];
    }
    if (s == schedule_.stages() - 1)
      losses[m] = loss_of(x, target(m), saved.loss_grad);
    else
      std::memcpy(out, x.data(), kActivation * sizeof(double));
  }

  void backward_input(int m, int s, const void* out_grad, void* in_grad) override {
    Saved& saved = saved_.at({m, s});
    Matrix dy = saved.loss_grad;
    if (out_grad != nullptr) {
      dy.assign(kActivation, 0.0);
      std::memcpy(dy.data(), out_grad, kActivation * sizeof(double));
    }
    for (int i = kLayersPerStage - 1; i >= 0; --i) {
      const int l = s * kLayersPerStage + i;
      Matrix dx;
      layer_backward_input(weights_.at(l), saved.ys[i], dy, saved.dzs[i], l > 0 ? &dx : nullptr);
      dy = dx;
    }
    if (in_grad != nullptr) std::memcpy(in_grad, dy.data(), kActivation * sizeof(double));
  }

  void backward_weight(int m, int s) override {
    const Saved& saved = saved_.at({m, s});
    for (int i = 0; i < kLayersPerStage; ++i)
      layer_weight_grad(saved.dzs[i], saved.xs[i], grads.at(s * kLayersPerStage + i));
    weight_order[s].push_back(m);
    saved_.erase({m, s});
  }

  std::map<int, double> losses;             // by micro-batch (the last stage's rank)
  std::map<int, Matrix> grads;              // by layer, this rank's
  std::map<int, std::vector<int>> weight_order;  // by stage: the micro-batches in W's order
  size_t saved_left() const { return saved_.size(); }

 private:
  struct Saved {
    Matrix xs[kLayersPerStage], ys[kLayersPerStage], dzs[kLayersPerStage], loss_grad;
  };
  const Schedule& schedule_;
  std::map<int, Matrix> weights_;
  std::map<std::pair<int, int>, Saved> saved_;
};

// A pipeline of one rank: everything hands over in memory.
class LoneCommunicator final : public dist::Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  Device device() const override { return Device::cpu; }
  std::string_view backend() const override { return "lone"; }
  void all_reduce(void*, int64_t, DType, dist::ReduceOp, std::string_view) override {}
  void broadcast(void*, int64_t, int, std::string_view) override {}
  void all_gather(void*, int64_t, std::string_view) override {}
  void reduce_scatter(void*, int64_t, DType, dist::ReduceOp, std::string_view) override {}
  void send(const void*, int64_t, int, int, std::string_view what) override { ADD_FAILURE() << "sent " << what; }
  void recv(void*, int64_t, int, int, std::string_view what) override { ADD_FAILURE() << "received " << what; }
};

std::vector<Schedule> schedules(int ranks, int microbatches) {
  return {build_gpipe(ranks, microbatches), build_1f1b(ranks, microbatches),
          build_interleaved_1f1b(ranks, 2, microbatches), build_zero_bubble_h1(ranks, microbatches)};
}

// Every schedule at `ranks` (threads; one rank: no communicator) and 4 and 8 micro-batches.
void expect_every_schedule_matches_one_thread(int ranks) {
  struct Run {
    Schedule schedule;
    std::vector<ToyStages> stages;  // by rank
  };
  std::vector<Run> runs;
  for (int m : {4, 8})
    for (Schedule& s : schedules(ranks, m)) runs.push_back({std::move(s), {}});
  for (Run& run : runs) {  // after `runs` stopped growing: the stages keep a reference to its schedule
    run.stages.reserve(static_cast<size_t>(ranks));
    for (int r = 0; r < ranks; ++r) run.stages.emplace_back(run.schedule, r);
  }

  if (ranks == 1) {
    LoneCommunicator lone;
    for (Run& run : runs) run_pipeline_step(run.schedule, run.stages[0], lone);
  } else {
    const int port = dist::free_loopback_port();
    const auto errors = run_ranks(ranks, [&](int r) {
      dist::ProcessGroup group(placement(r, ranks, port), Device::cpu, 20000ms);
      for (Run& run : runs) run_pipeline_step(run.schedule, run.stages[static_cast<size_t>(r)], group.host());
    });
    for (int r = 0; r < ranks; ++r) ASSERT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
  }

  for (Run& run : runs) {
    const Schedule& s = run.schedule;
    SCOPED_TRACE(::testing::Message() << s.name << ", " << s.ranks << " ranks x " << s.stages_per_rank
                                      << " stages, " << s.microbatches << " micro-batches");
    const Result want = reference(chain_weights(s.stages() * kLayersPerStage), s.microbatches);
    Result got{std::vector<double>(s.microbatches, NAN), std::vector<Matrix>(want.grads.size())};
    for (const ToyStages& stage : run.stages) {
      for (const auto& [m, loss] : stage.losses) got.losses[m] = loss;
      for (const auto& [l, grad] : stage.grads) got.grads[l] = grad;
      EXPECT_EQ(stage.saved_left(), 0u);
      // Why the gradients can match bit for bit: every schedule runs each stage's weight
      // passes in micro-batch order, as the reference accumulates them.
      std::vector<int> in_order(s.microbatches);
      for (int m = 0; m < s.microbatches; ++m) in_order[m] = m;
      for (const auto& [st, order] : stage.weight_order) EXPECT_EQ(order, in_order) << "stage " << st;
    }
    EXPECT_EQ(got.losses, want.losses);  // exact: not a tolerance
    for (size_t l = 0; l < want.grads.size(); ++l) EXPECT_EQ(got.grads[l], want.grads[l]) << "layer " << l;
  }
}

}  // namespace

// The reference itself against central differences of the summed loss, so the bitwise
// comparisons below compare against true gradients.
TEST(PipelineEngine, TheReferenceGradientsMatchFiniteDifferences) {
  const int layers = 6, microbatches = 3;
  const std::vector<Matrix> w = chain_weights(layers);
  const Result base = reference(w, microbatches);
  auto total_loss = [&](const std::vector<Matrix>& weights) {
    double sum = 0;
    for (double l : reference(weights, microbatches).losses) sum += l;
    return sum;
  };
  const double h = 1e-6;
  int checked = 0;
  for (int l : {0, 3, 5})
    for (int e : {0, 6, 15}) {
      std::vector<Matrix> plus = w, minus = w;
      plus[l][e] += h;
      minus[l][e] -= h;
      const double fd = (total_loss(plus) - total_loss(minus)) / (2 * h);
      EXPECT_NEAR(base.grads[l][e], fd, 1e-7 * std::max(1.0, std::abs(fd))) << "layer " << l << " element " << e;
      checked += std::abs(fd) > 1e-4;
    }
  EXPECT_GE(checked, 6);  // gradients that are not all ~0
}

TEST(PipelineEngine, OneRankHandsOverInMemoryAndMatchesOneThreadBitForBit) {
  expect_every_schedule_matches_one_thread(1);
}

TEST(PipelineEngine, TwoRanksMatchOneThreadBitForBit) { expect_every_schedule_matches_one_thread(2); }

TEST(PipelineEngine, FourRanksMatchOneThreadBitForBit) { expect_every_schedule_matches_one_thread(4); }

TEST(PipelineEngine, AForwardBeforeItsInputIsRefusedNamingIt) {
  Schedule s = build_interleaved_1f1b(1, 2, 1);  // F0@0 F0@1 B0@1 B0@0 on one rank
  ASSERT_EQ(describe(s.actions[0][0]), "F0@0");
  std::swap(s.actions[0][0], s.actions[0][1]);
  ToyStages stages(s, 0);
  LoneCommunicator lone;
  EXPECT_EQ(error_of([&] { run_pipeline_step(s, stages, lone); }),
            "[pipeline] rank 0: schedule 'interleaved-1f1b' runs F0@1 before it has its input activation (received, "
            "or from the stage before)");
}

TEST(PipelineEngine, TheNcclCommunicatorIsRefusedForNow) {
  struct GpuLone : public dist::Communicator {
    int rank() const override { return 0; }
    int world_size() const override { return 1; }
    Device device() const override { return Device::cuda; }
    std::string_view backend() const override { return "nccl"; }
    void all_reduce(void*, int64_t, DType, dist::ReduceOp, std::string_view) override {}
    void broadcast(void*, int64_t, int, std::string_view) override {}
    void all_gather(void*, int64_t, std::string_view) override {}
    void reduce_scatter(void*, int64_t, DType, dist::ReduceOp, std::string_view) override {}
    void send(const void*, int64_t, int, int, std::string_view) override {}
    void recv(void*, int64_t, int, int, std::string_view) override {}
  } gpu;
  const Schedule s = build_1f1b(1, 2);
  ToyStages stages(s, 0);
  EXPECT_EQ(error_of([&] { run_pipeline_step(s, stages, gpu); }),
            "[pipeline] the pipeline engine runs on the host communicator only for now, not 'nccl'");
}
