// TFRecord framing, the container of TensorBoard event files: each record is
//   uint64 length (little-endian) | uint32 masked CRC-32C of those 8 bytes |
//   data | uint32 masked CRC-32C of data
// so a reader finds the record boundaries and detects a torn or damaged record.
#pragma once

#include <string>
#include <string_view>

namespace kiln::io {

// `data` framed as one record.
std::string tfrecord(std::string_view data);

}  // namespace kiln::io
