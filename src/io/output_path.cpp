#include "io/output_path.h"

#include "core/error.h"

#include <algorithm>
#include <filesystem>

namespace kiln::io {

namespace fs = std::filesystem;

namespace {

// Absolute, symlinks resolved as far as the path exists, no "." / ".." / trailing "/".
fs::path resolved(const std::string& path) {
  std::error_code ec;
  fs::path p = fs::weakly_canonical(fs::absolute(path), ec);
  if (ec) p = fs::absolute(path);
  p = p.lexically_normal();
  if (p.has_relative_path() && p.filename().empty()) p = p.parent_path();
  return p;
}

// `inner` is `outer` or lies below it.
bool is_within(const fs::path& inner, const fs::path& outer) {
  return std::mismatch(outer.begin(), outer.end(), inner.begin(), inner.end()).first == outer.end();
}

}  // namespace

void check_output_apart_from_input(const std::string& input, const std::string& output, std::string_view where) {
  const fs::path in = resolved(input), out = resolved(output);
  const bool inside = is_within(out, in), contains = is_within(in, out);
  if (!inside && !contains) return;
  const char* relation = inside && contains ? "is" : inside ? "lies inside" : "contains";
  fail(where, "the output {} {} the input {}: writing it would overwrite or mix with what is read; choose another "
       "output", output, relation, input);
}

}  // namespace kiln::io
