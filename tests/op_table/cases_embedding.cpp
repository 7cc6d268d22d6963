// embedding (ops/embedding/embedding.h): rows of a table by token id, and the backward
// that adds the output gradient's rows into the table's (repeated ids add up; ids not in
// the batch get exactly nothing). Two backward forms: atomics (the GPU's order is not
// fixed: compared by tolerance only) and groups of equal ids (a fixed order, the same
// bits every run).
#include "op_table/op_table.h"
#include "ops/embedding/embedding.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

namespace kiln::op_test {

namespace {

OpCase embedding_case(std::vector<int32_t> ids, int64_t vocab, int64_t dim, bool grouped, std::vector<DType> cuda) {
  const auto n = static_cast<int64_t>(ids.size());
  OpCase c;
  c.op = grouped ? "embedding_grouped" : "embedding";
  c.name = fmt::format("n{}_v{}_d{}", n, vocab, dim);
  std::vector<bool> used(static_cast<size_t>(vocab), false);
  for (int32_t id : ids) used[static_cast<size_t>(id)] = true;
  c.tensors = {ints("tokens", ids), in("table", {vocab, dim}), out("out", {n, dim}).exact(),
               grad_out("dout", "out", {n, dim}), grad_in("dtable", "table", {vocab, dim}).accumulating()};
  if (grouped) {
    std::vector<int32_t> counts(static_cast<size_t>(vocab), 0), order, group_ids, starts;
    ops::group_tokens(ids.data(), n, counts, order, group_ids, starts);
    c.tensors.push_back(ints("order", order));
    c.tensors.push_back(ints("group_tokens", group_ids));
    c.tensors.push_back(ints("group_starts", starts));
  }
  c.forward = [](const Tensors& t) { ops::embedding_forward(process_exec(), t["tokens"], t["table"], t["out"]); };
  if (grouped)
    c.backward = [](const Tensors& t) {
      const ops::TokenGroups groups{t["order"], t["group_tokens"], t["group_starts"], t["group_tokens"].numel()};
      ops::embedding_backward(process_exec(), groups, t["dout"], t["dtable"]);
    };
  else
    c.backward = [](const Tensors& t) { ops::embedding_backward(process_exec(), t["tokens"], t["dout"], t["dtable"]); };
  c.reference = [dim](const Tensors& t) {
    const std::vector<int32_t>& tokens = t.ints("tokens");
    for (size_t i = 0; i < tokens.size(); ++i)
      for (int64_t e = 0; e < dim; ++e) t.f64("out")[static_cast<int64_t>(i) * dim + e] = t.f64("table")[tokens[i] * dim + e];
  };
  c.invariants = [used, dim](const Tensors& t) {
    for (size_t id = 0; id < used.size(); ++id)
      if (!used[id])
        for (int64_t e = 0; e < dim; ++e) {
          const int64_t i = static_cast<int64_t>(id) * dim + e;
          ASSERT_EQ(t.f64("dtable")[i], t.f64("dtable.start")[i]) << "row " << id << " is not in the batch";
        }
  };
  c.cuda = std::move(cuda);
  c.deterministic = grouped;
  c.finite_differences = c.cuda.empty();
  c.fd = fd_options(1e-8, 1e-4);
  return c;
}

}  // namespace

std::vector<OpCase> embedding_cases() {
  std::vector<OpCase> cases;
  // 3 and 4 unused, 2 four times.
  for (bool grouped : {false, true}) cases.push_back(embedding_case({2, 0, 2, 5, 2, 1, 0, 2}, 6, 5, grouped, {}));
  std::vector<int32_t> ids(100);
  for (int32_t i = 0; i < 100; ++i) ids[static_cast<size_t>(i)] = (i * 7 + i * i) % 50;  // repeats
  for (bool grouped : {false, true}) cases.push_back(embedding_case(ids, 50, 33, grouped, {DType::f32}));
  return cases;
}

}  // namespace kiln::op_test
