// Kimi Delta Attention on the GPU (ops/kda/kda_cuda.cu, kda_chunked_*.cu) through the
// ops:: front ends, against the CPU recurrent oracle run in f64 on the same inputs (rounded
// to bf16 first where the GPU reads bf16, to f32 otherwise): the recurrent and the chunked
// forward (out, final state), their backward (dq, dk, dv, dg, dbeta, d_initial_state) and
// the decay gate (g; draw, dA_log, ddt_bias). Outputs are poisoned (NaN bytes) before each run, so an element never
// written fails; every case runs twice and must give the same bytes (no atomics).
//
// Error: relative L2, ||gpu - ref|| / ||ref||, per tensor.
//   bf16   out 5e-3, every gradient 7e-3   (the bars of seed 001, B=1 T=64 H=1 D=128:
//                                           one bf16 rounding of each result, ~1e-3 rms,
//                                           over fp32 arithmetic)
//   f32    out 1e-4, every gradient 2e-4   (fp32 sums over d_k, d_v and the recurrence)
// Sizes: the seed's [1, 64, 1, 128] with the gate in front (7 input gradients: q, k, v,
// beta, raw gate, A_log, dt_bias), and awkward ones: lengths 1, 63, 65, 4097, several
// documents per batch (one of them empty), d_k / d_v that leave slices partly empty, with
// initial state and d_final_state.
#include "core/device_memory.h"
#include "core/tensor.h"
#include "gpu/bf16_tensors.h"
#include "gpu/gpu_harness.h"
#include "grad_check.h"
#include "ops/kda/kda.h"
#include "ops/kda/kda_gate.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <string>
#include <vector>

