// AdamW with decoupled weight decay (as torch.optim.AdamW): p *= 1 - lr*wd, then the
// bias-corrected Adam update. State m, v per parameter in the optimizer arena, under
// torch's names (exp_avg, exp_avg_sq), stored as optim.adamw_state says: fp32, bf16, or
// 8-bit codes with their blocks' absmax ("<name>.exp_avg.absmax"; tensors under
// adamw_lowmem::kMinQuantizedNumel elements keep fp32 moments).
#include "ops/optim/adamw.h"
#include "ops/optim/adamw_bf16_master.h"
#include "ops/optim/adamw_lowmem.h"
#include "ops/optim/adamw_lowmem_math.h"
#include "ops/optim/stochastic_round.h"
#include "train/optimizer_kinds.h"
#include "train/parameter_shards.h"

#include <cmath>

namespace kiln {

namespace {

class AdamW final : public Optimizer {
 public:
  explicit AdamW(const OptimizerGroup& group)
      : exec_(*group.exec),
        device_(group.parameters.empty() ? Device::cpu : group.parameters.front()->value().device()), index_(group.index), beta1_(group.beta1), beta2_(group.beta2), eps_(group.config->eps),
        weight_decay_(group.weight_decay), state_(ops::adamw_state_from_name(group.config->adamw_state)) {
    for (const Parameter* p : group.parameters) {
      Slot s;
      s.param = p;
      s.count = p->shape().numel();
      if (group.shards != nullptr) {  // ZeRO: only this rank's piece, if it has one
        const std::optional<ParameterPiece> piece = group.shards->piece(group.shard_rank, p);
        if (!piece) continue;
        s.begin = piece->begin;
        s.count = piece->count;
        s.sliced = true;  // its state is this rank's part of the whole (even when all of it)
      }
      // The whole tensor's size decides, so every rank's piece has the format it would have whole.
      s.format = state_ == ops::AdamWState::int8 && p->shape().numel() < adamw_lowmem::kMinQuantizedNumel
                     ? ops::AdamWState::fp32
                     : state_;
      slots_.push_back(s);
    }
  }

  void plan(Arena& state) override {
    for (Slot& s : slots_) {
      const DType dtype = s.param->value().dtype();
      KILN_CHECK(s.format == ops::AdamWState::fp32 || dtype == DType::f32, "adamw",
                 "optim.adamw_state = '{}' needs fp32 parameters, {} is {} (optim.master_weights = 'bf16' "
                 "takes fp32 moments only)", state_name(), s.param->name(), dtype_name(dtype));
      // A bf16 master (optim.master_weights) keeps fp32 moments.
      const DType moment = s.format == ops::AdamWState::bf16   ? DType::bf16
                           : s.format == ops::AdamWState::int8 ? DType::u8
                           : dtype == DType::bf16              ? DType::f32
                                                               : dtype;
      const Shape shape = s.sliced ? Shape{s.count} : s.param->shape();
      state.reserve(s.m, moment, shape);
      state.reserve(s.v, moment, shape);
      if (s.format == ops::AdamWState::int8) {
        const Shape blocks{adamw_lowmem::blocks_of(s.count)};
        state.reserve(s.m_absmax, DType::f32, blocks);
        state.reserve(s.v_absmax, DType::f32, blocks);
      }
    }
  }

  void step(double lr) override {
    ++steps_;
    const ops::AdamWStep step = step_scalars(lr, steps_);
    ops::adamw_update_all(exec_, tensors(), step, table_);
    ops::adamw_lowmem_update_all(exec_, state_, lowmem_tensors(), step, lowmem_table_);
    ops::adamw_bf16_master_update_all(exec_, bf16_master_tensors(), step, steps_);
  }

  int64_t steps_taken() const override { return steps_; }
  void set_steps_taken(int64_t steps) override { steps_ = steps; }

  bool updates_on_device() const override { return device_ == Device::cuda; }

  void prepare_device_update(double lr, ops::DeviceUpdateScalars& scalars) const override {
    const ops::AdamWStep step = step_scalars(lr, steps_ + 1);
    ops::GroupUpdateScalars& group = scalars.group[index_];
    group.lr = static_cast<float>(step.lr);
    group.bias_correction1 = static_cast<float>(step.bias_correction1);
    group.bias_correction2 = static_cast<float>(step.bias_correction2);
    group.update = static_cast<uint32_t>(steps_ + 1);
  }

  void step_on_device(const ops::DeviceUpdateScalars* scalars) override {
    const ops::AdamWStep fixed = step_scalars(0, steps_ + 1);
    ops::adamw_update_all_on_device(exec_, tensors(), fixed, scalars, index_, table_);
    ops::adamw_lowmem_update_all_on_device(exec_, state_, lowmem_tensors(), fixed, scalars, index_, lowmem_table_);
    ops::adamw_bf16_master_update_all_on_device(exec_, bf16_master_tensors(), fixed, scalars, index_);
  }

