// Packing must not change what a document computes: attention never crosses a document
// boundary and positions restart in every document (DESIGN.md, "Data flow"). Three
// documents packed into one batch (with a PAD tail) must give, row for row, the same
// outputs as each document alone, to 1e-10 in f64; negative controls show the comparison
// fails when the boundaries or the positions are wrong; the PAD tail must not touch the
// loss or any gradient.
//
// Per-row outputs at full f64 precision: Model::logits returns f32, so each row's
// losses against every vocabulary id, lse(row) - logit(row, v), come from evaluate() on a
// copy of the batch whose only target is (row, v). Model::logits is compared too, in f32.
#include "grad_check.h"
#include "tiny_model.h"

#include <gtest/gtest.h>

#include <cmath>

namespace kiln {
namespace {

using namespace kiln::test;

constexpr double kPackTol = 1e-10;

// losses[r][v] = cross-entropy of row r against target v, for the given rows of `batch`.
std::vector<std::vector<double>> row_losses(Model& m, const HostBatch& batch, int64_t begin, int64_t end) {
  ScopedCpuThreads one_thread(1);  // hundreds of tiny forwards
  const int64_t vocab = m.config().vocab_size;
  std::vector<std::vector<double>> out;
  HostBatch probe = batch;
  for (int64_t r = begin; r < end; ++r) {
    std::vector<double> row(static_cast<size_t>(vocab));
    for (int64_t v = 0; v < vocab; ++v) {
      std::fill(probe.targets.begin(), probe.targets.end(), kIgnoreTarget);
      probe.targets[static_cast<size_t>(r)] = static_cast<int32_t>(v);
      probe.target_count = 1;
      m.load_batch(probe);
      const LossSums s = m.evaluate();
      EXPECT_EQ(s.count, 1);
      row[static_cast<size_t>(v)] = s.loss;
    }
    out.push_back(std::move(row));
  }
  return out;
}

double max_diff(const std::vector<std::vector<double>>& a, const std::vector<std::vector<double>>& b) {
  if (a.size() != b.size()) return INFINITY;
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i)
    for (size_t j = 0; j < a[i].size(); ++j) m = std::max(m, std::abs(a[i][j] - b[i][j]));
  return m;
}

// f32 logits of rows [begin, end) through Model::logits.
std::vector<std::vector<float>> logits_rows(Model& m, const HostBatch& batch, int64_t begin, int64_t end) {
  m.load_batch(batch);
  std::vector<float> flat;
  m.logits(begin, end - begin, flat);
  const auto vocab = static_cast<size_t>(m.config().vocab_size);
  std::vector<std::vector<float>> out;
  for (int64_t r = 0; r < end - begin; ++r)
    out.emplace_back(flat.begin() + static_cast<std::ptrdiff_t>(r * vocab), flat.begin() + static_cast<std::ptrdiff_t>((r + 1) * vocab));
  return out;
}

struct Fixture {
  std::vector<Doc> docs = three_docs();
  std::unique_ptr<Model> model;
  explicit Fixture(bool qk_norm = true, bool tie = false) {
    model = std::make_unique<Model>(tiny_config(qk_norm, tie), tiny_build(24, 7, 1e-3));
    model->allocate();
    init_tiny_model(*model, 21);
  }
  // Row range of document d inside the packed batch.
  std::pair<int64_t, int64_t> rows_of(size_t d) const {
    int64_t begin = 0;
    for (size_t i = 0; i < d; ++i) begin += static_cast<int64_t>(docs[i].tokens.size());
    return {begin, begin + static_cast<int64_t>(docs[d].tokens.size())};
  }
  // Largest difference between document d's rows in `packed` and in its own batch.
  double diff_vs_alone(const HostBatch& packed, size_t d) {
    const auto [begin, end] = rows_of(d);
    const HostBatch alone = pack_docs({docs[d]});
    return max_diff(row_losses(*model, packed, begin, end), row_losses(*model, alone, 0, end - begin));
  }
};

TEST(Packing, PackedDocumentsMatchEachAlone) {
  for (bool qk_norm : {true, false}) {
    SCOPED_TRACE(qk_norm ? "qk_norm" : "no qk_norm");
    Fixture f(qk_norm);
    const HostBatch packed = pack_docs(f.docs, 4);  // 16 document rows + a PAD tail of 4
    ASSERT_EQ(packed.num_seqs(), 4);
    for (size_t d = 0; d < f.docs.size(); ++d) {
      SCOPED_TRACE("document " + std::to_string(d));
      const double diff = f.diff_vs_alone(packed, d);
      std::printf("packed document %zu: max row-loss difference %.3e\n", d, diff);
      EXPECT_LT(diff, kPackTol);
      // Model::logits (f32) agrees row for row as well.
      const auto [begin, end] = f.rows_of(d);
      const auto lp = logits_rows(*f.model, packed, begin, end);
      const auto la = logits_rows(*f.model, pack_docs({f.docs[d]}), 0, end - begin);
      for (size_t r = 0; r < lp.size(); ++r)
        for (size_t v = 0; v < lp[r].size(); ++v)
          EXPECT_NEAR(lp[r][v], la[r][v], 1e-6 * std::max(1.0f, std::abs(la[r][v]))) << "row " << r << " id " << v;
    }
    // The packed loss is the sum of the documents' losses.
    f.model->load_batch(packed);
    const LossSums all = f.model->evaluate();
    double sum = 0;
    int64_t count = 0;
    for (const Doc& d : f.docs) {
      f.model->load_batch(pack_docs({d}));
      const LossSums s = f.model->evaluate();
      sum += s.loss;
      count += s.count;
    }
    EXPECT_EQ(all.count, count);
    EXPECT_EQ(all.count, packed.target_count);
    EXPECT_NEAR(all.loss, sum, kPackTol);
  }
}

TEST(Packing, NegativeControlMergedDocumentsAreDetected) {
  // cu_seqlens without the boundary between documents 0 and 1: document 1 now attends to
  // document 0 (positions still restart), and the comparison must see it.
  Fixture f;
  HostBatch merged = pack_docs(f.docs, 4);
  merged.cu_seqlens.erase(merged.cu_seqlens.begin() + 1);
  merged.max_seqlen = 12;
  const double diff = f.diff_vs_alone(merged, 1);
  std::printf("merged documents: max row-loss difference %.3e\n", diff);
  EXPECT_GT(diff, 1e-3);
  EXPECT_LT(f.diff_vs_alone(merged, 2), kPackTol);  // document 2 is still alone
}

TEST(Packing, NegativeControlPositionsThatDoNotRestartAreDetected) {
  // Positions counting on across documents (cu_seqlens still right). RoPE scores depend on
  // pos_i - pos_j only, so in exact arithmetic a per-document offset is invisible; what
  // remains is the table's fp32 angle (pos * inv_freq formed in fp32, as transformers
  // does): ~1e-9 here, above the 1e-10 tolerance (correct packing gives exactly 0 on the
  // CPU), so the comparison fails -- but only by that margin. Past max_seq_len it throws.
  Fixture f;
  HostBatch continuing = pack_docs(f.docs);  // no PAD tail: positions 0..15 fit max_seq_len 16
  for (size_t i = 0; i < continuing.positions.size(); ++i) continuing.positions[i] = static_cast<int32_t>(i);
  EXPECT_LT(f.diff_vs_alone(continuing, 0), kPackTol);  // document 0 starts at 0 either way
  for (size_t d : {1u, 2u}) {
    const double diff = f.diff_vs_alone(continuing, d);
    std::printf("positions not restarting, document %zu: max row-loss difference %.3e\n", d, diff);
    EXPECT_GT(diff, 5 * kPackTol);
  }
  // Past model.max_seq_len, continuing positions are an error.
  HostBatch too_far = pack_docs(f.docs, 4);
  for (size_t i = 0; i < too_far.positions.size(); ++i) too_far.positions[i] = static_cast<int32_t>(i);
  f.model->load_batch(too_far);
  EXPECT_THROW(f.model->evaluate(), Error);
}

TEST(Packing, NegativeControlScrambledPositionsAreDetected) {
  // Positions that restart at the wrong place inside a document change relative distances,
  // which RoPE sees at full strength.
  Fixture f;
  HostBatch shifted = pack_docs(f.docs, 4);
  const auto [begin, end] = f.rows_of(1);
  for (int64_t i = begin + 3; i < end; ++i) shifted.positions[static_cast<size_t>(i)] -= 3;
  EXPECT_GT(f.diff_vs_alone(shifted, 1), 1e-3);
}

TEST(Packing, PadTailContributesNothing) {
  for (bool tie : {false, true}) {
    SCOPED_TRACE(tie ? "tied" : "untied");
    Fixture f(true, tie);
    const HostBatch with_pad = pack_docs(f.docs, 8);
    const HostBatch without = pack_docs(f.docs);
    ASSERT_EQ(with_pad.target_count, without.target_count);
    const double scale = 1.0 / static_cast<double>(without.target_count);
    Model& m = *f.model;

    m.load_batch(without);
    m.zero_grads();
    const LossSums a = m.forward_backward(scale);
    std::vector<std::vector<double>> ga;
    for (const auto& p : m.parameters()) ga.push_back(values_of(p->grad()));

    m.load_batch(with_pad);
    m.zero_grads();
    const LossSums b = m.forward_backward(scale);
    EXPECT_EQ(a.count, b.count);
    EXPECT_NEAR(a.loss, b.loss, kPackTol);
    EXPECT_NEAR(a.z, b.z, kPackTol);
    for (size_t i = 0; i < m.parameters().size(); ++i) {
      const auto& p = *m.parameters()[i];
      const std::vector<double> gb = values_of(p.grad());
      double scale_g = 0, diff = 0;
      for (size_t j = 0; j < gb.size(); ++j) {
        scale_g = std::max(scale_g, std::abs(ga[i][j]));
        diff = std::max(diff, std::abs(gb[j] - ga[i][j]));
      }
      EXPECT_LE(diff, 1e-12 * std::max(scale_g, 1e-3)) << p.name();
      // The PAD row of the input embedding gets nothing (when tied, the head's softmax
      // over all ids still reaches it, identically in both batches).
      if (!tie && p.name() == "embed.weight") {
        for (int64_t c = 0; c < m.config().hidden; ++c)
          EXPECT_EQ(gb[static_cast<size_t>(kTinyPad * m.config().hidden + c)], 0.0);
      }
    }

    // Negative control: a PAD tail whose targets are not ignored does change the gradient.
    HostBatch counted = with_pad;
    for (int64_t i = without.size(); i < counted.size(); ++i) counted.targets[static_cast<size_t>(i)] = 4;
    m.load_batch(counted);
    m.zero_grads();
    m.forward_backward(scale);
    double diff = 0;
    for (size_t i = 0; i < m.parameters().size(); ++i) {
      const std::vector<double> g = values_of(m.parameters()[i]->grad());
      for (size_t j = 0; j < g.size(); ++j) diff = std::max(diff, std::abs(g[j] - ga[i][j]));
    }
    EXPECT_GT(diff, 1e-4);
  }
}

// HostBatch::uniform (what lets the GPU attention skip per-sequence offsets) holds only when
// every sequence is exactly max_seqlen long.
TEST(Packing, UniformOnlyWhenEverySequenceIsMaxSeqlenLong) {
  HostBatch b;
  b.tokens.assign(8, 1);
  b.cu_seqlens = {0, 4, 8};
  b.max_seqlen = 4;
  EXPECT_TRUE(b.uniform());
  b.cu_seqlens = {0, 3, 8};
  b.max_seqlen = 5;
  EXPECT_FALSE(b.uniform());
  b.cu_seqlens = {0, 4, 8, 8};  // an empty sequence at the end
  b.max_seqlen = 4;
  EXPECT_FALSE(b.uniform());
  b.cu_seqlens = {0, 8};
  b.max_seqlen = 8;
  EXPECT_TRUE(b.uniform());
  b.max_seqlen = 9;  // overstated
  EXPECT_FALSE(b.uniform());
  b.cu_seqlens = {0};
  EXPECT_FALSE(b.uniform());
}

}  // namespace
}  // namespace kiln
