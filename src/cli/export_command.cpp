// `kiln export hf CHECKPOINT OUT` and `kiln export gguf CHECKPOINT OUT.gguf`.
#include "cli/commands.h"
#include "io/gguf_export.h"
#include "io/hf_export.h"

#include <fmt/format.h>

#include <cctype>

namespace kiln::cli {

namespace {

// "5GB", "500MB", "64KiB", "1000" (bytes) -> bytes; decimal and binary units.
int64_t parse_size(const std::string& text) {
  size_t end = 0;
  double value = 0;
  try {
    value = std::stod(text, &end);
  } catch (const std::exception&) {
    fail("export", "--max-shard-size '{}': expected a size like 5GB, 500MB or 1000000", text);
  }
  std::string unit = text.substr(end);
  for (char& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  double scale = 1;
  if (unit == "" || unit == "B") scale = 1;
  else if (unit == "KB") scale = 1e3;
  else if (unit == "MB") scale = 1e6;
  else if (unit == "GB") scale = 1e9;
  else if (unit == "KIB") scale = 1024.0;
  else if (unit == "MIB") scale = 1024.0 * 1024;
  else if (unit == "GIB") scale = 1024.0 * 1024 * 1024;
  else fail("export", "--max-shard-size '{}': unknown unit '{}'", text, unit);
  KILN_CHECK(value > 0, "export", "--max-shard-size '{}' must be positive", text);
  return static_cast<int64_t>(value * scale);
}

}  // namespace

void add_export_command(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand("export", "export a saved model to Hugging Face or GGUF files");
  cmd->require_subcommand(1);

  struct HfOptions {
    std::string model, out, dtype = "float32", shard = "5GB";
  };
  auto hf = std::make_shared<HfOptions>();
  CLI::App* hf_cmd = cmd->add_subcommand("hf", "a stock transformers model directory (Qwen3 / Llama / Qwen2)");
  hf_cmd->add_option("checkpoint", hf->model, "kiln model directory (or a run directory with model/)")->required();
  hf_cmd->add_option("out", hf->out, "output directory")->required();
  hf_cmd->add_option("--dtype", hf->dtype, "stored weight type: float32 | bfloat16 | float16")->capture_default_str();
  hf_cmd->add_option("--max-shard-size", hf->shard, "split weights into shards of at most this size")
      ->capture_default_str();
  hf_cmd->callback([hf] {
    io::HfExportOptions options;
    options.dtype = hf->dtype;
    options.max_shard_bytes = parse_size(hf->shard);
    const io::HfExportReport r = io::export_hf(hf->model, hf->out, options);
    fmt::print("exported {} ({}, {} tensors, {:.1f} MB of {} weights) to {}: {}\n", io::hf_architecture(r.arch),
               io::hf_model_type(r.arch), r.tensors, static_cast<double>(r.weight_bytes) / 1e6, hf->dtype, hf->out,
               fmt::join(r.files, ", "));
    if (r.training_only > 0)
      fmt::print("left out {} multi-token prediction tensors (training only; [model.mtp])\n", r.training_only);
  });

  struct GgufOptions {
    std::string model, out, type = "f32";
  };
  auto gg = std::make_shared<GgufOptions>();
  CLI::App* gg_cmd = cmd->add_subcommand("gguf", "a GGUF v3 file for llama.cpp (qwen3 / llama / qwen2)");
  gg_cmd->add_option("checkpoint", gg->model, "kiln model directory (or a run directory with model/)")->required();
  gg_cmd->add_option("out", gg->out, "output .gguf file")->required();
  gg_cmd->add_option("--type", gg->type, "matrix weight type: f32 | bf16 | q8_0 (norms stay f32)")
      ->capture_default_str();
  gg_cmd->callback([gg] {
    io::GgufExportOptions options;
    options.type = gg->type;
    const io::GgufExportReport r = io::export_gguf(gg->model, gg->out, options);
    const std::string types = gg->type == "f32" ? std::string("all f32")
                                                : fmt::format("{} {}, {} f32", r.quantized, gg->type, r.kept_f32);
    fmt::print("exported GGUF '{}' ({} tensors: {}; {:.1f} MB) to {}\n", r.arch, r.tensors, types,
               static_cast<double>(r.bytes) / 1e6, gg->out);
    if (r.training_only > 0)
      fmt::print("left out {} multi-token prediction tensors (training only; [model.mtp])\n", r.training_only);
  });
}

}  // namespace kiln::cli
