// Token embedding lookup.
#pragma once

#include "core/exec_context.h"
#include "core/tensor.h"

#include <vector>

namespace kiln::ops {

// tokens i32 [N], table [V, d] -> out [N, d] (=). Throws on a token id outside [0, V).
void embedding_forward(const ExecContext& ctx, const Tensor& tokens, const Tensor& table, const Tensor& out);
// dtable [V, d] += scatter of dout [N, d] by token. On the GPU this form accumulates with
// atomics (repeated ids add in no fixed order); the indexed form below is deterministic.
void embedding_backward(const ExecContext& ctx, const Tensor& tokens, const Tensor& dout, const Tensor& dtable);

// The batch's positions grouped by token id, in their original order within each group
// (a stable counting sort done on the host when a batch is loaded). Lets the GPU add each
// row of the table's gradient in one fixed order: deterministic, and no atomics.
struct TokenGroups {
  Tensor order;           // i32 [N]: positions sorted by token (stable)
  Tensor group_tokens;    // i32 [G]: the token of each group
  Tensor group_starts;    // i32 [G+1]: group g is order[group_starts[g] .. group_starts[g+1])
  int64_t groups = 0;
};

// Fills host vectors with the groups of `tokens` (ids in [0, vocab)); `counts` is scratch
// of size vocab, all zero on entry and on exit. No allocation once the vectors have capacity.
void group_tokens(const int32_t* tokens, int64_t n, std::vector<int32_t>& counts, std::vector<int32_t>& order,
                  std::vector<int32_t>& group_tokens, std::vector<int32_t>& group_starts);

// Deterministic form: dtable += sum over each group's rows of dout, in group order.
void embedding_backward(const ExecContext& ctx, const TokenGroups& groups, const Tensor& dout, const Tensor& dtable);

}  // namespace kiln::ops
