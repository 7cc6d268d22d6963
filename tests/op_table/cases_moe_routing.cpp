// The routers' math (ops/moe/routing.h): softmax_topk, sigmoid_bias (with expert groups),
// sinkhorn (with its scales), expert_choice and relu forward -- the distribution, the
// experts exactly, their weights -- and backward through the weights and the distribution,
// the choice held fixed; all fp32 on the GPU (wide). The
// logits are spread (scale 2) so that no two keys of a row sit within the finite
// differences' step or the GPU's rounding of each other.
#include "op_table/op_table.h"
#include "core/rng.h"
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
    ops::softmax_topk_forward(process_exec(), t["logits"], normalize, t["probs"], routes_of(t));
  };
  c.backward = [normalize](const Tensors& t) {
    ops::softmax_topk_backward(process_exec(), t["probs"], routes_of(t), normalize, t["dweights"], t["dprobs"], t["dlogits"]);
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
    ops::sigmoid_bias_forward(process_exec(), t["logits"], t["bias"], groups, top_groups, normalize, scaling, t["scores"], routes_of(t));
  };
  c.backward = [=](const Tensors& t) {
    ops::sigmoid_bias_backward(process_exec(), t["scores"], routes_of(t), normalize, scaling, t["dweights"], t["dscores"], t["dlogits"]);
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


std::vector<double> softmax(const double* l, int64_t n) {
  const double m = *std::max_element(l, l + n);
  std::vector<double> p(static_cast<size_t>(n));
  double sum = 0;
  for (int64_t j = 0; j < n; ++j) sum += p[static_cast<size_t>(j)] = std::exp(l[j] - m);
  for (double& v : p) v /= sum;
  return p;
}

// Sinkhorn's scales from c = 1 (eps 1e-8), then the top k of c_e p_te, weights from p. The
// logits lean toward expert 0 (+1.5) so that the balancing moves choices.
OpCase sinkhorn_case(int64_t tokens, int64_t experts, int64_t k, int64_t iterations, bool normalize,
                     std::vector<DType> cuda) {
  const Shape le{tokens, experts}, lk{tokens, k};
  OpCase c;
  c.op = "sinkhorn_topk";
  c.name = fmt::format("T{}_E{}_k{}_it{}_{}", tokens, experts, k, iterations, normalize ? "norm" : "raw");
  c.tensors = {in("logits", le, Width::wide).scaled(2.0).filled([experts](double* v, int64_t n) {
                 Rng rng(static_cast<uint64_t>(n + experts));
                 for (int64_t i = 0; i < n; ++i) v[i] = 2.0 * rng.normal() + (i % experts == 0 ? 1.5 : 0.0);
               }),
               out("probs", le, Width::wide), out("row_scale", {tokens}, Width::wide),
               out("col_scale", {experts}, Width::wide), int_out("experts", lk), out("weights", lk, Width::wide),
               grad_out("dweights", "weights", lk, Width::wide), grad_out("dprobs", "probs", le, Width::wide),
               grad_in("dlogits", "logits", le, Width::wide)};
  c.forward = [=](const Tensors& t) {
    ops::sinkhorn_topk_forward(process_exec(), t["logits"], iterations, normalize, t["probs"], t["row_scale"], t["col_scale"],
                               routes_of(t));
  };
  c.backward = [normalize](const Tensors& t) {
    ops::softmax_topk_backward(process_exec(), t["probs"], routes_of(t), normalize, t["dweights"], t["dprobs"], t["dlogits"]);
  };
  c.reference = [=](const Tensors& t) {
    std::vector<std::vector<double>> p;
    for (int64_t r = 0; r < tokens; ++r) p.push_back(softmax(t.f64("logits") + r * experts, experts));
    std::vector<double> row(static_cast<size_t>(tokens), 0.0), col(static_cast<size_t>(experts), 1.0);
    for (int64_t it = 0; it < iterations; ++it) {
      for (int64_t r = 0; r < tokens; ++r) {
        double s = 0;
        for (int64_t e = 0; e < experts; ++e) s += col[static_cast<size_t>(e)] * p[static_cast<size_t>(r)][static_cast<size_t>(e)];
        row[static_cast<size_t>(r)] = 1.0 / (static_cast<double>(tokens) * (s + 1e-8));
      }
      for (int64_t e = 0; e < experts; ++e) {
        double s = 0;
        for (int64_t r = 0; r < tokens; ++r) s += row[static_cast<size_t>(r)] * p[static_cast<size_t>(r)][static_cast<size_t>(e)];
        col[static_cast<size_t>(e)] = 1.0 / (static_cast<double>(experts) * (s + 1e-8));
      }
    }
    for (int64_t r = 0; r < tokens; ++r) {
      const std::vector<double>& pr = p[static_cast<size_t>(r)];
      std::copy(pr.begin(), pr.end(), t.f64("probs") + r * experts);
      t.f64("row_scale")[r] = row[static_cast<size_t>(r)];
      std::vector<double> key(static_cast<size_t>(experts));
      for (int64_t e = 0; e < experts; ++e) key[static_cast<size_t>(e)] = col[static_cast<size_t>(e)] * pr[static_cast<size_t>(e)];
      const std::vector<int> best = top_k(key, k, std::vector<bool>(static_cast<size_t>(experts), true));
      double chosen = 0;
      for (int e : best) chosen += pr[static_cast<size_t>(e)];
      for (int64_t j = 0; j < k; ++j) {
        const int e = best[static_cast<size_t>(j)];
        t["experts"].data<int32_t>()[r * k + j] = e;
        t.f64("weights")[r * k + j] = normalize ? pr[static_cast<size_t>(e)] / chosen : pr[static_cast<size_t>(e)];
      }
    }
    if (iterations == 0) std::fill(t.f64("row_scale"), t.f64("row_scale") + tokens, 0.0);
    std::copy(col.begin(), col.end(), t.f64("col_scale"));
  };
  if (iterations == 0) c.tensors[2].unchecked();  // no iteration writes the row scales
  c.cuda = std::move(cuda);
  c.cpu = tokens * experts <= kCpuMaxElements;
  c.finite_differences = tokens * experts <= 48;
  c.fd = fd_options(1e-7, 1e-5);
  return c;
}

// Expert e takes the `capacity` tokens of largest p_te; routes of E slots.
OpCase expert_choice_case(int64_t tokens, int64_t experts, int64_t capacity, std::vector<DType> cuda) {
  const Shape le{tokens, experts};
  OpCase c;
  c.op = "expert_choice";
  c.name = fmt::format("T{}_E{}_C{}", tokens, experts, capacity);
  c.tensors = {in("logits", le, Width::wide).scaled(2.0), out("probs", le, Width::wide), int_out("experts", le),
               out("weights", le, Width::wide), grad_out("dweights", "weights", le, Width::wide),
               grad_out("dprobs", "probs", le, Width::wide), grad_in("dlogits", "logits", le, Width::wide)};
  c.forward = [capacity](const Tensors& t) {
    ops::expert_choice_forward(process_exec(), t["logits"], capacity, t["probs"], routes_of(t));
  };
  c.backward = [](const Tensors& t) {
    ops::softmax_topk_backward(process_exec(), t["probs"], routes_of(t), false, t["dweights"], t["dprobs"], t["dlogits"]);
  };
  c.reference = [=](const Tensors& t) {
    for (int64_t r = 0; r < tokens; ++r) {
      const std::vector<double> p = softmax(t.f64("logits") + r * experts, experts);
      std::copy(p.begin(), p.end(), t.f64("probs") + r * experts);
    }
    for (int64_t e = 0; e < experts; ++e) {
      std::vector<double> column(static_cast<size_t>(tokens));
      for (int64_t r = 0; r < tokens; ++r) column[static_cast<size_t>(r)] = t.f64("probs")[r * experts + e];
      std::vector<bool> taken(static_cast<size_t>(tokens), false);
      for (int r : top_k(column, capacity, std::vector<bool>(static_cast<size_t>(tokens), true))) taken[static_cast<size_t>(r)] = true;
      for (int64_t r = 0; r < tokens; ++r) {
        const bool on = taken[static_cast<size_t>(r)];
        t["experts"].data<int32_t>()[r * experts + e] = on ? static_cast<int32_t>(e) : -1;
        t.f64("weights")[r * experts + e] = on ? column[static_cast<size_t>(r)] : 0.0;
      }
    }
  };
  c.cuda = std::move(cuda);
  c.cpu = tokens * experts <= kCpuMaxElements;
  c.finite_differences = tokens * experts <= 48;
  c.fd = fd_options(1e-7, 1e-5);
  return c;
}

// ReLU gates: slot e routed where the logit is positive; backward with the L1 penalty's
// gradient at coefficient `coef` (0 where finite differences check it: the penalty is not
// an output).
OpCase relu_case(int64_t tokens, int64_t experts, double coef, std::vector<DType> cuda) {
  const Shape le{tokens, experts};
  OpCase c;
  c.op = "relu_route";
  c.name = fmt::format("T{}_E{}_{}", tokens, experts, coef == 0 ? "no_l1" : "l1");
  c.tensors = {in("logits", le, Width::wide).scaled(2.0),
               in("coef", {1}, Width::wide).filled([coef](double* v, int64_t) { v[0] = coef; }),
               out("probs", le, Width::wide), int_out("experts", le), out("weights", le, Width::wide),
               grad_out("dweights", "weights", le, Width::wide), grad_in("dlogits", "logits", le, Width::wide)};
  c.forward = [](const Tensors& t) { ops::relu_route_forward(process_exec(), t["logits"], t["probs"], routes_of(t)); };
  c.backward = [](const Tensors& t) {
    ops::relu_route_backward(process_exec(), routes_of(t), t["dweights"], t["coef"], 0.5, t["dlogits"]);
  };
  c.reference = [=](const Tensors& t) {
    for (int64_t r = 0; r < tokens; ++r) {
      const double* l = t.f64("logits") + r * experts;
      double sum = 0;
      for (int64_t e = 0; e < experts; ++e) sum += std::max(0.0, l[e]);
      for (int64_t e = 0; e < experts; ++e) {
        const bool on = l[e] > 0;
        t["experts"].data<int32_t>()[r * experts + e] = on ? static_cast<int32_t>(e) : -1;
        t.f64("weights")[r * experts + e] = on ? l[e] : 0.0;
        t.f64("probs")[r * experts + e] = on ? l[e] / sum : 0.0;
      }
    }
  };
  c.cuda = std::move(cuda);
  c.cpu = tokens * experts <= kCpuMaxElements;
  c.finite_differences = coef == 0 && tokens * experts <= 48;
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
    // sinkhorn: finite differences; no iteration (the softmax's top k); E past a lane's slot.
    cases.push_back(sinkhorn_case(6, 4, 2, 5, normalize, {}));
    for (auto [t, e, k, it] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{7, 8, 2, 0}, {37, 8, 1, 3},
                               {130, 64, 8, 8}, {1000, 16, 2, 8}, {300, 256, 8, 4}})
      cases.push_back(sinkhorn_case(t, e, k, it, normalize, gpu));
  }
  // expert_choice: finite differences; capacities 0, 1 and every token; many tokens per block pass.
  cases.push_back(expert_choice_case(6, 4, 3, {}));
  for (auto [t, e, cap] : {std::tuple<int64_t, int64_t, int64_t>{7, 8, 0}, {7, 8, 7}, {37, 8, 1}, {130, 64, 5},
                           {1000, 16, 125}, {600, 256, 5}})
    cases.push_back(expert_choice_case(t, e, cap, gpu));
  // relu: finite differences without the penalty, then with it on the GPU's sizes.
  cases.push_back(relu_case(5, 6, 0.0, {}));
  for (auto [t, e] : {std::pair<int64_t, int64_t>{1, 1}, {37, 8}, {130, 64}, {1000, 16}, {33, 256}})
    cases.push_back(relu_case(t, e, 0.3, gpu));
  return cases;
}

}  // namespace kiln::op_test
