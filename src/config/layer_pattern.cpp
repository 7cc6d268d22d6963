#include "config/layer_pattern.h"

#include "core/error.h"

#include <algorithm>
#include <charconv>

namespace kiln {

namespace {

// A non-negative integer spelled exactly (no sign, no spaces); false otherwise.
bool parse_index(std::string_view s, int64_t& out) {
  if (s.empty()) return false;
  const auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), out);
  return ec == std::errc() && ptr == s.data() + s.size() && out >= 0;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && s.front() == ' ') s.remove_prefix(1);
  while (!s.empty() && s.back() == ' ') s.remove_suffix(1);
  return s;
}

}  // namespace

std::vector<bool> parse_layer_set(std::string_view key, std::string_view text, int64_t layers) {
  std::vector<bool> member(static_cast<size_t>(layers), false);
  text = trim(text);
  const bool complement = !text.empty() && text.front() == '~';
  if (complement) text = trim(text.substr(1));
  auto bad = [&](std::string_view item, std::string_view why) {
    fail("config", "{} = '{}': '{}' {} (layer sets: N, A-B, every:K, first:K, from:K, all; ~ for the complement)",
         key, text, item, why);
  };
  auto add = [&](int64_t l, std::string_view item) {
    if (l >= layers) bad(item, fmt::format("names layer {}, but the model has {} (model.layers)", l, layers));
    member[static_cast<size_t>(l)] = true;
  };
  size_t start = 0;
  while (start <= text.size() && !text.empty()) {
    const size_t comma = text.find(',', start);
    const std::string_view item = trim(text.substr(start, comma == std::string_view::npos ? comma : comma - start));
    start = comma == std::string_view::npos ? text.size() + 1 : comma + 1;
    int64_t a = 0, b = 0;
    const size_t colon = item.find(':'), dash = item.find('-');
    if (item == "all") {
      for (int64_t l = 0; l < layers; ++l) member[static_cast<size_t>(l)] = true;
    } else if (colon != std::string_view::npos) {
      const std::string_view kind = item.substr(0, colon);
      if (!parse_index(item.substr(colon + 1), a) || a == 0) bad(item, "needs a positive count after ':'");
      if (kind == "every") {
        for (int64_t l = a - 1; l < layers; l += a) member[static_cast<size_t>(l)] = true;
      } else if (kind == "first") {
        for (int64_t l = 0; l < std::min(a, layers); ++l) member[static_cast<size_t>(l)] = true;
      } else if (kind == "from") {
        for (int64_t l = a; l < layers; ++l) member[static_cast<size_t>(l)] = true;
      } else {
        bad(item, "is not every:K, first:K or from:K");
      }
    } else if (dash != std::string_view::npos) {
      if (!parse_index(item.substr(0, dash), a) || !parse_index(item.substr(dash + 1), b) || b < a)
        bad(item, "is not a range A-B with A <= B");
      for (int64_t l = a; l <= b; ++l) add(l, item);
    } else if (parse_index(item, a)) {
      add(a, item);
    } else {
      bad(item, "is not a layer, a range or a pattern");
    }
  }
  if (complement) member.flip();
  return member;
}

LayerChoices layer_choices(const ModelConfig& m, int64_t layer) {
  const auto l = static_cast<size_t>(layer);
  LayerChoices c;
  c.mixer = parse_layer_set("model.alt_attention_layers", m.alt_attention_layers, m.layers)[l] ? m.alt_attention
                                                                                               : m.attention;
  const bool full = parse_layer_set("model.full_attention_layers", m.full_attention_layers, m.layers)[l];
  c.window = full ? 0 : m.sliding_window;
  c.rotary = !parse_layer_set("model.nope_layers", m.nope_layers, m.layers)[l];
  c.mlp = parse_layer_set("model.alt_mlp_layers", m.alt_mlp_layers, m.layers)[l] ? m.alt_mlp : m.mlp;
  return c;
}

void validate_layer_patterns(const ModelConfig& m) {
  parse_layer_set("model.full_attention_layers", m.full_attention_layers, m.layers);
  parse_layer_set("model.nope_layers", m.nope_layers, m.layers);
  // An alternative component's layer set must name one when it names any layer.
  auto check_alt = [&](const char* key, const std::string& set, const char* alt_key, const std::string& alt,
                       const char* what) {
    const std::vector<bool> layers = parse_layer_set(key, set, m.layers);
    const bool any = std::find(layers.begin(), layers.end(), true) != layers.end();
    KILN_CHECK(!any || !alt.empty(), "config", "{} = '{}' names layers, but {} (their {}) is empty", key, set, alt_key,
               what);
  };
  check_alt("model.alt_mlp_layers", m.alt_mlp_layers, "model.alt_mlp", m.alt_mlp, "MLP");
  check_alt("model.alt_attention_layers", m.alt_attention_layers, "model.alt_attention", m.alt_attention,
            "token mixer");
  KILN_CHECK(m.full_attention_layers.empty() || m.sliding_window > 0, "config",
             "model.full_attention_layers = '{}' exempts layers from a window, but model.sliding_window is 0",
             m.full_attention_layers);
}

}  // namespace kiln
