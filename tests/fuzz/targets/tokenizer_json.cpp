// Fuzz target: bpe::load_tokenizer_json, which train, sample, serve, export and import read
// a model folder's tokenizer through. Input: tokenizer.json, then (after a NUL) an
// optional tokenizer_config.json beside it, then a text to encode. A file that loads
// must tokenize: every id encode() returns is inside the vocabulary, decode() takes them
// back, BOS/EOS/PAD are ids of the vocabulary.
#include "../fuzz_target.h"

#include "data/bpe/bpe_tokenizer.h"

#include <filesystem>

namespace {

constexpr std::string_view kProbe = "Hello, world! 1234 \xC3\xA9t\xC3\xA9 <|endoftext|>  \t\n\xff\xfe";

}  // namespace

KILN_FUZZ_TARGET(tokenizer_json) {
  using namespace kiln;
  static const bool made = std::filesystem::create_directories(fuzz::scratch_dir() + "/tok");
  (void)made;
  fuzz::scratch_file("tok/tokenizer.json", fuzz::part(input, 0));
  const std::string config = fuzz::scratch_dir() + "/tok/tokenizer_config.json";
  if (fuzz::part(input, 1).empty()) std::filesystem::remove(config);
  else fuzz::scratch_file("tok/tokenizer_config.json", fuzz::part(input, 1));

  std::unique_ptr<bpe::BpeTokenizer> tokenizer;
  if (!fuzz::accepts([&] { tokenizer = bpe::load_tokenizer_json(fuzz::scratch_dir() + "/tok"); })) return;
  const int32_t vocab = tokenizer->vocab_size();
  KILN_FUZZ_CHECK(vocab > 0 && vocab <= bpe::kMaxTokenizerIds, "vocabulary size out of bounds");
  for (const int32_t id : {tokenizer->bos_id(), tokenizer->eos_id(), tokenizer->pad_id()})
    KILN_FUZZ_CHECK(id >= 0 && id < vocab, "special id outside the vocabulary");
  for (const std::string_view text : {kProbe, fuzz::part(input, 2)}) {
    std::vector<int32_t> ids;
    // A regex that exhausts PCRE2's limits on the text is a refusal, not a bug.
    if (!fuzz::accepts([&] { ids = tokenizer->encode(text); })) continue;
    for (const int32_t id : ids) KILN_FUZZ_CHECK(id >= 0 && id < vocab, "encode() returned an id outside the vocabulary");
    tokenizer->decode(ids);
    for (const int32_t id : ids) tokenizer->token_bytes(id);
  }
}
