// `kiln eval-quant CHECKPOINT`: exports the model to GGUF at --type, reads that file back
// (dequantized) into a second model, and compares both on held-out documents: mean
// KL(f32 || quantized) of the next-token distributions and top-1 agreement.
#include "cli/commands.h"
#include "data/dataset.h"
#include "infer/quant_eval.h"
#include "io/gguf_export.h"
#include "io/model_dir.h"
#include "ops/parallel.h"

#include <fmt/format.h>

#include <filesystem>
#include <unistd.h>

namespace kiln::cli {

void add_eval_quant_command(CLI::App& app) {
  struct Options {
    std::string model, data, type = "q8_0", gguf;
    int64_t max_positions = 20000;
    int64_t threads = 0;
  };
  auto o = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand("eval-quant", "compare a GGUF-quantized model with the original on held-out text");
  cmd->add_option("checkpoint", o->model, "kiln model directory (or a run directory with model/)")->required();
  cmd->add_option("--data", o->data, "text/JSONL file (default: the model's data.path); its validation split is used");
  cmd->add_option("--type", o->type, "GGUF weight type: q8_0 | bf16 | f32")->capture_default_str();
  cmd->add_option("--gguf", o->gguf, "keep the exported GGUF file here (default: a temporary file)");
  cmd->add_option("--max-positions", o->max_positions, "compare at most this many next-token distributions")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--threads", o->threads, "CPU threads (0 = all)")->capture_default_str();
  cmd->callback([o] {
    set_cpu_threads(o->threads);
    const std::string dir = io::resolve_model_dir(o->model);
    io::LoadedModel ref = io::load_for_inference(dir, load_config(dir + "/config.toml").model.max_seq_len);
    const int64_t context = ref.config.model.max_seq_len;

    namespace fs = std::filesystem;
    const bool temporary = o->gguf.empty();
    const std::string gguf =
        temporary ? (fs::temp_directory_path() / fmt::format("kiln-eval-quant-{}.gguf", ::getpid())).string() : o->gguf;
    io::GgufExportOptions eo;
    eo.type = o->type;
    const io::GgufExportReport report = io::export_gguf(dir, gguf, eo);
    Model quant(ref.config.model, ref.model->options());
    quant.allocate();
    io::load_gguf_weights(quant, gguf);
    const auto file_bytes = static_cast<int64_t>(fs::file_size(gguf));
    if (temporary) fs::remove(gguf);

    DataConfig data = ref.config.data;
    if (!o->data.empty()) data.path = o->data;
    const auto tokenizer = io::model_tokenizer(dir);
    const TokenDataset dataset(data, *tokenizer);
    const TokenizedSplit& held_out = dataset.split(Split::validation);
    std::vector<std::vector<int32_t>> sequences;
    int64_t positions = 0;
    for (int64_t d = 0; d < held_out.num_documents() && positions < o->max_positions; ++d) {
      std::vector<int32_t> seq{tokenizer->bos_id()};
      for (int32_t id : held_out.document(d)) seq.push_back(id);
      seq.push_back(tokenizer->eos_id());
      // Long documents in windows of the context, each starting at position 0.
      for (size_t begin = 0; begin + 1 < seq.size() && positions < o->max_positions;) {
        const auto take = std::min<size_t>({seq.size() - begin, static_cast<size_t>(context),
                                            static_cast<size_t>(o->max_positions - positions + 1)});
        sequences.emplace_back(seq.begin() + static_cast<std::ptrdiff_t>(begin),
                               seq.begin() + static_cast<std::ptrdiff_t>(begin + take));
        positions += static_cast<int64_t>(take) - 1;
        begin += take - 1;
      }
    }
    const QuantEvalResult r = evaluate_quantization(*ref.model, quant, sequences);
    fmt::print("eval-quant: {} GGUF '{}' ({} tensors {}, {} f32; file {:.2f} MB) vs f32 on {} held-out positions of "
               "{} ({} sequences)\n",
               o->type, report.arch, report.quantized, o->type, report.kept_f32, static_cast<double>(file_bytes) / 1e6,
               r.positions, data.path, sequences.size());
    fmt::print("  mean KL(f32 || {}) = {:.3e} nats (max {:.3e}); top-1 agreement = {:.4f}\n", o->type, r.mean_kl,
               r.max_kl, r.top1_agreement);
    fmt::print("  loss f32 = {:.5f}, {} = {:.5f} nats/token (delta {:+.2e})\n", r.ref_loss, o->type, r.quant_loss,
               r.quant_loss - r.ref_loss);
  });
}

}  // namespace kiln::cli
