// Texts shared by the BPE tests: a hand-written Unicode stress text and a seeded random
// one built from the same hard cases (CJK, emoji with joiners and modifiers, combining
// marks, every kind of newline and whitespace run, digit runs, contractions).
#pragma once

#include "core/rng.h"
#include "data/bpe/bpe_tokenizer.h"
#include "data/bpe/byte_unicode.h"

#include <string>
#include <vector>

namespace kiln::test {

inline std::string unicode_stress_text() {
  return "Hello world! It's a test. They'll go, we've been, I'm here, she'd say, you're right, don't.\n"
         "IT'S LOUD, THEY'LL SHOUT; 'tis o'er, rock'n'roll, 's 'll 're 've 'm 'd 't, ſ KELVIN \u212A\n"
         "CJK: 日本語のテキスト、中文文本，한국어 텍스트。カタカナｶﾀｶﾅ 𠀀𪚥\n"
         "Emoji: 👍🏽 👨‍👩‍👧‍👦 🇯🇵🇺🇸 ❤️ 🔥🔥🔥 x🙂y\n"
         "Combining: e\u0301 a\u0308 n\u0303 (decomposed) vs é ä ñ; Z̤͔ͧ̑̓ä͖̭̈̇lͮ̒ͫǧ̗͚̚o̙̔ͮ̇͐̇ \u0301lone mark\n"
         "Whitespace:  two  spaces,\tTab,\t\ttabs, \u00a0nbsp, \u3000ideographic, \u2003em,      six\n"
         "Mixed newlines:\r\nCRLF\rCR\n\nLF\n\n\n\u0085NEL\u2028LS\u2029PS\v\fVT FF go\u0085\u0085x y\u0085 z\n"
         "   leading spaces and trailing   \n  \n\t\n"
         "Digits: 1 12 123 1234 12345 3.14159 1,000,000 ٣٤٥ ५६७ ２０２４ 2024-01-01 0x1F ½ ²\n"
         "Code: for (int i = 0; i < n; ++i) { x += a[i] * b[i]; } // done\n    return x;\n"
         "<|endoftext|> special in the middle<|endoftext|><|endoftext|>end <|im_start|>user\n"
         "thee, thee! prithee theee thee's <|mask|>  spaced  <|mask|>x [kiln added] café cafe\u0301\n"
         "Arabic: مرحبا بالعالم Hebrew: שלום Greek: Καλημέρα Russian: Привет мир Thai: สวัสดี नमस्ते\n"
         "Punctuation!!! ??? ... --- *** ''' \"\"\" ``` «» „“ — – … '\n"
         + std::string(300, 'a') + " " + std::string(100, ' ') + "x" + std::string(70, '\n') + "end";
}

// Seeded random text: fragments of the stress text, random code points from hard
// ranges and whitespace runs.
inline std::string random_stress_text(uint64_t seed, size_t bytes) {
  static const std::vector<std::string> fragments = {
      "the", " The", "'s", "'LL", "'ve", " don't", "日本", "語", "👍", "🏽", "\u200d", "e\u0301", "\u0301",
      "123", "4567890", " ", "  ", "\t", "\n", "\r\n", "\r", "\n\n", "\u00a0", "\u3000", "\u0085", "!", "?!",
      "...", "<|endoftext|>", "<|mask|>", "café", "thee", "ſ", "Ω", "ﬁ", "①", "x", "Q"};
  static const char32_t ranges[][2] = {{0x20, 0x7E},     {0xA0, 0x17F},   {0x300, 0x36F},  {0x370, 0x3FF},
                                       {0x400, 0x4FF},   {0x590, 0x6FF},  {0x900, 0x97F},  {0x1100, 0x11FF},
                                       {0x2000, 0x206F}, {0x3000, 0x30FF}, {0x4E00, 0x4FFF}, {0xAC00, 0xACFF},
                                       {0xFF00, 0xFFEF}, {0x1F300, 0x1F6FF}, {0x1F900, 0x1F9FF}};
  Rng rng(seed);
  std::string out;
  while (out.size() < bytes) {
    const uint64_t r = rng.next_u64() % 10;
    if (r < 6) {
      out += fragments[rng.next_u64() % fragments.size()];
    } else if (r < 9) {
      const auto& range = ranges[rng.next_u64() % (sizeof(ranges) / sizeof(ranges[0]))];
      bpe::append_utf8(out, range[0] + static_cast<char32_t>(rng.next_u64() % (range[1] - range[0] + 1)));
    } else {
      out += std::string(1 + rng.next_u64() % 5, " \n\t"[rng.next_u64() % 3]);
    }
  }
  return out;
}

// What decode(encode(text)) gives for a lossless tokenizer: the text without its
// special tokens (decode skips them).
inline std::string without_specials(std::string text, const Tokenizer& tokenizer) {
  const auto* bpe = dynamic_cast<const bpe::BpeTokenizer*>(&tokenizer);
  if (!bpe) return text;
  for (const bpe::AddedToken& t : bpe->added_tokens()) {
    if (!t.special) continue;
    for (size_t at = text.find(t.content); at != std::string::npos; at = text.find(t.content, at))
      text.erase(at, t.content.size());
  }
  return text;
}

}  // namespace kiln::test
