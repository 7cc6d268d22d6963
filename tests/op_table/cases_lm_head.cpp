// lm_head_loss (ops/cross_entropy/lm_head_loss.h): logits by chunks, cross-entropy with
// optional z-loss and softcap, never the whole [tokens, vocab] at once; forward and
// backward fused. The sums (loss, z, count) are its output; the objective
// loss_scale * (loss + z_loss * z) is L, so its "gradient" weights are fixed. The naive
// reference forms all logits at once. Also lm_head_logits (the sampled rows' logits).
#include "op_table/op_table.h"
#include "ops/cross_entropy/lm_head_loss.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

namespace kiln::op_test {

namespace {

struct Head {
  int64_t n, d, vocab;
  std::vector<int32_t> targets;
  ops::LmHeadLossOptions o;
  double w_scale;
};

// Full [N, V] logits (softcapped), then a log-sum-exp per counted row.
void reference_loss(const Tensors& t, const Head& h) {
  double loss = 0, z = 0;
  int64_t count = 0;
  std::vector<double> row(static_cast<size_t>(h.vocab));
  for (int64_t i = 0; i < h.n; ++i) {
    const int32_t target = h.targets[static_cast<size_t>(i)];
    if (target < 0) continue;
    for (int64_t j = 0; j < h.vocab; ++j) {
      double s = 0;
      for (int64_t c = 0; c < h.d; ++c) s += t.f64("h")[i * h.d + c] * t.f64("w")[j * h.d + c];
      row[static_cast<size_t>(j)] = h.o.softcap > 0 ? h.o.softcap * std::tanh(s / h.o.softcap) : s;
    }
    const double m = *std::max_element(row.begin(), row.end());
    double sum = 0;
    for (double x : row) sum += std::exp(x - m);
    const double lse = m + std::log(sum);
    loss += lse - row[static_cast<size_t>(target)];
    z += lse * lse;
    ++count;
  }
  t.f64("sums")[0] = loss, t.f64("sums")[1] = z, t.f64("sums")[2] = static_cast<double>(count);
}

void write_sums(const ops::LossSums& s, double* out) {
  out[0] = s.loss, out[1] = s.z, out[2] = static_cast<double>(s.count);
}

OpCase loss_case(const Head& h, std::vector<DType> cuda) {
  OpCase c;
  c.op = "lm_head_loss";
  c.name = fmt::format("n{}_d{}_v{}_chunk{}_z{}_cap{}", h.n, h.d, h.vocab, h.o.chunk_rows, h.o.z_loss, h.o.softcap);
  std::replace(c.name.begin(), c.name.end(), '.', 'p');
  const double weight_loss = h.o.loss_scale, weight_z = h.o.loss_scale * h.o.z_loss;
  c.tensors = {in("h", {h.n, h.d}),
               in("w", {h.vocab, h.d}).scaled(h.w_scale),
               ints("targets", h.targets),
               out("sums", {3}, Width::f64).on_host(),
               // L = loss_scale * (loss + z_loss * z): what the backward differentiates.
               grad_out("dsums", "sums", {3}, Width::f64).on_host().filled([=](double* v, int64_t) {
                 v[0] = weight_loss, v[1] = weight_z, v[2] = 0;
               }),
               grad_in("dh", "h", {h.n, h.d}),
               grad_in("dw", "w", {h.vocab, h.d}, Width::wide).accumulating(),
               // Rows padded to 8 columns; the padding stays poisoned (NaN), so a read of
               // it as a logit shows in every sum and gradient.
               scratch("logits", {h.o.chunk_rows, ops::lm_head_logits_cols(h.vocab)}),
               scratch("row_stats", {h.o.chunk_rows, 2}, Width::f64),
               // The loss of the backward's call, and dh alone and dw alone (from dw's
               // start): the same as the forward's and as both together.
               out("sums_backward", {3}, Width::f64).on_host().by_backward().unchecked(),
               out("dh_alone", {h.n, h.d}).by_backward().unchecked(),
               out("dw_alone", {h.vocab, h.d}, Width::wide).by_backward().unchecked().copied_from("dw")};
  c.same_bits = {{"sums_backward", "sums"}, {"dh_alone", "dh"}, {"dw_alone", "dw"}};
  const ops::LmHeadLossOptions o = h.o;
  c.forward = [o](const Tensors& t) {
    write_sums(ops::lm_head_loss(process_exec(), t["h"], t["w"], t["targets"], o, {t["logits"], t["row_stats"]}, Tensor(), Tensor()),
               t.f64("sums"));
  };
  c.backward = [o](const Tensors& t) {
    const ops::LmHeadScratch s{t["logits"], t["row_stats"]};
    ops::lm_head_loss(process_exec(), t["h"], t["w"], t["targets"], o, s, t["dh_alone"], Tensor());
    ops::lm_head_loss(process_exec(), t["h"], t["w"], t["targets"], o, s, Tensor(), t["dw_alone"]);
    write_sums(ops::lm_head_loss(process_exec(), t["h"], t["w"], t["targets"], o, s, t["dh"], t["dw"]), t.f64("sums_backward"));
  };
  c.reference = [h](const Tensors& t) { reference_loss(t, h); };
  c.invariants = [h](const Tensors& t) {  // ignored rows get exactly zero gradient
    for (int64_t i = 0; i < h.n; ++i) {
      if (h.targets[static_cast<size_t>(i)] >= 0) continue;
      for (int64_t e = 0; e < h.d; ++e) ASSERT_EQ(t.f64("dh")[i * h.d + e], 0.0) << "ignored row " << i;
    }
  };
  c.cuda = std::move(cuda);
  c.finite_differences = c.cuda.empty();
  c.fd = fd_options(1e-6, 1e-4);
  return c;
}

OpCase logits_case(int64_t m, int64_t d, int64_t vocab, double softcap) {
  OpCase c;
  c.op = "lm_head_logits";
  c.name = fmt::format("m{}_d{}_v{}_cap{}", m, d, vocab, softcap);
  c.tensors = {in("h", {m, d}), in("w", {vocab, d}).scaled(0.8), out("logits", {m, vocab}, Width::wide)};
  c.forward = [softcap](const Tensors& t) { ops::lm_head_logits(process_exec(), t["h"], t["w"], softcap, t["logits"]); };
  c.reference = [=](const Tensors& t) {
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < vocab; ++j) {
        double s = 0;
        for (int64_t e = 0; e < d; ++e) s += t.f64("h")[i * d + e] * t.f64("w")[j * d + e];
        t.f64("logits")[i * vocab + j] = softcap > 0 ? softcap * std::tanh(s / softcap) : s;
      }
  };
  c.cuda = {DType::f32, DType::bf16};
  c.finite_differences = false;
  return c;
}

}  // namespace

