// Fuzz target: io::SafetensorsFile::open, the reader of every checkpoint, saved model and
// imported Hugging Face model. A file that opens must be consistent: each tensor's bytes
// lie inside the file, its byte count is its element count times the element size, and
// read_tensor() converts it (or refuses with a kiln::Error: rank above 4, an i64 that
// does not fit an i32).
#include "../fuzz_target.h"

#include "io/safetensors.h"

#include <cstring>
#include <optional>

KILN_FUZZ_TARGET(safetensors) {
  using namespace kiln;
  const std::string path = fuzz::scratch_file("model.safetensors", input);
  std::optional<io::SafetensorsFile> file;
  if (!fuzz::accepts([&] { file.emplace(io::SafetensorsFile::open(path)); })) return;
  uint64_t header_len = 0;
  std::memcpy(&header_len, input.data(), 8);
  const uint64_t data_size = input.size() - 8 - header_len;
  for (const std::string& name : file->names()) {
    const io::TensorInfo& info = file->info(name);
    KILN_FUZZ_CHECK(info.begin <= info.end && info.end <= data_size, "tensor bytes outside the data section");
    KILN_FUZZ_CHECK(static_cast<uint64_t>(info.numel()) * dtype_size(info.dtype) == info.nbytes(),
                    "tensor byte count differs from its shape");
    (void)info.shape_str();
    const DType as = info.dtype == DType::i32 || info.dtype == DType::i64 ? DType::i32 : DType::f32;
    fuzz::accepts([&] { io::read_tensor(*file, name, as); });
  }
  for (const auto& [key, value] : file->metadata()) (void)file->metadata(key);
}
