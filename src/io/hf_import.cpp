#include "io/hf_import.h"

#include "core/json_file.h"
#include "core/printable.h"
#include "data/bpe/bpe_tokenizer.h"
#include "io/byte_tokenizer_json.h"
#include "io/export_names.h"
#include "io/model_dir.h"
#include "io/model_io.h"
#include "io/output_path.h"
#include "io/safetensors.h"

#include <filesystem>
#include <map>
#include <set>

namespace kiln::io {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

json read_json(const fs::path& path, std::string_view where = "import") { return read_json_file(path.string(), where); }

// tensor name -> the open file holding it (one entry per tensor of every shard).
struct WeightFiles {
  std::vector<SafetensorsFile> files;
  std::map<std::string, size_t> where;
};

WeightFiles open_weights(const fs::path& dir, std::string_view where) {
  WeightFiles w;
  const fs::path index = dir / "model.safetensors.index.json";
  if (fs::exists(index)) {
    const std::string index_name = index.string();
    std::map<std::string, size_t> file_index;
    for (const auto& [tensor, name] : read_weight_map(read_json(index, where), index_name)) {
      if (!file_index.count(name)) {
        file_index[name] = w.files.size();
        w.files.push_back(SafetensorsFile::open((dir / name).string()));
      }
      KILN_CHECK(w.files[file_index[name]].contains(tensor), where, "{}: tensor '{}' is not in {}", index_name,
                 printable(tensor), printable(name));
      w.where[tensor] = file_index[name];
    }
  } else {
    const fs::path single = dir / "model.safetensors";
    KILN_CHECK(fs::exists(single), where,
               "{}: no model.safetensors or model.safetensors.index.json (PyTorch .bin checkpoints are not read; "
               "convert them to safetensors first)",
               dir.string());
    w.files.push_back(SafetensorsFile::open(single.string()));
    for (const std::string& name : w.files[0].names()) w.where[name] = 0;
  }
  return w;
}

}  // namespace

std::vector<std::string> load_hf_weights(const std::string& hf_dir, Model& model, std::string_view model_type,
                                         std::string_view where, const Model* whole) {
  const fs::path dir(hf_dir);
  WeightFiles weights = open_weights(dir, where);
  std::set<std::string> used;
  std::set<std::string> others;  // a stage's model: the whole model's tensors it leaves to other stages
  if (whole != nullptr) {
    for (const auto& p : whole->parameters())
      if (!p->training_only() && model.find_parameter(p->name()) == nullptr) others.insert(hf_name(*p));
    // A tied head's stored lm_head.weight is checked where the embedding is.
    if (model.config().tie_embeddings && model.find_parameter("embed.weight") == nullptr) others.insert("lm_head.weight");
  }
  std::set<std::string> dtypes;
  for (const auto& p : model.parameters()) {
    if (p->training_only()) continue;  // no stock checkpoint has them: they keep their initial values
    const std::string hf = hf_name(*p);
    const auto it = weights.where.find(hf);
    KILN_CHECK(it != weights.where.end(), where, "{}: missing tensor '{}' (kiln parameter '{}')", hf_dir, hf,
               p->name());
    const SafetensorsFile& file = weights.files[it->second];
    dtypes.insert(std::string(safetensors_dtype_name(file.info(hf).dtype)));
    read_into(file, hf, p->value());
    used.insert(hf);
  }
  // A tied model may still store lm_head.weight: it must then equal the embedding.
  if (model.config().tie_embeddings && weights.where.count("lm_head.weight")) {
    const auto& file = weights.files[weights.where["lm_head.weight"]];
    const Tensor embed = model.find_parameter("embed.weight")->value();
    OwnedTensor embed_host(DType::f32, Device::cpu, embed.shape());  // the model may be on the GPU
    copy_tensor(embed, *embed_host);
    const OwnedTensor head = read_tensor(file, "lm_head.weight", DType::f32);
    KILN_CHECK(head->shape() == embed.shape() &&
                   std::equal(head->data<float>(), head->data<float>() + head->numel(), embed_host->data<float>()),
               where, "{}: tie_word_embeddings is true but lm_head.weight differs from the embedding", hf_dir);
    used.insert("lm_head.weight");
  }
  for (const auto& [name, file] : weights.where) {
    if (used.count(name) || others.count(name)) continue;
    if (name.size() >= 20 && name.substr(name.size() - 20) == "rotary_emb.inv_freq") continue;  // a buffer
    fail(where, "{}: tensor '{}' has no place in a {} model kiln computes; refusing to drop it", hf_dir, name,
         model_type);
  }
  return {dtypes.begin(), dtypes.end()};
}

HfImportReport import_hf(const std::string& hf_dir, const std::string& out_dir) {
  check_output_apart_from_input(hf_dir, out_dir, "import");  // before anything is read
  check_output_new_or_empty(out_dir, "import");  // never over a model or a run's files
  const fs::path dir(hf_dir);
  const fs::path config_path = dir / "config.json";
  KILN_CHECK(fs::exists(config_path), "import", "'{}' has no config.json", hf_dir);
  const HfModelSpec spec = hf_config_to_model(read_json(config_path), config_path.string());
  HfImportReport report;
  report.arch = spec.arch;
  report.model = spec.model;

  Config config = hf_import_config(spec, config_path.string());

  const fs::path tokenizer = dir / "tokenizer.json";
  if (fs::exists(tokenizer)) {
    report.byte_tokenizer = is_byte_tokenizer_json(read_json(tokenizer));
    if (!report.byte_tokenizer) {
      // Loaded before anything is written, so a file that kiln cannot read (or with ids
      // beyond the model's vocabulary) stops the import instead of every later command.
      const auto bpe = bpe::load_tokenizer_json(
          tokenizer.string(), bpe::TokenIdLimit::of_model(spec.model.vocab_size, "vocab_size in " + config_path.string()));
      report.notes.push_back(fmt::format("tokenizer.json (byte-level BPE, {} ids) copied next to the model",
                                         bpe->vocab_size()));
    }
  } else {
    report.notes.push_back("no tokenizer.json: the model will be read with kiln's byte-level tokenizer");
  }

  if (fs::exists(tokenizer) && !report.byte_tokenizer)  // continued training reads the same tokenizer
    config.data.tokenizer = fs::absolute(fs::path(out_dir) / "tokenizer.json").string();
  BuildOptions options;
  options.training = false;
  options.max_tokens = 1;
  options.loss_chunk_rows = 1;
  Model model(config.model, options);
  model.allocate();
  const std::vector<std::string> dtypes = load_hf_weights(hf_dir, model, hf_model_type(spec.arch), "import");
  report.tensors = static_cast<int64_t>(model.parameters().size());
  report.source_dtypes = dtypes;

  save_model(model, config, out_dir);
  if (fs::exists(tokenizer) && !report.byte_tokenizer) copy_tokenizer_files(dir.string(), out_dir);
  else fs::remove(fs::path(out_dir) / "tokenizer.json");  // a stale one would override byte-level
  return report;
}

}  // namespace kiln::io
