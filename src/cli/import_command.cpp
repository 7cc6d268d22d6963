// `kiln import hf DIR OUT`: a Hugging Face Qwen3 / Llama / Qwen2 directory into a kiln model.
#include "cli/commands.h"
#include "io/hf_import.h"

#include <fmt/format.h>

namespace kiln::cli {

void add_import_command(CLI::App& app) {
  CLI::App* cmd = app.add_subcommand("import", "import a model from Hugging Face files");
  cmd->require_subcommand(1);
  struct Options {
    std::string dir, out;
  };
  auto o = std::make_shared<Options>();
  CLI::App* hf = cmd->add_subcommand("hf", "a transformers model directory (config.json + safetensors)");
  hf->add_option("dir", o->dir, "Hugging Face model directory")->required();
  hf->add_option("out", o->out, "kiln model directory to write (model.safetensors + config.toml)")->required();
  hf->callback([o] {
    const io::HfImportReport r = io::import_hf(o->dir, o->out);
    const ModelConfig& m = r.model;
    fmt::print("imported {} ({} tensors from {}): {} layers, hidden {}, {} heads / {} kv heads of {}, ffn {}, vocab {},"
               " qk_norm {}, tied {} -> {}\n",
               io::hf_architecture(r.arch), r.tensors, fmt::join(r.source_dtypes, "/"), m.layers, m.hidden, m.heads,
               m.kv_heads, m.head_dim, m.ffn_hidden, m.vocab_size, m.qk_norm, m.tie_embeddings, o->out);
    for (const std::string& note : r.notes) fmt::print("note: {}\n", note);
  });
}

}  // namespace kiln::cli
