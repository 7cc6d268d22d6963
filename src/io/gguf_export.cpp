#include "io/gguf_export.h"

#include "core/json_file.h"
#include "data/bpe/pretokenizer.h"
#include "io/byte_tokenizer_json.h"
#include "io/gguf_writer.h"
#include "io/hf_config.h"
#include "io/model_dir.h"
#include "io/quant_q8_0.h"

#include <nlohmann/json.hpp>

#include <array>
#include <cstring>
#include <filesystem>
#include <set>

namespace kiln::io {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr std::array<std::pair<std::string_view, std::string_view>, 3> kGlobal{{
    {"embed.weight", "token_embd.weight"},
    {"final_norm.weight", "output_norm.weight"},
    {"lm_head.weight", "output.weight"},
}};

constexpr std::array<std::pair<std::string_view, std::string_view>, 14> kLayer{{
    {"attn_norm.weight", "attn_norm.weight"},
    {"mlp_norm.weight", "ffn_norm.weight"},
    {"attn.q_proj.weight", "attn_q.weight"},
    {"attn.k_proj.weight", "attn_k.weight"},
    {"attn.v_proj.weight", "attn_v.weight"},
    {"attn.o_proj.weight", "attn_output.weight"},
    {"attn.q_proj.bias", "attn_q.bias"},
    {"attn.k_proj.bias", "attn_k.bias"},
    {"attn.v_proj.bias", "attn_v.bias"},
    {"attn.q_norm.weight", "attn_q_norm.weight"},
    {"attn.k_norm.weight", "attn_k_norm.weight"},
    {"mlp.gate_proj.weight", "ffn_gate.weight"},
    {"mlp.up_proj.weight", "ffn_up.weight"},
    {"mlp.down_proj.weight", "ffn_down.weight"},
}};

// llama.cpp's "llama" rotates interleaved pairs: within each head of `head_dim` rows, row
// s * D/2 + j (s = half, j < D/2) moves to 2j + s (convert_hf_to_gguf.py's permute). The
// inverse maps it back. `rows` of `cols` floats.
std::vector<float> permute_rows(const std::vector<float>& w, int64_t rows, int64_t cols, int64_t head_dim,
                                bool inverse) {
  std::vector<float> out(w.size());
  const int64_t half = head_dim / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t h = r / head_dim, within = r % head_dim;
    const int64_t s = within / half, j = within % half;
    const int64_t to = h * head_dim + 2 * j + s;
    const int64_t dst = inverse ? r : to, src = inverse ? to : r;
    std::copy(w.begin() + src * cols, w.begin() + (src + 1) * cols, out.begin() + dst * cols);
  }
  return out;
}

bool permuted(HfArch arch, const std::string& kiln_name) {
  if (arch != HfArch::llama) return false;
  const auto ends = [&](std::string_view s) {
    return kiln_name.size() >= s.size() && kiln_name.compare(kiln_name.size() - s.size(), s.size(), s) == 0;
  };
  return ends("attn.q_proj.weight") || ends("attn.k_proj.weight");
}

std::vector<float> host_floats(const Tensor& t) {
  OwnedTensor host(DType::f32, Device::cpu, t.shape());
  copy_tensor(t, *host);
  return std::vector<float>(host->data<float>(), host->data<float>() + t.numel());
}

// llama.cpp's name (tokenizer.ggml.pre) for the pre-tokenizer of a byte-level BPE
// tokenizer.json: the split regexes of `kiln train-tokenizer --pattern` (gpt2, llama3,
// qwen2; what GPT-2, Llama 3 and Qwen2/3 ship), as a Split before a ByteLevel without its
// own regex, or GPT-2's ByteLevel with its built-in regex. llama.cpp splits by the name, not
// by the file's regex, so any other pre-tokenizer is refused: the GGUF would tokenize
// differently. (A normalizer, such as the NFC of Qwen's tokenizers, is not applied by
// llama.cpp; text already in NFC tokenizes the same.)
std::string llama_cpp_pre_tokenizer(const json& j, const fs::path& path) {
  const json pre = j.value("pre_tokenizer", json());
  auto byte_level_with_regex = [](const json& p) {
    return p.is_object() && p.value("type", "") == "ByteLevel" && p.value("use_regex", true);
  };
  if (byte_level_with_regex(pre)) return "gpt-2";
  std::string pattern;
  if (pre.is_object() && pre.value("type", "") == "Sequence") {
    const json steps = pre.value("pretokenizers", json::array());
    if (steps.size() == 2 && steps[0].value("type", "") == "Split" && steps[1].value("type", "") == "ByteLevel" &&
        !steps[1].value("use_regex", true) && steps[0].value("behavior", "") == "Isolated" &&
        !steps[0].value("invert", false))
      pattern = steps[0].value("pattern", json::object()).value("Regex", "");
  }
  if (!pattern.empty()) {
    if (pattern == bpe::named_pattern("gpt2")) return "gpt-2";
    if (pattern == bpe::named_pattern("llama3")) return "llama-bpe";
    if (pattern == bpe::named_pattern("qwen2")) return "qwen2";
  }
  fail("export", "{}: pre_tokenizer has no llama.cpp equivalent (GGUF takes the gpt2, llama3 or qwen2 split of "
       "kiln train-tokenizer --pattern, or GPT-2's ByteLevel regex): a GGUF would tokenize differently",
       path.string());
}

