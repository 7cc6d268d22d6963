#include "core/json_file.h"

#include "core/error.h"
#include "core/small_file.h"

namespace kiln {

nlohmann::json read_json_file(const std::string& path, std::string_view where) {
  const std::string text = read_small_file(path, kMaxJsonFileBytes, "JSON file", where);
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    fail(where, "{}: not valid JSON: {}", path, e.what());
  }
}

}  // namespace kiln
