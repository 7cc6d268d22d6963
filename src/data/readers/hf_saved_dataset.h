// Hugging Face `datasets` folders written by Dataset.save_to_disk: dataset_info.json,
// state.json and the rows as Arrow IPC streams (data-00000-of-00002.arrow, ...), which
// state.json lists in order. A DatasetDict's folder holds dataset_dict.json and one such
// folder per split.
#pragma once

#include <string>
#include <vector>

namespace kiln {

// `dir` holds state.json and dataset_info.json: one saved Dataset (one split).
bool is_hf_saved_dataset(const std::string& dir);

// Its Arrow files, in state.json's "_data_files" order. Throws "[data] DIR/state.json: ..."
// when state.json does not parse or lists no files, or a listed file is missing.
std::vector<std::string> hf_saved_dataset_files(const std::string& dir);

// Throws, naming the splits, when `dir` is a saved DatasetDict (holds dataset_dict.json):
// its splits (train, test, ...) must not be read as one corpus, so data.path must name one.
void refuse_hf_dataset_dict(const std::string& dir);

}  // namespace kiln
