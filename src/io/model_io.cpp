#include "io/model_io.h"

#include "io/durable_io.h"
#include "io/safetensors.h"

#include <filesystem>
#include <set>

namespace kiln::io {

namespace fs = std::filesystem;

void add_model_weights(SafetensorsWriter& writer, const Model& model) {
  for (const auto& p : model.parameters()) {
    const Tensor value = p->value();
    if (value.dtype() == DType::f32 || value.dtype() == DType::bf16) {  // bf16: masters (optim.master_weights), bit for bit
      writer.add(p->name(), value);
    } else {  // f64 reference models are stored as f32 like every other
      OwnedTensor host(value.dtype(), Device::cpu, value.shape());
      copy_tensor(value, *host);
      OwnedTensor f32(DType::f32, Device::cpu, value.shape());
      for (int64_t i = 0; i < value.numel(); ++i)
        f32->data<float>()[i] = static_cast<float>(host->data<double>()[i]);
      writer.add(p->name(), *f32);
    }
  }
  writer.set_metadata("format", "kiln-model");
  writer.set_metadata("kiln_version", KILN_VERSION);
}

void save_model(const Model& model, const Config& config, const std::string& dir,
                const std::function<void(SafetensorsWriter&)>& more_weights) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  KILN_CHECK(!ec, "save", "cannot create directory '{}': {}", dir, ec.message());
  SafetensorsWriter writer;
  add_model_weights(writer, model);
  if (more_weights) more_weights(writer);
  writer.write((fs::path(dir) / "model.safetensors").string());
  replace_file_atomically((fs::path(dir) / "config.toml").string(), config_to_toml(config), "save");
}

void load_weights(Model& model, const std::string& path) { load_weights(model, SafetensorsFile::open(path)); }

void load_weights(Model& model, const SafetensorsFile& file) {
  const std::string& path = file.path();
  std::set<std::string> expected;
  for (const auto& p : model.parameters()) {
    expected.insert(p->name());
    KILN_CHECK(file.contains(p->name()), "load", "{}: missing tensor '{}'", path, p->name());
    read_into(file, p->name(), p->value());
  }
  // A pipeline stage's model (BuildOptions::layers) reads its part of the whole model's file.
  if (!model.backbone().whole()) return;
  for (const std::string& name : file.names())
    KILN_CHECK(expected.count(name), "load", "{}: tensor '{}' does not belong to this model configuration", path,
               name);
}

LoadedModel load_model(const std::string& dir, BuildOptions options) {
  const std::string config_path = (fs::path(dir) / "config.toml").string();
  KILN_CHECK(fs::exists(config_path), "load", "'{}' is not a kiln model directory (no config.toml)", dir);
  LoadedModel loaded;
  loaded.config = load_config(config_path);
  loaded.model = std::make_unique<Model>(loaded.config.model, options);
  loaded.model->allocate();
  load_weights(*loaded.model, (fs::path(dir) / "model.safetensors").string());
  return loaded;
}

}  // namespace kiln::io
