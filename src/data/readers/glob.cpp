#include "data/readers/glob.h"

#include "core/error.h"
#include "data/readers/hf_saved_dataset.h"

#include <glob.h>

#include <algorithm>
#include <filesystem>

namespace kiln {

namespace fs = std::filesystem;

bool is_glob_pattern(const std::string& path) { return path.find_first_of("*?[") != std::string::npos; }

std::vector<std::string> expand_data_path(const std::string& path) {
  std::vector<std::string> files;
  std::error_code ec;
  if (is_glob_pattern(path) && !fs::exists(path, ec)) {
    glob_t matches{};
    const int rc = ::glob(path.c_str(), GLOB_ERR, nullptr, &matches);
    if (rc == 0) {
      for (size_t i = 0; i < matches.gl_pathc; ++i) {
        const std::string match = matches.gl_pathv[i];
        if (fs::is_regular_file(match, ec)) files.push_back(match);
      }
    }
    globfree(&matches);
    if (rc != 0 && rc != GLOB_NOMATCH) fail("data", "cannot expand '{}' (glob error {})", path, rc);
    if (files.empty()) fail("data", "'{}' matches no files", path);
  } else if (fs::is_directory(path, ec)) {
    // A Hugging Face save_to_disk folder is its Arrow files, in state.json's order; its
    // JSON metadata is not text to train on.
    refuse_hf_dataset_dict(path);
    if (is_hf_saved_dataset(path)) return hf_saved_dataset_files(path);
    for (auto it = fs::recursive_directory_iterator(path, fs::directory_options::skip_permission_denied, ec);
         !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
      const std::string name = it->path().filename().string();
      if (!name.empty() && name.front() == '.') {
        if (it->is_directory(ec)) it.disable_recursion_pending();
        continue;
      }
      if (it->is_directory(ec)) {
        refuse_hf_dataset_dict(it->path().string());
        if (is_hf_saved_dataset(it->path().string())) {
          for (std::string& file : hf_saved_dataset_files(it->path().string())) files.push_back(std::move(file));
          it.disable_recursion_pending();
        }
        continue;
      }
      if (it->is_regular_file(ec) && name != "manifest.json") files.push_back(it->path().string());
    }
    if (ec) fail("data", "cannot list '{}': {}", path, ec.message());
    if (files.empty()) fail("data", "directory '{}' contains no files", path);
  } else if (fs::exists(path, ec)) {
    files.push_back(path);
  } else {
    fail("data", "cannot open '{}'", path);
  }
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace kiln