  void count_update() override { ++steps_; }

  std::vector<OptimizerStateTensor> state_tensors() const override {
    std::vector<OptimizerStateTensor> out;
    for (const Slot& s : slots_) {
      const int64_t numel = s.param->shape().numel();
      // A piece of a sliced moment starts on a block (train/parameter_shards.h), so its
      // absmax values are a slice of the whole tensor's too.
      const auto add = [&](const std::string& suffix, const Tensor& t, Shape whole, int64_t offset) {
        out.push_back({s.param->name() + suffix, t, s.sliced, whole, offset});
      };
      add(".exp_avg", s.m, s.param->shape(), s.begin);
      add(".exp_avg_sq", s.v, s.param->shape(), s.begin);
      if (s.format == ops::AdamWState::int8) {
        const Shape blocks{adamw_lowmem::blocks_of(numel)};
        add(".exp_avg.absmax", s.m_absmax, blocks, s.begin / adamw_lowmem::kBlock);
        add(".exp_avg_sq.absmax", s.v_absmax, blocks, s.begin / adamw_lowmem::kBlock);
      }
    }
    return out;
  }

 private:
  const ExecContext& exec_;
  Device device_;  // its parameters'
  struct Slot {
    const Parameter* param = nullptr;
    int64_t begin = 0, count = 0;  // the elements it updates (all of them unless sharded)
    bool sliced = false;           // under ZeRO: a piece (all of it or part) of the parameter
    ops::AdamWState format = ops::AdamWState::fp32;  // of this tensor's moments
    // The value and gradient it updates: the parameter's, or flat views of its piece.
    Tensor value() const { return sliced ? piece_of(param->value()) : param->value(); }
    Tensor grad() const { return sliced ? piece_of(param->grad()) : param->grad(); }
    Tensor piece_of(const Tensor& t) const {
      return Tensor(static_cast<unsigned char*>(t.raw()) + begin * static_cast<int64_t>(dtype_size(t.dtype())),
                    t.dtype(), t.device(), Shape{count});
    }
    Tensor m, v, m_absmax, v_absmax;                // absmax: int8 only
    bool bf16_master() const { return param->value().dtype() == DType::bf16; }
  };
  const char* state_name() const {
    return state_ == ops::AdamWState::bf16 ? "bf16" : state_ == ops::AdamWState::int8 ? "int8" : "fp32";
  }
  // The scalars of update number `update` (1-based: bias corrections 1 - beta^update).
  ops::AdamWStep step_scalars(double lr, int64_t update) const {
    ops::AdamWStep step;
    step.lr = lr;
    step.beta1 = beta1_;
    step.beta2 = beta2_;
    step.eps = eps_;
    step.bias_correction1 = 1.0 - std::pow(beta1_, static_cast<double>(update));
    step.bias_correction2 = 1.0 - std::pow(beta2_, static_cast<double>(update));
    return step;
  }

  // The slots with fp32 moments, and the rest (the run's bf16 or int8 format).
  const std::vector<ops::AdamWTensor>& tensors() {
    batch_.clear();
    for (const Slot& s : slots_)
      if (s.format == ops::AdamWState::fp32 && !s.bf16_master())
        batch_.push_back({s.value(), s.grad(), s.m, s.v, weight_decay_});
    return batch_;
  }
  const std::vector<ops::AdamWLowMemTensor>& lowmem_tensors() {
    lowmem_batch_.clear();
    for (const Slot& s : slots_)
      if (s.format != ops::AdamWState::fp32)
        lowmem_batch_.push_back({s.value(), s.grad(), s.m, s.v, s.m_absmax, s.v_absmax, weight_decay_});
    return lowmem_batch_;
  }
  // The slots whose parameter is a bf16 master (optim.master_weights = "bf16").
  const std::vector<ops::AdamWBf16MasterTensor>& bf16_master_tensors() {
    bf16_batch_.clear();
    for (const Slot& s : slots_)
      if (s.bf16_master())
        bf16_batch_.push_back({s.value(), s.grad(), s.m, s.v, weight_decay_, ops::rounding_stream(s.param->name()), s.begin});
    return bf16_batch_;
  }

  int index_;
  double beta1_, beta2_, eps_, weight_decay_;
  ops::AdamWState state_;
  std::vector<Slot> slots_;
  std::vector<ops::AdamWTensor> batch_;  // reused each step: no allocation in the loop
  std::vector<ops::AdamWLowMemTensor> lowmem_batch_;
  std::vector<ops::AdamWBf16MasterTensor> bf16_batch_;
  ops::AdamWDeviceTable table_;                // the GPU kernel's copy of batch_
  ops::AdamWLowMemDeviceTable lowmem_table_;   // and of lowmem_batch_
  int64_t steps_ = 0;
};

}  // namespace

std::unique_ptr<Optimizer> make_adamw_optimizer(const OptimizerGroup& group) { return std::make_unique<AdamW>(group); }

}  // namespace kiln
