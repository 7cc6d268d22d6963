// The output of a conversion (import hf, export hf, export gguf) must not be its input:
// writing a model over the directory it is read from destroys it, and a write into or
// around it mixes old and new files. Checked before anything is read or written.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace kiln::io {

// How `path` sits relative to `other`, symlinks resolved as far as the paths exist:
// "is", "lies inside" or "contains"; nullopt when neither holds the other.
std::optional<std::string_view> path_overlap(const std::string& path, const std::string& other);

// Throws "[where] the output OUT is|lies inside|contains the input IN ..." when `output`
// is `input`, a path inside it, or a directory holding it. Symlinks are resolved; paths
// that do not exist yet are compared by what they would resolve to.
void check_output_apart_from_input(const std::string& input, const std::string& output, std::string_view where);

// Throws "[where] the output OUT already holds files (NAME, ...) ..." unless `output` does
// not exist or is an empty directory: a conversion writes a new model directory, never over
// another model or a run's files, nor among them.
void check_output_new_or_empty(const std::string& output, std::string_view where);

}  // namespace kiln::io
