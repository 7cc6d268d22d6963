// Muon on the GPU (ops/optim/muon.h) against the CPU reference: the update to bf16's
// precision and the momentum bit for bit, the device-scalar form against the host one,
// skipped steps, the standalone iteration's singular values, and reproducible bits (run to
// run, and a captured graph against the op-by-op step).
#include "core/device_memory.h"
#include "core/step_graphs.h"
#include "gpu/gpu_harness.h"
#include "muon_reference.h"
#include "ops/optim/muon.h"
#include "test_util.h"

#include <fmt/format.h>

#include <cmath>
#include <cstdio>
#include <utility>
#include <vector>

namespace kiln {
namespace {

using namespace gpu_test;

class GpuMuon : public GpuTest {};

// Matrices as row ranges [begin, end) of "fused" tensors (one range covering all rows is a
// plain matrix), with their own weight decay and update scale.
struct Range {
  size_t fused;
  int64_t begin, end;
  double weight_decay, update_scale;
};
struct Case {
  std::vector<Shape> fused;
  std::vector<Range> ranges;

  std::vector<Shape> shapes() const {
    std::vector<Shape> s;
    for (const Range& r : ranges) s.push_back(Shape{r.end - r.begin, fused[r.fused][1]});
    return s;
  }
};

// Wide, tall, square, three same-shape row ranges of one fused tensor (a bucket of 3, like
// q/k/v), a range that starts 10 rows into its tensor (33 columns: not 16-byte aligned, the
// kernels' scalar path), a matrix of two chunks (76800 elements), and 65 small matrices
// (one bucket cut into batches of 64 and 1 that share the workspace).
Case mixed_case() {
  Case c;
  auto whole = [&](Shape s, double wd, double scale) {
    c.fused.push_back(s);
    c.ranges.push_back({c.fused.size() - 1, 0, s[0], wd, scale});
  };
  whole(Shape{64, 160}, 0.1, 1.0);
  whole(Shape{160, 64}, 0.0, 1.58);
  whole(Shape{96, 96}, 0.1, 1.0);
  c.fused.push_back(Shape{144, 80});
  for (int64_t k = 0; k < 3; ++k) c.ranges.push_back({c.fused.size() - 1, 48 * k, 48 * (k + 1), 0.1, 0.5});
  c.fused.push_back(Shape{40, 33});
  c.ranges.push_back({c.fused.size() - 1, 10, 40, 0.1, 1.0});
  whole(Shape{256, 300}, 0.1, 1.0);
  for (int i = 0; i < 65; ++i) whole(Shape{8, 12}, 0.05, 1.0);
  return c;
}

// P, two gradients and the momentum of every fused tensor, in one dtype on one device,
// from the same fp32 host values for every copy.
struct Tensors {
  std::vector<OwnedTensor> p, g1, g2, m;

