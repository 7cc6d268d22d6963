// Kimi Delta Attention on the CPU (ops/kda): the chunked WY forward against the
// token-by-token recurrence, the recurrent backward against central finite differences in
// f64 (five-point stencil, L = sum(out * R) + sum(final_state * R_s)), documents that
// restart the state, a final state continued as an initial one (what decode does), and the
// decay gate with its golden value.
//
// The chunked backward against the recurrent one (every gradient, in f64 and f32).
//
// Tolerances: chunked vs recurrent in f64 1e-10 relative (to max(|x|, rms)), forward and
// backward; gradients 1e-7 relative error with floor 1e-4 at step 1e-4; f32 chunked vs f64
// recurrent 1e-4, forward and backward.
#include "grad_check.h"
#include "ops/kda/kda.h"
#include "ops/kda/kda_gate.h"
#include "test_util.h"

#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <string>
#include <vector>

namespace kiln {
namespace {

using namespace kiln::test;

// One packed batch of KDA inputs in f64: q and k L2-normalized per (token, head) as the
// module will hand them, g a log decay in [-1.5, -0.02] (strong and weak channels), beta
// a sigmoid.
struct KdaCase {
  int64_t heads, dk, dv, tokens;
  OwnedTensor q, k, v, g, beta, cu, h0;

  KdaCase(const std::vector<int32_t>& lengths, int64_t heads_, int64_t dk_, int64_t dv_, uint64_t seed)
      : heads(heads_), dk(dk_), dv(dv_), tokens(std::accumulate(lengths.begin(), lengths.end(), int64_t{0})),
        q(random_f64(Shape{tokens, heads, dk}, seed)), k(random_f64(Shape{tokens, heads, dk}, seed + 1)),
        v(random_f64(Shape{tokens, heads, dv}, seed + 2)), g(random_f64(Shape{tokens, heads, dk}, seed + 3)),
        beta(random_f64(Shape{tokens, heads}, seed + 4)), cu(i32_tensor(offsets(lengths))),
        h0(random_f64(Shape{static_cast<int64_t>(lengths.size()), heads, dk, dv}, seed + 5, 0.5)) {
    for (const Tensor* t : {&*q, &*k}) normalize_rows(*t, dk);
    double* pg = g->data<double>();
    for (int64_t i = 0; i < g->numel(); ++i) pg[i] = -0.02 - 1.48 / (1 + std::exp(-pg[i]));
    double* pb = beta->data<double>();
    for (int64_t i = 0; i < beta->numel(); ++i) pb[i] = 1 / (1 + std::exp(-pb[i]));
  }

