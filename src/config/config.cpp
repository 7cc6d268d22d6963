// load_config, apply_override, validate_config and config_to_toml, all driven by the
// field table in config/config_fields.cpp.
#include "config/config.h"

#include "core/error.h"
#include "core/printable.h"
#include "core/small_file.h"
#include "core/utf8.h"
#include "config/cadence_keys.h"
#include "config/config_fields.h"
#include "config/layer_pattern.h"
#include "config/mtp_weights.h"
#include "data/tokenizer.h"
#include "nn/mup.h"

// Debian's libtomlplusplus-dev ships <toml++/toml.h>; upstream also has toml.hpp.
#if __has_include(<toml++/toml.hpp>)
#include <toml++/toml.hpp>
#else
#include <toml++/toml.h>
#endif

#include <algorithm>
#include <charconv>
#include <cmath>
#include <filesystem>
#include <limits>
#include <type_traits>

namespace kiln {
namespace {

constexpr std::string_view kWhere = "config";
// A config is a few KiB; far beyond this is a wrong path, not a config.
constexpr size_t kMaxConfigBytes = size_t{4} << 20;
// TOML integers are signed 64-bit, so uint64_t fields stop at INT64_MAX to round-trip.
constexpr uint64_t kMaxTomlInteger = static_cast<uint64_t>(std::numeric_limits<int64_t>::max());

template <typename T>
constexpr std::string_view expected_type() {
  if constexpr (std::is_same_v<T, int64_t>) return "an integer";
  else if constexpr (std::is_same_v<T, uint64_t>) return "a non-negative integer";
  else if constexpr (std::is_same_v<T, double>) return "a number";
  else if constexpr (std::is_same_v<T, bool>) return "a boolean";
  else return "a string";
}

std::string_view toml_type_name(toml::node_type type) {
  switch (type) {
    case toml::node_type::table: return "table";
    case toml::node_type::array: return "array";
    case toml::node_type::string: return "string";
    case toml::node_type::integer: return "integer";
    case toml::node_type::floating_point: return "float";
    case toml::node_type::boolean: return "boolean";
    case toml::node_type::date: return "date";
    case toml::node_type::time: return "time";
    case toml::node_type::date_time: return "date-time";
    default: return "nothing";
  }
}

// Optimal string alignment distance (Levenshtein plus adjacent transpositions).
size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[a.size()][b.size()];
}

// " (did you mean 'x'?)" for a close known name, else "". `name` is "section.key" or a
// bare section.
std::string suggestion(std::string_view name) {
  std::vector<std::string> candidates;
  const size_t dot = name.rfind('.');  // "model.moe.experts": section "model.moe"
  if (dot == std::string_view::npos) {
    for (std::string_view s : config_sections()) candidates.emplace_back(s);
  } else {
    // The same key in another section ("train.lr" -> "optim.lr") wins outright.
    const std::string_view key = name.substr(dot + 1);
    for (const ConfigField& f : config_fields())
      if (f.key == key) return fmt::format(" (did you mean '{}'?)", f.name());
    for (const ConfigField& f : config_fields()) candidates.push_back(f.name());
  }
  const size_t limit = std::clamp<size_t>(name.size() / 5, 1, 3);
  const std::string* best = nullptr;
  size_t best_distance = limit + 1;
  for (const std::string& c : candidates) {
    const size_t distance = edit_distance(name, c);
    if (distance < best_distance) {
      best_distance = distance;
      best = &c;
    }
  }
  return best ? fmt::format(" (did you mean '{}'?)", *best) : std::string();
}

// Keys kiln once had, and what says the same now.
constexpr std::pair<std::string_view, std::string_view> kReplacedKeys[] = {
    {"optim.decay_embeddings", "optim.embedding.weight_decay = -1"},
    {"optim.decay_norms", "optim.norm.weight_decay = -1 and optim.bias.weight_decay = -1"},
};

std::string unknown_key(std::string_view name) {
  for (const auto& [old_key, now] : kReplacedKeys)
    if (name == old_key) return fmt::format("unknown key '{}' (replaced: write {})", old_key, now);
  return fmt::format("unknown key '{}'{}", printable(name), suggestion(name));
}

// ---- overrides: text -> value -------------------------------------------------------

std::string_view trim(std::string_view s) {
  const auto first = s.find_first_not_of(" \t");
  if (first == std::string_view::npos) return {};
  const auto last = s.find_last_not_of(" \t");
  return s.substr(first, last - first + 1);
}

// Parses `text` as a value of T; on failure returns an error message ("" on success).
template <typename T>
std::string parse_text(std::string_view text, T& out) {
  if constexpr (std::is_same_v<T, std::string>) {
    if (text.size() >= 2 && text.front() == '"' && text.back() == '"') text = text.substr(1, text.size() - 2);
    // TOML holds UTF-8 only: the config.toml every run saves could not hold this value,
    // and --resume, sample, export and serve would refuse the file the run wrote.
    if (const size_t bad = find_invalid_utf8(text); bad != std::string_view::npos)
      return fmt::format("the value is not valid UTF-8 (byte 0x{:02x} at offset {}); a TOML config holds UTF-8 only",
                         static_cast<unsigned char>(text[bad]), bad);
    out = std::string(text);
    return {};
  } else {
    text = trim(text);
    if constexpr (std::is_same_v<T, bool>) {
      if (text == "true" || text == "1") out = true;
      else if (text == "false" || text == "0") out = false;
      else return fmt::format("'{}' is not a boolean (true, false, 1 or 0)", printable(text));
      return {};
    } else {
      T value{};
      const char* end = text.data() + text.size();
      const auto [ptr, ec] = std::from_chars(text.data(), end, value);
      if (ec == std::errc::result_out_of_range)
        return fmt::format("'{}' is out of range", printable(text));
      if (ec != std::errc() || ptr != end || text.empty())
        return fmt::format("'{}' is not {}", printable(text), expected_type<T>());
      if constexpr (std::is_same_v<T, uint64_t>) {
        if (value > kMaxTomlInteger) return fmt::format("'{}' is out of range (max {})", text, kMaxTomlInteger);
      }
      if constexpr (std::is_same_v<T, double>) {
        if (!std::isfinite(value)) return fmt::format("'{}' is not a finite number", text);
      }
      out = value;
      return {};
    }
  }
}

// ---- files: TOML node -> value ------------------------------------------------------

// Reads `node` into `out`; on failure returns "must be ..., got ..." ("" on success).
template <typename T>
std::string read_node(const toml::node& node, T& out) {
  const auto mismatch = [&] {
    return fmt::format("must be {}, got {}", expected_type<T>(), toml_type_name(node.type()));
  };
  if constexpr (std::is_same_v<T, std::string>) {
    const auto* v = node.as_string();
    if (!v) return mismatch();
    out = v->get();
  } else if constexpr (std::is_same_v<T, bool>) {
    const auto* v = node.as_boolean();
    if (!v) return mismatch();
    out = v->get();
  } else if constexpr (std::is_same_v<T, double>) {
    double value;
    if (const auto* i = node.as_integer()) value = static_cast<double>(i->get());
    else if (const auto* f = node.as_floating_point()) value = f->get();
    else return mismatch();
    if (!std::isfinite(value)) return fmt::format("must be a finite number, got {}", value);
    out = value;
  } else {
    const auto* v = node.as_integer();
    if (!v) return mismatch();
    const int64_t value = v->get();
    if constexpr (std::is_same_v<T, uint64_t>) {
      if (value < 0) return fmt::format("must be a non-negative integer, got {}", value);
      out = static_cast<uint64_t>(value);
    } else {
      out = value;
    }
  }
  return {};
}

// ---- paths --------------------------------------------------------------------------

namespace fs = std::filesystem;

std::string absolute_path(const std::string& path, const fs::path& base) {
  if (path.empty()) return path;
  return (fs::path(path).is_absolute() ? fs::path(path) : base / path).lexically_normal().string();
}

// Makes the path `field` holds absolute against `base` (ConfigRule::PathKind says how the
// value reads); anything else is left alone.
void resolve_path(const ConfigField& field, Config& config, const fs::path& base) {
  if (field.rule.path == ConfigRule::kNotPath) return;
  std::string& value = *std::get<std::string*>(field.get(config));
  if (field.rule.path == ConfigRule::kTokenizer) {
    const std::vector<std::string> names = tokenizer_names();
    // As io/model_dir.cpp reads it: "bpe" itself needs a file, so it is one.
    if (value != "bpe" && std::find(names.begin(), names.end(), value) != names.end()) return;
  }
  if (field.rule.path != ConfigRule::kPathList) {
    value = absolute_path(value, base);
    return;
  }
  std::string list;
  size_t start = 0;
  while (start <= value.size()) {
    const size_t end = std::min(value.find(',', start), value.size());
    const std::string item(trim(std::string_view(value).substr(start, end - start)));
    if (!item.empty()) list += (list.empty() ? "" : ",") + absolute_path(item, base);
    start = end + 1;
  }
  value = list;
}

// [[data.sources]]: an array of tables, read by hand (the field table holds scalars).
// Each source's path is resolved against the file like any other path key.
void read_sources(const toml::node& node, DataConfig& data, const std::string& file, const fs::path& base) {
  const toml::array* array = node.as_array();
  if (!array)
    fail(kWhere, "{}: 'data.sources' must be an array of tables ([[data.sources]]), got {}", file,
         toml_type_name(node.type()));
  data.sources.clear();
  for (size_t i = 0; i < array->size(); ++i) {
    const toml::table* table = (*array)[i].as_table();
    if (!table)
      fail(kWhere, "{}: 'data.sources[{}]' must be a table with path and weight, got {}", file, i,
           toml_type_name((*array)[i].type()));
    DataSource source;
    bool has_path = false, has_weight = false;
    for (const auto& [key, value_node] : *table) {
      const toml::node& value = value_node;
      const std::string name = fmt::format("data.sources[{}].{}", i, key.str());
      std::string error;
      if (key.str() == "path") {
        error = read_node(value, source.path);
        has_path = true;
      } else if (key.str() == "weight") {
        error = read_node(value, source.weight);
        has_weight = true;
      } else if (key.str() == "name") {
        error = read_node(value, source.name);
      } else {
        fail(kWhere, "{}: unknown key '{}' (a source has path, weight and name)", file, printable(name));
      }
      if (!error.empty()) fail(kWhere, "{}: '{}' {}", file, name, error);
    }
    KILN_CHECK(has_path, kWhere, "{}: data.sources[{}].path is missing", file, i);
    KILN_CHECK(has_weight, kWhere, "{}: data.sources[{}].weight is missing", file, i);
    source.path = absolute_path(source.path, base);
    data.sources.push_back(std::move(source));
  }
}

bool is_section(std::string_view name) {
  const auto& sections = config_sections();
  return std::find(sections.begin(), sections.end(), name) != sections.end();
}

// True when `field` holds its built-in default in `config` (before path resolution).
bool is_default(const ConfigField& field, Config& config) {
  static Config defaults;
  return std::visit(
      [&](auto* value) {
        using T = std::remove_pointer_t<decltype(value)>;
        return *value == *std::get<T*>(field.get(defaults));
      },
      field.get(config));
}

// One section's table; a key holding a table is a nested section ([model.moe]).
// `base`: the file's directory, against which its relative paths resolve.
void apply_section(Config& config, const std::string& section, const toml::table& table, const std::string& file,
                   const fs::path& base) {
  for (const auto& [key, value_node] : table) {
    const toml::node& node = value_node;  // clang before 16 cannot capture a structured binding
    const std::string nested = fmt::format("{}.{}", section, key.str());
    if (node.is_table() && is_section(nested)) {
      apply_section(config, nested, *node.as_table(), file, base);
      continue;
    }
    if (section == "data" && key.str() == "sources") {
      read_sources(node, config.data, file, base);
      continue;
    }
    const ConfigField* field = find_config_field(section, key.str());
    if (!field) fail(kWhere, "{}: {}", file, unknown_key(nested));
    const std::string error = std::visit([&](auto* value) { return read_node(node, *value); }, field->get(config));
    if (!error.empty()) fail(kWhere, "{}: '{}' {}", file, field->name(), error);
    if (!is_default(*field, config)) config.chosen.push_back(field->name());
    resolve_path(*field, config, base);
  }
}

void apply_table(Config& config, const toml::table& root, const std::string& file) {
  const fs::path base = fs::absolute(fs::path(file)).parent_path();
  for (const auto& [section_key, section_node] : root) {
    const std::string section(section_key.str());
    if (!is_section(section) || section.find('.') != std::string::npos)
      fail(kWhere, "{}: {}", file, unknown_key(section));
    const toml::table* table = section_node.as_table();
    if (!table)
      fail(kWhere, "{}: '{}' must be a table, got {}", file, printable(section), toml_type_name(section_node.type()));
    apply_section(config, section, *table, file, base);
  }
}

// ---- writing ------------------------------------------------------------------------

std::string toml_string(std::string_view s) {
  std::string out = "\"";
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\t': out += "\\t"; break;
      case '\n': out += "\\n"; break;
      case '\f': out += "\\f"; break;
      case '\r': out += "\\r"; break;
      default:
        if (c < 0x20 || c == 0x7f) out += fmt::format("\\u{:04X}", c);
        else out += ch;
    }
  }
  out += '"';
  return out;
}

