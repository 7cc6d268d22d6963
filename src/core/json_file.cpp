#include "core/json_file.h"

#include "core/error.h"

#include <fstream>
#include <sstream>

namespace kiln {

nlohmann::json read_json_file(const std::string& path, std::string_view where) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(where, "{}: cannot open", path);
  std::stringstream text;
  text << in.rdbuf();
  try {
    return nlohmann::json::parse(text.str());
  } catch (const nlohmann::json::exception& e) {
    fail(where, "{}: not valid JSON: {}", path, e.what());
  }
}

}  // namespace kiln
