// Tokenizers: text <-> token ids, and a registry that picks one by name.
//
// The data pipeline only sees the Tokenizer interface; the byte-level BPE tokenizer
// (data/bpe/, Hugging Face tokenizer.json files) plugs in as the "bpe" factory. Special ids
// (BOS/EOS/PAD) come from the tokenizer, never from constants, because every vocabulary
// places them differently.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kiln {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Must be safe to call from several threads at once: the dataset tokenizes documents
  // in parallel with one shared tokenizer.
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // Special ids are skipped, so sampled text never shows BOS/EOS/PAD markers.
  virtual std::string decode(std::span<const int32_t> ids) const = 0;
  // encode() of each text, spread over the OpenMP threads.
  virtual std::vector<std::vector<int32_t>> encode_batch(std::span<const std::string_view> texts) const;

  virtual int32_t vocab_size() const = 0;
  virtual int32_t bos_id() const = 0;
  virtual int32_t eos_id() const = 0;
  virtual int32_t pad_id() const = 0;
  virtual std::string name() const = 0;
};

// Byte-level: ids 0..255 are the bytes of the UTF-8 text, so any input encodes with no
// unknown token and decode(encode(s)) == s exactly (multibyte characters included).
class ByteTokenizer final : public Tokenizer {
 public:
  static constexpr int32_t kBos = 256;
  static constexpr int32_t kEos = 257;
  static constexpr int32_t kPad = 258;
  static constexpr int32_t kVocab = 259;

  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(std::span<const int32_t> ids) const override;
  int32_t vocab_size() const override { return kVocab; }
  int32_t bos_id() const override { return kBos; }
  int32_t eos_id() const override { return kEos; }
  int32_t pad_id() const override { return kPad; }
  std::string name() const override { return "byte"; }
};

// A factory receives an optional model file (a tokenizer.json for "bpe"); "byte" ignores it.
using TokenizerFactory = std::function<std::unique_ptr<Tokenizer>(const std::string& model_path)>;

// Throws kiln::Error("[data.tokenizer] unknown tokenizer 'x' (known: byte, ...)").
std::unique_ptr<Tokenizer> make_tokenizer(const std::string& name, const std::string& model_path = "");
// Adds (or replaces) a factory; built-in tokenizers are registered without any call.
void register_tokenizer(const std::string& name, TokenizerFactory factory);
// Registered names, sorted (for `kiln list` and error messages).
std::vector<std::string> tokenizer_names();

// The tokenizer a config's data.tokenizer names: "byte" (or another registered name that
// needs no file), or a path to a Hugging Face tokenizer.json (or a folder holding one),
// loaded by the "bpe" factory.
std::unique_ptr<Tokenizer> tokenizer_from_config(const std::string& setting);

}  // namespace kiln
