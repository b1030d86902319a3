// The host/device ABI of every stage-4 kernel: one struct, passed by value as a
// `__grid_constant__` kernel parameter. src/abi.rs mirrors it field for field
// (#[repr(C)], same order, same sizes); a change here is a change there.
//
// Grid: blockIdx.x = V tile (BV = 64 columns of V), blockIdx.y = value head hv,
//       blockIdx.z = sequence n (batch index b without cu_seqlens).
// A sequence split (seg_chunks > 0, dense batches, sm_90a): blockIdx.y = j * HV + hv runs
// segment seg_first + j of batch row blockIdx.z, the chunks [s * seg_chunks, (s + 1) *
// seg_chunks) of that row; the passes and their buffers: src/split.rs (DESIGN.md, "The
// state scan as an affine map").
//
// Tensor maps (built on the host with cuTensorMapEncodeTiled, 128-byte swizzle,
// 16-bit elements, dims listed innermost first):
//   tma_q, tma_k : q, k  [B, T, H, K]    dims (K, H, T, B)     box (64, 1, 64, 1)
//   tma_w        : w     [B, T, HV, K]   dims (K, HV, T, B)    box (64, 1, 64, 1)
//   tma_do       : do    [B, T, HV, V]   dims (V, HV, T, B)    box (64, 1, 64, 1)
//   tma_dv       : dv    [B, T, HV, V]   dims (V, HV, T, B)    box (64, 1, 64, 1)
//   tma_dv2      : dv2   [B, T, HV, V]   dims (V, HV, T, B)    box (64, 1, 64, 1)  (store)
//   tma_dh       : dh    [B, NT, HV, K, V] dims (V, K, HV, B*NT) box (64, K, 1, 1) (store)
//                  state_v_first (the _svf kernels): [B, NT, HV, V, K] dims (K, V, HV, B*NT)
//                  box (64, 64, 1, 1), K / 64 stores per checkpoint
// Rows past T read as zeros and are clipped on store (TMA's bounds), so a short
// last chunk of a dense batch needs no masking. With cu_seqlens (B == 1) the rows
// past a sequence's end belong to the next sequence: the kernel masks them itself.
//
// Packed batches (FLAG_VARLEN): cu_seqlens and chunk_offsets are read on the device only
// (no call synchronizes the host), int32 or int64 as the caller made them. Every CTA
// checks its own sequence's entries before it loads or stores anything (the conditions
// and their messages: src/varlen.rs); a CTA whose sequence fails writes NaN to its
// outputs where they have bounds, stores nothing else, and reports through `error`.
#pragma once

#include <stdint.h>
#include <cuda.h>

namespace kda_dhu {

enum DhuFlags : uint32_t {
  FLAG_G = 1u << 0,          // scalar gate g [B, T, HV] fp32 present
  FLAG_GK = 1u << 1,         // per-K gate gk [B, T, HV, K] fp32 present
  FLAG_DHT = 1u << 2,        // dht present (else b starts at zero)
  FLAG_DH0 = 1u << 3,        // dh0 wanted (h0 was given)
  FLAG_VARLEN = 1u << 4,     // cu_seqlens present, B == 1
  FLAG_CU_I32 = 1u << 5,     // cu_seqlens is int32 (else int64)
  FLAG_OFFSETS_I32 = 1u << 6,  // chunk_offsets is int32 (else int64)
};

// Input errors found on the device (packed batches), in host-mapped pinned memory, one
// record per device. A CTA claims it (claim 0 -> 1; the first error wins), writes the
// details, then `code`; the host reads `code`, then the details, and clears both.
enum DhuErrorCode : uint32_t {
  DHU_ERR_FIRST_OFFSET = 1,  // cu_seqlens[0] = a != 0
  DHU_ERR_DECREASING = 2,    // cu_seqlens[seq] = a > cu_seqlens[seq + 1] = b, or a < 0
  DHU_ERR_PAST_T = 3,        // cu_seqlens[seq + 1] = a > T
  DHU_ERR_OFFSETS = 4,       // chunk_offsets[seq], [seq + 1] = a, b: not sequence seq's chunks
  DHU_ERR_PAST_NT = 5,       // sequence seq's chunks [a, a + b) pass dh's NT rows
};

struct DhuError {
  uint32_t code;   // DhuErrorCode, 0 while none
  uint32_t claim;  // 1 once a CTA has claimed the record
  int64_t seq;
  int64_t a;
  int64_t b;
  int64_t T;       // the failing call's T and NT, for the message
  int64_t NT;
};

struct alignas(128) DhuParams {
  CUtensorMap tma_q;
  CUtensorMap tma_k;
  CUtensorMap tma_w;
  CUtensorMap tma_do;
  CUtensorMap tma_dv;
  CUtensorMap tma_dv2;
  CUtensorMap tma_dh;
  const float* g;                 // [B, T, HV] contiguous, or null
  const float* gk;                // [B, T, HV, K] contiguous, or null
  const float* dht;               // [N, HV, K, V] ([N, HV, V, K] with state_v_first), or null
  float* dh0;                     // shaped like dht, contiguous, or null
  const void* cu_seqlens;         // [N + 1] int64 / int32 (FLAG_CU_I32), or null
  const void* chunk_offsets;      // [N + 1] first chunk of each sequence in dh (int64 /
                                  // int32: FLAG_OFFSETS_I32), or null: the kernel sums them
  void* dv2;                      // [B, T, HV, V]: plain stores of partial varlen chunks
  void* dh;                       // [B, NT, HV, K, V] ([.., V, K] with state_v_first)
  int64_t T;                      // tokens per batch row (the packed length with cu_seqlens)
  int32_t NT;                     // chunks per batch row (dense); dh.shape[1] (varlen)
  int32_t H;                      // q/k heads
  int32_t HV;                     // value heads; H divides HV
  int32_t V;                      // value dim, multiple of 64
  float scale;                    // applied after the fp32 q^T do dot, as fla does
  uint32_t flags;                 // DhuFlags
  DhuError* error;                // device address of the host-mapped error record, or null
  int32_t N;                      // sequences: B, or len(cu_seqlens) - 1
  int32_t seg_chunks;             // chunks per segment of a sequence split, or 0 (no split)
  int32_t seg_first;              // the segment that blockIdx.y = hv (j = 0) runs (src/split.rs)
};

}  // namespace kda_dhu
