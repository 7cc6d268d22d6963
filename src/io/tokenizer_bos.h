// kiln starts every document with BOS (data/packer.cpp: the tokenizer's bos_id, which is
// its EOS where it names no BOS). A tokenizer.json whose post-processor does not put that
// BOS first makes transformers encode text differently from how kiln trained on it (issue
// 44 reported a held-out loss of 5.33 instead of 5.17 nats through transformers for that).
// The Hugging Face export therefore writes a post-processor that adds it.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>

namespace kiln::io {

// Whether a parsed tokenizer.json's post-processor already starts a single sequence with
// the token `bos_id`: a TemplateProcessing whose single template begins with it, a
// Roberta/Bert processor whose cls it is, or a Sequence holding one of those.
bool tokenizer_adds_bos(const nlohmann::json& tokenizer, int32_t bos_id);

// `tokenizer` (a parsed tokenizer.json) with a post-processor that starts every sequence
// with `bos_id` (and each of a pair, as kiln starts each document): unchanged where it
// already does, else its post-processor followed by a TemplateProcessing. Throws naming
// `where` when `bos_id` is neither an added token nor in the model's vocabulary.
nlohmann::json with_bos_post_processor(nlohmann::json tokenizer, int32_t bos_id, const std::string& where);

}  // namespace kiln::io
