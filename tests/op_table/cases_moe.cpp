// The MoE dispatch ops (ops/moe/moe.h): dispatch (experts -> counts, offsets and the
// permutation, exactly), gather and its backward, the experts' grouped linear (forward,
// input and weight gradients) and combine with its backward. Loads: random, experts
// without tokens, one expert with every token; top-k 1, 2 and 8; widths off every tile and
// not multiples of 8 (the portable grouped kernel), multiples of 8 (on Hopper in bf16, the
// CUTLASS kernel), and the same widths one element off alignment (portable again); the
// dispatch also at the benchmark's 32768 x 8 pairs (chunks longer than a block's threads).
#include "op_table/moe_routes.h"
#include "op_table/op_table.h"
#include "core/rng.h"
#include "ops/moe/moe.h"

#include <fmt/format.h>

#include <cmath>

namespace kiln::op_test {

namespace {

TensorSpec ints_shaped(std::string name, std::vector<int32_t> values, Shape shape) {
  TensorSpec s = ints(std::move(name), std::move(values));
  s.shape = shape;
  return s;
}

// An i32 output, compared exactly (its prefill of -1 must be overwritten).
TensorSpec int_out(std::string name, int64_t n) {
  TensorSpec s = ints(std::move(name), std::vector<int32_t>(static_cast<size_t>(n), -1));
  s.role = Role::output;
  s.check = Check::exact;
  return s;
}

// The dispatch tensors of a case's run (from its i32 inputs).
ops::MoeDispatch dispatch_of(const Tensors& t, int64_t experts, int64_t k) {
  ops::MoeDispatch d;
  d.experts = experts, d.top_k = k;
  d.counts = t["counts"], d.offsets = t["offsets"], d.pair_of_row = t["pair_of_row"], d.row_of_pair = t["row_of_pair"];
  return d;
}

std::vector<TensorSpec> dispatch_inputs(const MoeRoutes& r) {
  return {ints("counts", r.counts), ints("offsets", r.offsets), ints("pair_of_row", r.pair_of_row),
          ints("row_of_pair", r.row_of_pair)};
}

std::string routes_name(const MoeRoutes& r, Load load) {
  return fmt::format("T{}_E{}_k{}_{}", r.tokens, r.experts, r.top_k, load_name(load));
}

OpCase dispatch_case(int64_t tokens, int64_t experts, int64_t k, Load load) {
  const MoeRoutes r = moe_routes(tokens, experts, k, load, 11 + static_cast<uint64_t>(tokens * experts + k));
  OpCase c;
  c.op = "moe_dispatch";
  c.name = routes_name(r, load);
  c.tensors = {ints_shaped("experts", r.ids, Shape{tokens, k}), int_out("counts", experts),
               int_out("offsets", experts + 1), int_out("pair_of_row", tokens * k), int_out("row_of_pair", tokens * k)};
  c.forward = [experts, k](const Tensors& t) { ops::moe_dispatch(process_exec(), t["experts"], dispatch_of(t, experts, k)); };
  c.reference = [r](const Tensors& t) {
    auto put = [&](const char* name, const std::vector<int32_t>& v) { std::copy(v.begin(), v.end(), t[name].data<int32_t>()); };
    put("counts", r.counts), put("offsets", r.offsets), put("pair_of_row", r.pair_of_row), put("row_of_pair", r.row_of_pair);
  };
  c.cpu = tokens * k <= kCpuMaxElements;
  c.finite_differences = false;
  c.cuda = {DType::f32};
  return c;
}

// Routes with empty slots (-1, about one in five) and a capacity: counts are the routed
// pairs, an expert keeps its first `capacity` pairs in pair order, the rest get row -1 and
// are counted in `dropped` (+=, onto 5). The reference walks the pairs in order.
OpCase dispatch_capacity_case(int64_t tokens, int64_t experts, int64_t k, int64_t capacity) {
  MoeRoutes r = moe_routes(tokens, experts, k, Load::few, 71 + static_cast<uint64_t>(tokens * experts + k + capacity));
  Rng rng(static_cast<uint64_t>(tokens + capacity));
  for (int32_t& id : r.ids)
    if (rng.below(5) == 0) id = -1;
  std::vector<int32_t> counts(static_cast<size_t>(experts), 0), kept(counts), offsets(static_cast<size_t>(experts + 1), 0);
  for (int32_t id : r.ids)
    if (id >= 0) ++counts[static_cast<size_t>(id)];
  for (int64_t e = 0; e < experts; ++e) {
    kept[static_cast<size_t>(e)] = capacity > 0 ? std::min<int32_t>(counts[static_cast<size_t>(e)], static_cast<int32_t>(capacity))
                                                : counts[static_cast<size_t>(e)];
    offsets[static_cast<size_t>(e + 1)] = offsets[static_cast<size_t>(e)] + kept[static_cast<size_t>(e)];
  }
  const int64_t rows = tokens * k;  // the layout's rows; those past offsets[E] stay unwritten
  std::vector<int32_t> pair_of_row(static_cast<size_t>(rows), -1), row_of_pair(r.ids.size(), -1);
  std::vector<int32_t> next(offsets.begin(), offsets.end() - 1);
  int32_t dropped = 5;
  for (size_t p = 0; p < r.ids.size(); ++p) {
    const int32_t e = r.ids[p];
    if (e < 0) continue;
    if (next[static_cast<size_t>(e)] == offsets[static_cast<size_t>(e + 1)]) {
      ++dropped;
      continue;
    }
    row_of_pair[p] = next[static_cast<size_t>(e)]++;
    pair_of_row[static_cast<size_t>(row_of_pair[p])] = static_cast<int32_t>(p);
  }
  OpCase c;
  c.op = "moe_dispatch";
  c.name = fmt::format("T{}_E{}_k{}_cap{}_empty", tokens, experts, k, capacity);
  TensorSpec dropped_spec = ints("dropped", {5});
  dropped_spec.role = Role::output, dropped_spec.check = Check::exact, dropped_spec.init = Init::copy;
  dropped_spec.from = "dropped_start";
  c.tensors = {ints_shaped("experts", r.ids, Shape{tokens, k}), int_out("counts", experts),
               int_out("offsets", experts + 1), ints("pair_of_row", std::vector<int32_t>(static_cast<size_t>(rows), -1)),
               int_out("row_of_pair", tokens * k), ints("dropped_start", {5}), dropped_spec};
  c.tensors[3].role = Role::output, c.tensors[3].check = Check::exact, c.tensors[3].init = Init::copy;
  c.tensors[3].from = "pair_of_row_start";
  c.tensors.push_back(ints("pair_of_row_start", std::vector<int32_t>(static_cast<size_t>(rows), -1)));
  c.forward = [experts, k, capacity](const Tensors& t) {
    ops::MoeDispatch d = dispatch_of(t, experts, k);
    d.capacity = capacity;
    d.dropped = t["dropped"];
    ops::moe_dispatch(process_exec(), t["experts"], d);
  };
  c.reference = [=](const Tensors& t) {
    auto put = [&](const char* name, const std::vector<int32_t>& v) { std::copy(v.begin(), v.end(), t[name].data<int32_t>()); };
    put("counts", counts), put("offsets", offsets), put("pair_of_row", pair_of_row), put("row_of_pair", row_of_pair);
    t["dropped"].data<int32_t>()[0] = dropped;
  };
  c.cpu = tokens * k <= kCpuMaxElements;
  c.finite_differences = false;
  c.cuda = {DType::f32};
  return c;
}

OpCase gather_case(int64_t tokens, int64_t experts, int64_t k, int64_t d, Load load, std::vector<DType> cuda) {
  const MoeRoutes r = moe_routes(tokens, experts, k, load, 23 + static_cast<uint64_t>(tokens + d));
  OpCase c;
  c.op = "moe_gather";
  c.name = fmt::format("{}_d{}", routes_name(r, load), d);
  c.tensors = dispatch_inputs(r);
  for (TensorSpec s : {in("x", {tokens, d}), out("grouped", {tokens * k, d}).exact(),
                       grad_out("dgrouped", "grouped", {tokens * k, d}), grad_in("dx", "x", {tokens, d}).accumulating()})
    c.tensors.push_back(s);
  c.forward = [experts, k](const Tensors& t) { ops::moe_gather(process_exec(), t["x"], dispatch_of(t, experts, k), t["grouped"]); };
  c.backward = [experts, k](const Tensors& t) {
    ops::moe_gather_backward(process_exec(), t["dgrouped"], dispatch_of(t, experts, k), t["dx"], true);
  };
  c.reference = [r, d](const Tensors& t) {
    for (size_t row = 0; row < r.pair_of_row.size(); ++row)
      for (int64_t col = 0; col < d; ++col)
        t.f64("grouped")[static_cast<int64_t>(row) * d + col] = t.f64("x")[(r.pair_of_row[row] / r.top_k) * d + col];
  };
  c.cuda = std::move(cuda);
  c.cpu = tokens * k * d <= kCpuMaxElements;
  c.finite_differences = tokens * d <= 64;
  c.fd = fd_options(1e-8, 1e-4);
  return c;
}

OpCase combine_case(int64_t tokens, int64_t experts, int64_t k, int64_t d, Load load, std::vector<DType> cuda) {
  const MoeRoutes r = moe_routes(tokens, experts, k, load, 37 + static_cast<uint64_t>(tokens + d));
  OpCase c;
  c.op = "moe_combine";
  c.name = fmt::format("{}_d{}", routes_name(r, load), d);
  c.tensors = dispatch_inputs(r);
  for (TensorSpec s : {in("y", {tokens * k, d}), in("weights", {tokens, k}, Width::wide).scaled(0.5, 0.5),
                       out("out", {tokens, d}), grad_out("dout", "out", {tokens, d}),
                       grad_in("dy", "y", {tokens * k, d}), grad_in("dweights", "weights", {tokens, k}, Width::wide)})
    c.tensors.push_back(s);
  c.forward = [experts, k](const Tensors& t) {
    ops::moe_combine(process_exec(), t["y"], t["weights"], dispatch_of(t, experts, k), t["out"]);
  };
  c.backward = [experts, k](const Tensors& t) {
    ops::moe_combine_backward(process_exec(), t["y"], t["weights"], t["dout"], dispatch_of(t, experts, k), t["dy"], t["dweights"]);
  };
  c.reference = [r, d](const Tensors& t) {
    for (int64_t tok = 0; tok < r.tokens; ++tok)
      for (int64_t col = 0; col < d; ++col) {
        double s = 0;
        for (int64_t j = 0; j < r.top_k; ++j)
          s += t.f64("weights")[tok * r.top_k + j] *
               t.f64("y")[static_cast<int64_t>(r.row_of_pair[static_cast<size_t>(tok * r.top_k + j)]) * d + col];
        t.f64("out")[tok * d + col] = s;
      }
  };
  c.cuda = std::move(cuda);
  c.cpu = tokens * k * d <= kCpuMaxElements;
  c.finite_differences = tokens * k * d <= 96;
  c.fd = fd_options(1e-8, 1e-4);
  return c;
}

// Expert e's rows [offsets[e], offsets[e + 1]) times its weight rows [e out, (e + 1) out).
OpCase grouped_linear_case(int64_t tokens, int64_t experts, int64_t k, int64_t in_f, int64_t out_f, Load load,
                           std::vector<DType> cuda, bool unaligned = false) {
  const MoeRoutes r = moe_routes(tokens, experts, k, load, 51 + static_cast<uint64_t>(tokens + in_f + out_f));
  const int64_t rows = tokens * k;
  OpCase c;
  c.op = "moe_grouped_linear";
  c.name = fmt::format("{}_in{}_out{}{}", routes_name(r, load), in_f, out_f, unaligned ? "_unaligned" : "");
  c.tensors = {ints("offsets", r.offsets),
               in("x", {rows, in_f}),
               in("w", {experts * out_f, in_f}),
               out("y", {rows, out_f}),
               grad_out("dy", "y", {rows, out_f}),
               grad_in("dx", "x", {rows, in_f}),
               grad_in("dw", "w", {experts * out_f, in_f}, Width::wide).accumulating()};
  auto dispatch = [experts](const Tensors& t) {
    ops::MoeDispatch d;
    d.experts = experts, d.top_k = 1;
    d.offsets = t["offsets"];
    return d;
  };
  c.forward = [dispatch](const Tensors& t) { ops::moe_grouped_linear_forward(process_exec(), t["x"], t["w"], dispatch(t), t["y"]); };
  c.backward = [dispatch](const Tensors& t) {
    ops::moe_grouped_linear_backward(process_exec(), t["x"], t["w"], t["dy"], dispatch(t), t["dx"], t["dw"]);
  };
  auto expert_of_row = [r](int64_t row) {
    int64_t e = 0;
    while (r.offsets[static_cast<size_t>(e + 1)] <= row) ++e;
    return e;
  };
  c.reference = [=](const Tensors& t) {
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t e = expert_of_row(i);
      for (int64_t j = 0; j < out_f; ++j) {
        double s = 0;
        for (int64_t q = 0; q < in_f; ++q) s += t.f64("x")[i * in_f + q] * t.f64("w")[(e * out_f + j) * in_f + q];
        t.f64("y")[i * out_f + j] = s;
      }
    }
  };
  c.magnitudes = [=](const Tensors& t, DType, Magnitudes& m) {
    Magnitude& my = m["y"];
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t e = expert_of_row(i);
      for (int64_t j = 0; j < out_f; ++j) {
        double s = 0;
        for (int64_t q = 0; q < in_f; ++q) s += std::fabs(t.f64("x")[i * in_f + q] * t.f64("w")[(e * out_f + j) * in_f + q]);
        my.values.push_back(s);
      }
    }
  };
  c.cuda = std::move(cuda);
  c.cpu = rows * std::max(in_f, out_f) * 2 <= kCpuMaxElements;
  c.finite_differences = rows * in_f <= 64 && experts * out_f * in_f <= 64;
  c.fd = fd_options(1e-8, 1e-4);
  c.unaligned = unaligned;
  return c;
}

}  // namespace

