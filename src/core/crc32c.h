// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of TFRecord framing
// (TensorBoard event files). Our own table-driven implementation of the public algorithm:
// Debian packages no C/C++ crc32c library. Checked against RFC 3720's test vectors
// (Tensorboard.Crc32c*). Not a fast path: a record of a few hundred bytes per log step.
#pragma once

#include <cstdint>
#include <string_view>

namespace kiln {

uint32_t crc32c(std::string_view bytes);

// TFRecord's masked CRC: rotated right by 15 bits plus a constant, so a CRC over data that
// holds CRCs of its own stays well distributed.
inline uint32_t masked_crc32c(std::string_view bytes) {
  const uint32_t crc = crc32c(bytes);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

}  // namespace kiln
