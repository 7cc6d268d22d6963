// Weighted mixtures: the schedule (data/mixture.h), the mixture splits and reading
// data.sources (TokenDataset::read_mixture).
#include "data/mixture.h"

#include "config/config.h"
#include "core/error.h"
#include "data/dataset.h"

#include <bit>
#include <cstring>
#include <memory>
#include <vector>
#include <filesystem>

namespace kiln {

size_t mixture_pick(std::span<const double> weights, uint64_t draw, std::span<const uint64_t> counts,
                    std::span<const bool> active) {
  double total = 0;
  for (const double w : weights) total += w;
  // The deficit is computed afresh from (draw, counts) rather than accumulated, so a
  // resumed stream takes exactly the same decisions as one that never stopped.
  size_t best = weights.size();
  double best_deficit = 0;
  for (size_t s = 0; s < weights.size(); ++s) {
    if (!active.empty() && !active[s]) continue;
    const double deficit = static_cast<double>(draw + 1) * weights[s] - static_cast<double>(counts[s]) * total;
    if (best == weights.size() || deficit > best_deficit) {
      best = s;
      best_deficit = deficit;
    }
  }
  KILN_CHECK(best < weights.size(), "data", "mixture: no source left to draw from");
  return best;
}

std::string source_name(const DataSource& source) {
  if (!source.name.empty()) return source.name;
  return std::filesystem::path(source.path).filename().string();
}

namespace {

uint64_t mix_value(uint64_t hash, uint64_t value) {
  char bytes[sizeof(value)];
  std::memcpy(bytes, &value, sizeof(value));
  return fnv1a64(std::string_view(bytes, sizeof(bytes)), hash);
}

}  // namespace

TokenizedSplit TokenizedSplit::concatenate(const std::vector<TokenizedSplit>& parts,
                                           const std::vector<std::string>& names, const std::vector<double>& weights) {
  KILN_CHECK(parts.size() == names.size() && parts.size() == weights.size(), "data", "{} parts, {} names, {} weights",
             parts.size(), names.size(), weights.size());
  TokenizedSplit out;
  // Names are left out: renaming a source does not change what is read, so a checkpoint
  // still resumes; the weights change the schedule, so they are in.
  uint64_t hash = mix_value(0x6d69787475726573ull, parts.size());
  for (size_t p = 0; p < parts.size(); ++p) {
    const TokenizedSplit& part = parts[p];
    const auto segment_base = static_cast<uint32_t>(out.segments_.size());
    out.segments_.insert(out.segments_.end(), part.segments_.begin(), part.segments_.end());
    out.owners_.insert(out.owners_.end(), part.owners_.begin(), part.owners_.end());
    out.sources_.push_back(SplitSource{names[p], weights[p], out.num_documents(), part.num_documents()});
    for (DocRef d : part.docs_) {
      d.segment += segment_base;
      out.docs_.push_back(d);
    }
    out.num_tokens_ += part.num_tokens_;
    hash = mix_value(mix_value(hash, part.fingerprint_), std::bit_cast<uint64_t>(weights[p]));
  }
  out.fingerprint_ = hash;
  return out;
}

TokenDataset TokenDataset::read_mixture(const DataConfig& config, const Tokenizer& tokenizer) {
  std::vector<TokenizedSplit> train, validation;
  std::vector<std::string> names;
  std::vector<double> weights;
  TokenDataset out;
  std::string summaries;
  for (size_t i = 0; i < config.sources.size(); ++i) {
    const DataSource& source = config.sources[i];
    DataConfig one = config;
    one.path = source.path;
    one.sources.clear();
    names.push_back(source_name(source));
    weights.push_back(source.weight);
    // Each source is read exactly as data.path would be, so it keeps its own validation
    // share by the same hash rule; a failure names the source it came from.
    try {
      TokenDataset part(one, tokenizer);
      train.push_back(std::move(part.train_));
      validation.push_back(std::move(part.validation_));
      out.skipped_.merge(part.skipped_);
      if (part.skipped_.total() > 0)
        summaries += fmt::format("{}{}: {}", summaries.empty() ? "" : "; ", names.back(), part.skipped_summary_);
    } catch (const Error& e) {
      throw Error(fmt::format("{} (data.sources[{}], '{}')", e.what(), i, names.back()));
    }
  }
  out.train_ = TokenizedSplit::concatenate(train, names, weights);
  out.validation_ = TokenizedSplit::concatenate(validation, names, weights);
  out.skipped_summary_ = summaries.empty() ? "none" : summaries;
  return out;
}

}  // namespace kiln
