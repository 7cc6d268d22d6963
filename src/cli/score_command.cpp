// `kiln score CHECKPOINT IDS.safetensors --out OUT.safetensors`: the model's logits and
// next-token loss on given token sequences, for comparisons with other implementations
// (scripts/hf_roundtrip_check.py compares them with transformers).
//   in:  input_ids  I32/I64 [S, L]   each row one sequence (positions 0..L-1)
//   out: logits     F32 [S, L, V]    (omitted with --no-logits)
//        loss_sum   F64 [S]          sum over t < L-1 of -log p(ids[t+1] | ids[..t])
//        count      I64 [S]          L - 1
#include "cli/commands.h"
#include "io/model_dir.h"
#include "io/safetensors.h"
#include "ops/parallel.h"

#include <fmt/format.h>

#include <cmath>
#include <numeric>

namespace kiln::cli {

void add_score_command(CLI::App& app) {
  struct Options {
    std::string model, ids, out;
    bool no_logits = false;
    int64_t threads = 0;
  };
  auto o = std::make_shared<Options>();
  CLI::App* cmd = app.add_subcommand("score", "logits and next-token loss of token sequences (for comparisons)");
  cmd->add_option("checkpoint", o->model, "kiln model directory (or a checkpoint or run directory)")->required();
  cmd->add_option("ids", o->ids, "safetensors file with input_ids [S, L]")->required();
  cmd->add_option("--out", o->out, "write logits and losses here (safetensors)");
  cmd->add_flag("--no-logits", o->no_logits, "write losses only");
  cmd->add_option("--threads", o->threads, "CPU threads (0 = all)")->capture_default_str();
  cmd->callback([o] {
    set_cpu_threads(o->threads);
    const auto file = io::SafetensorsFile::open(o->ids);
    const OwnedTensor ids = io::read_tensor(file, "input_ids", DType::i32);
    KILN_CHECK(ids->rank() == 2 && ids->size(1) >= 2, "score", "{}: input_ids must be [S, L] with L >= 2", o->ids);
    const int64_t s = ids->size(0), l = ids->size(1);
    io::LoadedModel loaded = io::load_for_inference(o->model, l);
    const int64_t vocab = loaded.config.model.vocab_size;
    std::vector<float> all_logits(o->no_logits ? 0 : static_cast<size_t>(s * l * vocab)), logits;
    std::vector<double> loss(static_cast<size_t>(s));
    std::vector<int64_t> count(static_cast<size_t>(s), l - 1);
    for (int64_t r = 0; r < s; ++r) {
      const int32_t* row = ids->data<int32_t>() + r * l;
      HostBatch b;
      b.tokens.assign(row, row + l);
      b.targets.assign(row + 1, row + l);
      b.targets.push_back(kIgnoreTarget);
      b.positions.resize(static_cast<size_t>(l));
      std::iota(b.positions.begin(), b.positions.end(), 0);
      b.cu_seqlens = {0, static_cast<int32_t>(l)};
      b.max_seqlen = static_cast<int32_t>(l);
      b.target_count = l - 1;
      loaded.model->load_batch(b);
      loaded.model->logits(0, l, logits);
      for (int64_t t = 0; t + 1 < l; ++t) {
        const float* x = logits.data() + t * vocab;
        const double m = *std::max_element(x, x + vocab);
        double sum = 0;
        for (int64_t v = 0; v < vocab; ++v) sum += std::exp(static_cast<double>(x[v]) - m);
        loss[static_cast<size_t>(r)] += m + std::log(sum) - x[row[t + 1]];
      }
      if (!o->no_logits) std::copy(logits.begin(), logits.end(), all_logits.begin() + r * l * vocab);
    }
    const double total = std::accumulate(loss.begin(), loss.end(), 0.0);
    fmt::print("score: {} sequences of {} tokens, mean next-token loss {:.6f} nats\n", s, l,
               total / static_cast<double>(s * (l - 1)));
    if (o->out.empty()) return;
    io::SafetensorsWriter w;
    if (!o->no_logits) w.add_raw("logits", DType::f32, {s, l, vocab}, all_logits.data(), all_logits.size() * 4);
    w.add_raw("loss_sum", DType::f64, {s}, loss.data(), loss.size() * 8);
    w.add_raw("count", DType::i64, {s}, count.data(), count.size() * 8);
    w.set_metadata("model", io::resolve_model_dir(o->model));
    w.write(o->out);
  });
}

}  // namespace kiln::cli
