// Device helpers shared by the stage-4 kernels (dhu_sm90_regstate.cuh, dhu_sm100.cu): exp2 as
// fla computes it, the accumulator fragment geometry both kernels' epilogues use,
// shared-memory access by address, 16-bit packing, synchronization wrappers that
// also order the compiler, and a CTA's sequence extent (packed batches checked on the
// device).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>

#include "dhu_layout.h"
#include "dhu_params.h"

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
  // (Host and device: scripts/build/layout_check_regstate.cu checks it on the CPU.)
  __host__ __device__ __forceinline__ explicit FragGeom(int t)
      : row0((t >> 5) * 16 + ((t & 31) >> 2)), col0(2 * (t & 3)), xr(uint32_t((t & 31) >> 2)) {}
  // Row and column of element i (of a 64-row block).
  __host__ __device__ __forceinline__ int row(int i) const { return row0 + 8 * ((i >> 1) & 1); }
  __host__ __device__ __forceinline__ int col(int i) const { return 8 * (i >> 2) + col0; }
  // Byte offset of elements i, i + 1 in a sw128 [64 rows][64 cols] 16-bit tile.
  __host__ __device__ __forceinline__ uint32_t sw(int i) const {
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

// blockIdx.z read afresh (volatile: not merged with earlier reads), for code past a
// warp-role split whose side has few registers: a value kept from before the split
// would stay live (or spill) across it.
__device__ __forceinline__ int ctaid_z() {
  uint32_t z;
  asm volatile("mov.u32 %0, %%ctaid.z;" : "=r"(z));
  return int(z);
}

// ---------------------------------------------------------------- sequence extent

// The batch row that holds sequence n's tokens: n in a dense batch, 0 in a packed one.
// From ctaid_z() and the flags it is uniform to ptxas, so a TMA coordinate made from it
// needs no per-thread register (see dhu_sm90_regstate.cuh's dv2 store).
__device__ __forceinline__ int batch_row(const DhuParams& p, int n) { return (p.flags & FLAG_VARLEN) ? 0 : n; }

// One CTA's sequence: tokens [bos, bos + len) of batch row b_row, dh chunk rows
// [boh, boh + nc). ok = false: the sequence's cu_seqlens / chunk_offsets entries failed
// a check (src/varlen.rs lists them); the CTA must only poison_sequence and return.
// A segment of a sequence split (seg_chunks > 0) is a sequence of its own: its tokens,
// its dh rows.
struct SeqExtent {
  int64_t bos;
  int64_t len;
  int64_t boh;
  int b_row;
  int nc;
  bool ok;

  // Through shared memory (16-byte aligned: `load` reads it as two 16-byte vectors;
  // SMEM_BYTES): a kernel whose roles split with few registers on one side stores it once
  // (one thread, before a CTA barrier) and each role loads it after the split.
  static constexpr int SMEM_BYTES = SEQ_EXTENT_BYTES;  // dhu_layout.h: the host sizes shared memory with it
  __device__ __forceinline__ void store(uint8_t* at) const {
    int64_t* w = reinterpret_cast<int64_t*>(at);
    w[0] = bos;
    w[1] = len;
    w[2] = boh;
    w[3] = int64_t((uint64_t(uint32_t(b_row)) << 32) | (uint64_t(uint32_t(nc)) << 1) | uint64_t(ok));
  }
  // `at`: the shared-memory address (after a barrier that follows the store).
  __device__ __forceinline__ static SeqExtent load(uint32_t at) {
    uint32_t r[8];
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(at)
                 : "memory");
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[4]), "=r"(r[5]), "=r"(r[6]), "=r"(r[7])
                 : "r"(at + 16)
                 : "memory");
    SeqExtent e;
    e.bos = int64_t((uint64_t(r[1]) << 32) | r[0]);
    e.len = int64_t((uint64_t(r[3]) << 32) | r[2]);
    e.boh = int64_t((uint64_t(r[5]) << 32) | r[4]);
    e.b_row = int(r[7]);
    e.nc = int(r[6] >> 1);
    e.ok = r[6] & 1;
    return e;
  }
};

__device__ __forceinline__ int64_t ld_index(const void* table, int64_t i, bool is32) {
  return is32 ? int64_t(static_cast<const int32_t*>(table)[i]) : static_cast<const int64_t*>(table)[i];
}

// ceil(len / BT) for len >= 0 (and some value for garbage: callers check bounds).
__device__ __forceinline__ int64_t chunks_of(int64_t len) { return (len + BT - 1) >> LOG2_BT; }

// First error wins; the details are written before the code (see DhuError).
__device__ __forceinline__ void report_input_error(const DhuParams& p, uint32_t code, int64_t seq, int64_t a,
                                                   int64_t b) {
  DhuError* e = p.error;
  if (e == nullptr) return;
  if (atomicCAS(&e->claim, 0u, 1u) != 0u) return;
  e->seq = seq;
  e->a = a;
  e->b = b;
  e->T = p.T;
  e->NT = p.NT;
  __threadfence_system();
  atomicExch(&e->code, code);
  __threadfence_system();
}