// The "gpt2" vocabulary of a trained byte-level BPE tokenizer.json (vocab + merges + added tokens).
GgufVocab vocab_from_tokenizer_json(const json& j, const fs::path& path, int64_t vocab_size,
                                    std::vector<std::string>& merges) {
  const json& model = j.at("model");
  KILN_CHECK(model.value("type", "") == "BPE", "export", "{}: only BPE tokenizers embed in GGUF", path.string());
  GgufVocab v;
  v.tokens.assign(static_cast<size_t>(vocab_size), "");
  v.types.assign(static_cast<size_t>(vocab_size), 5);
  auto put = [&](int64_t id, const std::string& text, int32_t type) {
    KILN_CHECK(id >= 0 && id < vocab_size, "export", "{}: token id {} outside model.vocab_size {}", path.string(), id,
               vocab_size);
    v.tokens[static_cast<size_t>(id)] = text;
    v.types[static_cast<size_t>(id)] = type;
  };
  for (const auto& [text, id] : model.at("vocab").items()) put(id.get<int64_t>(), text, 1);
  for (const auto& t : j.value("added_tokens", json::array()))
    put(t.at("id").get<int64_t>(), t.at("content"), t.value("special", false) ? 3 : 4);
  for (size_t id = 0; id < v.tokens.size(); ++id)
    if (v.tokens[id].empty()) v.tokens[id] = "<|unused_" + std::to_string(id) + "|>";
  for (const auto& m : model.at("merges"))
    merges.push_back(m.is_string() ? m.get<std::string>() : m[0].get<std::string>() + " " + m[1].get<std::string>());
  return v;
}

}  // namespace

std::string gguf_tensor_name(const std::string& name) {
  for (const auto& [kiln, gguf] : kGlobal)
    if (name == kiln) return std::string(gguf);
  const std::string prefix = "layers.";
  if (name.rfind(prefix, 0) == 0) {
    const size_t dot = name.find('.', prefix.size());
    if (dot != std::string::npos) {
      const std::string index = name.substr(prefix.size(), dot - prefix.size());
      const std::string rest = name.substr(dot + 1);
      for (const auto& [kiln, gguf] : kLayer)
        if (rest == kiln) return "blk." + index + "." + std::string(gguf);
    }
  }
  fail("gguf", "parameter '{}' has no llama.cpp tensor name", name);
}

