#include "infer/quant_eval.h"

#include "core/error.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace kiln {

namespace {

// log-softmax of one row in double.
void log_softmax(const float* x, int64_t n, std::vector<double>& out) {
  out.resize(static_cast<size_t>(n));
  const double m = *std::max_element(x, x + n);
  double sum = 0;
  for (int64_t i = 0; i < n; ++i) sum += std::exp(static_cast<double>(x[i]) - m);
  const double lse = m + std::log(sum);
  for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = static_cast<double>(x[i]) - lse;
}

}  // namespace

QuantEvalResult evaluate_quantization(Model& ref, Model& quant, const std::vector<std::vector<int32_t>>& sequences) {
  QuantEvalResult r;
  const int64_t vocab = ref.config().vocab_size;
  KILN_CHECK(quant.config().vocab_size == vocab, "eval-quant", "models disagree on the vocabulary");
  std::vector<float> lr, lq;
  std::vector<double> pr, pq;
  int64_t agree = 0;
  for (const auto& seq : sequences) {
    const auto n = static_cast<int64_t>(seq.size());
    if (n < 2) continue;
    HostBatch b;
    b.tokens = seq;
    b.targets.assign(seq.begin() + 1, seq.end());
    b.targets.push_back(kIgnoreTarget);
    b.positions.resize(seq.size());
    std::iota(b.positions.begin(), b.positions.end(), 0);
    b.cu_seqlens = {0, static_cast<int32_t>(n)};
    b.max_seqlen = static_cast<int32_t>(n);
    b.target_count = n - 1;
    b.document_tokens = n;
    ref.load_batch(b);
    ref.logits(0, n - 1, lr);
    quant.load_batch(b);
    quant.logits(0, n - 1, lq);
    for (int64_t i = 0; i + 1 < n; ++i) {
      log_softmax(lr.data() + i * vocab, vocab, pr);
      log_softmax(lq.data() + i * vocab, vocab, pq);
      double kl = 0;
      for (int64_t v = 0; v < vocab; ++v) kl += std::exp(pr[v]) * (pr[v] - pq[v]);
      kl = std::max(kl, 0.0);
      r.mean_kl += kl;
      r.max_kl = std::max(r.max_kl, kl);
      agree += std::max_element(pr.begin(), pr.end()) - pr.begin() == std::max_element(pq.begin(), pq.end()) - pq.begin();
      const auto target = static_cast<size_t>(seq[static_cast<size_t>(i + 1)]);
      r.ref_loss -= pr[target];
      r.quant_loss -= pq[target];
      ++r.positions;
    }
  }
  KILN_CHECK(r.positions > 0, "eval-quant", "no held-out positions to compare");
  const auto n = static_cast<double>(r.positions);
  r.mean_kl /= n;
  r.ref_loss /= n;
  r.quant_loss /= n;
  r.top1_agreement = static_cast<double>(agree) / n;
  return r;
}

}  // namespace kiln
