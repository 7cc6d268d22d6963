#include "nn/export_config.h"

#include "core/error.h"

namespace kiln {

ExportConfig::ExportConfig(Format format, std::string family, std::string gguf_arch, int64_t layers,
                           nlohmann::json& out)
    : format_(format), family_(std::move(family)), gguf_arch_(std::move(gguf_arch)), layers_(layers), out_(out) {}

std::string ExportConfig::full_key(const std::string& key) const {
  return format_ == Format::gguf ? gguf_arch_ + "." + key : key;
}

void ExportConfig::append(const std::string& key, const nlohmann::json& value) {
  const std::string k = full_key(key);
  if (!out_.contains(k)) out_[k] = nlohmann::json::array();
  out_[k].push_back(value);
}

void ExportConfig::set(const std::string& key, const nlohmann::json& value, std::string_view config_key) {
  const std::string k = full_key(key);
  if (out_.contains(k) && out_[k] != value)
    fail("export", "{}: the layers differ in '{}' ({} and {}), which a stock {} model holds once for all layers",
         config_key, k, out_[k].dump(), value.dump(), family_);
  out_[k] = value;
}

void ExportConfig::set_layer(const std::string& key, int64_t layer, const nlohmann::json& value) {
  const std::string k = full_key(key);
  if (!out_.contains(k)) out_[k] = nlohmann::json::array();
  nlohmann::json& list = out_[k];
  while (static_cast<int64_t>(list.size()) < layers_) list.push_back(nullptr);
  list[static_cast<size_t>(layer)] = value;
}

void ExportConfig::refuse(std::string_view config_key, const std::string& value, std::string_view why) const {
  fail("export", "{} = {}: {}; no stock {} model computes this", config_key, value, why, family_);
}

}  // namespace kiln
