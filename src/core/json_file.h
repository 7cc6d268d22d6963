// Reading a whole JSON file, with errors that name it: "[where] FILE: cannot open file",
// "[where] FILE: is a FIFO, not a JSON file", "[where] FILE: larger than N bytes" or
// "[where] FILE: not valid JSON: ...".
#pragma once

#include <nlohmann/json.hpp>

#include <cstddef>
#include <string>
#include <string_view>

namespace kiln {

// The cap on every JSON file kiln reads whole (tokenizer.json, config.json, an index.json):
// the largest tokenizer.json files in use are tens of MB; /dev/zero was read past 4 GB.
inline constexpr size_t kMaxJsonFileBytes = size_t{256} << 20;

nlohmann::json read_json_file(const std::string& path, std::string_view where);

}  // namespace kiln