// The extent of sequence n, checked. Called by all NTHREADS threads of the CTA before
// their roles split (it synchronizes the CTA when the chunk offsets are summed here);
// `scratch`: 33 int64 of shared memory, free until the CTA's next barrier. Thread 0
// reports a failure. Dense batches: row n, all T tokens, no check.
// SEG_REV: the launch's segments in reverse blockIdx.y order (segment j at blockIdx.y / HV =
// segments - 1 - j), so that a stage-4 first pass dispatches its live segment first.
template <int NTHREADS, bool SEG_REV = false>
__device__ __forceinline__ SeqExtent sequence_extent(const DhuParams& p, int n, int64_t* scratch) {
  static_assert(NTHREADS % 32 == 0 && NTHREADS <= 1024, "whole warps");
  SeqExtent e;
  if (!(p.flags & FLAG_VARLEN)) {
    if (p.seg_chunks > 0) {
      // Segment seg_first + blockIdx.y / HV of row n (SEG_REV: counted from the launch's
      // last): seg_chunks chunks (the last segment up to T; the planner makes every segment
      // non-empty).
      const int j = SEG_REV ? int(gridDim.y) / p.HV - 1 - int(blockIdx.y) / p.HV : int(blockIdx.y) / p.HV;
      const int64_t c0 = int64_t(p.seg_first + j) * p.seg_chunks;
      e.bos = c0 * BT;
      e.len = min(int64_t(p.seg_chunks) * BT, p.T - e.bos);
      e.boh = int64_t(n) * p.NT + c0;
    } else {
      e.bos = 0;
      e.len = p.T;
      e.boh = int64_t(n) * p.NT;
    }
    e.b_row = batch_row(p, n);
    e.nc = int(chunks_of(e.len));
    e.ok = true;
    return e;
  }
  const bool cu32 = p.flags & FLAG_CU_I32;
  const int64_t bos = ld_index(p.cu_seqlens, n, cu32);
  const int64_t eos = ld_index(p.cu_seqlens, n + 1, cu32);
  int64_t first, next = 0;
  const bool given = p.chunk_offsets != nullptr;
  if (given) {
    const bool o32 = p.flags & FLAG_OFFSETS_I32;
    first = ld_index(p.chunk_offsets, n, o32);
    next = ld_index(p.chunk_offsets, n + 1, o32);
  } else {
    // first = sum over i < n of chunks(cu[i + 1] - cu[i]): a CTA-wide sum (cu_seqlens is
    // small and shared by every CTA, so these loads hit L2).
    int64_t part = 0;
    for (int i = threadIdx.x; i < n; i += NTHREADS)
      part += chunks_of(ld_index(p.cu_seqlens, i + 1, cu32) - ld_index(p.cu_seqlens, i, cu32));
    for (int o = 16; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = part;
    __syncthreads();
    if (threadIdx.x == 0) {
      int64_t total = 0;
      for (int w = 0; w < NTHREADS / 32; ++w) total += scratch[w];
      scratch[32] = total;
    }
    __syncthreads();
    first = scratch[32];
  }
  const int64_t nc = chunks_of(eos - bos);
  uint32_t code = 0;
  int64_t a = 0, b = 0;
  if (n == 0 && bos != 0) {
    code = DHU_ERR_FIRST_OFFSET, a = bos;
  } else if (bos < 0 || eos < bos) {
    code = DHU_ERR_DECREASING, a = bos, b = eos;
  } else if (eos > p.T) {
    code = DHU_ERR_PAST_T, a = eos;
  } else if (given && ((n == 0 && first != 0) || first < 0 || next - first != nc)) {
    code = DHU_ERR_OFFSETS, a = first, b = next;
  } else if (first < 0 || first > int64_t(p.NT) - nc) {
    code = DHU_ERR_PAST_NT, a = first, b = nc;
  }
  if (code != 0 && threadIdx.x == 0) report_input_error(p, code, n, a, b);
  e.bos = bos;
  e.len = eos - bos;
  e.boh = first;
  e.b_row = batch_row(p, n);
  e.nc = code == 0 ? int(nc) : 0;
  e.ok = code == 0;
  return e;
}

// A failed sequence's outputs, for this CTA's value head hv and V columns [v0, v0 + ncols):
// dh0 (n < N always), and the dh and dv2 rows its entries bound, clipped to dh's NT
// rows and to [0, T), all NaN. Nothing else is stored. Every thread of the CTA calls it.
template <int K, class T, bool SVF>
__device__ __forceinline__ void poison_sequence(const DhuParams& p, const SeqExtent& e, int n, int hv, int v0,
                                                int ncols, int tid, int nthreads) {
  const float nan = __int_as_float(0x7fc00000);
  const T tnan = T(nan);
  const int64_t nh = int64_t(n) * p.HV + hv;
  if (p.flags & FLAG_DH0) {
    for (int i = tid; i < K * ncols; i += nthreads) {
      const int k = i / ncols, v = v0 + i % ncols;
      p.dh0[SVF ? (nh * p.V + v) * K + k : (nh * K + k) * p.V + v] = nan;
    }
  }
  // dh rows [boh, boh + chunks(len)) within [0, NT), when the entries bound any.
  const int64_t len = e.len > 0 ? e.len : 0;
  const int64_t r0 = e.boh < 0 ? 0 : e.boh;
  const int64_t r1 = e.boh > int64_t(p.NT) - chunks_of(len) ? int64_t(p.NT) : e.boh + chunks_of(len);
  T* dh = reinterpret_cast<T*>(p.dh);
  for (int64_t r = r0; r < r1; ++r) {
    for (int i = tid; i < K * ncols; i += nthreads) {
      const int k = i / ncols, v = v0 + i % ncols;
      const int64_t rh = r * p.HV + hv;
      dh[SVF ? (rh * p.V + v) * K + k : (rh * K + k) * p.V + v] = tnan;
    }
  }
  // dv2 rows [bos, bos + len) within [0, T).
  const int64_t t0 = e.bos < 0 ? 0 : e.bos;
  const int64_t t1 = e.bos + len > p.T || e.bos + len < e.bos ? p.T : e.bos + len;
  T* dv2 = reinterpret_cast<T*>(p.dv2);
  for (int64_t t = t0; t < t1; ++t) {
    for (int i = tid; i < ncols; i += nthreads) dv2[(t * p.HV + hv) * p.V + v0 + i] = tnan;
  }
}

}  // namespace kda_dhu