std::string toml_value(const int64_t* v) { return fmt::format("{}", *v); }
std::string toml_value(const uint64_t* v) { return fmt::format("{}", *v); }
std::string toml_value(const bool* v) { return *v ? "true" : "false"; }
std::string toml_value(const std::string* v) { return toml_string(*v); }
std::string toml_value(const double* v) {
  // fmt's "{}" is the shortest text that reads back to the same double; TOML needs a
  // '.' or an exponent to see a float.
  std::string s = fmt::format("{}", *v);
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

// [[data.sources]] after [data]'s keys; none: a commented example, so that a config
// written by kiln (configs/default.toml, `kiln config`) shows the key.
std::string sources_to_toml(const std::vector<DataSource>& sources) {
  std::string out;
  const auto line = [&](std::string_view text, std::string_view help) {
    out += help.empty() ? fmt::format("{}\n", text) : fmt::format("{:<40}# {}\n", std::string(text) + " ", help);
  };
  if (sources.empty()) {
    out += "\n# A weighted mixture instead of data.path (docs/data.md \"Mixtures\"), one table per source:\n";
    line("# [[data.sources]]", "");
    line("# path = \"fineweb-edu/\"", "any path data.path takes, relative to this file");
    line("# weight = 4.0", "> 0; documents drawn in proportion to the weights");
    line("# name = \"fineweb-edu\"", "for logs; \"\" = the path's last part");
    return out;
  }
  for (const DataSource& s : sources) {
    out += "\n[[data.sources]]\n";
    line("path = " + toml_string(s.path), "any path data.path takes");
    line("weight = " + toml_value(&s.weight), "> 0; documents drawn in proportion to the weights");
    line("name = " + toml_string(s.name), "for logs; \"\" = the path's last part");
  }
  return out;
}

// ---- validation ---------------------------------------------------------------------

template <typename T>
void check_rule(const ConfigField& field, const ConfigRule& rule, const T& value) {
  if constexpr (std::is_same_v<T, int64_t> || std::is_same_v<T, double>) {
    if (rule.unset_allowed && value == -1) return;
    switch (rule.kind) {
      case ConfigRule::kPositive:
        KILN_CHECK(value > 0, kWhere, "{} must be > 0, got {}", field.name(), value);
        break;
      case ConfigRule::kNonNegative:
        KILN_CHECK(value >= 0, kWhere, "{} must be >= 0, got {}", field.name(), value);
        break;
      case ConfigRule::kUnitOpen:
        KILN_CHECK(value >= 0 && value < 1, kWhere, "{} must be in [0, 1), got {}", field.name(), value);
        break;
      case ConfigRule::kUnitClosed:
        KILN_CHECK(value >= 0 && value <= 1, kWhere, "{} must be in [0, 1], got {}", field.name(), value);
        break;
      case ConfigRule::kNone: break;
      default: fail(kWhere, "{}: rule does not apply to a number", field.name());
    }
    KILN_CHECK(rule.max <= 0 || value <= static_cast<T>(rule.max), kWhere, "{} must be <= {} ({}), got {}",
               field.name(), rule.max, rule.max_why, value);
  } else if constexpr (std::is_same_v<T, std::string>) {
    switch (rule.kind) {
      case ConfigRule::kNonEmpty:
        KILN_CHECK(!value.empty(), kWhere, "{} must not be empty", field.name());
        break;
      case ConfigRule::kOneOf: {
        bool found = false;
        std::string_view rest = rule.choices;
        while (!found) {
          const size_t bar = rest.find('|');
          found = rest.substr(0, bar) == value;
          if (bar == std::string_view::npos) break;
          rest = rest.substr(bar + 1);
        }
        KILN_CHECK(found, kWhere, "{} must be one of {}, got '{}'", field.name(), rule.choices, printable(value));
        break;
      }
      case ConfigRule::kNone: break;
      default: fail(kWhere, "{}: rule does not apply to a string", field.name());
    }
  } else {
    KILN_CHECK(rule.kind == ConfigRule::kNone, kWhere, "{}: rule does not apply to this type", field.name());
    if constexpr (std::is_same_v<T, uint64_t>)
      KILN_CHECK(value <= kMaxTomlInteger, kWhere, "{} must be <= {}, got {}", field.name(), kMaxTomlInteger, value);
  }
}

// [model.rope]: what the scaling reads must be there and consistent; what it does not read
// must stay at its default (a key set for nothing is a mistake worth naming).
void validate_rope_scaling(const ModelConfig& m) {
  const RopeConfig& r = m.rope;
  if (r.local_theta != 0) {
    KILN_CHECK(m.position == "rope", kWhere, "model.rope.local_theta = {} needs model.position = 'rope' (got '{}')",
               r.local_theta, m.position);
    bool windowed = false;
    for (int64_t l = 0; l < m.layers; ++l) windowed = windowed || layer_choices(m, l).window > 0;
    KILN_CHECK(windowed, kWhere, "model.rope.local_theta = {} applies to windowed layers, but none has a window "
               "(model.sliding_window, model.full_attention_layers)", r.local_theta);
  }
  if (r.fraction != 1.0) {
    KILN_CHECK(m.position == "rope", kWhere, "model.rope.fraction = {} needs model.position = 'rope' (got '{}')",
               r.fraction, m.position);
    const double dims = r.fraction * static_cast<double>(m.head_dim);
    KILN_CHECK(r.fraction < 1.0 && dims == std::round(dims) && std::llround(dims) % 2 == 0 && dims >= 2, kWhere,
               "model.rope.fraction = {} must be below 1 and rotate an even number of model.head_dim's {} dims "
               "(it gives {})",
               r.fraction, m.head_dim, dims);
  }
  if (r.scaling == "none") {
    KILN_CHECK(r.factor == 1.0, kWhere, "model.rope.factor ({}) needs model.rope.scaling (linear, ntk, yarn or llama3)",
               r.factor);
    return;
  }
  KILN_CHECK(m.position == "rope", kWhere, "model.rope.scaling = '{}' needs model.position = 'rope' (got '{}')",
             r.scaling, m.position);
  KILN_CHECK(r.factor >= 1.0, kWhere, "model.rope.factor ({}) must be >= 1 (a stretch of the context)", r.factor);
  if (r.scaling == "yarn" || r.scaling == "llama3")
    KILN_CHECK(r.original_max_seq_len > 0, kWhere, "model.rope.scaling = '{}' needs model.rope.original_max_seq_len",
               r.scaling);
  if (r.scaling == "llama3")
    KILN_CHECK(r.high_freq_factor > r.low_freq_factor, kWhere,
               "model.rope.high_freq_factor ({}) must be > model.rope.low_freq_factor ({})", r.high_freq_factor,
               r.low_freq_factor);
  if (r.scaling == "yarn")
    KILN_CHECK(r.beta_fast > r.beta_slow, kWhere, "model.rope.beta_fast ({}) must be > model.rope.beta_slow ({})",
               r.beta_fast, r.beta_slow);
  if (r.scaling == "ntk")
    KILN_CHECK(rotary_dims(m) > 2, kWhere, "model.rope.scaling = 'ntk' needs more than 2 rotated dims (got {})",
               rotary_dims(m));
}

}  // namespace

