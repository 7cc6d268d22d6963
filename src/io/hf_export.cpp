#include "io/hf_export.h"

#include "core/json_file.h"
#include "io/byte_tokenizer_json.h"
#include "io/durable_io.h"
#include "io/export_names.h"
#include "io/model_dir.h"
#include "io/output_path.h"
#include "io/safetensors.h"
#include "io/tokenizer_bos.h"

#include <fmt/format.h>

#include <filesystem>

namespace kiln::io {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

void write_json(const fs::path& path, const json& j) {
  write_file_synced(path.string(), j.dump(2) + "\n", "export");  // checked to the disk
}

DType export_dtype(const std::string& name) {
  if (name == "float32") return DType::f32;
  if (name == "bfloat16") return DType::bf16;
  if (name == "float16") return DType::f16;
  fail("export", "--dtype '{}': expected float32, bfloat16 or float16", name);
}

// A parameter as a host tensor of the export dtype (rounded to nearest even).
void add_converted(SafetensorsWriter& writer, const std::string& name, const Tensor& value, DType dtype) {
  OwnedTensor host(DType::f32, Device::cpu, value.shape());
  KILN_CHECK(value.dtype() == DType::f32, "export", "parameter '{}' is {}, expected f32", name,
             dtype_name(value.dtype()));
  copy_tensor(value, *host);
  std::vector<int64_t> shape;
  for (int i = 0; i < value.rank(); ++i) shape.push_back(value.size(i));
  const float* x = host->data<float>();
  const auto n = static_cast<size_t>(value.numel());
  if (dtype == DType::f32) {
    writer.add_raw(name, dtype, shape, x, n * 4);
    return;
  }
  std::vector<uint16_t> h(n);
  for (size_t i = 0; i < n; ++i) h[i] = dtype == DType::bf16 ? float_to_bf16(x[i]) : float_to_f16(x[i]);
  writer.add_raw(name, dtype, shape, h.data(), n * 2);
}

// Removes weight files a previous export may have left (a stale shard would be loaded).
void remove_old_weights(const fs::path& out) {
  for (const auto& entry : fs::directory_iterator(out)) {
    const std::string name = entry.path().filename().string();
    if (name == "model.safetensors" || name == "model.safetensors.index.json" ||
        (name.rfind("model-", 0) == 0 && name.find("-of-") != std::string::npos &&
         entry.path().extension() == ".safetensors"))
      fs::remove(entry.path());
  }
}

}  // namespace

HfExportReport export_hf(const std::string& model_path, const std::string& out_dir, const HfExportOptions& options) {
  const std::string model_dir = resolve_model_dir(model_path);
  check_output_apart_from_input(model_dir, out_dir, "export");  // what is read, not the path that named it
  // First: a checkpoint's checksums, every tensor and shape, finite weights.
  LoadedModel loaded = load_for_inference(model_dir, 1);
  const Config config = load_config((fs::path(model_dir) / "config.toml").string());
  HfExportReport report;
  report.arch = choose_hf_arch(config.model);
  const DType dtype = export_dtype(options.dtype);
  KILN_CHECK(options.max_shard_bytes > 0, "export", "--max-shard-size must be positive");
  const fs::path trained_tokenizer = model_tokenizer_json(model_dir);  // "" = byte-level
  const bool byte_level = trained_tokenizer.empty();
  if (byte_level)
    KILN_CHECK(config.model.vocab_size >= ByteTokenizer::kVocab, "export",
               "model.vocab_size = {} is smaller than the byte-level vocabulary ({})", config.model.vocab_size,
               ByteTokenizer::kVocab);

  HfSpecialTokens special;
  if (byte_level) special = {ByteTokenizer::kBos, ByteTokenizer::kEos, ByteTokenizer::kPad};
  else {
    const auto tok = model_tokenizer(model_dir);
    special = {tok->bos_id(), tok->eos_id(), tok->pad_id()};
  }
  // The components write (or refuse) their fields before anything is written.
  const json config_json = hf_config_json(*loaded.model, report.arch, special, options.dtype);
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  KILN_CHECK(!ec, "export", "cannot create directory '{}': {}", out_dir, ec.message());
  const fs::path out(out_dir);
  remove_old_weights(out);

  // Shards in parameter order, each up to max_shard_bytes (a larger tensor gets its own).
  std::vector<std::vector<const Parameter*>> shards(1);
  int64_t shard_bytes = 0;
  for (const auto& p : loaded.model->parameters()) {
    if (p->training_only()) {  // the stock classes have no place for them
      ++report.training_only;
      continue;
    }
    const int64_t bytes = p->shape().numel() * static_cast<int64_t>(dtype_size(dtype));
    if (!shards.back().empty() && shard_bytes + bytes > options.max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(p.get());
    shard_bytes += bytes;
    report.weight_bytes += bytes;
    ++report.tensors;
  }
  json weight_map = json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string file = shards.size() == 1 ? "model.safetensors"
                                                : fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, shards.size());
    SafetensorsWriter writer;
    writer.set_metadata("format", "pt");  // transformers refuses safetensors without it
    writer.set_metadata("producer", "kiln " KILN_VERSION);
    for (const Parameter* p : shards[s]) {
      const std::string hf = hf_name(*p);
      add_converted(writer, hf, p->value(), dtype);
      weight_map[hf] = file;
    }
    writer.write((out / file).string());
    report.files.push_back(file);
  }
  if (shards.size() > 1) {
    write_json(out / "model.safetensors.index.json",
               {{"metadata", {{"total_size", report.weight_bytes}}}, {"weight_map", weight_map}});
    report.files.push_back("model.safetensors.index.json");
  }

  write_json(out / "config.json", config_json);
  json generation = {{"_from_model_config", false}};
  if (special.bos >= 0) generation["bos_token_id"] = special.bos;
  if (special.eos >= 0) generation["eos_token_id"] = special.eos;
  if (special.pad >= 0) generation["pad_token_id"] = special.pad;
  write_json(out / "generation_config.json", generation);
  report.files.insert(report.files.end(), {"config.json", "generation_config.json"});

  if (byte_level) {
    write_json(out / "tokenizer.json", byte_tokenizer_json());
    write_json(out / "tokenizer_config.json", byte_tokenizer_config_json(config.model.max_seq_len));
    write_json(out / "special_tokens_map.json",
               {{"bos_token", kBosText}, {"eos_token", kEosText}, {"pad_token", kPadText}});
    report.files.insert(report.files.end(), {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"});
  } else {
    // As trained: BOS before every document (io/tokenizer_bos.h).
    write_json(out / "tokenizer.json",
               with_bos_post_processor(read_json_file(trained_tokenizer.string(), "export"), special.bos,
                                       trained_tokenizer.string()));
    report.files.push_back("tokenizer.json");
    for (const char* extra : {"tokenizer_config.json", "special_tokens_map.json"}) {
      const fs::path src = trained_tokenizer.parent_path() / extra;
      if (fs::exists(src)) {
        fs::copy_file(src, out / extra, fs::copy_options::overwrite_existing);
        report.files.push_back(extra);
      }
    }
    if (!fs::exists(trained_tokenizer.parent_path() / "tokenizer_config.json")) {
      // The tokenizer.json as it is (no model-specific class rebuilding it).
      write_json(out / "tokenizer_config.json",
                 {{"tokenizer_class", "PreTrainedTokenizerFast"}, {"model_max_length", config.model.max_seq_len}});
      report.files.push_back("tokenizer_config.json");
    }
  }
  return report;
}

}  // namespace kiln::io
