#include "ops/embedding/embedding.h"

#include "core/op_profiler.h"
#include "ops/common.h"
#include "ops/cuda_kernels.h"

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
}  // namespace

void embedding_forward(const Tensor& tokens, const Tensor& table, const Tensor& out) {
  const char* op = "embedding";
  KILN_OP_SCOPE(op, table);
  validate(op, tokens, table, out);
  // Device ids are trusted: the data pipeline checks every id against the vocabulary.
  KILN_ON_CUDA(table, op, cuda::embedding_forward_f32(tokens.data<int32_t>(), table.data<float>(), tokens.size(0),
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

void embedding_backward(const Tensor& tokens, const Tensor& dout, const Tensor& dtable) {
  const char* op = "embedding_backward";
  KILN_OP_SCOPE(op, dtable);
  validate(op, tokens, dtable, dout);
  KILN_ON_CUDA(dtable, op, cuda::embedding_backward_f32(tokens.data<int32_t>(), dout.data<float>(), tokens.size(0),
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

}  // namespace kiln::ops
