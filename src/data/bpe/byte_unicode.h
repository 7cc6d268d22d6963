// GPT-2's byte <-> Unicode mapping used by every byte-level BPE tokenizer.json, and the
// few UTF-8 helpers the tokenizer needs.
//
// A byte-level vocabulary stores token strings whose characters each stand for one byte:
// printable bytes map to themselves, the rest to U+0100 and up (space -> 'Ġ', newline ->
// 'Ċ'). kiln converts the vocabulary to raw bytes once at load time, so encoding works
// on the input's bytes directly and never builds mapped strings.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace kiln::bpe {

// The code point that stands for byte b.
char32_t byte_to_codepoint(uint8_t b);
// The byte a code point stands for, or -1 when it is not part of the mapping.
int codepoint_to_byte(char32_t c);

// Raw bytes -> the mapped token string (UTF-8), as it appears in tokenizer.json.
std::string bytes_to_token(std::string_view bytes);
// Mapped token string -> raw bytes. False (out untouched) when the string is not valid
// UTF-8 or holds a character outside the mapping.
bool token_to_bytes(std::string_view token, std::string& out);

// Appends the UTF-8 encoding of c.
void append_utf8(std::string& out, char32_t c);
// Decodes the code point at s[i] and advances i; invalid UTF-8 yields -1 and advances by
// one byte.
int32_t next_codepoint(std::string_view s, size_t& i);
// True when every byte is ASCII (no normalization can change such text).
bool is_ascii(std::string_view s);

}  // namespace kiln::bpe