std::vector<OpCase> lm_head_cases() {
  std::vector<OpCase> cases;
  // The last row of the last chunk ignored; chunks of every row, of 5 and 4 rows (a short
  // last chunk), and one larger than the batch.
  const std::vector<int32_t> small_targets = {3, 0, -1, 10, 7, 7, 1, -1, 2, 9, 4, 5, -1};
  for (double z : {0.0, 1e-2})
    for (double softcap : {0.0, 3.0})
      for (int64_t chunk : {13, 5, 4, 20}) {
        Head h{13, 6, 11, small_targets, {}, 0.8};
        h.o.chunk_rows = chunk, h.o.z_loss = z, h.o.softcap = softcap, h.o.loss_scale = 1.0 / 10;  // 1 / targets
        cases.push_back(loss_case(h, {}));
      }
  // On the GPU too: vocabularies whose logits rows are padded (259 to 264, 1001 to 1008)
  // and one that needs no padding (256).
  for (int64_t vocab : {259, 1001, 256}) {
    std::vector<int32_t> targets(50);
    for (int32_t i = 0; i < 50; ++i)
      targets[static_cast<size_t>(i)] = i % 9 == 4 ? -1 : static_cast<int32_t>((i * 31) % vocab);
    for (double z : {0.0, 1e-2})
      for (double softcap : {0.0, 3.0}) {
        if (vocab != 259 && (z > 0) != (softcap > 0)) continue;  // the other two: both off, both on
        Head h{50, 32, vocab, targets, {}, 0.3};
        h.o.chunk_rows = 16, h.o.z_loss = z, h.o.softcap = softcap, h.o.loss_scale = 1.0 / 44;
        cases.push_back(loss_case(h, {DType::f32}));
      }
  }
  for (double softcap : {0.0, 3.0}) cases.push_back(logits_case(3, 6, 11, softcap));
  return cases;
}

}  // namespace kiln::op_test
