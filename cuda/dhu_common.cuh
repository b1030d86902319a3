// Device helpers shared by the stage-4 kernels (dhu_sm90.cu, dhu_sm100.cu): exp2 as
// fla computes it, the accumulator fragment geometry both kernels' epilogues use,
// shared-memory access by address, 16-bit packing, and synchronization wrappers that
// also order the compiler.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>

namespace kda_dhu {

// exp2 as fla's Triton kernels compute it (ex2.approx.f32).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Where an element of a 64-row f32 accumulator block lives, as held by the 128 threads
// of a warpgroup: the wgmma m64nNk16 D fragment (PTX ISA) on sm_90, and the same
// geometry read out of tensor memory by tcgen05.ld.16x256b on sm_100. Thread t (warp
// w = t / 32 within the warpgroup, lane l) holds, for j in [0, N/8), h in {0, 1}, c in
// {0, 1}, element i = 4j + 2h + c at row 16w + l/4 + 8h and column 8j + 2(l%4) + c.
// So each thread owns column pairs, and its rows are all congruent to l/4 mod 8: in a
// 128-byte-swizzled [row][64] 16-bit tile (TMA SWIZZLE_128B == CuTe's SW128 atoms),
// where the 16-byte chunk index is XORed with row % 8, the XOR term is one per thread.
struct FragGeom {
  int row0;      // 16w + l/4
  int col0;      // 2 (l % 4)
  uint32_t xr;   // l / 4: the swizzle's row term for every row this thread owns
  __device__ __forceinline__ explicit FragGeom(int t)
      : row0((t >> 5) * 16 + ((t & 31) >> 2)), col0(2 * (t & 3)), xr(uint32_t((t & 31) >> 2)) {}
  // Row and column of element i (of a 64-row block).
  __device__ __forceinline__ int row(int i) const { return row0 + 8 * ((i >> 1) & 1); }
  __device__ __forceinline__ int col(int i) const { return 8 * (i >> 2) + col0; }
  // Byte offset of elements i, i + 1 in a sw128 [64 rows][64 cols] 16-bit tile.
  __device__ __forceinline__ uint32_t sw(int i) const {
    return uint32_t(row(i)) * 128u + ((uint32_t(i >> 2) ^ xr) << 4) + uint32_t(col0) * 2u;
  }
};

// Synchronization. CUTLASS's mbarrier and named-barrier asm statements carry no
// "memory" clobber; these wrappers add compiler barriers, so that no shared-memory
// access of the C++ code moves across a wait, an arrive or a barrier at compile time
// (the hardware ordering is the instructions' own).
__device__ __forceinline__ void compiler_fence() { asm volatile("" ::: "memory"); }
__device__ __forceinline__ void wait_bar(uint64_t* bar, uint32_t parity) {
  cutlass::arch::ClusterBarrier::wait(bar, parity);
  compiler_fence();
}
__device__ __forceinline__ void arrive_bar(uint64_t* bar) {
  compiler_fence();
  cutlass::arch::ClusterBarrier::arrive(bar);
}
__device__ __forceinline__ void named_sync(uint32_t num_threads, uint32_t barrier_id) {
  compiler_fence();
  cutlass::arch::NamedBarrier::sync(num_threads, barrier_id);
  compiler_fence();
}
// Generic-proxy smem writes -> visible to the async proxy (MMA operand reads, TMA stores).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

template <class T> __device__ __forceinline__ uint32_t pack2(float a, float b);
template <> __device__ __forceinline__ uint32_t pack2<cutlass::bfloat16_t>(float a, float b) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <> __device__ __forceinline__ uint32_t pack2<cutlass::half_t>(float a, float b) {
  __half2 v = __floats2half2_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <class T> __device__ __forceinline__ float2 unpack2(uint32_t u);
template <> __device__ __forceinline__ float2 unpack2<cutlass::bfloat16_t>(uint32_t u) {
  return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&u));
}
template <> __device__ __forceinline__ float2 unpack2<cutlass::half_t>(uint32_t u) {
  return __half22float2(*reinterpret_cast<__half2*>(&u));
}

// Shared memory by 32-bit address (volatile, with a memory clobber: never cached in
// registers across a barrier, never reordered with the synchronization above).
__device__ __forceinline__ void st_shared_u32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}
__device__ __forceinline__ void st_shared_u16(uint32_t addr, uint16_t v) {
  asm volatile("st.shared.u16 [%0], %1;" ::"r"(addr), "h"(v) : "memory");
}
__device__ __forceinline__ uint32_t ld_shared_u32(uint32_t addr) {
  uint32_t v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ float ld_shared_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ void st_shared_v4(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}
__device__ __forceinline__ void st_shared_v4(uint32_t addr, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  st_shared_v4(addr, make_uint4(a, b, c, d));
}
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

}  // namespace kda_dhu
