// The MFU denominator: the dense bf16 tensor-core peak of an H100/H200 SXM (datasheet).
#pragma once

namespace kiln {

inline constexpr double kGpuPeakFlops = 989.4e12;

}  // namespace kiln
