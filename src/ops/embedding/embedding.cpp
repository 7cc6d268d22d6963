#include "ops/embedding/embedding.h"

#include "core/op_profiler.h"
#include "ops/common.h"
#include "ops/embedding/embedding_cuda.h"

#include <cstring>

namespace kiln::ops {

namespace {
void validate(const char* op, const Tensor& tokens, const Tensor& table, const Tensor& rows) {
  expect_rank(op, "tokens", tokens, 1);
  expect_dtype(op, "tokens", tokens, DType::i32);
  expect_rank(op, "table", table, 2);
  expect_shape(op, "rows", rows, Shape{tokens.size(0), table.size(1)});
  expect_same(op, "rows", rows, table);
  KILN_CHECK(tokens.device() == table.device(), op, "tokens and table on different devices");
}

// A bf16 table (bf16 masters, optim.master_weights) read into fp32 rows: the rows widened exactly.
void forward_bf16_table(const ExecContext& ctx, const char* op, const Tensor& tokens, const Tensor& table,
                        const Tensor& out) {
  expect_rank(op, "tokens", tokens, 1);
  expect_dtype(op, "tokens", tokens, DType::i32);
  expect_rank(op, "table", table, 2);
  expect_tensor(op, "rows", out, Shape{tokens.size(0), table.size(1)}, DType::f32, table.device());
  KILN_CHECK(tokens.device() == table.device(), op, "tokens and table on different devices");
  const auto* bits = static_cast<const uint16_t*>(table.raw());
  KILN_ON_CUDA(table, op, cuda::embedding_forward_bf16_table(ctx, tokens.data<int32_t>(), bits, tokens.size(0),
                                                             table.size(1), out.data<float>()));
  const int32_t* ids = tokens.data<int32_t>();
  const int64_t n = tokens.size(0), vocab = table.size(0), dim = table.size(1);
  float* dst = out.data<float>();
  for (int64_t i = 0; i < n; ++i) {
    KILN_CHECK(ids[i] >= 0 && ids[i] < vocab, op, "token id {} at position {} is outside the vocabulary [0, {})",
               ids[i], i, vocab);
    for (int64_t c = 0; c < dim; ++c) dst[i * dim + c] = bf16_to_float(bits[ids[i] * dim + c]);
  }
}
}  // namespace

void embedding_forward(const ExecContext& ctx, const Tensor& tokens, const Tensor& table, const Tensor& out) {
  const char* op = "embedding";
  KILN_OP_SCOPE(op, table);
  if (table.dtype() == DType::bf16 && out.dtype() == DType::f32) return forward_bf16_table(ctx, op, tokens, table, out);
  validate(op, tokens, table, out);
  // Device ids are trusted: the data pipeline checks every id against the vocabulary.
  KILN_ON_CUDA(table, op, cuda::embedding_forward_f32(ctx, tokens.data<int32_t>(), table.data<float>(), tokens.size(0),
                                                      table.size(1), out.data<float>()));
  const int32_t* ids = tokens.data<int32_t>();
  const int64_t n = tokens.size(0), vocab = table.size(0), dim = table.size(1);
  for (int64_t i = 0; i < n; ++i)
    KILN_CHECK(ids[i] >= 0 && ids[i] < vocab, op, "token id {} at position {} is outside the vocabulary [0, {})",
               ids[i], i, vocab);
  dispatch_cpu_float(op, table.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T* src = table.data<T>();
    T* dst = out.data<T>();
    for (int64_t i = 0; i < n; ++i) std::memcpy(dst + i * dim, src + ids[i] * dim, sizeof(T) * dim);
  });
}

