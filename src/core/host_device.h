// KILN_HOST_DEVICE marks a function compiled for both the CPU and the GPU: headers of
// arithmetic that the CPU reference and the CUDA kernels share, so both give the same bits.
#pragma once

#ifdef __CUDACC__
#define KILN_HOST_DEVICE __host__ __device__
#else
#define KILN_HOST_DEVICE
#endif
