// AdamW with bf16 and 8-bit moments on the GPU (ops/optim/adamw_lowmem.h) against the CPU
// reference: both compute adamw_lowmem_math.h's arithmetic (each operation rounded to fp32
// on its own, the same nearest-code search, exact block maxima), so parameters, moments,
// codes and absmax must agree bit for bit. Then the device-scalar form against the host
// one, skipped steps, and a captured graph against the op-by-op step.
#include "adamw_lowmem_fixture.h"
#include "core/device_memory.h"
#include "core/step_graphs.h"
#include "gpu/gpu_harness.h"

#include <cstdio>

namespace kiln {
namespace {

using namespace gpu_test;
using lowmem_test::LowMemSet;
using lowmem_test::step_of;

class GpuAdamWLowMem : public GpuTest {};

const char* name_of(ops::AdamWState s) { return s == ops::AdamWState::bf16 ? "bf16" : "int8"; }

// Bytes that differ between two sets' written state, per tensor list (p, m, v, m_absmax,
// v_absmax), for the message.
size_t differing_bytes(const LowMemSet& a, const LowMemSet& b) {
  const auto x = a.state_bytes(), y = b.state_bytes();
  size_t n = 0;
  for (size_t i = 0; i < x.size(); ++i) {
    if (x[i].size() != y[i].size()) return SIZE_MAX;
    for (size_t j = 0; j < x[i].size(); ++j) n += x[i][j] != y[i][j];
  }
  return n;
}

// Three steps with new gradients each, on the GPU (host scalars) and on the CPU.
TEST_F(GpuAdamWLowMem, MatchesTheCpuReferenceBitwise) {
  for (const auto state : {ops::AdamWState::bf16, ops::AdamWState::int8}) {
    SCOPED_TRACE(name_of(state));
    LowMemSet cpu(state, lowmem_test::mixed_shapes(), 31);
    LowMemSet gpu(cpu, Device::cuda);
    ops::AdamWLowMemDeviceTable cpu_table, gpu_table;
    for (int64_t t = 1; t <= 3; ++t) {
      cpu.regrad(500 * t), gpu.regrad(500 * t);
      ops::adamw_lowmem_update_all(process_exec(), state, cpu.list(), step_of(t), cpu_table);
      ops::adamw_lowmem_update_all(process_exec(), state, gpu.list(), step_of(t), gpu_table);
    }
    const size_t differ = differing_bytes(cpu, gpu);
    std::printf("adamw %s moments: GPU against CPU after 3 steps: %zu bytes differ\n", name_of(state), differ);
    EXPECT_EQ(differ, 0u);
  }
}

// The scalars in device memory (group 3, grad scale 0.37) give the bits of the CPU step on
// gradients scaled first (one fp32 product each: the kernel's); skip changes nothing.
TEST_F(GpuAdamWLowMem, DeviceScalarsMatchHostScalarsAndSkipChangesNothing) {
  for (const auto state : {ops::AdamWState::bf16, ops::AdamWState::int8}) {
    SCOPED_TRACE(name_of(state));
    ops::DeviceUpdateScalars host{};
    host.grad_scale = 0.37f;
    const ops::AdamWStep s = step_of(2);
    host.group[3] = {static_cast<float>(s.lr), static_cast<float>(s.bias_correction1),
                     static_cast<float>(s.bias_correction2)};
    Storage device(Device::cuda, sizeof(host));
    device_copy(device.data(), Device::cuda, &host, Device::cpu, sizeof(host));
    const auto* scalars = static_cast<const ops::DeviceUpdateScalars*>(device.data());

    LowMemSet cpu(state, lowmem_test::mixed_shapes(), 41);
    LowMemSet gpu(cpu, Device::cuda);
    for (OwnedTensor& g : cpu.g)
      for (int64_t i = 0; i < g->numel(); ++i) g->data<float>()[i] *= host.grad_scale;
    ops::AdamWLowMemDeviceTable cpu_table, gpu_table;
    ops::adamw_lowmem_update_all(process_exec(), state, cpu.list(), s, cpu_table);
    ops::adamw_lowmem_update_all_on_device(process_exec(), state, gpu.list(), s, scalars, 3, gpu_table);
    EXPECT_EQ(differing_bytes(cpu, gpu), 0u);

    host.skip = 1;
    device_copy(device.data(), Device::cuda, &host, Device::cpu, sizeof(host));
    ops::adamw_lowmem_update_all_on_device(process_exec(), state, gpu.list(), s, scalars, 3, gpu_table);
    EXPECT_EQ(differing_bytes(cpu, gpu), 0u) << "a skipped step changed something";
  }
}

// A captured graph of the device-scalar step replayed gives the op-by-op step's bits.
TEST_F(GpuAdamWLowMem, CapturedStepMatchesTheOpByOpStep) {
  for (const auto state : {ops::AdamWState::bf16, ops::AdamWState::int8}) {
    SCOPED_TRACE(name_of(state));
    ops::DeviceUpdateScalars host{};
    host.grad_scale = 0.5f;
    host.group[1] = {1e-2f, 0.19f, 0.0975f};
    Storage device(Device::cuda, sizeof(host));
    device_copy(device.data(), Device::cuda, &host, Device::cpu, sizeof(host));
    const auto* scalars = static_cast<const ops::DeviceUpdateScalars*>(device.data());

    const LowMemSet seed(state, lowmem_test::mixed_shapes(), 51);
    const LowMemSet start(seed, Device::cuda);
    LowMemSet work(seed, Device::cuda), first(seed, Device::cuda);
    ops::AdamWLowMemDeviceTable table;
    const auto list = work.list();
    auto step = [&] { ops::adamw_lowmem_update_all_on_device(process_exec(), state, list, step_of(2), scalars, 1, table); };
    cuda::StepGraphs graphs("adamw lowmem test", process_exec());
    graphs.run(0, step);  // runs op by op (and builds the table), then captures
    ASSERT_TRUE(graphs.captured(0)) << "the device-scalar step could not be captured";
    first.load_state(work);
    work.load_state(start);
    graphs.run(0, step);  // the graph
    EXPECT_EQ(graphs.launches(), 1);
    synchronize_stream();
    EXPECT_EQ(differing_bytes(work, first), 0u) << "the captured step differs from the op-by-op one";
  }
}

}  // namespace
}  // namespace kiln
