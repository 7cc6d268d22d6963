// Tensors for the AdamW low-memory-moment tests (CPU: test_adamw_lowmem.cpp; GPU:
// gpu/test_gpu_adamw_lowmem.cpp): parameters, gradients and bf16 or 8-bit moments of a
// list of shapes, from seeded random values, copyable to another device.
#pragma once

#include "ops/optim/adamw_lowmem.h"
#include "ops/optim/adamw_lowmem_math.h"
#include "test_util.h"

#include <cstring>
#include <vector>

namespace kiln::lowmem_test {

// Tensor sizes: one element, one partial 8-bit block, a block and a bit, several chunks of
// the GPU kernels (64K elements) with a partial last block, and odd shapes.
inline std::vector<Shape> mixed_shapes() {
  return {Shape{1}, Shape{100}, Shape{257}, Shape{64, 96}, Shape{3, 50001}, Shape{33, 77}};
}

struct LowMemSet {
  ops::AdamWState state;
  std::vector<OwnedTensor> p, g, m, v, m_absmax, v_absmax;

  // Fresh (zero) moments, random parameters (N(0, 1)) and gradients (scale 0.1).
  LowMemSet(ops::AdamWState s, const std::vector<Shape>& shapes, uint64_t seed) : state(s) {
    const DType moment = s == ops::AdamWState::bf16 ? DType::bf16 : DType::u8;
    for (const Shape& shape : shapes) {
      p.push_back(test::random_tensor(DType::f32, shape, ++seed));
      g.push_back(test::random_tensor(DType::f32, shape, ++seed, 0.1));
      m.push_back(zeros(moment, shape));
      v.push_back(zeros(moment, shape));
      const Shape blocks{adamw_lowmem::blocks_of(shape.numel())};
      m_absmax.push_back(zeros(DType::f32, blocks));
      v_absmax.push_back(zeros(DType::f32, blocks));
    }
  }
  // A copy on `device`.
  LowMemSet(const LowMemSet& from, Device device) : state(from.state) {
    auto copy = [&](const std::vector<OwnedTensor>& src, std::vector<OwnedTensor>& dst) {
      for (const OwnedTensor& t : src) {
        OwnedTensor out(t->dtype(), device, t->shape());
        copy_tensor(*t, *out);
        dst.push_back(std::move(out));
      }
    };
    copy(from.p, p), copy(from.g, g), copy(from.m, m), copy(from.v, v);
    copy(from.m_absmax, m_absmax), copy(from.v_absmax, v_absmax);
  }
  static OwnedTensor zeros(DType dtype, Shape shape) {
    OwnedTensor t(dtype, Device::cpu, shape);
    std::memset(t->raw(), 0, t->nbytes());
    return t;
  }
  std::vector<ops::AdamWLowMemTensor> list(double weight_decay = 0.1) const {
    std::vector<ops::AdamWLowMemTensor> out;
    for (size_t i = 0; i < p.size(); ++i)
      out.push_back({*p[i], *g[i], *m[i], *v[i], state == ops::AdamWState::int8 ? *m_absmax[i] : Tensor(),
                     state == ops::AdamWState::int8 ? *v_absmax[i] : Tensor(), weight_decay * (i % 2)});
    return out;
  }
  // Every tensor that a step writes, each as bytes on the host.
  std::vector<std::vector<unsigned char>> state_bytes() const {
    std::vector<std::vector<unsigned char>> out;
    for (const auto* list : {&p, &m, &v, &m_absmax, &v_absmax})
      for (const OwnedTensor& t : *list) {
        OwnedTensor host(t->dtype(), Device::cpu, t->shape());
        copy_tensor(*t, *host);
        const auto* b = static_cast<const unsigned char*>(host->raw());
        out.emplace_back(b, b + host->nbytes());
      }
    return out;
  }
  // Copies another set's written state (same shapes and device): a reset to it.
  void load_state(const LowMemSet& from) {
    for (size_t i = 0; i < p.size(); ++i) {
      copy_tensor(*from.p[i], *p[i]), copy_tensor(*from.m[i], *m[i]), copy_tensor(*from.v[i], *v[i]);
      copy_tensor(*from.m_absmax[i], *m_absmax[i]), copy_tensor(*from.v_absmax[i], *v_absmax[i]);
    }
  }
  // New gradients (the next step's), the same on every copy made after this call.
  void regrad(uint64_t seed) {
    for (size_t i = 0; i < g.size(); ++i) {
      const OwnedTensor fresh = test::random_tensor(DType::f32, g[i]->shape(), seed + i, 0.1);
      copy_tensor(*fresh, *g[i]);
    }
  }
};

// The scalars of update number `t` (bias corrections 1 - beta^t).
inline ops::AdamWStep step_of(int64_t t, double lr = 1e-2) {
  ops::AdamWStep s;
  s.lr = lr, s.beta1 = 0.9, s.beta2 = 0.95, s.eps = 1e-8;
  s.bias_correction1 = 1 - std::pow(s.beta1, static_cast<double>(t));
  s.bias_correction2 = 1 - std::pow(s.beta2, static_cast<double>(t));
  return s;
}

}  // namespace kiln::lowmem_test
