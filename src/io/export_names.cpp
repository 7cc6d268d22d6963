#include "io/export_names.h"

#include "core/error.h"

namespace kiln::io {

const std::string& hf_name(const Parameter& p) {
  KILN_CHECK(!p.names().hf.empty(), "hf", "parameter '{}' has no Hugging Face name (no stock class holds it)",
             p.name());
  return p.names().hf;
}

const std::string& gguf_name(const Parameter& p) {
  KILN_CHECK(!p.names().gguf.empty(), "gguf", "parameter '{}' has no llama.cpp tensor name", p.name());
  return p.names().gguf;
}

}  // namespace kiln::io
