// Trainable parameters and the context modules are built in.
#pragma once

#include "core/arena.h"

#include <memory>
#include <string>
#include <vector>

namespace kiln {

enum class InitKind { normal, ones, zeros };

struct Init {
  InitKind kind = InitKind::normal;
  double std = 0.02;
  static Init normal(double std) { return {InitKind::normal, std}; }
  static Init ones() { return {InitKind::ones, 0}; }
  static Init zeros() { return {InitKind::zeros, 0}; }
};

// A named weight and its gradient. Several parameters may share one fused storage
// (q/k/v projections in one [rows, d] matrix, so one GEMM computes all three): each is
// then a row range of the fused tensors, and keeps its own whole-model name.
class Parameter {
 public:
  Parameter(std::string name, const Tensor* value_base, const Tensor* grad_base, int64_t row_begin,
            int64_t row_end, bool decay, Init init)
      : name_(std::move(name)), value_base_(value_base), grad_base_(grad_base), row_begin_(row_begin),
        row_end_(row_end), decay_(decay), init_(init) {}

  const std::string& name() const { return name_; }
  Tensor value() const { return value_base_->rows(row_begin_, row_end_); }
  Tensor grad() const { return grad_base_->defined() ? grad_base_->rows(row_begin_, row_end_) : Tensor(); }
  bool decay() const { return decay_; }
  const Init& init() const { return init_; }
  // Shape is known at plan time, before memory exists.
  Shape shape() const;

 private:
  std::string name_;
  const Tensor* value_base_;
  const Tensor* grad_base_;
  int64_t row_begin_, row_end_;
  bool decay_;
  Init init_;
};

// Everything a module needs to plan its memory when it is built.
struct BuildContext {
  Arena& params;
  Arena& grads;
  Arena& activations;
  Workspace& workspace;
  std::vector<std::unique_ptr<Parameter>>& parameters;
  DType dtype;               // compute dtype of activations and (for now) parameters
  Device device;
  int64_t max_tokens;        // fixed token budget of one micro-batch
  bool training;             // gradients and saved activations are planned only when training

  // Reserves a weight (and its gradient when training) and registers it under `name`.
  // Weights of rank 1 are norm gains or biases: no weight decay unless `decay` says so.
  void parameter(Tensor& value, Tensor& grad, const std::string& name, Shape shape, bool decay, Init init);
  // Reserves a fused weight [sum(rows), cols] (or a fused 1-D bias when cols is 0) and
  // registers each row block as a parameter.
  void fused_parameter(Tensor& value, Tensor& grad, const std::vector<std::pair<std::string, int64_t>>& parts,
                       int64_t cols, bool decay, Init init);
  // An activation written in forward and read in backward (compute dtype).
  void saved(Tensor& t, Shape shape);
  // A buffer that must exist in evaluation too (outputs read by the next module).
  void buffer(Tensor& t, Shape shape, DType dtype);
};

}  // namespace kiln
