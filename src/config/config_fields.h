// The table of configuration keys behind load_config, apply_override, validate_config
// and config_to_toml (config/config.cpp). Each key is one entry in config_fields.cpp:
//
//   KILN_FIELD(model, layers, positive(), "transformer blocks"),
//
// names the section, the member of Config (its C++ type picks the TOML type), a
// per-value rule checked by validate_config, and a help line written into the resolved
// TOML. Rules that relate several keys live in validate_config itself.
#pragma once

#include "config/config.h"

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <variant>

namespace kiln {

// Where a field's value lives in a Config; the alternative is the field's type.
using ConfigValueRef = std::variant<int64_t*, uint64_t*, double*, bool*, std::string*>;

// A check on one value. Numeric kinds apply to int64_t/double fields, the string kinds
// to std::string fields; uint64_t and bool fields take kNone.
struct ConfigRule {
  enum Kind {
    kNone,
    kPositive,     // > 0
    kNonNegative,  // >= 0
    kUnitOpen,     // [0, 1)
    kUnitClosed,   // [0, 1]
    kNonEmpty,     // string not empty
    kOneOf,        // string equal to one of `choices`, written "a|b|c"
  };
  Kind kind = kNone;
  std::string_view choices = {};
  // Numeric fields: when > 0, the value must also be <= max, because of `max_why` (what
  // the limit protects: 32-bit positions, a plan that must stay quick, memory reserved
  // per unit). Checked with the rest by validate_config, before anything is allocated.
  int64_t max = 0;
  std::string_view max_why = {};
  // -1 is accepted besides the rule's values: "unset, take the general key's value".
  bool unset_allowed = false;
  // Path keys (not a check, but how the value reads): load_config makes them absolute, a
  // relative one against the directory of the config file that gives it, else (--set, a
  // default) against the working directory. "" stays "" (unset).
  enum PathKind {
    kNotPath,
    kPath,       // one path (a file, directory or glob)
    kPathList,   // comma-separated paths
    kTokenizer,  // a registered tokenizer name ("byte"), else a path
  };
  PathKind path = kNotPath;

  constexpr ConfigRule or_unset() const {
    ConfigRule r = *this;
    r.unset_allowed = true;
    return r;
  }
  constexpr ConfigRule as(PathKind kind) const {
    ConfigRule r = *this;
    r.path = kind;
    return r;
  }
  constexpr ConfigRule up_to(int64_t limit, std::string_view why) const {
    ConfigRule r = *this;
    r.max = limit;
    r.max_why = why;
    return r;
  }
};

struct ConfigField {
  std::string_view section;
  std::string_view key;
  ConfigRule rule;
  std::string_view help;
  ConfigValueRef (*ref)(Config&);

  std::string name() const;  // "section.key"
  ConfigValueRef get(Config& config) const { return ref(config); }
  // Const access: the pointer refers into `config` and must only be read.
  ConfigValueRef get(const Config& config) const { return ref(const_cast<Config&>(config)); }
};

// Every key, grouped by section in the order config_to_toml writes them.
std::span<const ConfigField> config_fields();
// The section names in order ("model", "data", ...).
std::span<const std::string_view> config_sections();
// nullptr when there is no such key.
const ConfigField* find_config_field(std::string_view section, std::string_view key);
// True when every field of a and b is equal (doubles compared exactly).
bool config_equal(const Config& a, const Config& b);

}  // namespace kiln
