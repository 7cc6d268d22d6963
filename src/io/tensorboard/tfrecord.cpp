#include "io/tensorboard/tfrecord.h"

#include "core/crc32c.h"

#include <cstdint>

namespace kiln::io {

namespace {

void append_le(std::string& out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xFFu));
}

}  // namespace

std::string tfrecord(std::string_view data) {
  std::string out;
  out.reserve(data.size() + 16);
  append_le(out, data.size(), 8);
  append_le(out, masked_crc32c(out), 4);  // of the 8 length bytes
  out.append(data);
  append_le(out, masked_crc32c(data), 4);
  return out;
}

}  // namespace kiln::io
