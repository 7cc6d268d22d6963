#include "io/gguf_export.h"

#include "core/json_file.h"
#include "data/bpe/pretokenizer.h"
#include "io/byte_tokenizer_json.h"
#include "io/export_names.h"
#include "io/gguf_writer.h"
#include "io/hf_config.h"
#include "io/model_dir.h"
#include "io/output_path.h"
#include "io/quant_q8_0.h"

#include <nlohmann/json.hpp>

#include <array>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>

namespace kiln::io {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// Where each of a head's D dims goes in llama.cpp's layout (to[kiln dim]), or empty where
// it is kiln's own. kiln rotates pairs (j, j + D/2) for j < R/2 and passes the rest.
//   llama (R = D): interleaved pairs, dim s * D/2 + j to 2j + s (convert_hf_to_gguf.py's
//     permute; llama.cpp's llama refuses rope.dimension_count != D, so the Rope refuses R < D).
//   qwen2/qwen3 (NEOX) with R < D: pairs (j, j + R/2) over the first R dims and the rest
//     passed, so [0, R/2) stays, [D/2, D/2 + R/2) follows it, then the passed dims in order:
//     the same rotation of the same values, and q.k is unchanged by one order for q and k.
std::vector<int64_t> rope_dim_order(HfArch arch, int64_t head_dim, int64_t rotary) {
  const int64_t half = head_dim / 2, rotated = rotary / 2;
  std::vector<int64_t> to(static_cast<size_t>(head_dim));
  if (arch == HfArch::llama) {
    for (int64_t d = 0; d < head_dim; ++d) to[static_cast<size_t>(d)] = 2 * (d % half) + d / half;
    return to;
  }
  if (rotary == head_dim) return {};
  for (int64_t d = 0; d < head_dim; ++d) {
    const int64_t s = d / half, j = d % half;  // d is the first (s = 0) or second of pair j
    to[static_cast<size_t>(d)] = j < rotated ? s * rotated + j : rotary + s * (half - rotated) + (j - rotated);
  }
  return to;
}

// Reorders the rows of each head (`rows` of `cols` floats, heads of to.size() rows) by `to`;
// inverse maps them back. A 1-D tensor (a bias, a norm gain) is rows of one.
std::vector<float> permute_rows(const std::vector<float>& w, int64_t rows, int64_t cols,
                                const std::vector<int64_t>& to, bool inverse) {
  std::vector<float> out(w.size());
  const int64_t head_dim = static_cast<int64_t>(to.size());
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t moved = r / head_dim * head_dim + to[static_cast<size_t>(r % head_dim)];
    const int64_t dst = inverse ? r : moved, src = inverse ? moved : r;
    std::copy(w.begin() + src * cols, w.begin() + (src + 1) * cols, out.begin() + dst * cols);
  }
  return out;
}

// A parameter's floats in llama.cpp's order (or back, inverse): the q/k tensors of rotating
// layers (ParamName's rope_rows) reordered by rope_dim_order, the others as they are.
std::vector<float> gguf_order(std::vector<float> x, const Parameter& p, const std::vector<int64_t>& to,
                              bool inverse) {
  if (to.empty() || p.names().gguf_layout != GgufLayout::rope_rows) return x;
  const Shape shape = p.shape();
  const int64_t cols = shape.rank() == 2 ? shape[1] : 1;
  return permute_rows(x, shape[0], cols, to, inverse);
}

// Gemma's norms compute x * rstd * (1 + w) and kiln stores w; llama.cpp's gemma2/gemma3
// multiply by the stored gain, so the file holds 1 + w (conversion/gemma.py: every tensor
// whose name ends in "norm.weight", the q/k norms included), and reading it back subtracts
// 1. In fp32 (1 + w) - 1 is w only where 1 + w is exact: a w below about 2^-24 in size, or
// with bits below 1's last place, comes back rounded to 1's grid (the file has no more).
bool stores_gain_offset(HfArch arch, const std::string& gguf_name) {
  return is_gemma(arch) && gguf_name.ends_with("norm.weight");
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

// The GGUF tensors of a model in parameter order: one per parameter, or one per stack of
// parameters llama.cpp keeps as one tensor (an MoE layer's experts: ParamName::gguf_stack),
// at the place of its first part.
struct GgufTensor {
  std::string name;
  std::vector<const Parameter*> parts;  // one, or the stack's in index order
};

std::vector<GgufTensor> gguf_tensors(const Model& model) {
  std::vector<GgufTensor> out;
  std::map<std::string, size_t> stacks;
  for (const auto& p : model.parameters()) {
    if (p->training_only()) continue;  // llama.cpp's archs have no place for them
    const std::string& name = gguf_name(*p);
    if (p->names().gguf_stack < 0) {
      out.push_back({name, {p.get()}});
      continue;
    }
    const auto [it, fresh] = stacks.emplace(name, out.size());
    if (fresh) out.push_back({name, {}});
    std::vector<const Parameter*>& parts = out[it->second].parts;
    KILN_CHECK(p->names().gguf_stack == static_cast<int64_t>(parts.size()), "gguf",
               "parameter '{}' is part {} of '{}', after {} parts: an internal error", p->name(), p->names().gguf_stack,
               name, parts.size());
    parts.push_back(p.get());
  }
  return out;
}

// The tensor's shape as kiln and Hugging Face write it (outermost first): a stack of n
// parts [rows, cols] is [n, rows, cols].
std::vector<int64_t> gguf_shape(const GgufTensor& t) {
  std::vector<int64_t> shape;
  if (t.parts.size() > 1) shape.push_back(static_cast<int64_t>(t.parts.size()));
  const Shape part = t.parts.front()->shape();
  for (int i = 0; i < part.rank(); ++i) shape.push_back(part[i]);
  return shape;
}

}  // namespace

