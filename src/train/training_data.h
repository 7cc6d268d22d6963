// The training micro-batches a run reads, built one way for `kiln train` and for
// `kiln bench --tokens data` (so a benchmark routes the tokens training would): the
// data.tokenizer checked against model.vocab_size, data.path / data.sources tokenized
// (TokenDataset), packed as the run packs (packer_options) and streamed from data.seed
// (BatchStream).
#pragma once

#include "config/config.h"
#include "data/batch_stream.h"
#include "data/dataset.h"
#include "data/tokenizer.h"

#include <memory>

namespace kiln {

// data.tokenizer; throws naming model.vocab_size when the model's vocabulary is smaller
// than the tokenizer's (its ids would index past the embedding).
std::unique_ptr<Tokenizer> training_tokenizer(const Config& config);

// A single process's training stream: data.seed, and the rank and prefetch of
// loader_options(config.data). The stream refers to the dataset, which refers to the
// tokenizer: they are kept together.
struct TrainingData {
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<TokenDataset> dataset;
  std::unique_ptr<BatchStream> stream;
};
TrainingData open_training_data(const Config& config);

}  // namespace kiln
