// Muon (Jordan et al. 2024; Moonlight, Liu et al. 2025) for 2-D matrices: momentum, then
// the orthogonalization of the momentum (or of Nesterov's look-ahead) by Newton-Schulz,
// scaled so the update's RMS matches AdamW's, with decoupled weight decay. Each matrix is
// orthogonalized on its own: fused storage (q/k/v, gate/up, an MoE layer's experts) is cut
// into its parameters first, as the stock models hold them. The numerics are
// ops/optim/muon.h's; state is one momentum buffer per matrix, under torch.optim.Muon's
// name ("<parameter>.momentum_buffer").
#include "ops/optim/muon.h"
#include "ops/optim/stochastic_round.h"
#include "train/optimizer_kinds.h"
#include "train/parameter_shards.h"

#include <algorithm>
#include <cmath>

namespace kiln {

namespace {

// The factor on the orthogonalized update (whose RMS is about 1 / sqrt(max(rows, cols))):
// Moonlight's 0.2 sqrt(max(rows, cols)) gives it AdamW's typical RMS of 0.2, so AdamW's
// learning rate and weight decay carry over; "shape" is Keller Jordan's
// sqrt(max(1, rows / cols)), which wants a larger learning rate (about 0.02).
double update_scale(const std::string& scale, const Shape& shape) {
  const double rows = static_cast<double>(shape[0]), cols = static_cast<double>(shape[1]);
  if (scale == "shape") return std::sqrt(std::max(1.0, rows / cols));
  return 0.2 * std::sqrt(std::max(rows, cols));
}

class Muon final : public Optimizer {
 public:
  explicit Muon(const OptimizerGroup& group)
      : exec_(*group.exec),
        device_(group.parameters.empty() ? Device::cpu : group.parameters.front()->value().device()),
        sharded_(group.shards != nullptr),
        index_(group.index),
        weight_decay_(group.weight_decay) {
    const MuonConfig& c = group.config->muon;
    settings_.momentum = group.beta1;
    settings_.nesterov = c.nesterov;
    settings_.ema = c.ema;
    settings_.ns_steps = static_cast<int>(c.ns_steps);
    for (const Parameter* p : group.parameters) {
      KILN_CHECK(p->shape().rank() == 2, group.key(), "muon updates 2-D matrices only, got {} ({})", p->name(),
                 p->shape().str());
      if (group.shards != nullptr) {  // ZeRO: the matrices this rank was given, each whole
        const std::optional<ParameterPiece> piece = group.shards->piece(group.shard_rank, p);
        if (!piece) continue;
        KILN_CHECK(piece->count == p->shape().numel(), "dist.zero", "{} is cut between ranks: Muon needs it whole",
                   p->name());
      }
      slots_.push_back({p, Tensor(), update_scale(c.scale, p->shape())});
    }
  }

  void plan(Arena& state) override {
    std::vector<Shape> shapes;
    for (Slot& s : slots_) {
      const DType dtype = s.param->value().dtype();  // a bf16 master keeps fp32 momentum
      state.reserve(s.momentum, dtype == DType::bf16 ? DType::f32 : dtype, s.param->shape());
      shapes.push_back(s.param->shape());
    }
    update_ = std::make_unique<ops::MuonUpdate>(settings_, std::move(shapes), state.device());
    update_->plan(state);
  }

  void step(double lr) override {
    ++steps_;
    update_->step(exec_, matrices(), lr, 1.0, steps_);
  }

  int64_t steps_taken() const override { return steps_; }
  void set_steps_taken(int64_t steps) override { steps_ = steps; }

  bool updates_on_device() const override { return device_ == Device::cuda; }
  void prepare_device_update(double lr, ops::DeviceUpdateScalars& scalars) const override {
    scalars.group[index_] = {static_cast<float>(lr), 1.0f, 1.0f, static_cast<uint32_t>(steps_ + 1)};
  }
  void step_on_device(const ops::DeviceUpdateScalars* scalars) override {
    update_->step_on_device(exec_, matrices(), scalars, index_);
  }
  void count_update() override { ++steps_; }

  std::vector<OptimizerStateTensor> state_tensors() const override {
    std::vector<OptimizerStateTensor> out;
    // Under ZeRO each buffer is whole, but only this rank's: a slice of the run's state.
    for (const Slot& s : slots_)
      out.push_back({s.param->name() + ".momentum_buffer", s.momentum, sharded_, s.param->shape(), 0});
    return out;
  }

 private:
  const ExecContext& exec_;
  Device device_;  // its parameters'
  bool sharded_;   // ZeRO: it updates this rank's matrices only
  struct Slot {
    const Parameter* param;
    Tensor momentum;
    double scale;
  };

  const std::vector<ops::MuonMatrix>& matrices() {
    batch_.clear();
    for (const Slot& s : slots_)
      batch_.push_back({s.param->value(), s.param->grad(), s.momentum, weight_decay_, s.scale,
                        ops::rounding_stream(s.param->name())});
    return batch_;
  }

  int index_;
  double weight_decay_;
  ops::MuonSettings settings_;
  std::vector<Slot> slots_;
  std::vector<ops::MuonMatrix> batch_;  // reused each step: no allocation in the loop
  std::unique_ptr<ops::MuonUpdate> update_;
  int64_t steps_ = 0;
};

}  // namespace

std::unique_ptr<Optimizer> make_muon_optimizer(const OptimizerGroup& group) { return std::make_unique<Muon>(group); }

}  // namespace kiln
