// Unicode normalizers a tokenizer.json may name: NFC, NFD, NFKC, NFKD, or a Sequence of
// them (utf8proc). Any other normalizer is refused when the file is loaded.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace kiln::bpe {

enum class NormalForm { nfc, nfd, nfkc, nfkd };

class Normalizer {
 public:
  void add(NormalForm form) { forms_.push_back(form); }
  bool empty() const { return forms_.empty(); }
  // Writes the normalized text to `out` and returns true, or returns false when the text
  // is unchanged (pure ASCII, or invalid UTF-8, which is passed through as is).
  bool apply(std::string_view text, std::string& out) const;

 private:
  std::vector<NormalForm> forms_;
};

// "NFC" -> nfc, ...; false for other names.
bool parse_normal_form(std::string_view name, NormalForm& form);

}  // namespace kiln::bpe
