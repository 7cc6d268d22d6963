// Token grouping for the deterministic embedding backward: the groups are a stable sort of
// the batch's positions by token, and the grouped backward adds the same gradient.
#include "ops/embedding/embedding.h"
#include "test_util.h"

#include <gtest/gtest.h>

namespace kiln {
namespace {

TEST(EmbeddingGroups, StableGroupsByToken) {
  const std::vector<int32_t> tokens = {5, 2, 5, 0, 2, 5, 9};
  std::vector<int32_t> counts(10, 0), order, ids, starts;
  ops::group_tokens(tokens.data(), 7, counts, order, ids, starts);
  EXPECT_EQ(ids, (std::vector<int32_t>{0, 2, 5, 9}));
  EXPECT_EQ(starts, (std::vector<int32_t>{0, 1, 3, 6, 7}));
  EXPECT_EQ(order, (std::vector<int32_t>{3, 1, 4, 0, 2, 5, 6}));
  EXPECT_EQ(counts, std::vector<int32_t>(10, 0));  // scratch left clean for the next batch
  const std::vector<int32_t> bad = {3, 10};
  EXPECT_THROW(ops::group_tokens(bad.data(), 2, counts, order, ids, starts), Error);
}

TEST(EmbeddingGroups, GroupedBackwardEqualsScatter) {
  const int64_t vocab = 13, dim = 6, n = 40;
  std::vector<int32_t> tokens(n);
  for (int64_t i = 0; i < n; ++i) tokens[static_cast<size_t>(i)] = static_cast<int32_t>((i * i + 3 * i) % vocab);
  std::vector<int32_t> counts(vocab, 0), order, ids, starts;
  ops::group_tokens(tokens.data(), n, counts, order, ids, starts);
  const Tensor order_t(order.data(), DType::i32, Device::cpu, Shape{n});
  const Tensor ids_t(ids.data(), DType::i32, Device::cpu, Shape{static_cast<int64_t>(ids.size())});
  const Tensor starts_t(starts.data(), DType::i32, Device::cpu, Shape{static_cast<int64_t>(starts.size())});
  const OwnedTensor dout = test::random_tensor(DType::f64, Shape{n, dim}, 7);
  OwnedTensor a = test::random_tensor(DType::f64, Shape{vocab, dim}, 8), b = test::random_tensor(DType::f64, Shape{vocab, dim}, 8);
  ops::embedding_backward(process_exec(), Tensor(tokens.data(), DType::i32, Device::cpu, Shape{n}), *dout, *a);
  ops::embedding_backward(process_exec(), ops::TokenGroups{order_t, ids_t, starts_t, static_cast<int64_t>(ids.size())}, *dout, *b);
  for (int64_t i = 0; i < vocab * dim; ++i) EXPECT_NEAR(a->data<double>()[i], b->data<double>()[i], 1e-12);
}

}  // namespace
}  // namespace kiln
