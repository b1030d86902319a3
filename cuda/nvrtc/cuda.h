// Stands in for the driver API header when build.rs compiles with NVRTC, which has no C
// library headers for the real cuda.h to include. The device code needs one type from
// it: CUtensorMap, the kernel parameter's TMA descriptors (64-byte aligned, 128 bytes),
// declared as cuda.h declares it. (CuTe itself includes cuda.h only outside NVRTC.)
#pragma once

#if !defined(__CUDACC_RTC__)
#error "cuda/nvrtc/ is for NVRTC only: other compilers use the CUDA toolkit's cuda.h"
#endif

#include <cuda/std/cstdint>

#define CU_TENSOR_MAP_NUM_QWORDS 16

typedef struct CUtensorMap_st {
  alignas(64) unsigned long long opaque[CU_TENSOR_MAP_NUM_QWORDS];
} CUtensorMap;
