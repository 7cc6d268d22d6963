#include "data/readers/hf_saved_dataset.h"

#include "core/error.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

namespace kiln {

namespace fs = std::filesystem;

namespace {

nlohmann::json read_json(const fs::path& file) {
  std::ifstream in(file);
  if (!in) fail("data", "cannot open '{}'", file.string());
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    fail("data", "{}: malformed JSON ({})", file.string(), e.what());
  }
}

}  // namespace

bool is_hf_saved_dataset(const std::string& dir) {
  std::error_code ec;
  return fs::is_regular_file(fs::path(dir) / "state.json", ec) && fs::is_regular_file(fs::path(dir) / "dataset_info.json", ec);
}

std::vector<std::string> hf_saved_dataset_files(const std::string& dir) {
  const fs::path state_path = fs::path(dir) / "state.json";
  const nlohmann::json state = read_json(state_path);
  const auto listed = state.is_object() ? state.find("_data_files") : state.end();
  if (!state.is_object() || listed == state.end() || !listed->is_array() || listed->empty())
    fail("data", "{}: no \"_data_files\" list (not a Hugging Face save_to_disk folder?)", state_path.string());
  std::vector<std::string> files;
  for (const nlohmann::json& entry : *listed) {
    const auto name = entry.is_object() ? entry.find("filename") : entry.end();
    if (!entry.is_object() || name == entry.end() || !name->is_string())
      fail("data", "{}: a \"_data_files\" entry without a \"filename\"", state_path.string());
    const fs::path file = fs::path(dir) / name->get<std::string>();
    std::error_code ec;
    if (!fs::is_regular_file(file, ec)) fail("data", "{}: lists '{}', which is missing", state_path.string(), file.string());
    files.push_back(file.string());
  }
  return files;
}

void refuse_hf_dataset_dict(const std::string& dir) {
  const fs::path dict_path = fs::path(dir) / "dataset_dict.json";
  std::error_code ec;
  if (!fs::is_regular_file(dict_path, ec)) return;
  std::string splits;
  const nlohmann::json dict = read_json(dict_path);
  if (dict.is_object() && dict.contains("splits") && dict["splits"].is_array()) {
    for (const nlohmann::json& split : dict["splits"]) {
      if (!split.is_string()) continue;
      splits += (splits.empty() ? "" : ", ") + split.get<std::string>();
    }
  }
  fail("data", "'{}' is a Hugging Face DatasetDict (splits: {}); set data.path to one split's folder, e.g. '{}'", dir,
       splits.empty() ? "?" : splits, (fs::path(dir) / (splits.empty() ? "train" : splits.substr(0, splits.find(','))))
                                          .string());
}

}  // namespace kiln