GgufExportReport export_gguf(const std::string& model_path, const std::string& out_path,
                             const GgufExportOptions& options) {
  const std::string dir = resolve_model_dir(model_path);
  check_output_apart_from_input(dir, out_path, "export");
  // Before the work: the rename into place at the end said "cannot rename ...: Success".
  KILN_CHECK(!fs::is_directory(out_path), "export", "{}: is a directory; the output is a .gguf file", out_path);
  LoadedModel loaded = load_for_inference(dir, 1);  // a checkpoint's checksums, shapes, finite weights
  const Config config = load_config((fs::path(dir) / "config.toml").string());
  const ModelConfig& m = config.model;
  const HfArch arch = choose_hf_arch(m);
  const std::vector<int64_t> order = rope_dim_order(arch, m.head_dim, rotary_dims(m));
  const std::string& type = options.type;
  KILN_CHECK(type == "f32" || type == "bf16" || type == "q8_0", "export", "--type '{}': expected f32, bf16 or q8_0",
             type);

  GgufExportReport report;
  report.arch = std::string(gguf_architecture(arch));
  const std::string a = report.arch;
  GgufWriter w;
  w.set("general.architecture", a);
  w.set("general.type", std::string("model"));
  w.set("general.name", m.name);
  w.set("general.file_type", uint32_t(type == "f32" ? 0 : type == "bf16" ? 32 : 7));
  w.set("general.quantization_version", uint32_t(2));
  // The components' fields (nn/export_config.h), refused before anything is written;
  // integers are llama.cpp's uint32, floats its float32.
  json fields = json::object();
  ExportConfig out(ExportConfig::Format::gguf, std::string(hf_model_type(arch)), a, m.layers, fields);
  loaded.model->backbone().export_config(out);
  loaded.model->head().export_config(out);
  for (const auto& [key, value] : fields.items()) {
    if (value.is_number_integer()) w.set(key, static_cast<uint32_t>(value.get<int64_t>()));
    else if (value.is_number_float()) w.set(key, value.get<float>());
    else if (value.is_boolean()) w.set(key, value.get<bool>());
    else if (value.is_array() && !value.empty() && value[0].is_boolean()) w.set(key, value.get<std::vector<bool>>());
    else fail("export", "internal: GGUF field '{}' = {} has no GGUF type here", key, value.dump());
  }

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

  for (const auto& p : loaded.model->parameters()) report.training_only += p->training_only() ? 1 : 0;
  for (const GgufTensor& tensor : gguf_tensors(*loaded.model)) {
    std::vector<float> x;
    for (const Parameter* p : tensor.parts) {
      std::vector<float> part = host_floats(p->value());
      part = gguf_order(std::move(part), *p, order, false);
      x.insert(x.end(), part.begin(), part.end());
    }
    if (stores_gain_offset(arch, tensor.name))
      for (float& v : x) v += 1.0f;
    const std::vector<int64_t> shape = gguf_shape(tensor);
    // A router stays f32 at every type, as llama.cpp's converter and quantizer keep
    // ffn_gate_inp: its logits choose the experts.
    const bool router = tensor.name.ends_with("ffn_gate_inp.weight");
    GgmlType t = GgmlType::f32;
    if (shape.size() >= 2 && !router && type == "bf16") t = GgmlType::bf16;
    if (shape.size() >= 2 && !router && type == "q8_0" && shape.back() % kQ8_0Block == 0) t = GgmlType::q8_0;
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
    w.add_tensor(tensor.name, t, shape, std::move(bytes));
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
  const std::vector<int64_t> order = rope_dim_order(arch, m.head_dim, rotary_dims(m));
  const auto& file_arch = std::get<std::string>(file.get("general.architecture"));
  KILN_CHECK(file_arch == gguf_architecture(arch), "gguf", "{}: architecture '{}', this model exports as '{}'", path,
             file_arch, gguf_architecture(arch));
  std::set<std::string> expected;
  for (const GgufTensor& tensor : gguf_tensors(model)) {
    expected.insert(tensor.name);
    const auto& info = file.tensor(tensor.name);
    KILN_CHECK(info.shape == gguf_shape(tensor), "gguf", "{}: tensor '{}' has the wrong shape", path, tensor.name);
    const std::vector<float> all = file.read_f32(tensor.name);
    size_t at = 0;
    for (const Parameter* p : tensor.parts) {
      const Tensor value = p->value();
      KILN_CHECK(value.dtype() == DType::f32, "gguf", "load into an f32 model");
      std::vector<float> x(all.begin() + static_cast<std::ptrdiff_t>(at),
                           all.begin() + static_cast<std::ptrdiff_t>(at + static_cast<size_t>(value.numel())));
      at += static_cast<size_t>(value.numel());
      if (stores_gain_offset(arch, tensor.name))
        for (float& v : x) v -= 1.0f;
      x = gguf_order(std::move(x), *p, order, true);
      Tensor host(x.data(), DType::f32, Device::cpu, value.shape());
      copy_tensor(host, value);
    }
  }
  for (const auto& t : file.tensors())
    KILN_CHECK(expected.count(t.name), "gguf", "{}: tensor '{}' does not belong to this model", path, t.name);
}

}  // namespace kiln::io
