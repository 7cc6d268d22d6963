// qkv_split / qkv_merge (ops/split/qkv_split.h): fused rows [n, (hq + 2 hkv) d] to q
// [n, hq, d], k and v [n, hkv, d] and back, as exact copies; each is the other's gradient.
// The forward also merges its parts again ("merged"), which must be the input.
#include "op_table/op_table.h"
#include "ops/split/qkv_split.h"

#include <fmt/format.h>

namespace kiln::op_test {

namespace {

struct Heads {
  int64_t n, hq, hkv, d;
};

// Row i of the fused layout = [q heads | k heads | v heads].
void reference_split(const double* qkv, const Heads& h, double* q, double* k, double* v) {
  const int64_t qc = h.hq * h.d, kc = h.hkv * h.d, cols = qc + 2 * kc;
  for (int64_t i = 0; i < h.n; ++i)
    for (int64_t c = 0; c < cols; ++c) {
      const double x = qkv[i * cols + c];
      if (c < qc) q[i * qc + c] = x;
      else if (c < qc + kc) k[i * kc + c - qc] = x;
      else v[i * kc + c - qc - kc] = x;
    }
}

OpCase split_case(const Heads& h, bool merge, std::vector<DType> cuda) {
  const Shape fs{h.n, (h.hq + 2 * h.hkv) * h.d}, qs{h.n, h.hq, h.d}, ks{h.n, h.hkv, h.d};
  OpCase c;
  c.op = merge ? "qkv_merge" : "qkv_split";
  c.name = fmt::format("n{}_h{}x{}_d{}", h.n, h.hq, h.hkv, h.d);
  if (!merge) {
    c.tensors = {in("qkv", fs),        out("q", qs).exact(),          out("k", ks).exact(),
                 out("v", ks).exact(), out("merged", fs).exact(),     grad_out("dq", "q", qs),
                 grad_out("dk", "k", ks), grad_out("dv", "v", ks), grad_in("dqkv", "qkv", fs).exact()};
    c.forward = [](const Tensors& t) {
      ops::qkv_split(process_exec(), t["qkv"], t["q"], t["k"], t["v"]);
      ops::qkv_merge(process_exec(), t["q"], t["k"], t["v"], t["merged"]);
    };
    c.backward = [](const Tensors& t) { ops::qkv_merge(process_exec(), t["dq"], t["dk"], t["dv"], t["dqkv"]); };
    c.reference = [h](const Tensors& t) {
      reference_split(t.f64("qkv"), h, t.f64("q"), t.f64("k"), t.f64("v"));
      std::copy(t.f64("qkv"), t.f64("qkv") + t["qkv"].numel(), t.f64("merged"));
    };
  } else {
    c.tensors = {in("q", qs),         in("k", ks),
                 in("v", ks),         out("qkv", fs).exact(),
                 grad_out("dqkv", "qkv", fs), grad_in("dq", "q", qs).exact(),
                 grad_in("dk", "k", ks).exact(), grad_in("dv", "v", ks).exact()};
    c.forward = [](const Tensors& t) { ops::qkv_merge(process_exec(), t["q"], t["k"], t["v"], t["qkv"]); };
    c.backward = [](const Tensors& t) { ops::qkv_split(process_exec(), t["dqkv"], t["dq"], t["dk"], t["dv"]); };
    c.reference = [h](const Tensors& t) {
      const int64_t qc = h.hq * h.d, kc = h.hkv * h.d, cols = qc + 2 * kc;
      double* qkv = t.f64("qkv");
      for (int64_t i = 0; i < h.n; ++i)
        for (int64_t col = 0; col < cols; ++col)
          qkv[i * cols + col] = col < qc        ? t.f64("q")[i * qc + col]
                                : col < qc + kc ? t.f64("k")[i * kc + col - qc]
                                                : t.f64("v")[i * kc + col - qc - kc];
    };
  }
  c.cuda = std::move(cuda);
  c.cpu = fs.numel() <= kCpuMaxElements;
  c.finite_differences = fs.numel() <= 200;
  c.fd = fd_options(1e-8, 1e-4);
  return c;
}

}  // namespace

std::vector<OpCase> qkv_split_cases() {
  std::vector<OpCase> cases;
  // n, hq, hkv, d: finite differences (5, 4, 2, 3); the vector path (q and kv columns
  // multiples of 8) and the scalar path.
  for (const Heads& h : {Heads{5, 4, 2, 3}, {1, 4, 2, 16}, {37, 12, 4, 64}, {1000, 2, 1, 64}, {29, 3, 1, 16},
                         {29, 3, 1, 4}, {7, 13, 5, 1}, {29, 4, 2, 12}})
    for (bool merge : {false, true})
      cases.push_back(split_case(h, merge, h.n == 5 ? std::vector<DType>{} : std::vector<DType>{DType::f32, DType::bf16}));
  return cases;
}

}  // namespace kiln::op_test
