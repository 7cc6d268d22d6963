// ggml's Q8_0 quantization: blocks of 32 values, each stored as an fp16 scale d followed by
// 32 int8 q, with x ~= d * q. Bit-exact with ggml's quantize_row_q8_0_ref (and gguf-py):
//   d = max|x| / 127;  q = roundf(x / d) computed as roundf(x * (1/d));  d stored as fp16.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kiln::io {

inline constexpr int64_t kQ8_0Block = 32;
inline constexpr size_t kQ8_0BlockBytes = 2 + 32;

// n % 32 == 0 (throws otherwise); returns n / 32 blocks of 34 bytes.
std::vector<uint8_t> quantize_q8_0(const float* x, int64_t n);
// blocks: n / 32 blocks; writes n floats.
void dequantize_q8_0(const uint8_t* blocks, int64_t n, float* out);

}  // namespace kiln::io