void embedding_backward(const ExecContext& ctx, const Tensor& tokens, const Tensor& dout, const Tensor& dtable) {
  const char* op = "embedding_backward";
  KILN_OP_SCOPE(op, dtable);
  validate(op, tokens, dtable, dout);
  KILN_ON_CUDA(dtable, op, cuda::embedding_backward_f32(ctx, tokens.data<int32_t>(), dout.data<float>(), tokens.size(0),
                                                        dtable.size(1), dtable.data<float>()));
  const int32_t* ids = tokens.data<int32_t>();
  const int64_t n = tokens.size(0), dim = dtable.size(1);
  dispatch_cpu_float(op, dtable.dtype(), [&](auto zero) {
    using T = decltype(zero);
    const T* g = dout.data<T>();
    T* dt = dtable.data<T>();
    // Sequential over tokens: repeated ids accumulate in token order (reproducible).
    for (int64_t i = 0; i < n; ++i) {
      T* row = dt + ids[i] * dim;
      const T* gi = g + i * dim;
      for (int64_t c = 0; c < dim; ++c) row[c] += gi[c];
    }
  });
}

void group_tokens(const int32_t* tokens, int64_t n, std::vector<int32_t>& counts, std::vector<int32_t>& order,
                  std::vector<int32_t>& group_tokens, std::vector<int32_t>& group_starts) {
  const int64_t vocab = static_cast<int64_t>(counts.size());
  for (int64_t i = 0; i < n; ++i)
    KILN_CHECK(tokens[i] >= 0 && tokens[i] < vocab, "embedding", "token id {} at position {} is outside [0, {})",
               tokens[i], i, vocab);
  group_tokens.clear();
  group_starts.clear();
  order.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ++counts[static_cast<size_t>(tokens[i])];
  // Groups in increasing token order; counts[t] becomes the next free slot of token t.
  // (A pass over the vocabulary per batch: cheap next to a training step.)
  int32_t start = 0;
  for (int32_t t = 0; t < static_cast<int32_t>(vocab); ++t) {
    const int32_t c = counts[static_cast<size_t>(t)];
    if (c == 0) continue;
    group_tokens.push_back(t);
    group_starts.push_back(start);
    counts[static_cast<size_t>(t)] = start;
    start += c;
  }
  group_starts.push_back(start);
  for (int64_t i = 0; i < n; ++i) order[static_cast<size_t>(counts[static_cast<size_t>(tokens[i])]++)] = static_cast<int32_t>(i);
  for (int32_t t : group_tokens) counts[static_cast<size_t>(t)] = 0;
}

void embedding_backward(const ExecContext& ctx, const TokenGroups& groups, const Tensor& dout, const Tensor& dtable) {
  const char* op = "embedding_backward";
  KILN_OP_SCOPE(op, dtable);
  expect_rank(op, "dout", dout, 2);
  expect_rank(op, "dtable", dtable, 2);
  expect_same(op, "dout", dout, dtable);
  expect_shape(op, "order", groups.order, Shape{dout.size(0)});
  KILN_CHECK(groups.group_starts.size(0) >= groups.groups + 1, op, "group_starts holds {} entries for {} groups",
             groups.group_starts.size(0), groups.groups);
  KILN_ON_CUDA(dtable, op, cuda::embedding_backward_grouped_f32(ctx,
                               groups.order.data<int32_t>(), groups.group_tokens.data<int32_t>(),
                               groups.group_starts.data<int32_t>(), groups.groups, dout.data<float>(), dtable.size(1),
                               dtable.data<float>()));
  // CPU: rows in group order, each group's rows in original order.
  const int32_t* order = groups.order.data<int32_t>();
  const int32_t* tokens = groups.group_tokens.data<int32_t>();
  const int32_t* starts = groups.group_starts.data<int32_t>();
  const int64_t dim = dtable.size(1);
  dispatch_cpu_float(op, dtable.dtype(), [&](auto zero) {
    using T = decltype(zero);
    for (int64_t g = 0; g < groups.groups; ++g) {
      T* row = dtable.data<T>() + static_cast<int64_t>(tokens[g]) * dim;
      for (int32_t r = starts[g]; r < starts[g + 1]; ++r) {
        const T* src = dout.data<T>() + static_cast<int64_t>(order[r]) * dim;
        for (int64_t c = 0; c < dim; ++c) row[c] += src[c];
      }
    }
  });
}

}  // namespace kiln::ops