int64_t rotary_dims(const ModelConfig& model) {
  return std::llround(model.rope.fraction * static_cast<double>(model.head_dim));
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  Config config;
  bool path_given = false;  // data.path set by the file or --set (not its default)
  if (!path.empty()) {
    // Bounded, and a directory refused: a wrong path must not train on defaults or be
    // read without end (/dev/zero).
    const std::string text = read_small_file(path, kMaxConfigBytes, "config file", kWhere);
    toml::table root;
    try {
      root = toml::parse(text, path);
    } catch (const toml::parse_error& e) {
      // toml++ quotes the text it saw, which can hold a newline.
      fail(kWhere, "{}:{}:{}: {}", path, e.source().begin.line, e.source().begin.column,
           printable(e.description(), 200));
    }
    apply_table(config, root, path);
    path_given = root["data"]["path"].is_string();
  }
  for (const std::string& assignment : overrides) {
    apply_override(config, assignment);
    const std::string_view name = trim(std::string_view(assignment).substr(0, assignment.find('=')));
    if (name == "data.path") path_given = true;
  }
  // data.path has a default; a mixture replaces it unless data.path was given too, which
  // validate_config then refuses naming both keys.
  if (!config.data.sources.empty() && !path_given) config.data.path.clear();
  give_way_to_token_cadences(config);
  // What no file gave (--set values, defaults) is relative to the working directory. The
  // resolved config is then absolute throughout, so the config.toml a run saves loads the
  // same from any directory.
  const fs::path cwd = fs::current_path();
  for (const ConfigField& field : config_fields()) resolve_path(field, config, cwd);
  validate_config(config);
  return config;
}

