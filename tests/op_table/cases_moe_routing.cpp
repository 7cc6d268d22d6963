// The routers' math (ops/moe/routing.h): softmax_topk and sigmoid_bias (with expert groups)
// forward -- the distribution, the k experts exactly, their weights -- and backward through
// the weights and the distribution, the choice held fixed; all fp32 on the GPU (wide). The
// logits are spread (scale 2) so that no two keys of a row sit within the finite
// differences' step or the GPU's rounding of each other.
#include "op_table/op_table.h"
#include "ops/moe/routing.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <numeric>

namespace kiln::op_test {

namespace {

TensorSpec int_out(std::string name, Shape shape) {
  TensorSpec s = ints(std::move(name), std::vector<int32_t>(static_cast<size_t>(shape.numel()), -1));
  s.shape = shape;
  s.role = Role::output;
  s.check = Check::exact;
  return s;
}

// The k best of `key` among `allowed` (largest first, equal keys: the lower id).
std::vector<int> top_k(const std::vector<double>& key, int64_t k, const std::vector<bool>& allowed) {
  std::vector<int> ids(key.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::stable_sort(ids.begin(), ids.end(), [&](int a, int b) {
    if (allowed[static_cast<size_t>(a)] != allowed[static_cast<size_t>(b)]) return static_cast<bool>(allowed[static_cast<size_t>(a)]);
    return key[static_cast<size_t>(a)] > key[static_cast<size_t>(b)];
  });
  ids.resize(static_cast<size_t>(k));
  return ids;
}

ops::Routes routes_of(const Tensors& t) { return {t["experts"], t["weights"]}; }

OpCase softmax_topk_case(int64_t tokens, int64_t experts, int64_t k, bool normalize, std::vector<DType> cuda) {
  const Shape le{tokens, experts}, lk{tokens, k};
  OpCase c;
  c.op = "softmax_topk";
  c.name = fmt::format("T{}_E{}_k{}_{}", tokens, experts, k, normalize ? "norm" : "raw");
  c.tensors = {in("logits", le, Width::wide).scaled(2.0), out("probs", le, Width::wide), int_out("experts", lk),
               out("weights", lk, Width::wide), grad_out("dweights", "weights", lk, Width::wide),
               grad_out("dprobs", "probs", le, Width::wide), grad_in("dlogits", "logits", le, Width::wide)};
  c.forward = [normalize](const Tensors& t) {
    ops::softmax_topk_forward(t["logits"], normalize, t["probs"], routes_of(t));
  };
  c.backward = [normalize](const Tensors& t) {
    ops::softmax_topk_backward(t["probs"], routes_of(t), normalize, t["dweights"], t["dprobs"], t["dlogits"]);
  };
  c.reference = [=](const Tensors& t) {
    for (int64_t r = 0; r < tokens; ++r) {
      const double* l = t.f64("logits") + r * experts;
      const double m = *std::max_element(l, l + experts);
      std::vector<double> p(static_cast<size_t>(experts));
      double sum = 0;
      for (int64_t j = 0; j < experts; ++j) sum += p[static_cast<size_t>(j)] = std::exp(l[j] - m);
      for (double& v : p) v /= sum;
      std::copy(p.begin(), p.end(), t.f64("probs") + r * experts);
      const std::vector<int> best = top_k(p, k, std::vector<bool>(static_cast<size_t>(experts), true));
      double chosen = 0;
      for (int e : best) chosen += p[static_cast<size_t>(e)];
      for (int64_t j = 0; j < k; ++j) {
        const int e = best[static_cast<size_t>(j)];
        t["experts"].data<int32_t>()[r * k + j] = e;
        t.f64("weights")[r * k + j] = normalize ? p[static_cast<size_t>(e)] / chosen : p[static_cast<size_t>(e)];
      }
    }
  };
  c.cuda = std::move(cuda);
  c.cpu = tokens * experts <= kCpuMaxElements;
  c.finite_differences = tokens * experts <= 48;
  c.fd = fd_options(1e-7, 1e-5);
  return c;
}

OpCase sigmoid_bias_case(int64_t tokens, int64_t experts, int64_t k, int64_t groups, int64_t top_groups, bool normalize,
                         std::vector<DType> cuda) {
  const Shape le{tokens, experts}, lk{tokens, k};
  const double scaling = 2.5;
  OpCase c;
  c.op = "sigmoid_bias";
  c.name = fmt::format("T{}_E{}_k{}_g{}of{}_{}", tokens, experts, k, top_groups, groups, normalize ? "norm" : "raw");
  c.tensors = {in("logits", le, Width::wide).scaled(2.0),   in("bias", {experts}, Width::wide).scaled(0.3),
               out("scores", le, Width::wide),              int_out("experts", lk),
               out("weights", lk, Width::wide),             grad_out("dweights", "weights", lk, Width::wide),
               grad_out("dscores", "scores", le, Width::wide), grad_in("dlogits", "logits", le, Width::wide)};
  c.forward = [=](const Tensors& t) {
    ops::sigmoid_bias_forward(t["logits"], t["bias"], groups, top_groups, normalize, scaling, t["scores"], routes_of(t));
  };
  c.backward = [=](const Tensors& t) {
    ops::sigmoid_bias_backward(t["scores"], routes_of(t), normalize, scaling, t["dweights"], t["dscores"], t["dlogits"]);
  };
  c.reference = [=](const Tensors& t) {
    const int64_t size = experts / groups;
    for (int64_t r = 0; r < tokens; ++r) {
      std::vector<double> s(static_cast<size_t>(experts)), key(s.size());
      for (int64_t j = 0; j < experts; ++j) {
        s[static_cast<size_t>(j)] = 1 / (1 + std::exp(-t.f64("logits")[r * experts + j]));
        key[static_cast<size_t>(j)] = s[static_cast<size_t>(j)] + t.f64("bias")[j];
        t.f64("scores")[r * experts + j] = s[static_cast<size_t>(j)];
      }
      std::vector<double> group_key(static_cast<size_t>(groups));
      for (int64_t g = 0; g < groups; ++g) {
        std::vector<double> members(key.begin() + g * size, key.begin() + (g + 1) * size);
        std::sort(members.rbegin(), members.rend());
        group_key[static_cast<size_t>(g)] = members[0] + (size > 1 ? members[1] : 0.0);
      }
      std::vector<bool> allowed(static_cast<size_t>(experts), false);
      for (int g : top_k(group_key, top_groups, std::vector<bool>(static_cast<size_t>(groups), true)))
        std::fill(allowed.begin() + g * size, allowed.begin() + (g + 1) * size, true);
      const std::vector<int> best = top_k(key, k, allowed);
      double chosen = 0;
      for (int e : best) chosen += s[static_cast<size_t>(e)];
      for (int64_t j = 0; j < k; ++j) {
        const int e = best[static_cast<size_t>(j)];
        t["experts"].data<int32_t>()[r * k + j] = e;
        const double w = normalize ? s[static_cast<size_t>(e)] / chosen : s[static_cast<size_t>(e)];
        t.f64("weights")[r * k + j] = w * scaling;
      }
    }
  };
  c.cuda = std::move(cuda);
  c.cpu = tokens * experts <= kCpuMaxElements;
  c.finite_differences = tokens * experts <= 48;
  c.fd = fd_options(1e-7, 1e-5);
  return c;
}

}  // namespace

std::vector<OpCase> moe_routing_cases() {
  std::vector<OpCase> cases;
  const std::vector<DType> gpu = {DType::f32};
  for (bool normalize : {true, false}) {
    cases.push_back(softmax_topk_case(5, 6, 2, normalize, {}));  // finite differences
    cases.push_back(sigmoid_bias_case(5, 6, 2, 1, 1, normalize, {}));
    cases.push_back(sigmoid_bias_case(4, 8, 3, 4, 2, normalize, {}));
    // One expert; top 1 and 8; E past one lane's slot (64, 160) and up to 256.
    for (auto [t, e, k] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 1}, {7, 8, 8}, {37, 8, 1}, {130, 64, 8},
                           {33, 160, 6}, {300, 256, 8}, {1000, 16, 2}}) {
      cases.push_back(softmax_topk_case(t, e, k, normalize, gpu));
      cases.push_back(sigmoid_bias_case(t, e, k, 1, 1, normalize, gpu));
    }
    // Expert groups (DeepSeek-V3's node-limited routing): 8 groups of 8, the best 4; 4 of 64.
    cases.push_back(sigmoid_bias_case(130, 64, 8, 8, 4, normalize, gpu));
    cases.push_back(sigmoid_bias_case(37, 256, 8, 4, 2, normalize, gpu));
  }
  return cases;
}

}  // namespace kiln::op_test
