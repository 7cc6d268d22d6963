// One run of an op case: its tensors allocated for a precision and a device, filled from
// shared input values, and the case's forward and backward called on them.
#pragma once

#include "core/tensor.h"
#include "op_table/op_case.h"

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace kiln::op_test {

// The host values of a case's inputs, output gradients and accumulator prefills, made
// once per comparison so that every run reads the same numbers: random N(offset, scale)
// (or the spec's fill) rounded to the narrowest dtype any run of it stores (bf16 for a
// narrow tensor when `precision` is bf16, else f32).
using Values = std::map<std::string, std::vector<double>>;
Values make_values(const OpCase& c, DType precision);

// The dtype a tensor of `spec` has in a run of `precision`.
DType dtype_in_run(const TensorSpec& spec, DType precision);

class Run {
 public:
  // precision: f64 (CPU only), f32 or bf16 (CUDA only).
  Run(const OpCase& c, DType precision, Device device, const Values& values);
  Run(const Run&) = delete;
  Run& operator=(const Run&) = delete;

  const Tensors& tensors() const { return tensors_; }
  DType precision() const { return precision_; }
  Device device() const { return device_; }

  // Resets the forward outputs (poison, prefill or in-place copy) and calls case.forward,
  // or the case's naive reference instead.
  void forward();
  void reference();
  // Resets the input gradients and backward outputs, and calls case.backward.
  void backward();

  // A tensor's values as doubles (bf16 and f32 widen exactly).
  std::vector<double> read(const std::string& name) const;
  // Its bytes (determinism checks).
  std::vector<unsigned char> bytes(const std::string& name) const;
  // Every tensor as a host copy, f64 (i32 stays i32): what invariants read.
  Tensors host_copies(std::vector<OwnedTensor>& keep) const;
  // Names of guard regions that were written (empty: none).
  std::vector<std::string> written_guards() const;

 private:
  struct Buffer {
    Storage storage;
    Tensor view;  // between the guards
    int64_t lead = 0;  // elements before the view (guard, plus one when unaligned)
    int64_t total = 0;
  };
  void reset(const TensorSpec& spec);
  void upload(const std::string& name, const std::vector<double>& values);

  const OpCase& case_;
  DType precision_;
  Device device_;
  const Values& values_;
  std::map<std::string, Buffer> buffers_;
  Tensors tensors_;
};

}  // namespace kiln::op_test
