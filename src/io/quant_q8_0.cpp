#include "io/quant_q8_0.h"

#include "core/dtype.h"
#include "core/error.h"

#include <cmath>
#include <cstring>

namespace kiln::io {

std::vector<uint8_t> quantize_q8_0(const float* x, int64_t n) {
  KILN_CHECK(n % kQ8_0Block == 0, "q8_0", "{} values are not a whole number of {}-value blocks", n, kQ8_0Block);
  const int64_t blocks = n / kQ8_0Block;
  std::vector<uint8_t> out(static_cast<size_t>(blocks) * kQ8_0BlockBytes);
  for (int64_t b = 0; b < blocks; ++b) {
    const float* v = x + b * kQ8_0Block;
    float amax = 0;
    for (int64_t j = 0; j < kQ8_0Block; ++j) amax = std::max(amax, std::fabs(v[j]));
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    uint8_t* block = out.data() + static_cast<size_t>(b) * kQ8_0BlockBytes;
    const uint16_t dh = float_to_f16(d);
    std::memcpy(block, &dh, 2);  // little-endian host
    for (int64_t j = 0; j < kQ8_0Block; ++j) {
      const auto q = static_cast<int8_t>(std::roundf(v[j] * id));
      std::memcpy(block + 2 + j, &q, 1);
    }
  }
  return out;
}

void dequantize_q8_0(const uint8_t* blocks, int64_t n, float* out) {
  KILN_CHECK(n % kQ8_0Block == 0, "q8_0", "{} values are not a whole number of {}-value blocks", n, kQ8_0Block);
  for (int64_t b = 0; b < n / kQ8_0Block; ++b) {
    const uint8_t* block = blocks + static_cast<size_t>(b) * kQ8_0BlockBytes;
    uint16_t dh;
    std::memcpy(&dh, block, 2);
    const float d = f16_to_float(dh);
    for (int64_t j = 0; j < kQ8_0Block; ++j) {
      int8_t q;
      std::memcpy(&q, block + 2 + j, 1);
      out[b * kQ8_0Block + j] = static_cast<float>(q) * d;
    }
  }
}

}  // namespace kiln::io
