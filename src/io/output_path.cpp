#include "io/output_path.h"

#include "core/error.h"
#include "core/printable.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <vector>

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

std::optional<std::string_view> path_overlap(const std::string& path, const std::string& other) {
  const fs::path a = resolved(path), b = resolved(other);
  const bool inside = is_within(a, b), contains = is_within(b, a);
  if (!inside && !contains) return std::nullopt;
  return inside && contains ? "is" : inside ? "lies inside" : "contains";
}

void check_output_apart_from_input(const std::string& input, const std::string& output, std::string_view where) {
  const std::optional<std::string_view> relation = path_overlap(output, input);
  if (!relation) return;
  fail(where, "the output {} {} the input {}: writing it would overwrite or mix with what is read; choose another "
       "output", output, *relation, input);
}

void check_output_new_or_empty(const std::string& output, std::string_view where) {
  std::error_code ec;
  if (!fs::exists(output, ec)) return;
  KILN_CHECK(fs::is_directory(output, ec), where, "the output {} exists and is not a directory; choose a new or empty "
             "directory", output);
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(output, ec)) names.push_back(entry.path().filename().string());
  if (names.empty()) return;
  std::sort(names.begin(), names.end());
  std::string listed = names[0];
  for (size_t i = 1; i < std::min<size_t>(names.size(), 3); ++i) listed += ", " + names[i];
  if (names.size() > 3) listed += fmt::format(" and {} more", names.size() - 3);
  fail(where, "the output {} already holds files ({}): writing into it would replace or mix with them; choose a new "
       "or empty directory", output, printable(listed, 200));
}

}  // namespace kiln::io
