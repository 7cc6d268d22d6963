// Registries map a config name to a factory. A config resolves its classes once, when
// the model is built; the step loop then calls plain members (no per-step dispatch).
#pragma once

#include "core/error.h"
#include "core/printable.h"

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace kiln {

template <typename Interface, typename... Args>
class Registry {
 public:
  using Factory = std::function<std::unique_ptr<Interface>(Args...)>;

  explicit Registry(std::string kind) : kind_(std::move(kind)) {}

  void add(const std::string& name, std::string help, Factory factory) {
    KILN_CHECK(!entries_.count(name), "registry", "{} '{}' registered twice", kind_, name);
    entries_[name] = {std::move(help), std::move(factory)};
  }

  bool contains(const std::string& name) const { return entries_.count(name) > 0; }

  // Throws naming the config key and the known names when `name` is unknown.
  std::unique_ptr<Interface> build(const std::string& key, const std::string& name, Args... args) const {
    auto it = entries_.find(name);
    if (it == entries_.end()) fail("config", "{}: unknown {} '{}' (known: {})", key, kind_, printable(name), known());
    return it->second.factory(std::forward<Args>(args)...);
  }

  std::vector<std::pair<std::string, std::string>> list() const {
    std::vector<std::pair<std::string, std::string>> out;
    for (const auto& [name, entry] : entries_) out.emplace_back(name, entry.help);
    return out;
  }

  std::string known() const {
    std::string s;
    for (const auto& [name, entry] : entries_) s += (s.empty() ? "" : ", ") + name;
    return s;
  }

  const std::string& kind() const { return kind_; }

 private:
  struct Entry {
    std::string help;
    Factory factory;
  };
  std::string kind_;
  std::map<std::string, Entry> entries_;
};

}  // namespace kiln