std::vector<OpCase> moe_cases() {
  const std::vector<DType> both = {DType::f32, DType::bf16};
  std::vector<OpCase> cases;
  for (Load load : {Load::random, Load::few, Load::all_to_last}) {
    for (auto [t, e, k] : {std::tuple<int64_t, int64_t, int64_t>{1, 1, 1}, {7, 3, 2}, {130, 8, 1}, {130, 64, 8},
                           {600, 64, 2}, {2000, 16, 8}, {5000, 64, 8}, {32768, 64, 8}})
      cases.push_back(dispatch_case(t, e, k, load));
    // Finite differences on small ones; then odd and vector widths.
    cases.push_back(gather_case(5, 4, 2, 3, load, {}));
    if (load == Load::random)  // empty slots and a capacity: none, 1, a few, past every count
      for (auto [t, e, k, cap] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{7, 3, 2, 0}, {7, 3, 2, 1},
                                  {130, 8, 2, 20}, {2000, 16, 8, 600}, {32768, 64, 8, 3000}})
        cases.push_back(dispatch_capacity_case(t, e, k, cap));
    cases.push_back(combine_case(5, 4, 2, 3, load, {}));
    for (auto [t, e, k, d] : {std::tuple<int64_t, int64_t, int64_t, int64_t>{7, 3, 1, 13}, {33, 8, 8, 64},
                              {130, 64, 2, 77}}) {
      cases.push_back(gather_case(t, e, k, d, load, both));
      cases.push_back(combine_case(t, e, k, d, load, both));
    }
    cases.push_back(grouped_linear_case(4, 3, 1, 3, 2, load, {}));  // finite differences
    for (auto [t, e, k, in_f, out_f] : {std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t>{1, 1, 1, 5, 3},
                                        {7, 3, 2, 13, 7}, {37, 8, 2, 40, 24}, {130, 8, 1, 64, 128}, {66, 16, 8, 72, 33},
                                        {40, 64, 8, 128, 64}})
      cases.push_back(grouped_linear_case(t, e, k, in_f, out_f, load, both));
    cases.push_back(grouped_linear_case(37, 8, 2, 40, 24, load, both, /*unaligned=*/true));
  }
  return cases;
}

}  // namespace kiln::op_test
