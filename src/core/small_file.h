// Reading a file that is small by nature (a config, a checkpoint's `latest`, a JSON file
// of a model folder), with a cap: a wrong path (/dev/zero, a FIFO, a huge data file, a
// directory) is refused with one line instead of being read without end, waited on
// forever or parsed as nothing.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace kiln {

// The whole file, at most `max_bytes`. Throws "[where] PATH: cannot open file: ...",
// "[where] PATH: is a directory, not a <what>" (a FIFO, a character device, ...) or
// "[where] PATH: larger than N bytes: not a <what>" (what: "config file", ...).
std::string read_small_file(const std::string& path, size_t max_bytes, std::string_view what, std::string_view where);

// An open descriptor of `path`, refused as read_small_file does unless it is a regular
// file; opening never blocks (a FIFO). The caller closes it.
int open_regular_file(const std::string& path, std::string_view what, std::string_view where);

}  // namespace kiln