GgufExportReport export_gguf(const std::string& model_path, const std::string& out_path,
                             const GgufExportOptions& options) {
  const std::string dir = resolve_model_dir(model_path);
  const Config config = load_config((fs::path(dir) / "config.toml").string());
  const ModelConfig& m = config.model;
  const HfArch arch = choose_hf_arch(m);
  const std::string& type = options.type;
  KILN_CHECK(type == "f32" || type == "bf16" || type == "q8_0", "export", "--type '{}': expected f32, bf16 or q8_0",
             type);
  LoadedModel loaded = load_for_inference(dir, 1);

  GgufExportReport report;
  report.arch = std::string(hf_model_type(arch));
  const std::string a = report.arch;
  GgufWriter w;
  w.set("general.architecture", a);
  w.set("general.type", std::string("model"));
  w.set("general.name", m.name);
  w.set("general.file_type", uint32_t(type == "f32" ? 0 : type == "bf16" ? 32 : 7));
  w.set("general.quantization_version", uint32_t(2));
  w.set(a + ".vocab_size", uint32_t(m.vocab_size));
  w.set(a + ".context_length", uint32_t(m.max_seq_len));
  w.set(a + ".embedding_length", uint32_t(m.hidden));
  w.set(a + ".block_count", uint32_t(m.layers));
  w.set(a + ".feed_forward_length", uint32_t(m.ffn_hidden));
  w.set(a + ".attention.head_count", uint32_t(m.heads));
  w.set(a + ".attention.head_count_kv", uint32_t(m.kv_heads));
  w.set(a + ".attention.key_length", uint32_t(m.head_dim));
  w.set(a + ".attention.value_length", uint32_t(m.head_dim));
  w.set(a + ".attention.layer_norm_rms_epsilon", float(m.norm_eps));
  w.set(a + ".rope.dimension_count", uint32_t(m.head_dim));
  w.set(a + ".rope.freq_base", float(m.rope_theta));

  // Loaded (and so validated: types, ids below model.vocab_size) before its JSON is read
  // again for the GGUF vocabulary below.
  const auto tokenizer = model_tokenizer(dir);
  const std::string trained = model_tokenizer_json(dir);  // "" = byte-level
  std::vector<std::string> merges;
  GgufVocab vocab;
  // Byte-level: one token per byte and no merges, so no split changes an id.
  std::string pre = "default";
  if (trained.empty()) {
    vocab = byte_gguf_vocab(m.vocab_size);
  } else {
    const json j = read_json_file(trained, "export");
    pre = llama_cpp_pre_tokenizer(j, trained);
    vocab = vocab_from_tokenizer_json(j, trained, m.vocab_size, merges);
  }
  w.set("tokenizer.ggml.model", std::string("gpt2"));
  w.set("tokenizer.ggml.pre", pre);
  w.set("tokenizer.ggml.tokens", vocab.tokens);
  w.set("tokenizer.ggml.token_type", vocab.types);
  w.set("tokenizer.ggml.merges", merges);
  w.set("tokenizer.ggml.bos_token_id", uint32_t(tokenizer->bos_id()));
  w.set("tokenizer.ggml.eos_token_id", uint32_t(tokenizer->eos_id()));
  w.set("tokenizer.ggml.padding_token_id", uint32_t(tokenizer->pad_id()));
  w.set("tokenizer.ggml.add_bos_token", true);
  w.set("tokenizer.ggml.add_eos_token", false);

  for (const auto& p : loaded.model->parameters()) {
    const Tensor value = p->value();
    std::vector<float> x = host_floats(value);
    std::vector<int64_t> shape;
    for (int i = 0; i < value.rank(); ++i) shape.push_back(value.size(i));
    if (permuted(arch, p->name())) x = permute_rows(x, shape[0], shape[1], m.head_dim, false);
    GgmlType t = GgmlType::f32;
    if (shape.size() == 2 && type == "bf16") t = GgmlType::bf16;
    if (shape.size() == 2 && type == "q8_0" && shape[1] % kQ8_0Block == 0) t = GgmlType::q8_0;
    std::vector<uint8_t> bytes;
    if (t == GgmlType::f32) {
      bytes.resize(x.size() * 4);
      std::memcpy(bytes.data(), x.data(), bytes.size());
    } else if (t == GgmlType::bf16) {
      bytes.resize(x.size() * 2);
      for (size_t i = 0; i < x.size(); ++i) {
        const uint16_t h = float_to_bf16(x[i]);
        std::memcpy(bytes.data() + 2 * i, &h, 2);
      }
    } else {
      bytes = quantize_q8_0(x.data(), static_cast<int64_t>(x.size()));
    }
    (t == GgmlType::f32 ? report.kept_f32 : report.quantized) += 1;
    report.bytes += static_cast<int64_t>(bytes.size());
    w.add_tensor(gguf_tensor_name(p->name()), t, shape, std::move(bytes));
    ++report.tensors;
  }
  const fs::path parent = fs::path(out_path).parent_path();
  if (!parent.empty()) fs::create_directories(parent);
  w.write(out_path);
  return report;
}

void load_gguf_weights(Model& model, const std::string& path) {
  const GgufFile file = GgufFile::open(path);
  const ModelConfig& m = model.config();
  const HfArch arch = choose_hf_arch(m);
  const auto& file_arch = std::get<std::string>(file.get("general.architecture"));
  KILN_CHECK(file_arch == hf_model_type(arch), "gguf", "{}: architecture '{}', this model exports as '{}'", path,
             file_arch, hf_model_type(arch));
  std::set<std::string> expected;
  for (const auto& p : model.parameters()) {
    const std::string name = gguf_tensor_name(p->name());
    expected.insert(name);
    const auto& info = file.tensor(name);
    const Tensor value = p->value();
    KILN_CHECK(value.dtype() == DType::f32, "gguf", "load into an f32 model");
    std::vector<int64_t> shape;
    for (int i = 0; i < value.rank(); ++i) shape.push_back(value.size(i));
    KILN_CHECK(info.shape == shape, "gguf", "{}: tensor '{}' has the wrong shape", path, name);
    std::vector<float> x = file.read_f32(name);
    if (permuted(arch, p->name())) x = permute_rows(x, shape[0], shape[1], m.head_dim, true);
    Tensor host(x.data(), DType::f32, Device::cpu, value.shape());
    copy_tensor(host, value);
  }
  for (const auto& t : file.tensors())
    KILN_CHECK(expected.count(t.name), "gguf", "{}: tensor '{}' does not belong to this model", path, t.name);
}

}  // namespace kiln::io