void apply_override(Config& config, const std::string& assignment) {
  const size_t eq = assignment.find('=');
  const std::string_view name = trim(std::string_view(assignment).substr(0, std::min(eq, assignment.size())));
  const size_t dot = name.rfind('.');  // the key is the last part: model.moe.experts
  if (eq == std::string::npos || dot == std::string_view::npos || dot == 0 || dot + 1 == name.size())
    fail(kWhere, "--set '{}': expected section.key=value", printable(assignment));
  if (name.starts_with("data.sources"))
    fail(kWhere, "--set cannot give data.sources (an array of tables): write [[data.sources]] in the config file");
  const ConfigField* field = find_config_field(name.substr(0, dot), name.substr(dot + 1));
  if (!field) fail(kWhere, "--set: {}", unknown_key(name));
  const std::string_view text = std::string_view(assignment).substr(eq + 1);
  const std::string error = std::visit([&](auto* value) { return parse_text(text, *value); }, field->get(config));
  if (!error.empty()) fail(kWhere, "--set {}: {}", field->name(), error);
  config.chosen.push_back(field->name());
}

bool Config::was_chosen(const std::string& key) const {
  return std::find(chosen.begin(), chosen.end(), key) != chosen.end();
}

namespace {

// The routers' own rules: what each reads of [model.moe] and what it cannot be combined with.
void validate_moe_router(const Config& config) {
  const MoeConfig& moe = config.model.moe;
  KILN_CHECK(moe.l1_rate > 1.0, kWhere, "model.moe.l1_rate ({}) must be > 1 (the L1 coefficient's factor per step)",
             moe.l1_rate);
  const bool variable = moe.router == "expert_choice" || moe.router == "relu";
  // The Switch balance loss counts k choices per token; these give a token any number.
  KILN_CHECK(!variable || moe.aux_loss == 0, kWhere,
             "model.moe.aux_loss ({}) must be 0 with model.moe.router = '{}' ({})", moe.aux_loss, moe.router,
             moe.router == "relu" ? "it balances by its adaptive L1 penalty" : "its experts take equal shares by construction");
  KILN_CHECK(moe.balance_scope != "step" || moe.aux_loss > 0, kWhere,
             "model.moe.balance_scope = 'step' scopes the balance loss, but model.moe.aux_loss is 0");
  // The multi-token prediction heads' sparse layers run in the heads, after the counting pass.
  KILN_CHECK(moe.balance_scope != "step" || config.model.mtp.depth == 0, kWhere,
             "model.moe.balance_scope = 'step' is not supported with model.mtp.depth > 0 ({})", config.model.mtp.depth);
  KILN_CHECK(moe.router != "expert_choice" || config.train.sample_tokens == 0, kWhere,
             "train.sample_tokens ({}) must be 0 with model.moe.router = 'expert_choice': it is not causal, so the "
             "KV-cache decoder cannot sample it", config.train.sample_tokens);
}

// [[data.sources]]: each source complete, and no other key naming the training data.
void validate_sources(const DataConfig& d) {
  for (size_t i = 0; i < d.sources.size(); ++i) {
    const DataSource& s = d.sources[i];
    KILN_CHECK(!s.path.empty(), kWhere, "data.sources[{}].path must not be empty", i);
    KILN_CHECK(std::isfinite(s.weight) && s.weight > 0, kWhere, "data.sources[{}].weight must be > 0, got {}", i,
               s.weight);
  }
  if (d.sources.empty()) return;
  KILN_CHECK(d.path.empty(), kWhere,
             "data.path ('{}') and data.sources are mutually exclusive: give the training data by one of them",
             printable(d.path));
  KILN_CHECK(d.val_path.empty(), kWhere,
             "data.val_path ('{}') and data.sources are mutually exclusive: each source holds out its own validation "
             "share (data.val_fraction)", printable(d.val_path));
}

}  // namespace

