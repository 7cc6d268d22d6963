#include "ops/optim/adamw_lowmem.h"

#include "core/op_profiler.h"
#include "ops/common.h"
#include "ops/optim/adamw_lowmem_math.h"
#include "ops/optim/dynamic_map.h"

#include <algorithm>
#include <cmath>

namespace kiln::ops {

namespace am = adamw_lowmem;

AdamWState adamw_state_from_name(const std::string& name) {
  if (name == "fp32") return AdamWState::fp32;
  if (name == "bf16") return AdamWState::bf16;
  if (name == "int8") return AdamWState::int8;
  fail("adamw", "unknown optim.adamw_state '{}' (fp32 | bf16 | int8)", name);
}

namespace {

constexpr const char* kOp = "adamw_lowmem";

// Every tensor of the entry matches its parameter (fp32 parameter and gradient, moments
// and absmax in the format's dtype and size, one device).
void check(AdamWState state, const AdamWLowMemTensor& t) {
  KILN_CHECK(state != AdamWState::fp32, kOp, "fp32 moments take ops::adamw_update_all");
  expect_dtype(kOp, "param", t.param, DType::f32);
  expect_same(kOp, "grad", t.grad, t.param);
  KILN_CHECK(t.grad.numel() == t.param.numel(), kOp, "size mismatch: param {}, grad {}", t.param.describe(),
             t.grad.describe());
  const DType moment = state == AdamWState::bf16 ? DType::bf16 : DType::u8;
  for (const Tensor* x : {&t.m, &t.v}) {
    expect_tensor(kOp, "m/v", *x, t.param.shape(), moment, t.param.device());
  }
  if (state == AdamWState::int8)
    for (const Tensor* x : {&t.m_absmax, &t.v_absmax})
      expect_tensor(kOp, "absmax", *x, Shape{am::blocks_of(t.param.numel())}, DType::f32, t.param.device());
}

void update_bf16(const AdamWLowMemTensor& t, const AdamWStep& s, const am::Factors& f) {
  float* p = t.param.data<float>();
  const float* g = t.grad.data<float>();
  auto* m = static_cast<uint16_t*>(t.m.raw());
  auto* v = static_cast<uint16_t*>(t.v.raw());
  const float b1 = static_cast<float>(s.beta1), b2 = static_cast<float>(s.beta2), eps = static_cast<float>(s.eps);
  const int64_t n = t.param.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    float mi = am::from_bf16(m[i]), vi = am::from_bf16(v[i]);
    am::update(p[i], g[i], mi, vi, b1, b2, eps, f);
    m[i] = am::to_bf16(mi), v[i] = am::to_bf16(vi);
  }
}

// Block by block: dequantize, update, then requantize over the block's new absmax.
void update_int8(const AdamWLowMemTensor& t, const AdamWStep& s, const am::Factors& f) {
  const float* smap = signed_dynamic_map().data();
  const float* umap = unsigned_dynamic_map().data();
  float* p = t.param.data<float>();
  const float* g = t.grad.data<float>();
  uint8_t* mq = t.m.data<uint8_t>();
  uint8_t* vq = t.v.data<uint8_t>();
  float* m_absmax = t.m_absmax.data<float>();
  float* v_absmax = t.v_absmax.data<float>();
  const float b1 = static_cast<float>(s.beta1), b2 = static_cast<float>(s.beta2), eps = static_cast<float>(s.eps);
  const int64_t n = t.param.numel(), blocks = am::blocks_of(n);
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * am::kBlock, end = std::min(n, begin + am::kBlock);
    float m[am::kBlock], v[am::kBlock];
    float m_max = 0, v_max = 0;
    for (int64_t i = begin; i < end; ++i) {
      float& mi = m[i - begin];
      float& vi = v[i - begin];
      mi = am::dequantize(smap, mq[i], m_absmax[b]);
      vi = am::dequantize(umap, vq[i], v_absmax[b]);
      am::update(p[i], g[i], mi, vi, b1, b2, eps, f);
      m_max = std::max(m_max, std::fabs(mi));
      v_max = std::max(v_max, vi);
    }
    for (int64_t i = begin; i < end; ++i) {
      mq[i] = am::quantize(smap, m[i - begin], m_max);
      vq[i] = am::quantize(umap, v[i - begin], v_max);
    }
    m_absmax[b] = m_max, v_absmax[b] = v_max;
  }
}

