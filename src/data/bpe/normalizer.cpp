#include "data/bpe/normalizer.h"

#include "data/bpe/byte_unicode.h"

#include <utf8proc.h>

#include <cstdlib>

namespace kiln::bpe {

bool parse_normal_form(std::string_view name, NormalForm& form) {
  if (name == "NFC") form = NormalForm::nfc;
  else if (name == "NFD") form = NormalForm::nfd;
  else if (name == "NFKC") form = NormalForm::nfkc;
  else if (name == "NFKD") form = NormalForm::nfkd;
  else return false;
  return true;
}

bool Normalizer::apply(std::string_view text, std::string& out) const {
  if (forms_.empty() || is_ascii(text)) return false;
  std::string current(text);
  for (const NormalForm form : forms_) {
    int options = UTF8PROC_STABLE;
    switch (form) {
      case NormalForm::nfc: options |= UTF8PROC_COMPOSE; break;
      case NormalForm::nfd: options |= UTF8PROC_DECOMPOSE; break;
      case NormalForm::nfkc: options |= UTF8PROC_COMPOSE | UTF8PROC_COMPAT; break;
      case NormalForm::nfkd: options |= UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT; break;
    }
    utf8proc_uint8_t* result = nullptr;
    const utf8proc_ssize_t n =
        utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(current.data()),
                     static_cast<utf8proc_ssize_t>(current.size()), &result, static_cast<utf8proc_option_t>(options));
    if (n < 0) {  // invalid UTF-8: leave the text alone, byte-level BPE still encodes it
      std::free(result);
      return false;
    }
    current.assign(reinterpret_cast<const char*>(result), static_cast<size_t>(n));
    std::free(result);
  }
  out = std::move(current);
  return true;
}

}  // namespace kiln::bpe
