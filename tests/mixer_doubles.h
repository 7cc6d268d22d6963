// Test-only token mixers, registered into mixer_registry() by register_test_mixers():
//   "recording_gqa"  gqa itself under another name, whose decoder also keeps a fixed-size
//                    state per slot (the rows the slot has run, as a recurrent mixer's
//                    state counts what it has read) and logs the slot contract's calls.
//   "zero_mixer"     a mixer without parameters or query-key logits (out = 0) that no
//                    stock family computes: QK-Clip has nothing to clip there, and an
//                    export refuses it.
#pragma once

#include "nn/modules.h"
#include "nn/slot_state.h"

#include <algorithm>
#include <mutex>
#include <string>
#include <vector>

namespace kiln::test {

// A call of the slot contract on a recording decoder: reset (slot in `from`) or copy.
struct SlotCall {
  std::string what;
  int32_t from = -1, to = -1;
  int64_t positions = 0;
  bool operator==(const SlotCall&) const = default;
};

class RecordingDecoder;

// Every call on every recording decoder, in order (cleared by the tests).
inline std::vector<SlotCall>& slot_calls() {
  static std::vector<SlotCall> calls;
  return calls;
}

// The recording decoders alive now, one per recording layer, in the model's order.
inline std::vector<RecordingDecoder*>& recording_decoders() {
  static std::vector<RecordingDecoder*> live;
  return live;
}

class RecordingDecoder final : public BranchDecoder {
 public:
  RecordingDecoder(std::unique_ptr<BranchDecoder> inner, DecodeContext& ctx) : inner_(std::move(inner)) {
    ctx.state.reserve(rows_run_, DType::i32, Shape{ctx.slots, 1});  // planned as any decode state
    recording_decoders().push_back(this);
  }
  ~RecordingDecoder() override { std::erase(recording_decoders(), this); }

  void forward(const Tensor& h, const DecodeRows& rows, const Tensor& out) override {
    inner_->forward(h, rows, out);
    const int32_t* slots = rows.slots.data<int32_t>();  // the CPU's: host memory
    for (int64_t i = 0; i < rows.count; ++i) ++rows_run_.data<int32_t>()[slots[i]];
  }
  void reset_slot(int32_t slot) override {
    slot_calls().push_back({"reset", slot});
    zero_slot(rows_run_, slot);
    inner_->reset_slot(slot);
  }
  void copy_slot(int32_t from, int32_t to, int64_t positions) override {
    slot_calls().push_back({"copy", from, to, positions});
    copy_slot_whole(rows_run_, from, to);
    inner_->copy_slot(from, to, positions);
  }

  int32_t rows_run(int32_t slot) const { return rows_run_.data<int32_t>()[slot]; }

 private:
  std::unique_ptr<BranchDecoder> inner_;
  Tensor rows_run_;  // i32 [slots, 1]
};

class RecordingMixer final : public TokenMixer {
 public:
  RecordingMixer(BuildContext& ctx, const LayerSpec& layer, PositionEncoding& position)
      : inner_(mixer_registry().build(mixer_key(layer), "gqa", ctx, layer, position)) {}

  void forward(const Tensor& x, const SeqInfo& seq, const Tensor& out) override { inner_->forward(x, seq, out); }
  void backward(const Tensor& x, const Tensor& dout, const SeqInfo& seq, const Tensor& dx) override {
    inner_->backward(x, dout, seq, dx);
  }
  std::unique_ptr<BranchDecoder> make_decoder(DecodeContext& ctx, const Norm& pre_norm) const override {
    return std::make_unique<RecordingDecoder>(inner_->make_decoder(ctx, pre_norm), ctx);
  }
  double extra_forward_flops_per_token(int64_t seq_len) const override {
    return inner_->extra_forward_flops_per_token(seq_len);
  }
  void export_config(ExportConfig& out) const override { inner_->export_config(out); }
  bool clips_qk() const override { return inner_->clips_qk(); }
  void after_step(bool applied) override { inner_->after_step(applied); }
  void report(std::vector<std::pair<std::string, double>>& out) const override { inner_->report(out); }

 private:
  std::unique_ptr<TokenMixer> inner_;
};

class ZeroDecoder final : public BranchDecoder {
 public:
  void forward(const Tensor&, const DecodeRows&, const Tensor& out) override { zero_tensor(out); }
};

class ZeroMixer final : public TokenMixer {
 public:
  explicit ZeroMixer(const LayerSpec& layer) : key_(mixer_key(layer)), name_(layer.choices.mixer) {}

  void forward(const Tensor&, const SeqInfo&, const Tensor& out) override { zero_tensor(out); }
  void backward(const Tensor&, const Tensor&, const SeqInfo&, const Tensor& dx) override { zero_tensor(dx); }
  std::unique_ptr<BranchDecoder> make_decoder(DecodeContext&, const Norm&) const override {
    return std::make_unique<ZeroDecoder>();
  }
  double extra_forward_flops_per_token(int64_t) const override { return 0; }
  void export_config(ExportConfig& out) const override {
    out.refuse(key_, "'" + name_ + "'", "no stock model has a layer without token mixing");
  }

 private:
  std::string key_, name_;
};

inline void register_test_mixers() {
  static std::once_flag once;
  std::call_once(once, [] {
    MixerRegistry& r = mixer_registry();
    r.add("recording_gqa", "test double: gqa that records its decoders' slot calls",
          [](BuildContext& ctx, const LayerSpec& layer, PositionEncoding& position) {
            return std::make_unique<RecordingMixer>(ctx, layer, position);
          });
    r.add("zero_mixer", "test double: out = 0, no logits, no export",
          [](BuildContext&, const LayerSpec& layer, PositionEncoding&) { return std::make_unique<ZeroMixer>(layer); });
  });
}

}  // namespace kiln::test
