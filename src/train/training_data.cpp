#include "train/training_data.h"

#include "core/error.h"

namespace kiln {

std::unique_ptr<Tokenizer> training_tokenizer(const Config& config) {
  std::unique_ptr<Tokenizer> tokenizer = tokenizer_from_config(config.data.tokenizer);  // "byte" or a tokenizer.json
  KILN_CHECK(config.model.vocab_size >= tokenizer->vocab_size(), "model.vocab_size",
             "{} is smaller than the {} tokenizer's vocabulary ({})", config.model.vocab_size, tokenizer->name(),
             tokenizer->vocab_size());
  return tokenizer;
}

TrainingData open_training_data(const Config& config) {
  TrainingData data;
  data.tokenizer = training_tokenizer(config);
  data.dataset = std::make_unique<TokenDataset>(config.data, *data.tokenizer);
  data.stream = std::make_unique<BatchStream>(*data.dataset, Split::train, Packer(packer_options(config, *data.tokenizer)),
                                              config.data);
  return data;
}

}  // namespace kiln
