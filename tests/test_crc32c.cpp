// CRC-32C (core/crc32c.h), the checksum of TensorBoard's TFRecord framing: RFC 3720's
// vectors and TFRecord's masking.
#include "core/crc32c.h"

#include <gtest/gtest.h>

#include <string>

namespace kiln {

// RFC 3720 B.4's CRC-32C vectors, the classic check value ("123456789"), and TFRecord's
// masking.
TEST(Crc32c, MatchesRfc3720Vectors) {
  std::string ascending(32, '\0'), descending(32, '\0');
  for (int i = 0; i < 32; ++i) ascending[i] = static_cast<char>(i), descending[i] = static_cast<char>(31 - i);
  EXPECT_EQ(crc32c(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(crc32c(std::string(32, '\xFF')), 0x62A8AB43u);
  EXPECT_EQ(crc32c(ascending), 0x46DD794Eu);
  EXPECT_EQ(crc32c(descending), 0x113FDB5Cu);
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(crc32c(""), 0u);
  // Masked, as the tensorboard package's masked_crc32c computes them: "123456789", the
  // length field of an empty record (8 zero bytes), nothing.
  EXPECT_EQ(masked_crc32c("123456789"), 0xC78AB0E5u);
  EXPECT_EQ(masked_crc32c(std::string(8, '\0')), 0x07980329u);
  EXPECT_EQ(masked_crc32c(""), 0xA282EAD8u);
}

}  // namespace kiln