void validate_config(const Config& config) {
  for (const ConfigField& field : config_fields()) {
    // A mixture leaves data.path empty; validate_sources checks the pair.
    if (!config.data.sources.empty() && field.section == "data" && field.key == "path") continue;
    std::visit([&](const auto* value) { check_rule(field, field.rule, *value); }, field.get(config));
  }

  const ModelConfig& m = config.model;
  KILN_CHECK(m.heads % m.kv_heads == 0, kWhere, "model.heads ({}) must be a multiple of model.kv_heads ({})",
             m.heads, m.kv_heads);
  validate_layer_patterns(m);
  validate_rope_scaling(m);
  KILN_CHECK(m.dropout < 1.0, kWhere, "model.dropout ({}) must be below 1", m.dropout);
  const double scale = config.train.loss_scale_init;
  KILN_CHECK(scale >= 1 && std::exp2(std::round(std::log2(scale))) == scale, kWhere,
             "train.loss_scale_init ({}) must be a power of two >= 1: scaling by one is exact", scale);
  KILN_CHECK(m.embed_dropout < 1.0, kWhere, "model.embed_dropout ({}) must be below 1", m.embed_dropout);
  KILN_CHECK(m.attention_dropout < 1.0, kWhere, "model.attention_dropout ({}) must be below 1", m.attention_dropout);
  const MoeConfig& moe = m.moe;
  KILN_CHECK(moe.top_k <= moe.experts, kWhere, "model.moe.top_k ({}) must be <= model.moe.experts ({})", moe.top_k,
             moe.experts);
  KILN_CHECK(moe.experts % moe.groups == 0, kWhere, "model.moe.experts ({}) must be a multiple of model.moe.groups ({})",
             moe.experts, moe.groups);
  KILN_CHECK(moe.top_groups <= moe.groups, kWhere, "model.moe.top_groups ({}) must be <= model.moe.groups ({})",
             moe.top_groups, moe.groups);
  KILN_CHECK(moe.top_k <= moe.top_groups * (moe.experts / moe.groups), kWhere,
             "model.moe.top_k ({}) exceeds the experts of model.moe.top_groups ({} of {} experts each)", moe.top_k,
             moe.top_groups, moe.experts / moe.groups);
  validate_moe_router(config);
  validate_sources(config.data);
  validate_cadences(config);
  check_mup(m);
  mtp_loss_weights(m);  // throws naming model.mtp.weights
  KILN_CHECK(m.max_seq_len <= config.train.micro_batch_tokens, kWhere,
             "model.max_seq_len ({}) must be <= train.micro_batch_tokens ({})", m.max_seq_len,
             config.train.micro_batch_tokens);
}

std::string config_to_toml(const Config& config) {
  std::string out = "# kiln resolved configuration\n";
  for (const std::string_view section : config_sections()) {
    out += fmt::format("\n[{}]\n", section);
    for (const ConfigField& field : config_fields()) {
      if (field.section != section) continue;
      const std::string line = fmt::format(
          "{} = {}", field.key, std::visit([](const auto* value) { return toml_value(value); }, field.get(config)));
      out += fmt::format("{:<40}# {}\n", line + " ", field.help);
    }
    if (section == "data") out += sources_to_toml(config.data.sources);
  }
  return out;
}

}  // namespace kiln