  static std::vector<int32_t> offsets(const std::vector<int32_t>& lengths) {
    std::vector<int32_t> cu{0};
    for (int32_t n : lengths) cu.push_back(cu.back() + n);
    return cu;
  }
  static void normalize_rows(const Tensor& t, int64_t d) {
    double* p = t.data<double>();
    for (int64_t r = 0; r < t.numel() / d; ++r) {
      double n = 0;
      for (int64_t i = 0; i < d; ++i) n += p[r * d + i] * p[r * d + i];
      for (int64_t i = 0; i < d; ++i) p[r * d + i] /= std::sqrt(n);
    }
  }
  int64_t seqs() const { return cu->size(0) - 1; }
  Shape out_shape() const { return Shape{tokens, heads, dv}; }
  Shape state_shape() const { return Shape{seqs(), heads, dk, dv}; }
};

enum class Form { recurrent, chunked };

// out and final state of one forward.
struct Result {
  std::vector<double> out, state;
};

Result forward(Form form, const KdaCase& c, bool with_h0, int64_t chunk = 64) {
  OwnedTensor out = nan_f64(c.out_shape()), ht = nan_f64(c.state_shape());
  ops::KdaOptions o;
  o.chunk = chunk;
  const Tensor h0 = with_h0 ? *c.h0 : Tensor();
  if (form == Form::recurrent)
    ops::kda_recurrent_forward(process_exec(), *c.q, *c.k, *c.v, *c.g, *c.beta, *c.cu, h0, o, *out, *ht);
  else
    ops::kda_chunked_forward(process_exec(), *c.q, *c.k, *c.v, *c.g, *c.beta, *c.cu, h0, o, *out, *ht);
  return {values_of(*out), values_of(*ht)};
}

double rel(const std::vector<double>& a, const std::vector<double>& b) {
  return max_rel_diff(a, b, std::max(rms(b), 1e-30));
}

TEST(Kda, ChunkedForwardMatchesRecurrent) {
  const std::vector<std::vector<int32_t>> batches = {{1}, {63}, {64}, {65}, {130}, {65, 1, 130, 63, 64, 7}};
  for (const auto& lengths : batches)
    for (bool with_h0 : {false, true})
      for (int64_t chunk : {64, 16}) {
        SCOPED_TRACE(fmt::format("lengths {} h0 {} chunk {}", fmt::join(lengths, ","), with_h0, chunk));
        const KdaCase c(lengths, 3, 5, 4, 100);
        const Result ref = forward(Form::recurrent, c, with_h0), got = forward(Form::chunked, c, with_h0, chunk);
        EXPECT_LT(rel(got.out, ref.out), 1e-10);
        EXPECT_LT(rel(got.state, ref.state), 1e-10);
      }
}

// The f32 instantiation computes the same thing to f32 precision.
TEST(Kda, F32ForwardsMatchF64) {
  const KdaCase c({65, 30}, 2, 6, 5, 200);
  const Result ref = forward(Form::recurrent, c, true);
  for (Form form : {Form::recurrent, Form::chunked}) {
    OwnedTensor out(DType::f32, Device::cpu, c.out_shape()), ht(DType::f32, Device::cpu, c.state_shape());
    OwnedTensor q = to_f32(*c.q), k = to_f32(*c.k), v = to_f32(*c.v), g = to_f32(*c.g), b = to_f32(*c.beta),
                h0 = to_f32(*c.h0);
    if (form == Form::recurrent)
      ops::kda_recurrent_forward(process_exec(), *q, *k, *v, *g, *b, *c.cu, *h0, ops::KdaOptions{}, *out, *ht);
    else
      ops::kda_chunked_forward(process_exec(), *q, *k, *v, *g, *b, *c.cu, *h0, ops::KdaOptions{}, *out, *ht);
    EXPECT_LT(rel(values_of(*out), ref.out), 1e-4);
    EXPECT_LT(rel(values_of(*ht), ref.state), 1e-4);
  }
}

// Rows [begin, end) of a [N, ...] tensor.
OwnedTensor rows(const Tensor& t, int64_t begin, int64_t end) {
  const Shape& full = t.shape();
  const int64_t width = t.numel() / t.size(0);
  const Shape shape = full.rank() == 2 ? Shape{end - begin, full[1]} : Shape{end - begin, full[1], full[2]};
  OwnedTensor r(DType::f64, Device::cpu, shape);
  std::copy(t.data<double>() + begin * width, t.data<double>() + end * width, r->data<double>());
  return r;
}

// The tokens [begin, end) of a case as a batch of one document.
KdaCase slice(const KdaCase& c, int64_t begin, int64_t end) {
  KdaCase s({static_cast<int32_t>(end - begin)}, c.heads, c.dk, c.dv, 1);
  s.q = rows(*c.q, begin, end);
  s.k = rows(*c.k, begin, end);
  s.v = rows(*c.v, begin, end);
  s.g = rows(*c.g, begin, end);
  s.beta = rows(*c.beta, begin, end);
  return s;
}

std::vector<double> part(const std::vector<double>& v, int64_t begin, int64_t end) {
  return std::vector<double>(v.begin() + begin, v.begin() + end);
}

// A document's outputs do not depend on the one before it: the second document of a batch
// gives the same outputs as run alone (bit for bit: the same arithmetic).
TEST(Kda, StateRestartsAtEachDocument) {
  const KdaCase c({37, 70}, 2, 4, 3, 300);
  const KdaCase second = slice(c, 37, 107);
  const int64_t row = c.heads * c.dv;
  for (Form form : {Form::recurrent, Form::chunked}) {
    const Result both = forward(form, c, false), alone = forward(form, second, false);
    EXPECT_EQ(part(both.out, 37 * row, 107 * row), alone.out);
    EXPECT_EQ(part(both.state, c.heads * c.dk * c.dv, 2 * c.heads * c.dk * c.dv), alone.state);
  }
}

// A document run in two pieces, the first piece's final state fed as the second's initial
// state, gives the whole run's outputs and final state: what decode continues from.
TEST(Kda, FinalStateContinuesTheSequence) {
  const KdaCase c({100}, 2, 4, 3, 400);
  const int64_t split = 37, row = c.heads * c.dv;
  for (Form form : {Form::recurrent, Form::chunked}) {
    SCOPED_TRACE(form == Form::recurrent ? "recurrent" : "chunked");
    const Result whole = forward(form, c, true);
    KdaCase head = slice(c, 0, split), tail = slice(c, split, 100);
    head.h0 = copy_of(*c.h0);
    const Result first = forward(form, head, true);
    std::copy(first.state.begin(), first.state.end(), tail.h0->data<double>());
    const Result rest = forward(form, tail, true);
    EXPECT_LT(rel(first.out, part(whole.out, 0, split * row)), 1e-12);
    EXPECT_LT(rel(rest.out, part(whole.out, split * row, 100 * row)), 1e-12);
    EXPECT_LT(rel(rest.state, whole.state), 1e-12);
    if (form == Form::recurrent) EXPECT_EQ(rest.out, part(whole.out, split * row, 100 * row));
  }
}

GradCheckOptions kda_tolerance(int64_t max_checks = 0) {
  GradCheckOptions o;
  o.order = 4;
  o.eps = 1e-4;
  o.floor = 1e-4;
  o.tol = 1e-7;
  o.max_checks = max_checks;
  return o;
}

// Every input's gradient against finite differences of L = sum(out R) + sum(final R_s).
void check_backward(const KdaCase& c, int64_t max_checks) {
  OwnedTensor r = random_f64(c.out_shape(), 7), rs = random_f64(c.state_shape(), 8);
  const EvalFn eval = [&](std::vector<double>& o) {
    const Result res = forward(Form::recurrent, c, true);
    o = res.out;
    o.insert(o.end(), res.state.begin(), res.state.end());
  };
  std::vector<double> weights = values_of(*r);
  for (double w : values_of(*rs)) weights.push_back(w);

  OwnedTensor dq = nan_f64(c.q->shape()), dk = nan_f64(c.k->shape()), dv = nan_f64(c.v->shape()),
              dg = nan_f64(c.g->shape()), db = nan_f64(c.beta->shape()), dh0 = nan_f64(c.state_shape());
  ops::kda_recurrent_backward(process_exec(), *c.q, *c.k, *c.v, *c.g, *c.beta, *c.cu, *c.h0, *r, *rs,
                              ops::KdaOptions{}, *dq, *dk, *dv, *dg, *db, *dh0);
  ScopedCpuThreads one_thread(1);
  for (const auto& [name, x, d] : {std::tuple{"q", &c.q, &dq}, {"k", &c.k, &dk}, {"v", &c.v, &dv}, {"g", &c.g, &dg},
                                   {"beta", &c.beta, &db}, {"initial_state", &c.h0, &dh0}}) {
    const GradCheckReport rep = check_gradient(**x, values_of(**d), eval, weights, kda_tolerance(max_checks));
    EXPECT_TRUE(rep.ok()) << "d" << name << ": " << rep.str();
  }
}

TEST(Kda, RecurrentBackwardMatchesFiniteDifferences) {
  check_backward(KdaCase({4, 5}, 2, 4, 3, 500), 0);
}

// Past 64 tokens the backward recomputes its states from checkpoints, block by block.
TEST(Kda, RecurrentBackwardAcrossCheckpointBlocks) {
  check_backward(KdaCase({3, 70}, 1, 3, 2, 600), 40);
}

// Without d_final_state and d_initial_state the gradients are those of sum(out R) alone.
TEST(Kda, RecurrentBackwardWithoutStates) {
  const KdaCase c({5, 4}, 2, 3, 2, 700);
  OwnedTensor r = random_f64(c.out_shape(), 9);
  OwnedTensor dq = nan_f64(c.q->shape()), dk = nan_f64(c.k->shape()), dv = nan_f64(c.v->shape()),
              dg = nan_f64(c.g->shape()), db = nan_f64(c.beta->shape());
  ops::kda_recurrent_backward(process_exec(), *c.q, *c.k, *c.v, *c.g, *c.beta, *c.cu, Tensor(), *r, Tensor(),
                              ops::KdaOptions{}, *dq, *dk, *dv, *dg, *db);
  const EvalFn eval = [&](std::vector<double>& o) { o = forward(Form::recurrent, c, false).out; };
  ScopedCpuThreads one_thread(1);
  for (const auto& [name, x, d] : {std::tuple{"k", &c.k, &dk}, {"g", &c.g, &dg}, {"beta", &c.beta, &db}}) {
    const GradCheckReport rep = check_gradient(**x, values_of(**d), eval, values_of(*r), kda_tolerance());
    EXPECT_TRUE(rep.ok()) << "d" << name << ": " << rep.str();
  }
}

// ---- the chunked backward -------------------------------------------------------------

// dq, dk, dv, dg, dbeta and d_initial_state of one backward.
struct Grads {
  std::vector<double> dq, dk, dv, dg, dbeta, dh0;
};

// The gradients of L = sum(out R) (+ sum(final R_s) with d_final_state), by either form;
// d_initial_state is asked for when with_dh0. Inputs of f32 run in f32 (the case's f64
// inputs converted), gradients returned as f64.
Grads backward(Form form, const KdaCase& c, bool with_h0, bool with_dht, bool with_dh0, int64_t chunk = 64,
               DType dtype = DType::f64) {
  OwnedTensor r = random_f64(c.out_shape(), 7), rs = random_f64(c.state_shape(), 8);
  auto as = [&](const Tensor& t) { return dtype == DType::f32 ? to_f32(t) : copy_of(t); };
  OwnedTensor q = as(*c.q), k = as(*c.k), v = as(*c.v), g = as(*c.g), b = as(*c.beta), h0 = as(*c.h0), dout = as(*r),
              dht = as(*rs);
  OwnedTensor dq(dtype, Device::cpu, c.q->shape()), dk(dtype, Device::cpu, c.k->shape()),
      dv(dtype, Device::cpu, c.v->shape()), dg(dtype, Device::cpu, c.g->shape()),
      db(dtype, Device::cpu, c.beta->shape()), dh0(dtype, Device::cpu, c.state_shape());
  ops::KdaOptions o;
  o.chunk = chunk;
  const Tensor h0_arg = with_h0 ? *h0 : Tensor(), dht_arg = with_dht ? *dht : Tensor(),
               dh0_arg = with_dh0 ? *dh0 : Tensor();
  if (form == Form::recurrent)
    ops::kda_recurrent_backward(process_exec(), *q, *k, *v, *g, *b, *c.cu, h0_arg, *dout, dht_arg, o, *dq, *dk, *dv,
                                *dg, *db, dh0_arg);
  else
    ops::kda_chunked_backward(process_exec(), *q, *k, *v, *g, *b, *c.cu, h0_arg, *dout, dht_arg, o, *dq, *dk, *dv,
                              *dg, *db, dh0_arg);
  return {values_of(*dq), values_of(*dk), values_of(*dv),
          values_of(*dg), values_of(*db), with_dh0 ? values_of(*dh0) : std::vector<double>()};
}

// Every gradient of `got` within `tol` of `ref` (relative to max(|x|, rms)).
void expect_grads_near(const Grads& got, const Grads& ref, double tol) {
  for (const auto& [name, a, b] : {std::tuple{"dq", &got.dq, &ref.dq}, {"dk", &got.dk, &ref.dk},
                                   {"dv", &got.dv, &ref.dv}, {"dg", &got.dg, &ref.dg},
                                   {"dbeta", &got.dbeta, &ref.dbeta}, {"d_initial_state", &got.dh0, &ref.dh0}}) {
    ASSERT_EQ(a->size(), b->size()) << name;
    if (!a->empty()) EXPECT_LT(rel(*a, *b), tol) << name;
  }
}

// The chunked backward gives the recurrent backward's gradients in f64: lengths around
// the chunk (1, 63, 64, 65, 130), several documents (one empty), with and without the
// initial state and the final state's gradient, chunks of 64 and 16.
TEST(Kda, ChunkedBackwardMatchesRecurrent) {
  const std::vector<std::vector<int32_t>> batches = {{1}, {63}, {64}, {65}, {130}, {65, 1, 130, 0, 63, 64, 7}};
  for (const auto& lengths : batches)
    for (bool with_h0 : {false, true})
      for (bool with_dht : {false, true})
        for (int64_t chunk : {64, 16}) {
          SCOPED_TRACE(fmt::format("lengths {} h0 {} dht {} chunk {}", fmt::join(lengths, ","), with_h0, with_dht,
                                   chunk));
          const KdaCase c(lengths, 3, 5, 4, 100);
          const Grads ref = backward(Form::recurrent, c, with_h0, with_dht, true);
          expect_grads_near(backward(Form::chunked, c, with_h0, with_dht, true, chunk), ref, 1e-10);
        }
}

// Without d_initial_state asked for, the other gradients are the same; odd chunk lengths
// (1: every token its own chunk; 7; longer than the document) too.
TEST(Kda, ChunkedBackwardOtherChunks) {
  const KdaCase c({40, 9}, 2, 6, 3, 150);
  Grads ref = backward(Form::recurrent, c, true, true, false);
  for (int64_t chunk : {1, 7, 64, 100}) {
    SCOPED_TRACE(fmt::format("chunk {}", chunk));
    expect_grads_near(backward(Form::chunked, c, true, true, false, chunk), ref, 1e-10);
  }
}

// The f32 chunked backward against the f64 recurrent one: 1e-4 relative (to max(|x|, rms)).
TEST(Kda, F32ChunkedBackwardMatchesF64) {
  const KdaCase c({65, 30, 130}, 2, 6, 5, 200);
  for (int64_t chunk : {64, 16}) {
    SCOPED_TRACE(fmt::format("chunk {}", chunk));
    const Grads ref = backward(Form::recurrent, c, true, true, true);
    expect_grads_near(backward(Form::chunked, c, true, true, true, chunk, DType::f32), ref, 1e-4);
  }
}

TEST(Kda, RejectsMisplacedSequences) {
  const KdaCase c({5, 4}, 2, 3, 2, 800);
  OwnedTensor out = nan_f64(c.out_shape()), bad = i32_tensor({0, 5, 8});
  const std::string error = error_of([&] {
    ops::kda_chunked_forward(process_exec(), *c.q, *c.k, *c.v, *c.g, *c.beta, *bad, Tensor(), {}, *out);
  });
  EXPECT_NE(error.find("[kda_chunked_forward] cu_seqlens must run from 0 to 9"), std::string::npos) << error;
}

// ---- the decay gate ------------------------------------------------------------------

// A_log = log(ln 2), dt_bias = log(e - 1), raw 0: softplus(log(e - 1)) = 1, so every token
// decays by exactly one bit (log2 a = -1), and a 16-token tile spans a log2 decay of 15
// between its first and last token (the 15 steps after the first).
TEST(Kda, GateGoldenDecayOfOneBitPerToken) {
  const int64_t tokens = 16, heads = 2, dk = 3;
  OwnedTensor raw = filled_f64(Shape{tokens, heads, dk}, 0.0), a = filled_f64(Shape{heads}, std::log(std::log(2.0))),
              bias = filled_f64(Shape{heads, dk}, std::log(std::exp(1.0) - 1)), g = nan_f64(Shape{tokens, heads, dk});
  ops::kda_gate_forward(process_exec(), *raw, *a, *bias, *g);
  const double* pg = g->data<double>();
  for (int64_t c = 0; c < heads * dk; ++c) {
    double span = 0;
    for (int64_t t = 0; t < tokens; ++t) {
      EXPECT_NEAR(pg[t * heads * dk + c] / std::log(2.0), -1.0, 1e-15);
      if (t > 0) span -= pg[t * heads * dk + c] / std::log(2.0);
    }
    EXPECT_NEAR(span, 15.0, 1e-13) << "channel " << c;
  }
  // In f32 too.
  OwnedTensor raw32 = to_f32(*raw), a32 = to_f32(*a), bias32 = to_f32(*bias);
  OwnedTensor g32(DType::f32, Device::cpu, raw->shape());
  ops::kda_gate_forward(process_exec(), *raw32, *a32, *bias32, *g32);
  double span32 = 0;
  for (int64_t t = 1; t < tokens; ++t) span32 -= g32->data<float>()[t * heads * dk] / std::log(2.0);
  EXPECT_NEAR(span32, 15.0, 1e-5);
}

TEST(Kda, GateBackwardMatchesFiniteDifferences) {
  const int64_t tokens = 5, heads = 2, dk = 3;
  OwnedTensor raw = random_f64(Shape{tokens, heads, dk}, 10, 3.0), a = random_f64(Shape{heads}, 11),
              bias = random_f64(Shape{heads, dk}, 12), r = random_f64(Shape{tokens, heads, dk}, 13);
  OwnedTensor g = nan_f64(raw->shape());
  const EvalFn eval = [&](std::vector<double>& o) {
    ops::kda_gate_forward(process_exec(), *raw, *a, *bias, *g);
    o = values_of(*g);
  };
  OwnedTensor draw = nan_f64(raw->shape()), da0 = random_f64(Shape{heads}, 14), db0 = random_f64(Shape{heads, dk}, 15);
  OwnedTensor da = copy_of(*da0), db = copy_of(*db0);
  ops::kda_gate_backward(process_exec(), *raw, *a, *bias, *r, *draw, *da, *db);
  auto minus = [](const Tensor& x, const Tensor& y) {
    std::vector<double> d = values_of(x), e = values_of(y);
    for (size_t i = 0; i < d.size(); ++i) d[i] -= e[i];
    return d;
  };
  GradCheckOptions o = kda_tolerance();
  o.tol = 1e-8;
  ScopedCpuThreads one_thread(1);
  for (const auto& [name, x, d] : {std::tuple{"raw", &*raw, values_of(*draw)}, {"A_log", &*a, minus(*da, *da0)},
                                   {"dt_bias", &*bias, minus(*db, *db0)}}) {
    const GradCheckReport rep = check_gradient(*x, d, eval, values_of(*r), o);
    EXPECT_TRUE(rep.ok()) << "d" << name << ": " << rep.str();
  }
}

}  // namespace
}  // namespace kiln
