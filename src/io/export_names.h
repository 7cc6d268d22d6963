// A parameter's names in the stock formats, as its component gave them (nn/parameter.h's
// ParamName): the exporters and the importer walk the model's parameters and ask these,
// so no table here repeats a component's layout.
#pragma once

#include "nn/parameter.h"

#include <string>

namespace kiln::io {

// Its Hugging Face tensor name; throws "[hf] parameter '...' has no Hugging Face name"
// when its component gave none (a component no stock class holds).
const std::string& hf_name(const Parameter& p);
// Its llama.cpp GGUF tensor name; throws likewise.
const std::string& gguf_name(const Parameter& p);

}  // namespace kiln::io
