// data.path as a file, a directory or a glob pattern -> the list of files to read, in
// a fixed order (sorted by path), so document ids and shuffles never depend on the
// order a file system lists a directory in.
#pragma once

#include <string>
#include <vector>

namespace kiln {

// True when `path` contains glob characters (* ? [).
bool is_glob_pattern(const std::string& path);

// A regular file: {path}. A directory: every regular file below it (recursively), sorted,
// skipping hidden names (starting with '.') and kiln's own manifest.json; a Hugging Face
// save_to_disk folder (data/readers/hf_saved_dataset.h) at or below it gives its Arrow
// files, in its state.json's order when it is `path` itself, and a DatasetDict's folder is
// refused (one split must be named). A pattern:
// glob(3) matches that are regular files, sorted. Throws "[data] cannot open 'PATH'"
// when a plain path does not exist and "[data] 'PATTERN' matches no files" when
// nothing matches.
std::vector<std::string> expand_data_path(const std::string& path);

}  // namespace kiln
