// AdamW on bf16 masters on the GPU (ops/optim/adamw_bf16_master.h) against the CPU reference:
// the same fp32 arithmetic and the same counter-based rounding bits, so weights and moments
// must agree bit for bit, over several steps, with host scalars and with device scalars
// (a captured step's form), and a skipped step changes nothing.
#include "core/device_memory.h"
#include "gpu/gpu_harness.h"
#include "ops/attention/qk_clip.h"
#include "ops/optim/adamw_bf16_master.h"
#include "ops/optim/muon.h"
#include "ops/optim/stochastic_round.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace kiln {
namespace {

using namespace gpu_test;

class GpuBf16Masters : public GpuTest {};

using Pair = std::pair<std::vector<OwnedTensor>*, const std::vector<OwnedTensor>*>;
using CPair = std::pair<const std::vector<OwnedTensor>*, const std::vector<OwnedTensor>*>;

// Tensors of awkward sizes (one element, odd, over a grid's worth) with random contents.
struct MasterSet {
  std::vector<OwnedTensor> p, g, m, v;
  explicit MasterSet(uint32_t seed) {
    std::mt19937 gen(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (const int64_t n : {int64_t{1}, int64_t{4097}, int64_t{1000003}}) {
      p.emplace_back(DType::bf16, Device::cpu, Shape{n});
      g.emplace_back(DType::f32, Device::cpu, Shape{n});
      m.emplace_back(DType::f32, Device::cpu, Shape{n});
      v.emplace_back(DType::f32, Device::cpu, Shape{n});
      auto* bits = static_cast<uint16_t*>(p.back()->raw());
      for (int64_t i = 0; i < n; ++i) {
        bits[i] = float_to_bf16(0.05f * normal(gen));
        m.back()->data<float>()[i] = 0.01f * normal(gen);
        v.back()->data<float>()[i] = 1e-4f * std::abs(normal(gen));
      }
    }
    regrad(seed);
  }
  MasterSet(const MasterSet& other, Device device) {
    for (size_t i = 0; i < other.p.size(); ++i)
      for (auto [dst, src] : {std::pair{&p, &other.p}, {&g, &other.g}, {&m, &other.m}, {&v, &other.v}}) {
        dst->emplace_back((*src)[i]->dtype(), device, (*src)[i]->shape());
        copy_tensor(*(*src)[i], *dst->back());
      }
  }
  void regrad(uint32_t seed) {  // on the host set; copied to the device one by the caller
    std::mt19937 gen(seed);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (OwnedTensor& t : g)
      for (int64_t i = 0; i < t->numel(); ++i) t->data<float>()[i] = 0.01f * normal(gen);
  }
  std::vector<ops::AdamWBf16MasterTensor> list() const {
    std::vector<ops::AdamWBf16MasterTensor> out;
    for (size_t i = 0; i < p.size(); ++i)
      out.push_back({*p[i], *g[i], *m[i], *v[i], i == 0 ? 0.0 : 0.1, ops::rounding_stream(std::to_string(i)),
                     static_cast<int64_t>(3 * i)});
    return out;
  }
};

size_t differing_bytes(const MasterSet& cpu, const MasterSet& gpu) {
  size_t n = 0;
  for (size_t i = 0; i < cpu.p.size(); ++i)
    for (auto [a, b] : {CPair{&cpu.p, &gpu.p}, CPair{&cpu.m, &gpu.m}, CPair{&cpu.v, &gpu.v}}) {
      const OwnedTensor back = to_host(*(*b)[i]);
      const auto* x = static_cast<const unsigned char*>((*a)[i]->raw());
      const auto* y = static_cast<const unsigned char*>(back->raw());
      for (size_t j = 0; j < back->nbytes(); ++j) n += x[j] != y[j];
    }
  return n;
}

ops::AdamWStep step_of(int64_t t) {
  ops::AdamWStep s;
  s.lr = 1e-3;
  s.bias_correction1 = 1 - std::pow(s.beta1, static_cast<double>(t));
  s.bias_correction2 = 1 - std::pow(s.beta2, static_cast<double>(t));
  return s;
}

TEST_F(GpuBf16Masters, AdamWMatchesTheCpuReferenceBitwise) {
  MasterSet cpu(5);
  MasterSet gpu(cpu, Device::cuda);
  for (int64_t t = 1; t <= 3; ++t) {
    cpu.regrad(100 + static_cast<uint32_t>(t));
    for (size_t i = 0; i < cpu.g.size(); ++i) copy_tensor(*cpu.g[i], *gpu.g[i]);
    ops::adamw_bf16_master_update_all(process_exec(), cpu.list(), step_of(t), t);
    ops::adamw_bf16_master_update_all(process_exec(), gpu.list(), step_of(t), t);
  }
  const size_t differ = differing_bytes(cpu, gpu);
  std::printf("adamw bf16 masters: GPU against CPU after 3 steps: %zu bytes differ\n", differ);
  EXPECT_EQ(differ, 0u);
}

// Scalars in device memory (group 2, grad scale 0.37, update 7) give the bits of the host
// form on gradients scaled first (one fp32 product, the kernel's); skip changes nothing.
TEST_F(GpuBf16Masters, DeviceScalarsMatchHostScalarsAndSkipChangesNothing) {
  ops::DeviceUpdateScalars host{};
  host.grad_scale = 0.37f;
  const ops::AdamWStep s = step_of(7);
  host.group[2] = {static_cast<float>(s.lr), static_cast<float>(s.bias_correction1),
                   static_cast<float>(s.bias_correction2), 7};
  Storage device(Device::cuda, sizeof(host));
  device_copy(device.data(), Device::cuda, &host, Device::cpu, sizeof(host));
  const auto* scalars = static_cast<const ops::DeviceUpdateScalars*>(device.data());

  MasterSet cpu(9);
  MasterSet gpu(cpu, Device::cuda);
  for (OwnedTensor& g : cpu.g)
    for (int64_t i = 0; i < g->numel(); ++i) g->data<float>()[i] *= host.grad_scale;
  ops::adamw_bf16_master_update_all(process_exec(), cpu.list(), s, 7);
  ops::adamw_bf16_master_update_all_on_device(process_exec(), gpu.list(), s, scalars, 2);
  EXPECT_EQ(differing_bytes(cpu, gpu), 0u);

  host.skip = 1;
  device_copy(device.data(), Device::cuda, &host, Device::cpu, sizeof(host));
  ops::adamw_bf16_master_update_all_on_device(process_exec(), gpu.list(), s, scalars, 2);
  EXPECT_EQ(differing_bytes(cpu, gpu), 0u) << "a skipped step changed something";
}

// Muon on the GPU: a bf16 master and an fp32 master holding the same values take the same
// momentum and the same orthogonalized update (neither reads the weight); the bf16 master's
// new value is the fp32 one rounded with the bits of (stream, update, index), bit for bit,
// with host scalars and with device scalars. Two matrices of one shape (one batch) and one
// of another, odd sizes.
TEST_F(GpuBf16Masters, MuonRoundsTheFp32UpdateStochastically) {
  const std::vector<Shape> shapes{Shape{37, 64}, Shape{37, 64}, Shape{129, 33}};
  struct Matrix {
    OwnedTensor p16, p32, g, m16, m32;
  };
  std::vector<Matrix> mats;
  std::mt19937 gen(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (const Shape& shape : shapes) {
    OwnedTensor p16(DType::bf16, Device::cpu, shape), p32(DType::f32, Device::cpu, shape),
        g(DType::f32, Device::cpu, shape);
    auto* bits = static_cast<uint16_t*>(p16->raw());
    for (int64_t i = 0; i < shape.numel(); ++i) {
      bits[i] = float_to_bf16(0.02f * normal(gen));
      p32->data<float>()[i] = bf16_to_float(bits[i]);
      g->data<float>()[i] = 0.01f * normal(gen);
    }
    OwnedTensor zeros(DType::f32, Device::cpu, shape);
    zero_tensor(*zeros);
    mats.push_back({to_device(*p16), to_device(*p32), to_device(*g), to_device(*zeros), to_device(*zeros)});
  }
  ops::MuonUpdate narrow(ops::MuonSettings{}, shapes, Device::cuda), wide(ops::MuonSettings{}, shapes, Device::cuda);
  Arena arena("muon", Device::cuda);
  narrow.plan(arena), wide.plan(arena);
  arena.allocate();
  ops::DeviceUpdateScalars host{};
  host.grad_scale = 0.5f;
  Storage device(Device::cuda, sizeof(host));
  const auto* scalars = static_cast<const ops::DeviceUpdateScalars*>(device.data());
  for (int64_t update = 1; update <= 3; ++update) {
    std::vector<ops::MuonMatrix> n16, n32;
    for (size_t k = 0; k < mats.size(); ++k) {
      const uint64_t stream = ops::mix64(k + 1);
      n16.push_back({*mats[k].p16, *mats[k].g, *mats[k].m16, 0.1, 1.5, stream});
      n32.push_back({*mats[k].p32, *mats[k].g, *mats[k].m32, 0.1, 1.5, 0});
    }
    if (update == 3) {  // device scalars: the captured step's form
      host.group[1] = {0.02f, 1.0f, 1.0f, static_cast<uint32_t>(update)};
      device_copy(device.data(), Device::cuda, &host, Device::cpu, sizeof(host));
      narrow.step_on_device(process_exec(), n16, scalars, 1);
      wide.step_on_device(process_exec(), n32, scalars, 1);
    } else {
      narrow.step(process_exec(), n16, 0.02, 0.5, update);
      wide.step(process_exec(), n32, 0.02, 0.5, update);
    }
    for (size_t k = 0; k < mats.size(); ++k) {
      const OwnedTensor m16 = to_host(*mats[k].m16), m32 = to_host(*mats[k].m32);
      ASSERT_EQ(std::memcmp(m16->raw(), m32->raw(), m16->nbytes()), 0) << "momentum of matrix " << k;
      const OwnedTensor p16 = to_host(*mats[k].p16), p32 = to_host(*mats[k].p32);
      const uint64_t stream = ops::mix64(k + 1);
      const auto* bits = static_cast<const uint16_t*>(p16->raw());
      int64_t differ = 0;
      std::vector<float> restart(static_cast<size_t>(p16->numel()));
      for (int64_t i = 0; i < p16->numel(); ++i) {
        differ += bits[i] != ops::stochastic_round_bf16(p32->data<float>()[i],
                                                        ops::rounding_bits(stream, static_cast<uint64_t>(update), i));
        restart[static_cast<size_t>(i)] = bf16_to_float(bits[i]);
      }
      EXPECT_EQ(differ, 0) << "update " << update << ", matrix " << k;
      // The fp32 master restarts from the bf16 one, so the next step compares like with like.
      device_copy(mats[k].p32->raw(), Device::cuda, restart.data(), Device::cpu, restart.size() * 4);
    }
  }
}

// QK-Clip's rescale of a bf16 master on the GPU: the CPU's bits (fp32 products rounded to
// nearest even), per-head factors and a single one.
TEST_F(GpuBf16Masters, QkClipScalesBf16HeadRowsAsTheCpu) {
  const int64_t head_dim = 64, heads = 5, cols = 129;
  std::mt19937 gen(4);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  OwnedTensor w(DType::bf16, Device::cpu, Shape{heads * head_dim, cols});
  auto* bits = static_cast<uint16_t*>(w->raw());
  for (int64_t i = 0; i < w->numel(); ++i) bits[i] = float_to_bf16(0.05f * normal(gen));
  for (const int64_t count : {heads, int64_t{1}}) {
    OwnedTensor f(DType::f32, Device::cpu, Shape{count});
    for (int64_t h = 0; h < count; ++h) f->data<float>()[h] = 1.0f - 0.13f * static_cast<float>(h + 1);
    const OwnedTensor dw = to_device(*w), df = to_device(*f);
    ops::scale_head_rows(process_exec(), *w, *f, head_dim);
    ops::scale_head_rows(process_exec(), *dw, *df, head_dim);
    const OwnedTensor back = to_host(*dw);
    EXPECT_EQ(std::memcmp(back->raw(), w->raw(), w->nbytes()), 0) << count << " factors";
  }
}

}  // namespace
}  // namespace kiln
