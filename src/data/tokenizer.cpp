#include "data/tokenizer.h"

#include "core/error.h"
#include "core/printable.h"
#include "data/bpe/bpe_tokenizer.h"

#include <fmt/format.h>

#include <map>
#include <mutex>

namespace kiln {

std::vector<int32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids(text.size());
  // Through unsigned char: bytes >= 0x80 (UTF-8 continuation) must map to 128..255.
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  return ids;
}

std::string ByteTokenizer::decode(std::span<const int32_t> ids) const {
  std::string text;
  text.reserve(ids.size());
  for (const int32_t id : ids) {
    if (id >= 0 && id < 256) {
      text.push_back(static_cast<char>(static_cast<unsigned char>(id)));
    } else if (id < 0 || id >= kVocab) {
      // Out-of-vocabulary ids mean a bug upstream (a wrong vocab_size in the model).
      fail("data.tokenizer", "id {} is outside the byte vocabulary [0, {})", id, kVocab);
    }
  }
  return text;
}

std::vector<std::vector<int32_t>> Tokenizer::encode_batch(std::span<const std::string_view> texts) const {
  std::vector<std::vector<int32_t>> out(texts.size());
  const auto n = static_cast<int64_t>(texts.size());
#pragma omp parallel for schedule(dynamic, 16)
  for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = encode(texts[static_cast<size_t>(i)]);
  return out;
}

namespace {

// A function-local registry: static-registration objects in a static library can be
// dropped by the linker, so built-ins are inserted here when the map is first used.
struct Registry {
  Registry() {
    factories["byte"] = [](const std::string&) { return std::make_unique<ByteTokenizer>(); };
    // Byte-level BPE from a Hugging Face tokenizer.json; "hf" is an alias.
    factories["bpe"] = [](const std::string& path) -> std::unique_ptr<Tokenizer> {
      KILN_CHECK(!path.empty(), "data.tokenizer", "the bpe tokenizer needs a tokenizer.json path");
      return bpe::load_tokenizer_json(path);
    };
    factories["hf"] = factories["bpe"];
  }
  std::mutex mutex;
  std::map<std::string, TokenizerFactory> factories;
};

Registry& registry() {
  static Registry r;
  return r;
}

}  // namespace

std::unique_ptr<Tokenizer> make_tokenizer(const std::string& name, const std::string& model_path) {
  TokenizerFactory factory;
  {
    Registry& r = registry();
    std::lock_guard lock(r.mutex);
    const auto it = r.factories.find(name);
    if (it != r.factories.end()) factory = it->second;
  }
  if (!factory) fail("data.tokenizer", "unknown tokenizer '{}' (known: {})", printable(name), fmt::join(tokenizer_names(), ", "));
  return factory(model_path);
}

void register_tokenizer(const std::string& name, TokenizerFactory factory) {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  r.factories[name] = std::move(factory);
}

std::vector<std::string> tokenizer_names() {
  Registry& r = registry();
  std::lock_guard lock(r.mutex);
  std::vector<std::string> names;
  for (const auto& [name, factory] : r.factories) names.push_back(name);
  return names;
}

std::unique_ptr<Tokenizer> tokenizer_from_config(const std::string& setting) {
  KILN_CHECK(!setting.empty(), "data.tokenizer", "is empty (use 'byte' or a tokenizer.json path)");
  TokenizerFactory named;
  {
    Registry& r = registry();
    std::lock_guard lock(r.mutex);
    const auto it = r.factories.find(setting);
    if (setting != "bpe" && setting != "hf" && it != r.factories.end()) named = it->second;
  }
  return named ? named("") : make_tokenizer("bpe", setting);
}

}  // namespace kiln
