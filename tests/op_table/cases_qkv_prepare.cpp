// qkv_prepare (ops/attention/qkv_prepare.h): per-head q/k RMSNorm, RoPE and the q|k|v
// split in one pass, and its backward with the gain gradients (+=). Shapes cover every
// launch shape of the kernel: scalar rows (head_dim 12, 8), 4, 8 and 16 threads per row
// (head_dim 16, 64/128, 256), with and without the norm and the rotation, single tokens,
// odd counts, and more row groups than blocks (each block loops over several), and partial
// rotary (tables of the first pairs, the rest cos 1 / sin 0, passed through by the reference).
#include "op_table/op_table.h"
#include "ops/attention/qkv_prepare.h"
#include "ops/rope/rope.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>

namespace kiln::op_test {

namespace {

struct Layout {
  int64_t tokens, hq, hkv, d;
  bool norm, rope;
  int64_t rotary = 0;  // dims rotated (partial rotary); 0 = d

  int64_t rotary_dims() const { return rotary > 0 ? rotary : d; }
};

constexpr double kEps = 1e-6;

std::function<void(double*, int64_t)> table(int64_t max_pos, int64_t d, int64_t rotary, bool sine) {
  return [=](double* v, int64_t) {
    OwnedTensor cos(DType::f64, Device::cpu, Shape{max_pos, d / 2}), sin(DType::f64, Device::cpu, Shape{max_pos, d / 2});
    ops::rope_fill_tables(process_exec(), ops::rope_inverse_frequencies(10000.0, rotary), *cos, *sin);
    const double* src = (sine ? sin : cos)->data<double>();
    std::copy(src, src + max_pos * d / 2, v);
  };
}

// Head by head: q and k normalized (1/sqrt(mean(x^2) + eps) times the gain) and rotated
// (pairs j, j + d/2 for j below rotary / 2, the others passed), v copied.
void reference_prepare(const Tensors& t, const Layout& l) {
  const int64_t heads = l.hq + 2 * l.hkv, half = l.d / 2;
  const double* qkv = t.f64("qkv");
  const int32_t* pos = t.i32("positions");
  std::vector<double> head(static_cast<size_t>(l.d));
  for (int64_t i = 0; i < l.tokens; ++i)
    for (int64_t h = 0; h < heads; ++h) {
      const double* src = qkv + (i * heads + h) * l.d;
      const bool is_q = h < l.hq, is_v = h >= l.hq + l.hkv;
      double* dst = is_q ? t.f64("q") + (i * l.hq + h) * l.d
                    : is_v ? t.f64("v") + (i * l.hkv + h - l.hq - l.hkv) * l.d
                           : t.f64("k") + (i * l.hkv + h - l.hq) * l.d;
      std::copy(src, src + l.d, head.begin());
      if (!is_v && l.norm) {
        const double* gain = t.f64(is_q ? "q_gain" : "k_gain");
        double sum = 0;
        for (double x : head) sum += x * x;
        const double inv = 1.0 / std::sqrt(sum / static_cast<double>(l.d) + kEps);
        for (int64_t c = 0; c < l.d; ++c) head[static_cast<size_t>(c)] *= inv * gain[c];
      }
      if (!is_v && l.rope)
        for (int64_t j = 0; j < l.rotary_dims() / 2; ++j) {
          const double c = t.f64("cos")[pos[i] * half + j], s = t.f64("sin")[pos[i] * half + j];
          const double a = head[static_cast<size_t>(j)], b = head[static_cast<size_t>(j + half)];
          head[static_cast<size_t>(j)] = a * c - b * s;
          head[static_cast<size_t>(j + half)] = b * c + a * s;
        }
      std::copy(head.begin(), head.end(), dst);
    }
}

OpCase prepare_case(const Layout& l, std::vector<int32_t> positions, int64_t max_pos, std::vector<DType> cuda) {
  const int64_t cols = (l.hq + 2 * l.hkv) * l.d;
  const Shape fs{l.tokens, cols}, qs{l.tokens, l.hq, l.d}, ks{l.tokens, l.hkv, l.d}, gs{l.d}, ts{max_pos, l.d / 2};
  OpCase c;
  c.op = "qkv_prepare";
  c.name = fmt::format("t{}_h{}x{}_d{}_{}_{}{}", l.tokens, l.hq, l.hkv, l.d, l.norm ? "norm" : "nonorm",
                       l.rope ? "rope" : "norope", l.rotary > 0 ? fmt::format("{}", l.rotary) : "");
  c.tensors = {in("qkv", fs).scaled(1.5),
               in("q_gain", gs, Width::wide).scaled(0.3, 1.0),
               in("k_gain", gs, Width::wide).scaled(0.3, 1.0),
               ints("positions", std::move(positions)),
               in("cos", ts, Width::wide).filled(table(max_pos, l.d, l.rotary_dims(), false)),
               in("sin", ts, Width::wide).filled(table(max_pos, l.d, l.rotary_dims(), true)),
               out("q", qs),
               out("k", ks),
               out("v", ks).exact(),
               grad_out("dq", "q", qs),
               grad_out("dk", "k", ks),
               grad_out("dv", "v", ks),
               grad_in("dqkv", "qkv", fs)};
  if (l.norm) {
    c.tensors.push_back(grad_in("dq_gain", "q_gain", gs, Width::wide).accumulating());
    c.tensors.push_back(grad_in("dk_gain", "k_gain", gs, Width::wide).accumulating());
  } else {
    // Without a norm the gain gradients given to the backward stay as they were.
    c.tensors.push_back(out("dq_gain", gs, Width::wide).by_backward().accumulating().exact());
    c.tensors.push_back(out("dk_gain", gs, Width::wide).by_backward().accumulating().exact());
    c.invariants = [](const Tensors& t) {
      for (const char* g : {"dq_gain", "dk_gain"})
        for (int64_t i = 0; i < t[g].numel(); ++i)
          ASSERT_EQ(t.f64(g)[i], t.f64(std::string(g) + ".start")[i]) << g << " changed without a norm, at " << i;
    };
  }
  const double eps = kEps;
  auto params = [l, eps](const Tensors& t) {
    ops::QkvPrepare p;
    p.q_heads = l.hq, p.kv_heads = l.hkv, p.head_dim = l.d, p.eps = eps;
    if (l.norm) p.q_gain = t["q_gain"], p.k_gain = t["k_gain"];
    if (l.rope) p.cos = t["cos"], p.sin = t["sin"], p.positions = t["positions"];
    return p;
  };
  c.forward = [params](const Tensors& t) { ops::qkv_prepare_forward(process_exec(), t["qkv"], params(t), t["q"], t["k"], t["v"]); };
  c.backward = [params](const Tensors& t) {
    ops::qkv_prepare_backward(process_exec(), t["qkv"], params(t), t["dq"], t["dk"], t["dv"], t["dqkv"], t["dq_gain"], t["dk_gain"]);
  };
  c.reference = [l](const Tensors& t) { reference_prepare(t, l); };
  c.cuda = std::move(cuda);
  c.cpu = fs.numel() <= kCpuMaxElements;
  c.finite_differences = false;
  c.fd = fd_options(1e-6, 1e-5);
  return c;
}

}  // namespace

std::vector<OpCase> qkv_prepare_cases() {
  std::vector<OpCase> cases;
  // Finite differences: positions restarting, as packed.
  for (auto [norm, rope] : {std::pair{true, true}, {true, false}, {false, true}, {false, false}}) {
    OpCase c = prepare_case({7, 4, 2, 6, norm, rope}, {0, 1, 2, 0, 1, 5, 3}, 8, {});
    c.finite_differences = true;
    cases.push_back(std::move(c));
  }
  for (bool norm : {true, false}) {  // partial rotary: 4 of 8 dims
    OpCase c = prepare_case({7, 4, 2, 8, norm, true, 4}, {0, 1, 2, 0, 1, 5, 3}, 8, {});
    c.finite_differences = true;
    cases.push_back(std::move(c));
  }
  const Layout gpu[] = {
      {29, 4, 2, 12, true, true},     // half 6: scalar path
      {1, 1, 1, 8, true, true},       // one token, half 4: scalar
      {70, 3, 1, 16, true, true},     // half 8: one vector, 4 threads per row
      {37, 16, 8, 128, true, true},   // Qwen3-0.6B heads: 8 threads per row
      {5, 2, 2, 64, false, true},     // Llama: no q/k norm
      {33, 4, 2, 128, true, false},   // NoPE
      {300, 2, 1, 256, true, true},   // 16 threads per row, several blocks
      {33000, 2, 1, 64, true, true},  // over 2048 groups of rows: each block takes several
      {37, 16, 8, 128, true, true, 64},  // partial rotary, half the head (vector path)
      {29, 4, 2, 12, true, true, 4},     // partial, scalar path
      {5, 2, 2, 64, false, true, 16},    // partial without q/k norm
  };
  constexpr int64_t kMaxPos = 64;
  for (const Layout& l : gpu) {
    std::vector<int32_t> pos(static_cast<size_t>(l.tokens));
    for (int64_t i = 0; i < l.tokens; ++i) pos[static_cast<size_t>(i)] = static_cast<int32_t>((i * 13 + 5) % kMaxPos);
    cases.push_back(prepare_case(l, pos, kMaxPos, {DType::f32}));
    // bf16 data: the gain gradients are fp32 sums of exactly known bf16 inputs, judged at 1e-3.
    OpCase b = prepare_case(l, pos, kMaxPos, {DType::bf16});
    b.name += "_bf16data";
    b.cpu = false;
    for (TensorSpec& s : b.tensors)
      if (l.norm && (s.name == "dq_gain" || s.name == "dk_gain")) s.within(1e-3);
    cases.push_back(std::move(b));
  }
  return cases;
}

}  // namespace kiln::op_test
