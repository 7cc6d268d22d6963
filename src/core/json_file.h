// Reading a whole JSON file, with errors that name it: "[where] FILE: cannot open" or
// "[where] FILE: not valid JSON: ...".
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <string_view>

namespace kiln {

nlohmann::json read_json_file(const std::string& path, std::string_view where);

}  // namespace kiln
