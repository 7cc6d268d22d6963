// Fuzz target: `kiln import hf`'s JSON files. Input: config.json, then (after a NUL) a
// model.safetensors.index.json. config.json is read (read_json_file: capped), turned into a
// kiln model (hf_config_to_model) and validated as the import does (hf_import_config); the
// index's weight_map is read by read_weight_map. An accepted config must survive what the
// import does with it: its config.toml is saved with the model and loaded by every later
// command, so it must load back equal. Every accepted shard name stays inside the directory.
#include "../fuzz_target.h"

#include "config/config.h"
#include "config/config_fields.h"
#include "core/json_file.h"
#include "io/hf_config.h"

KILN_FUZZ_TARGET(hf_config) {
  using namespace kiln;
  if (const std::string_view index = fuzz::part(input, 1); !index.empty()) {
    const std::string index_path = fuzz::scratch_file("model.safetensors.index.json", index);
    std::map<std::string, std::string> shards;
    if (fuzz::accepts([&] { shards = io::read_weight_map(read_json_file(index_path, "import"), index_path); }))
      for (const auto& [tensor, shard] : shards)
        KILN_FUZZ_CHECK(!shard.empty() && shard.find('/') == std::string::npos && shard != "." && shard != "..",
                        "a shard name outside the model's directory was accepted");
  }
  const std::string path = fuzz::scratch_file("config.json", fuzz::part(input, 0));
  Config config;
  if (!fuzz::accepts([&] {
        config = io::hf_import_config(io::hf_config_to_model(read_json_file(path, "import"), path), path);
      }))
    return;
  const std::string saved = fuzz::scratch_file("config.toml", config_to_toml(config));
  Config back;
  if (!fuzz::accepts([&] { back = load_config(saved); })) fuzz::bug("an imported model's config.toml does not load");
  KILN_FUZZ_CHECK(config_equal(config, back), "an imported model's config.toml reads back different values");
}