  Tensors(const Case& c, DType dtype, Device device) {
    uint64_t seed = 900;
    for (const Shape& s : c.fused) {
      const OwnedTensor p32 = test::random_tensor(DType::f32, s, ++seed);
      const OwnedTensor g132 = test::random_tensor(DType::f32, s, ++seed);
      const OwnedTensor g232 = test::random_tensor(DType::f32, s, ++seed);
      const OwnedTensor m32 = test::random_tensor(DType::f32, s, ++seed, 0.1);
      p.push_back(place(*p32, dtype, device));
      g1.push_back(place(*g132, dtype, device));
      g2.push_back(place(*g232, dtype, device));
      m.push_back(place(*m32, dtype, device));
    }
  }
  static OwnedTensor place(const Tensor& f32, DType dtype, Device device) {
    OwnedTensor host = dtype == DType::f64 ? to_f64(f32) : to_host(f32);
    return device == Device::cpu ? std::move(host) : to_device(*host);
  }
  std::vector<ops::MuonMatrix> list(const Case& c, bool second) const {
    std::vector<ops::MuonMatrix> l;
    for (const Range& r : c.ranges) {
      const auto& g = second ? g2 : g1;
      l.push_back({p[r.fused]->rows(r.begin, r.end), g[r.fused]->rows(r.begin, r.end), m[r.fused]->rows(r.begin, r.end),
                   r.weight_decay, r.update_scale});
    }
    return l;
  }
  // Copies another set's parameters and momentum (same case): a reset to its state.
  void load_state(const Tensors& from) {
    for (size_t i = 0; i < p.size(); ++i) copy_tensor(*from.p[i], *p[i]), copy_tensor(*from.m[i], *m[i]);
  }
};

// A GPU update with its own arena, planned and allocated.
struct GpuUpdate {
  ops::MuonUpdate update;
  Arena arena{"muon", Device::cuda};
  GpuUpdate(ops::MuonSettings settings, std::vector<Shape> shapes) : update(settings, std::move(shapes), Device::cuda) {
    update.plan(arena);
    EXPECT_EQ(arena.planned_bytes(), update.planned_bytes());
    arena.allocate();
  }
};

std::vector<double> host_values(const Tensor& t) {
  const OwnedTensor h(t.dtype(), Device::cpu, t.shape());
  copy_tensor(t, *h);
  std::vector<double> v(static_cast<size_t>(t.numel()));
  for (int64_t i = 0; i < t.numel(); ++i)
    v[static_cast<size_t>(i)] = t.dtype() == DType::f64 ? h->data<double>()[i] : h->data<float>()[i];
  return v;
}

bool same_state(const Case& c, const Tensors& a, const Tensors& b) {
  bool same = true;
  for (size_t i = 0; i < c.fused.size(); ++i) {
    const bool p = same_bytes(*to_host(*a.p[i]), *to_host(*b.p[i]));
    const bool m = same_bytes(*to_host(*a.m[i]), *to_host(*b.m[i]));
    EXPECT_TRUE(p) << "param of fused tensor " << i;
    EXPECT_TRUE(m) << "momentum of fused tensor " << i;
    same = same && p && m;
  }
  return same;
}

constexpr double kLr = 0.02, kGradScale = 0.37;

// 5. Two steps on the GPU against the CPU: per matrix, the parameters' change agrees with
// the f64 reference to 4e-2 of the update's RMS (RMS of the error; the largest element
// error within 0.2 of it). Why that much: the iteration runs on bf16 operands, each iterate
// and Gram matrix rounded to 8 significant bits (2^-9 relative) at every one of its 15
// GEMMs a step, and the quintic's slope (up to a = 3.44 on small singular values) carries
// the early steps' errors forward; an emulation of exactly this arithmetic (numpy, bf16
// rounding of every GEMM output) measured an RMS error of 0.95e-2 to 2.1e-2 and a largest
// error of 0.06 to 0.08 of the RMS on these shapes over 8 seeds. The momentum is
// elementwise fp32 with each product and sum rounded on its own on both sides: the bits of
// the f32 CPU update.
TEST_F(GpuMuon, MatchesTheCpuReference) {
  const Case c = mixed_case();
  for (const bool ema : {false, true}) {
    SCOPED_TRACE(ema ? "ema" : "plain");
    ops::MuonSettings settings;
    settings.ema = ema;
    Tensors gpu(c, DType::f32, Device::cuda), cpu32(c, DType::f32, Device::cpu), cpu64(c, DType::f64, Device::cpu);
    const Tensors start(c, DType::f64, Device::cpu);
    GpuUpdate g(settings, c.shapes());
    ops::MuonUpdate u32(settings, c.shapes(), Device::cpu), u64(settings, c.shapes(), Device::cpu);
    for (const bool second : {false, true}) {
      g.update.step(process_exec(), gpu.list(c, second), kLr, kGradScale);
      u32.step(process_exec(), cpu32.list(c, second), kLr, kGradScale);
      u64.step(process_exec(), cpu64.list(c, second), kLr, kGradScale);
    }
    for (size_t i = 0; i < c.fused.size(); ++i)
      EXPECT_TRUE(same_bytes(*to_host(*gpu.m[i]), *cpu32.m[i])) << "momentum of fused tensor " << i;
    double worst_rms = 0, worst_max = 0;
    const auto gl = gpu.list(c, false), rl = cpu64.list(c, false), sl = start.list(c, false);
    for (size_t k = 0; k < c.ranges.size(); ++k) {
      const std::vector<double> pg = host_values(gl[k].param), pr = host_values(rl[k].param),
                                p0 = host_values(sl[k].param);
      const double decay = 1 - kLr * c.ranges[k].weight_decay;
      double update_ss = 0, error_ss = 0, error_max = 0;
      for (size_t j = 0; j < pg.size(); ++j) {
        const double update = pr[j] - p0[j] * decay * decay, error = pg[j] - pr[j];
        update_ss += update * update, error_ss += error * error, error_max = std::max(error_max, std::abs(error));
      }
      const double rms = std::sqrt(update_ss / static_cast<double>(pg.size()));
      const double rel_rms = std::sqrt(error_ss / static_cast<double>(pg.size())) / rms, rel_max = error_max / rms;
      EXPECT_LT(rel_rms, 4e-2) << "matrix " << k << " " << gl[k].param.describe();
      EXPECT_LT(rel_max, 0.2) << "matrix " << k << " " << gl[k].param.describe();
      worst_rms = std::max(worst_rms, rel_rms), worst_max = std::max(worst_max, rel_max);
    }
    ::testing::Test::RecordProperty(ema ? "ema_update_error" : "plain_update_error",
                                    fmt::format("rms {:.3e}, max {:.3e} of the update's rms", worst_rms, worst_max));
    std::printf("muon %s: the update's error against f64, worst matrix: rms %.3e, max %.3e of its rms\n",
                ema ? "ema" : "plain", worst_rms, worst_max);
  }
}

// 6. The scalars in device memory (group 3; the other groups' lr zero) give the bits of the
// host-scalar step with the same values; with skip set nothing changes at all.
TEST_F(GpuMuon, DeviceScalarsMatchHostScalarsAndSkipChangesNothing) {
  const Case c = mixed_case();
  const ops::MuonSettings settings;
  ops::DeviceUpdateScalars host{};
  host.grad_scale = 0.37f;
  host.group[3].lr = 0.02f;
  Storage device(Device::cuda, sizeof(host));
  device_copy(device.data(), Device::cuda, &host, Device::cpu, sizeof(host));
  const auto* scalars = static_cast<const ops::DeviceUpdateScalars*>(device.data());

  Tensors a(c, DType::f32, Device::cuda), b(c, DType::f32, Device::cuda);
  GpuUpdate ua(settings, c.shapes()), ub(settings, c.shapes());
  for (const bool second : {false, true}) {
    ua.update.step(process_exec(), a.list(c, second), host.group[3].lr, host.grad_scale);
    ub.update.step_on_device(process_exec(), b.list(c, second), scalars, 3);
  }
  EXPECT_TRUE(same_state(c, a, b));

  host.skip = 1;
  device_copy(device.data(), Device::cuda, &host, Device::cpu, sizeof(host));
  ub.update.step_on_device(process_exec(), b.list(c, false), scalars, 3);
  EXPECT_TRUE(same_state(c, a, b)) << "a skipped step changed something";
}

// 7. The GPU iteration's output has singular values in the quintic's band, widened by bf16:
// for these inputs (smallest normalized singular value about 0.06) the exact band is
// [0.6818, 1.1344]; the bf16 emulation measured [0.679, 1.138]. Checked within [0.6, 1.25],
// and against the f64 CPU iteration to 4e-2 of the output's RMS (see MatchesTheCpuReference).
TEST_F(GpuMuon, NewtonSchulzSingularValuesStayInTheBand) {
  for (const Shape shape : {Shape{64, 256}, Shape{256, 64}}) {
    SCOPED_TRACE(shape.str());
    const OwnedTensor x32 = test::random_tensor(DType::f32, shape, 77);
    OwnedTensor xd = to_device(*x32), x64 = to_f64(*x32);
    ops::newton_schulz(process_exec(), *xd, 5);
    ops::newton_schulz(process_exec(), *x64, 5);
    const std::vector<double> got = host_values(*xd), ref = host_values(*x64);
    const std::vector<double> s = muon_test::singular_values(got, shape[0], shape[1]);
    EXPECT_GT(s.back(), 0.6);
    EXPECT_LT(s.front(), 1.25);
    double ref_ss = 0, err_ss = 0;
    for (size_t i = 0; i < got.size(); ++i) ref_ss += ref[i] * ref[i], err_ss += (got[i] - ref[i]) * (got[i] - ref[i]);
    EXPECT_LT(std::sqrt(err_ss / ref_ss), 4e-2);
    ::testing::Test::RecordProperty("band_" + std::to_string(shape[0]) + "x" + std::to_string(shape[1]),
                                    fmt::format("[{:.4f}, {:.4f}], rms error {:.3e}", s.back(), s.front(),
                                                std::sqrt(err_ss / ref_ss)));
    std::printf("newton_schulz %s on the GPU: singular values in [%.4f, %.4f], rms error against f64 %.3e\n",
                shape.str().c_str(), s.back(), s.front(), std::sqrt(err_ss / ref_ss));
  }
}

// 8. The same inputs give the same bits: two op-by-op steps of one update from the same
// state, and a captured graph of the device-scalar step replayed against that step.
TEST_F(GpuMuon, StepsAreReproducibleAndCapturable) {
  const Case c = mixed_case();
  const ops::MuonSettings settings;
  ops::DeviceUpdateScalars host{};
  host.grad_scale = 0.37f;
  host.group[3].lr = 0.02f;
  Storage device(Device::cuda, sizeof(host));
  device_copy(device.data(), Device::cuda, &host, Device::cpu, sizeof(host));
  const auto* scalars = static_cast<const ops::DeviceUpdateScalars*>(device.data());

  const Tensors start(c, DType::f32, Device::cuda);
  Tensors work(c, DType::f32, Device::cuda), first(c, DType::f32, Device::cuda);
  GpuUpdate u(settings, c.shapes());
  u.update.step(process_exec(), work.list(c, false), kLr, kGradScale);
  first.load_state(work);
  work.load_state(start);
  u.update.step(process_exec(), work.list(c, false), kLr, kGradScale);
  EXPECT_TRUE(same_state(c, work, first)) << "two runs of one step differ";

  cuda::StepGraphs graphs("muon test", process_exec());
  const auto list = work.list(c, false);
  auto step = [&] { u.update.step_on_device(process_exec(), list, scalars, 3); };
  work.load_state(start);
  graphs.run(0, step);  // runs op by op, then captures
  ASSERT_TRUE(graphs.captured(0)) << "the device-scalar step could not be captured";
  first.load_state(work);
  work.load_state(start);
  graphs.run(0, step);  // the graph
  EXPECT_EQ(graphs.launches(), 1);
  synchronize_stream();
  EXPECT_TRUE(same_state(c, work, first)) << "the captured step differs from the op-by-op one";
}

}  // namespace
}  // namespace kiln
