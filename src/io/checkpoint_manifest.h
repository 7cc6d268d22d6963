// A checkpoint's manifest.json (train/checkpoint.h writes it, last): format and version,
// the step, and the size and XXH64 of every file of the checkpoint, plus an XXH64 of the
// manifest itself. Verified here for everything that reads a checkpoint directory: the
// trainer resuming from it, and sample/serve/export loading it as a model.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <span>
#include <string>

namespace kiln::io {

// Bumped whenever the checkpoint layout or state.json changes incompatibly; a checkpoint
// of another version is refused, never guessed at.
constexpr int64_t kCheckpointFormatVersion = 1;

// The manifest's own checksum: over its canonical dump without "manifest_xxh64", so a
// flipped byte anywhere in it (a size, a hash) is caught before it is believed.
uint64_t checkpoint_manifest_hash(nlohmann::json manifest);

// Verifies DIR/manifest.json (its checksum, format version, that it lists every one of
// `required`) and then the size and XXH64 of every file it lists. Returns the step it
// records. Errors name the file: "[checkpoint] DIR/model.safetensors: checksum mismatch
// ...", "... truncated ...", "[checkpoint] DIR: incomplete checkpoint (no manifest.json)".
int64_t verify_checkpoint_files(const std::string& dir, std::span<const char* const> required);

}  // namespace kiln::io