namespace kiln {
namespace {

using gpu_test::bf16_of;
using gpu_test::f32_of_bf16;
using gpu_test::poison;
using gpu_test::same_bytes;
using gpu_test::to_device;
using gpu_test::to_host;

// f64 values as the GPU reads them in `dt` (rounded to f32, then to bf16 for bf16).
OwnedTensor rounded(const Tensor& f64, DType dt) {
  OwnedTensor f32 = gpu_test::to_f32(f64);
  if (dt == DType::bf16) gpu_test::round_to_bf16(*f32);
  return gpu_test::to_f64(*f32);
}

// A device tensor of `dt` holding f64's (already rounded) values.
OwnedTensor device_of(const Tensor& f64, DType dt) {
  OwnedTensor f32 = gpu_test::to_f32(f64);
  return dt == DType::bf16 ? to_device(*bf16_of(*f32)) : to_device(*f32);
}

OwnedTensor device_empty(DType dt, Shape shape) {
  OwnedTensor t(dt, Device::cuda, shape);
  poison(*t);
  return t;
}

// A device tensor's values as f64 on the host.
std::vector<double> values(const Tensor& dev) {
  OwnedTensor host = to_host(dev);
  if (host->dtype() == DType::bf16) return test::values_of(*f32_of_bf16(*host));
  return test::values_of(*host);
}

std::vector<uint8_t> bytes(const Tensor& dev) {
  OwnedTensor host = to_host(dev);
  const auto* p = static_cast<const uint8_t*>(host->raw());
  return std::vector<uint8_t>(p, p + host->nbytes());
}

double rel_l2(const std::vector<double>& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double d = got[i] - ref[i];
    num += std::isfinite(got[i]) ? d * d : INFINITY;
    den += ref[i] * ref[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

void expect_rel(const std::string& name, const Tensor& dev, const Tensor& ref_f64, double tol) {
  const double e = rel_l2(values(dev), test::values_of(ref_f64));
  EXPECT_LT(e, tol) << name << " relative L2 " << e;
  ::testing::Test::RecordProperty(name + "_rel_l2", fmt::format("{:.3e}", e));
}

// The GPU kernels under test: the token-by-token recurrence or the chunked WY form (the
// latter only up to its d_k; the reference is the recurrent oracle for both).
enum class Form { recurrent, chunked };

struct Spec {
  std::vector<int32_t> lengths;
  int64_t heads, dk, dv;
  DType dtype;
  bool gate;    // g from the gate op (raw, A_log, dt_bias) rather than given
  bool states;  // initial state and d_final_state
  uint64_t seed;
};

std::string name_of(const Spec& s) {
  return fmt::format("lengths {} H {} dk {} dv {} {} gate {} states {}", fmt::join(s.lengths, ","), s.heads, s.dk,
                     s.dv, dtype_name(s.dtype), s.gate, s.states);
}

// slice, tensor_cores, bf16_grads: the chunked kernels' (ops::KdaOptions::gpu_slice, 0 =
// chosen at launch; gpu_tensor_cores; gpu_bf16_grads).
void run_form(const Spec& sp, Form form, int slice = 0, bool tensor_cores = true, bool bf16_grads = false) {
  const bool chunked = form == Form::chunked;
  SCOPED_TRACE(name_of(sp) +
               (chunked ? fmt::format(" chunked, slice {}, tensor cores {}, bf16 grads {}", slice, tensor_cores, bf16_grads)
                       : " recurrent"));
  ops::KdaOptions chunked_options;
  chunked_options.gpu_slice = slice;
  chunked_options.gpu_tensor_cores = tensor_cores;
  chunked_options.gpu_bf16_grads = bf16_grads;
  const DType dt = sp.dtype;
  const int64_t n = std::accumulate(sp.lengths.begin(), sp.lengths.end(), int64_t{0});
  const int64_t H = sp.heads, dk = sp.dk, dv = sp.dv, S = static_cast<int64_t>(sp.lengths.size());
  const Shape kshape{n, H, dk}, vshape{n, H, dv}, bshape{n, H}, sshape{S, H, dk, dv};
  std::vector<int32_t> cu{0};
  for (int32_t l : sp.lengths) cu.push_back(cu.back() + l);
  OwnedTensor cu_host = test::i32_tensor(cu), cu_dev = to_device(*cu_host);

  // Inputs in f64 as test_kda.cpp draws them: q, k unit rows, g in [-1.5, -0.02], beta a sigmoid.
  OwnedTensor q = test::random_f64(kshape, sp.seed), k = test::random_f64(kshape, sp.seed + 1),
              v = test::random_f64(vshape, sp.seed + 2), beta = test::random_f64(bshape, sp.seed + 4),
              h0 = test::random_f64(sshape, sp.seed + 5, 0.5);
  for (const Tensor* t : {&*q, &*k}) {
    double* p = t->data<double>();
    for (int64_t r = 0; r < n * H; ++r) {
      double norm = 0;
      for (int64_t i = 0; i < dk; ++i) norm += p[r * dk + i] * p[r * dk + i];
      for (int64_t i = 0; i < dk; ++i) p[r * dk + i] /= std::sqrt(norm);
    }
  }
  for (int64_t i = 0; i < beta->numel(); ++i) beta->data<double>()[i] = 1 / (1 + std::exp(-beta->data<double>()[i]));
  q = rounded(*q, dt);
  k = rounded(*k, dt);
  v = rounded(*v, dt);
  beta = rounded(*beta, dt);
  h0 = rounded(*h0, DType::f32);

  // g: given, or from the gate (raw of dt; A_log, dt_bias f32) -- the reference's g is
  // rounded as the GPU stores it.
  OwnedTensor raw = rounded(*test::random_f64(kshape, sp.seed + 3), dt);
  OwnedTensor a_log = rounded(*test::random_f64(Shape{H}, sp.seed + 6, 0.5), DType::f32);
  OwnedTensor dt_bias = rounded(*test::random_f64(Shape{H, dk}, sp.seed + 7, 0.5), DType::f32);
  OwnedTensor g = test::nan_f64(kshape);
  if (sp.gate) {
    ops::kda_gate_forward(process_exec(), *raw, *a_log, *dt_bias, *g);
  } else {
    OwnedTensor r = test::random_f64(kshape, sp.seed + 3);
    for (int64_t i = 0; i < g->numel(); ++i) g->data<double>()[i] = -0.02 - 1.48 / (1 + std::exp(-r->data<double>()[i]));
  }
  g = rounded(*g, dt);
  OwnedTensor dout = rounded(*test::random_f64(vshape, sp.seed + 8), dt);
  OwnedTensor dht = rounded(*test::random_f64(sshape, sp.seed + 9), DType::f32);
  const Tensor h0_ref = sp.states ? *h0 : Tensor(), dht_ref = sp.states ? *dht : Tensor();

  // Reference.
  OwnedTensor out = test::nan_f64(vshape), ht = test::nan_f64(sshape);
  ops::kda_recurrent_forward(process_exec(), *q, *k, *v, *g, *beta, *cu_host, h0_ref, {}, *out, *ht);
  OwnedTensor dq = test::nan_f64(kshape), dk_ = test::nan_f64(kshape), dv_ = test::nan_f64(vshape),
              dg = test::nan_f64(kshape), db = test::nan_f64(bshape), dh0 = test::nan_f64(sshape);
  ops::kda_recurrent_backward(process_exec(), *q, *k, *v, *g, *beta, *cu_host, h0_ref, *dout, dht_ref, {}, *dq, *dk_,
                              *dv_, *dg, *db, sp.states ? *dh0 : Tensor());
  OwnedTensor draw = test::nan_f64(kshape), da = test::filled_f64(Shape{H}, 0.0),
              ddb = test::filled_f64(Shape{H, dk}, 0.0);
  if (sp.gate) ops::kda_gate_backward(process_exec(), *raw, *a_log, *dt_bias, *dg, *draw, *da, *ddb);

  // GPU, twice.
  OwnedTensor q_d = device_of(*q, dt), k_d = device_of(*k, dt), v_d = device_of(*v, dt), b_d = device_of(*beta, dt),
              h0_d = device_of(*h0, DType::f32), dout_d = device_of(*dout, dt), dht_d = device_of(*dht, DType::f32),
              raw_d = device_of(*raw, dt), alog_d = device_of(*a_log, DType::f32),
              bias_d = device_of(*dt_bias, DType::f32), gin_d = device_of(*g, dt);
  const int64_t ws_elems =
      chunked ? ops::kda_chunked_workspace(n, H, dk, dv, S) : ops::kda_backward_workspace(n, H, dk, dv, S);
  OwnedTensor ws(DType::f32, Device::cuda, Shape{std::max<int64_t>(ws_elems, 1)});
  std::vector<std::vector<uint8_t>> first;
  for (int pass = 0; pass < 2; ++pass) {
    SCOPED_TRACE(fmt::format("pass {}", pass));
    OwnedTensor g_d = device_empty(dt, kshape), o_d = device_empty(dt, vshape),
                ht_d = device_empty(DType::f32, sshape), dq_d = device_empty(dt, kshape),
                dk_d = device_empty(dt, kshape), dv_d = device_empty(dt, vshape), dg_d = device_empty(dt, kshape),
                db_d = device_empty(dt, bshape), dh0_d = device_empty(DType::f32, sshape),
                draw_d = device_empty(dt, kshape);
    OwnedTensor da_d = device_of(*test::filled_f64(Shape{H}, 0.0), DType::f32),
                ddb_d = device_of(*test::filled_f64(Shape{H, dk}, 0.0), DType::f32);
    poison(*ws);
    const Tensor h0_dev = sp.states ? *h0_d : Tensor(), dht_dev = sp.states ? *dht_d : Tensor();
    const Tensor g_use = sp.gate ? *g_d : *gin_d;
    if (sp.gate) ops::kda_gate_forward(process_exec(), *raw_d, *alog_d, *bias_d, *g_d);
    if (chunked) {
      ops::kda_chunked_forward(process_exec(), *q_d, *k_d, *v_d, g_use, *b_d, *cu_dev, h0_dev, chunked_options, *o_d,
                               *ht_d, *ws);
      poison(*ws);  // the backward recomputes what it needs
      ops::kda_chunked_backward(process_exec(), *q_d, *k_d, *v_d, g_use, *b_d, *cu_dev, h0_dev, *dout_d, dht_dev,
                                chunked_options,
                                *dq_d, *dk_d, *dv_d, *dg_d, *db_d, sp.states ? *dh0_d : Tensor(), *ws);
    } else {
      ops::kda_recurrent_forward(process_exec(), *q_d, *k_d, *v_d, g_use, *b_d, *cu_dev, h0_dev, {}, *o_d, *ht_d);
      ops::kda_recurrent_backward(process_exec(), *q_d, *k_d, *v_d, g_use, *b_d, *cu_dev, h0_dev, *dout_d, dht_dev,
                                  {}, *dq_d, *dk_d, *dv_d, *dg_d, *db_d, sp.states ? *dh0_d : Tensor(), *ws);
    }
    if (sp.gate) ops::kda_gate_backward(process_exec(), *raw_d, *alog_d, *bias_d, *dg_d, *draw_d, *da_d, *ddb_d);

    const bool bf = dt == DType::bf16;
    const double tol_out = bf ? 5e-3 : 1e-4, tol_grad = bf ? 7e-3 : 2e-4;
    if (sp.gate) expect_rel("g", *g_d, *g, bf ? 5e-3 : 1e-5);
    expect_rel("out", *o_d, *out, tol_out);
    expect_rel("final_state", *ht_d, *ht, bf ? 5e-3 : 1e-4);
    expect_rel("dq", *dq_d, *dq, tol_grad);
    expect_rel("dk", *dk_d, *dk_, tol_grad);
    expect_rel("dv", *dv_d, *dv_, tol_grad);
    expect_rel("dg", *dg_d, *dg, tol_grad);
    expect_rel("dbeta", *db_d, *db, tol_grad);
    if (sp.states) expect_rel("d_initial_state", *dh0_d, *dh0, tol_grad);
    if (sp.gate) {
      expect_rel("draw", *draw_d, *draw, tol_grad);
      expect_rel("dA_log", *da_d, *da, tol_grad);
      expect_rel("ddt_bias", *ddb_d, *ddb, tol_grad);
    }
    std::vector<std::vector<uint8_t>> all;
    for (const Tensor* t : {&*g_d, &*o_d, &*ht_d, &*dq_d, &*dk_d, &*dv_d, &*dg_d, &*db_d, &*dh0_d, &*draw_d, &*da_d,
                            &*ddb_d})
      all.push_back(bytes(*t));
    if (pass == 0)
      first = all;
    else
      for (size_t i = 0; i < all.size(); ++i) EXPECT_TRUE(all[i] == first[i]) << "output " << i << " differs between runs";
  }
}

// Both kernels on the same inputs (the chunked one where d_k allows, at the slice the
// launch chooses and at each one it can choose, with and without tensor cores; and with the
// backward's bf16 grads kernels, model.kda.gpu_kernel = "chunked_bf16", which take bf16
// inputs with d_k and d_v multiples of 16 and leave the others to the tf32 or fp32 kernels).
void run(const Spec& sp) {
  run_form(sp, Form::recurrent);
  if (sp.dk <= ops::kda_chunked_max_dk()) {
    for (bool tensor_cores : {true, false})
      for (int slice : {0, 8, 16, 32}) run_form(sp, Form::chunked, slice, tensor_cores);
    run_form(sp, Form::chunked, 0, true, /*bf16_grads=*/true);
  }
}

class GpuKda : public gpu_test::GpuTest {};

// Seed 001's shape, B=1 T=64 H=1 D=128 in bf16, with the gate: q, k, v, beta and the
// gate's raw input, A_log and dt_bias.
TEST_F(GpuKda, Seed001ShapeBf16WithGate) { run({{64}, 1, 128, 128, DType::bf16, true, false, 1}); }

TEST_F(GpuKda, Seed001ShapeF32WithGate) { run({{64}, 1, 128, 128, DType::f32, true, false, 2}); }

TEST_F(GpuKda, AwkwardLengthsWithStates) {
  for (DType dt : {DType::f32, DType::bf16})
    for (int32_t len : {1, 63, 65, 130}) run({{len}, 2, 128, 128, dt, false, true, 10 + static_cast<uint64_t>(len)});
}

TEST_F(GpuKda, LongDocument) {
  for (DType dt : {DType::f32, DType::bf16}) run({{4097}, 1, 128, 128, dt, false, true, 20});
}

// Several documents per batch (one empty); d_k / d_v that leave the last d_v slice partly
// empty and lanes without rows (d_k 5 and 48: one row per lane; 64; 200: eight).
TEST_F(GpuKda, SeveralDocumentsAndOddSizes) {
  const std::vector<int32_t> docs{65, 1, 130, 0, 63, 64, 7};
  for (DType dt : {DType::f32, DType::bf16}) {
    run({docs, 3, 64, 48, dt, false, true, 30});
    run({docs, 2, 5, 7, dt, true, true, 31});
    run({docs, 2, 48, 130, dt, false, true, 32});
    run({{70, 3}, 1, 200, 24, dt, true, true, 33});
  }
}

// The tensor cores' grads kernel at shapes the others miss: d_k 48 (its pairwise sums' last
// channel slab 16 wide), and d_v 256, too wide for k and q's staging beside the pairwise
// sums' in Hopper's 227 KiB (its k and q read from global memory).
TEST_F(GpuKda, TensorCoreGradsShapes) {
  run({{65, 130, 17}, 2, 48, 32, DType::bf16, false, true, 60});
  run({{65, 130, 17}, 1, 128, 256, DType::bf16, true, true, 61});
}

// Many short documents (the chunked kernels find each chunk's document by a search over
// cu_seqlens; most slots of the chunk grid are a document's only, short, chunk).
TEST_F(GpuKda, ManyShortDocuments) {
  std::vector<int32_t> docs;
  for (int32_t i = 0; i < 90; ++i) docs.push_back((i * 37) % 71);
  for (DType dt : {DType::f32, DType::bf16}) run({docs, 2, 64, 40, dt, true, true, 50});
}

// The chunked kernels refuse what they cannot take, in one line naming the limit.
TEST_F(GpuKda, ChunkedRefusesWideKeysAndOtherChunks) {
  const int64_t n = 8, H = 1;
  OwnedTensor cu = to_device(*test::i32_tensor({0, 8}));
  for (int64_t dk : {ops::kda_chunked_max_dk() + 1, int64_t{16}}) {
    OwnedTensor q(DType::f32, Device::cuda, Shape{n, H, dk}), v(DType::f32, Device::cuda, Shape{n, H, 16}),
        beta(DType::f32, Device::cuda, Shape{n, H}), o(DType::f32, Device::cuda, Shape{n, H, 16}),
        ws(DType::f32, Device::cuda, Shape{std::max<int64_t>(ops::kda_chunked_workspace(n, H, dk, 16, 1), 1)});
    ops::KdaOptions options;
    if (dk == 16) options.chunk = 32;
    try {
      ops::kda_chunked_forward(process_exec(), *q, *q, *v, *q, *beta, *cu, Tensor(), options, *o, Tensor(), *ws);
      ADD_FAILURE() << "d_k " << dk << " chunk " << options.chunk << " accepted";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(dk == 16 ? "chunk 64" : "d_k up to"), std::string::npos) << e.what();
    }
  }
}

// The gate alone in bf16 and f32 over many tokens (its parameter gradients sum over them).
TEST_F(GpuKda, GateOnly) {
  for (DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    const int64_t n = 3000, H = 4, dk = 96;
    OwnedTensor raw = rounded(*test::random_f64(Shape{n, H, dk}, 40, 2.0), dt);
    OwnedTensor a = rounded(*test::random_f64(Shape{H}, 41), DType::f32),
                b = rounded(*test::random_f64(Shape{H, dk}, 42), DType::f32),
                dg = rounded(*test::random_f64(Shape{n, H, dk}, 43), dt);
    OwnedTensor g = test::nan_f64(raw->shape()), draw = test::nan_f64(raw->shape()),
                da = test::filled_f64(Shape{H}, 0.5), db = test::filled_f64(Shape{H, dk}, 0.25);
    ops::kda_gate_forward(process_exec(), *raw, *a, *b, *g);
    ops::kda_gate_backward(process_exec(), *raw, *a, *b, *dg, *draw, *da, *db);
    OwnedTensor raw_d = device_of(*raw, dt), a_d = device_of(*a, DType::f32), b_d = device_of(*b, DType::f32),
                dg_d = device_of(*dg, dt), g_d = device_empty(dt, raw->shape()), draw_d = device_empty(dt, raw->shape()),
                da_d = device_of(*test::filled_f64(Shape{H}, 0.5), DType::f32),
                db_d = device_of(*test::filled_f64(Shape{H, dk}, 0.25), DType::f32);
    ops::kda_gate_forward(process_exec(), *raw_d, *a_d, *b_d, *g_d);
    ops::kda_gate_backward(process_exec(), *raw_d, *a_d, *b_d, *dg_d, *draw_d, *da_d, *db_d);
    const double tol = dt == DType::bf16 ? 5e-3 : 1e-5;
    expect_rel("gate_g", *g_d, *g, tol);
    expect_rel("gate_draw", *draw_d, *draw, tol);
    expect_rel("gate_dA_log", *da_d, *da, 1e-4);
    expect_rel("gate_ddt_bias", *db_d, *db, 1e-4);
  }
}

}  // namespace
}  // namespace kiln
