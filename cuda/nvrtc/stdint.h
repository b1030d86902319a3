// Stands in for the C library's stdint.h when build.rs compiles with NVRTC (which has
// none): CCCL's <cuda/std/cstdint> declares int32_t, uint64_t, ... in the global
// namespace under NVRTC.
#pragma once

#if !defined(__CUDACC_RTC__)
#error "cuda/nvrtc/ is for NVRTC only: other compilers use the C library's stdint.h"
#endif

#include <cuda/std/cstdint>