#if KILN_WITH_CUDA
const std::vector<cuda::AdamWLowMemTensorDev>& device_list(AdamWState state,
                                                           const std::vector<AdamWLowMemTensor>& tensors) {
  static thread_local std::vector<cuda::AdamWLowMemTensorDev> list;
  list.clear();
  for (const AdamWLowMemTensor& t : tensors) {
    check(state, t);
    const bool int8 = state == AdamWState::int8;
    list.push_back({t.param.data<float>(), t.grad.data<float>(), t.m.raw(), t.v.raw(),
                    int8 ? t.m_absmax.data<float>() : nullptr, int8 ? t.v_absmax.data<float>() : nullptr,
                    t.param.numel(), static_cast<float>(t.weight_decay)});
  }
  return list;
}

cuda::AdamWLowMemTable& table_of(AdamWLowMemDeviceTable& table) {
  if (!table) table = cuda::make_adamw_lowmem_table();
  return *table;
}
#endif

}  // namespace

void adamw_lowmem_update_all(const ExecContext& ctx, AdamWState state, const std::vector<AdamWLowMemTensor>& tensors, const AdamWStep& s,
                             AdamWLowMemDeviceTable& table) {
  if (tensors.empty()) return;
  KILN_OP_SCOPE(kOp, tensors.front().param);
  if (tensors.front().param.device() == Device::cuda) {
#if KILN_WITH_CUDA
    const auto& list = device_list(state, tensors);
    cuda::adamw_lowmem_update_many(ctx, table_of(table), state == AdamWState::int8, list.data(),
                                   static_cast<int64_t>(list.size()), static_cast<float>(s.lr),
                                   static_cast<float>(s.beta1), static_cast<float>(s.beta2), static_cast<float>(s.eps),
                                   static_cast<float>(s.bias_correction1), static_cast<float>(s.bias_correction2));
    return;
#else
    (void)table;
    no_cuda_kernel(kOp);
#endif
  }
  for (const AdamWLowMemTensor& t : tensors) {
    check(state, t);
    KILN_CHECK(t.param.device() == Device::cpu, kOp, "tensors on two devices: {}", t.param.describe());
    // The device kernels' factors, from the same fp32 scalars.
    const am::Factors f = am::factors(static_cast<float>(s.lr), static_cast<float>(t.weight_decay),
                                      static_cast<float>(s.bias_correction1), static_cast<float>(s.bias_correction2));
    if (state == AdamWState::bf16) update_bf16(t, s, f);
    else update_int8(t, s, f);
  }
}

void adamw_lowmem_update_all_on_device(const ExecContext& ctx, AdamWState state, const std::vector<AdamWLowMemTensor>& tensors,
                                       const AdamWStep& fixed, const DeviceUpdateScalars* scalars, int group,
                                       AdamWLowMemDeviceTable& table) {
  if (tensors.empty()) return;
  KILN_CHECK(tensors.front().param.device() == Device::cuda, kOp, "scalars in device memory need GPU tensors");
  KILN_OP_SCOPE(kOp, tensors.front().param);
#if KILN_WITH_CUDA
  const auto& list = device_list(state, tensors);
  cuda::adamw_lowmem_update_many_device(ctx, table_of(table), state == AdamWState::int8, list.data(),
                                        static_cast<int64_t>(list.size()), static_cast<float>(fixed.beta1),
                                        static_cast<float>(fixed.beta2), static_cast<float>(fixed.eps), scalars,
                                        group);
#else
  (void)state, (void)fixed, (void)scalars, (void)group, (void)table;
  no_cuda_kernel(kOp);
#endif
}

}  // namespace kiln::ops
