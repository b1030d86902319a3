// Stage 4 of fla's chunked gated delta rule backward on Hopper (sm_90a), with the state
// held transposed in registers: both products of the serial chain take their A operand
// from registers (wgmma's register-A form), so nothing on the chain waits on shared
// memory, a proxy fence or a named barrier. Its entry points are in dhu_sm90.cu.
//
// What a consumer warpgroup owns: (sequence n, value head hv, V tile of BV = 64 columns);
// it walks the sequence's chunks of BT = 64 tokens newest first. A CTA
// holds NWG = 1 or 2 of them (NWG = 2: the two V tiles of 128 columns share the stage's
// k, q, w loads, two independent chains per SM). The state gradient is kept as
// b^T [BV, K] in fp32 registers: M = BV = 64 rows (wgmma's M), N = K columns. Per chunk
// (SPEC.md's recurrence, transposed; the state is b itself, not negated):
//
//     dh[chunk]^T     = bf16(b^T)                               registers -> sBh (stmatrix) -> TMA store
//     DV^T  [BV, BT]  = bf16(b^T) [BV, K] . k^T [K, BT]         wgmma RS: A = bf16(b^T), B = k (K-major)
//     QD^T  [BV, K]   = do^T [BV, BT] . q [BT, K]             wgmma SS: A = do (MN-major), B = q (MN-major)
//     dv2^T [BV, BT]  = gate(t) * DV^T + dv^T  -> q.dtype      registers; re-packed as WD's A (K dim = BT)
//     b^T             = decay(k) * b^T + scale * QD^T           fp32 registers (scale after the dot, as fla)
//     b^T            += -(dv2^T [BV, BT] . w [BT, K])           wgmma RS into b^T, A scaled by -1 (exact)
//
//   gate(t) = exp2(g[e-1] - g[t]) with the scalar gate g, else 1 (per column t of DV^T);
//   decay(k) = exp2(gk[e-1, k]) with gk (per column k of b^T), exp2(g[e-1]) with g, else 1;
//   with g, do's rows are weighted by exp2(g[t]) in shared memory and rounded to q.dtype
//   before QD (q^T diag(e) do == (diag(e) do)^T q): do is the smaller operand. (fla keeps
//   q[t] * exp2(g[t]) in fp32 for a TF32 dot; measured within SPEC.md's bar on the H200:
//   tests/gpu/test_gpu_kernel.py, gate "g".)
//
// fla's rounding points are kept: b is rounded to q.dtype before k.b (DV's A fragment),
// dv2 is rounded before w^T.dv2 (WD's A fragment), and scale multiplies the fp32 QD
// accumulator; dv is added to the fp32 DV after the dot, as fla adds it.
//
// Fragment geometry. An m64nNk16 accumulator element i = 4j + 2h + c of thread t (warp
// w = t / 32, lane l) sits at row 16w + l/4 + 8h, column 8j + 2(l%4) + c (FragGeom in
// dhu_common.cuh); the A fragment of k-block kb (16 columns) is registers 4kb..4kb+3, each
// two 16-bit values, register 4kb + m holding elements 8kb + 2m, 8kb + 2m + 1: the same
// rows and columns. So an accumulator re-packed pairwise is the A fragment of the next
// product whose K dim is its N (as FlashAttention-3 feeds P into P.V), and ldmatrix /
// stmatrix x4 of one k-block move registers 4kb..4kb+3 (SmGeom below). Checked on the
// CPU by scripts/build/layout_check_regstate.sh.
//
// The serial chain per chunk: bf16(b) -> DV -> dv2 -> fold -> WD -> bf16(b): two wgmma
// batches, the dv2 epilogue and the fold. Chunk i issues its own QD_i right behind DV_i, so
// the tensor pipe runs DV_i, QD_i, WD_i and QD_i runs during the dv2 epilogue instead of
// between DV_i and WD_i; the fold (decay . b + scale . QD_i, fla's order) follows QD_i's
// completion and precedes WD_i's issue. DV's accumulator starts from zero and the epilogue
// adds dv^T (loaded while DV_i runs). While DV_i runs the warps stage bf16(b) (and, one
// warpgroup or K = 64, the previous chunk's dv2) and issue the TMA stores; while WD_i runs,
// the next stage's wait. No wgmma group stays in flight across the loop's back edge: ptxas
// serializes every wgmma of the kernel otherwise (C7514/C7518). Pipeline and buffer reuse:
// docs/dhu_sm90_regstate_pipeline.md.
//
// Warp roles (NWG = 1: 160 threads; NWG = 2: 384, the producer a whole
// warpgroup so that setmaxnreg can hand its registers to the consumers):
//   warpgroup wg < NWG  consumers of V tile wg: all wgmma, the fp32 recurrence, the
//                       epilogues, TMA stores (issued by the warpgroup's thread 0)
//   next warp           producer: TMA loads of a stage (k, q, w, NWG do and dv tiles), then
//                       the gate vectors from plain loads made three chunks ahead (NWG = 1;
//                       one with NWG = 2), so that their DRAM round trip is off the stage's
//                       critical path: exp2(gk[e-1]) per K column, exp2(g[e-1] - g[t]),
//                       exp2(g[t]), exp2(g[e-1])
//
// Operand majors (shared-memory tiles exactly as TMA wrote them, 128-byte swizzled):
//   k     [t][k]  K/64 boxes of [64 t][64 k]  B of DV (N = t, K dim = k): K-major
//   q, w  [t][k]  same bytes                  B of QD / WD (N = k, K dim = t): MN-major
//   do    [t][v]  [64 t][64 v]                A of QD (M = v, K dim = t): MN-major
//   dv    [t][v]  [64 t][64 v]                ldmatrix.trans into DV's accumulator order
//   dv2   [t][v]  [64 t][64 v]                stmatrix.trans from WD's A fragment (TMA store source)
//   sBh   [k][v]  [K rows k][64 v]            stmatrix.trans from DV's A fragment: the [K, V] dh box
//         (SVF, state_v_first: [K/64 boxes][64 v][64 k], stmatrix: the [V, K] checkpoint's boxes)
// Why: the register forms need A K-major in registers, which is the state's and dv2's
// accumulator layout once the state is transposed (M = V); every B operand and QD's A
// are the tiles as TMA loads them, so no operand is rewritten for the tensor core.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "dhu_common.cuh"
#include "dhu_layout.h"
#include "dhu_params.h"

// Compile-time experiments, off in every release build: build.rs defines them from
// KDA_DHU_KERNEL_DEFINES for a wheel of their own, measured against the plain build with
// benches/build_ab.py (benches/NOTES.md has each one's command and result).
//   KDA_DHU_EXP_GK_ONLY     the instances without g (G = false) assume gk: the ungated
//                           path's code left out (an ungated call traps): what the gk
//                           branches cost.
//   KDA_DHU_EXP_DENSE_ONLY  the packed-batch code left out (a call with cu_seqlens traps):
//                           what the varlen branches cost.
//   KDA_DHU_EXP_SPLIT_LIVE  a split's first pass (SUMMARY) with a long live segment: the
//                           live CTA runs every segment on its side of the launch's (FWD:
//                           segments 0 .. seg_first; stage 4: its own to the last), while
//                           the others summarize one segment each (src/split.rs, `live`).
//                           A launch with one live segment runs as without it.
//   KDA_DHU_EXP_ABLATE      a timing probe whose results are WRONG (never a release build):
//                           bit 0: stage 4's QD not on the tensor core, its accumulator
//                           read from the stage's q and w slots by 16 LDS.128 per thread
//                           where QD is issued (what a chain CTA would spend if a partner
//                           CTA of a 2-CTA cluster computed QD and delivered it to its
//                           shared memory); bit 1: no dh staging and no dh store; bit 2:
//                           dh staged, not stored; bit 3: dh stored, not staged (sBh as it
//                           is); bit 4: no dv2 staging and no dv2 store. What each costs on
//                           the chain: benches/NOTES.md, "Ablations".
//   KDA_DHU_EXP_EARLY_DV    1: each stage's DV operand (k's slot: stage 4 k, FWD w) loaded
//                           first and behind a full barrier of its own (dv_full): a chunk's
//                           DV and the dh / dv2 staging start once that tile has landed, the
//                           rest of the stage (q, w, do, dv and the gates; FWD: k and u) is
//                           waited for after the staging (with g, stage 4 still waits for it
//                           at the end of the chunk before: its do rows are weighted there).
//                           2: also each part of a stage handed back as soon as it is read:
//                           k's slot after DV (k_empty), q, do, dv and the gates after the
//                           fold (empty), w's slot after WD (w_empty), which has a full
//                           barrier of its own too (w_full), so that the producer refills
//                           each part a chunk ahead of where the whole stage would be.
//                           What the chain gains where the consumers wait on the ring's
//                           loads (benches/NOTES.md, "DV's operand first").
//   KDA_DHU_EXP_STAMPS      a timing probe whose dh (FWD: h) is WRONG in its first 34
//                           elements (never a release build): warp 0 of CTA (0, 0, 0) of
//                           the usual instances reads the SM clock at ten points of each
//                           chunk (=2: sixteen) and lane k sums section k's cycles; at the
//                           end, once thread 0's bulk stores are complete, the lanes write
//                           the sums and NC as uint32 over dh's first 17 words
//                           (benches/chain_stamps.py reads them; benches/NOTES.md, "Where a
//                           chunk's cycles go"). No device printf: an extern call in the
//                           kernel makes ptxas serialize every wgmma.
#ifndef KDA_DHU_EXP_ABLATE
#define KDA_DHU_EXP_ABLATE 0
#endif
#ifndef KDA_DHU_EXP_STAMPS
#define KDA_DHU_EXP_STAMPS 0
#endif
#ifndef KDA_DHU_EXP_GK_ONLY
#define KDA_DHU_EXP_GK_ONLY 0
#endif
#ifndef KDA_DHU_EXP_DENSE_ONLY
#define KDA_DHU_EXP_DENSE_ONLY 0
#endif
#ifndef KDA_DHU_EXP_SPLIT_LIVE
#define KDA_DHU_EXP_SPLIT_LIVE 0
#endif

namespace kda_dhu {
namespace sm90_regstate {

using namespace cute;

// BT, BV, WG_THREADS, num_stages, num_threads, the gate vectors' offsets (G_GATE,
// G_WEIGHT, G_DECAY, G_LEN) and SmemMap (the shared memory map, in bytes from a
// 1024-aligned base; the host asks for SmemMap::DYNAMIC_BYTES): dhu_layout.h, their one owner.

#if KDA_DHU_EXP_STAMPS
// KDA_DHU_EXP_STAMPS: the sections of a chunk, each ending at its numbered point (0-9 at
// level 1; level 2 adds the fine points 10-15 inside DV's issue and the staging). Warp 0 of
// CTA (0, 0, 0) reads the clock at each point, lane k keeps section k's sum in a register
// (no memory traffic, no divergence inside the warp: a few instructions per point).
constexpr int N_STAMPS = 16;
struct Stamps {
  bool on;
  uint32_t prev, acc;
  int lane;
  __device__ __forceinline__ void start(bool enable, int lane_) {
    on = enable;
    lane = lane_;
    acc = 0;
    prev = uint32_t(clock());
  }
  template <int K> __device__ __forceinline__ void at() {
    if (K < 10 || KDA_DHU_EXP_STAMPS >= 2) {
      if (on) {
        const uint32_t t = uint32_t(clock());
        if (lane == K) acc += t - prev;
        prev = t;
      }
    }
  }
  // Lane k's sum over dh's word k, nc over word N_STAMPS, after thread 0's (the leader's)
  // bulk stores have completed their writes (wait_group without .read).
  __device__ __forceinline__ void write(void* dh, int nc) const {
    if (!on) return;
    if (lane == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    __syncwarp();
    uint32_t* out = reinterpret_cast<uint32_t*>(dh);
    if (lane < N_STAMPS) out[lane] = acc;
    if (lane == N_STAMPS) out[N_STAMPS] = uint32_t(nc);
  }
};
#define KDA_DHU_STAMP(k) stamps.template at<k>()
#else
#define KDA_DHU_STAMP(k) ((void)0)
#endif

// NWG = 2: setmaxnreg moves the producer warpgroup's registers to the consumers:
// 2 x 128 x 240 + 128 x 24 = 64512 <= 65536.
constexpr int PRODUCER_REGS_WG2 = 24;
constexpr int CONSUMER_REGS_WG2 = 240;
// Named barrier ids (0 is __syncthreads): 1 + wg for warpgroup wg's 128 threads,
// ALL_CONSUMERS for every consumer thread (NWG = 2: the shared q / w rows of a short chunk).
constexpr int ALL_CONSUMERS = 3;

// ldmatrix / stmatrix x4 of one k-block (16 columns) of a 64-row fragment: warp w's four
// 8x8 matrices m = 0..3 cover rows 16w + 8(m & 1) + [0, 8) and columns 16kb + 8(m >> 1) +
// [0, 8), register m of each thread being the fragment's register 4kb + m. Lane l gives
// the address of row l % 8 of matrix l / 8 (16 bytes). Tiles are 128-byte rows of 64
// 16-bit values, 128-byte swizzled: the 16-byte chunk index XORed with row % 8.
struct SmGeom {
  // Tiles whose rows are the fragment's columns ([t][v]: do, dv, dv2; [k][v]: the [K, V]
  // state), read / written with .trans: row 16kb + 8(m >> 1) + l % 8, chunk (2w + (m & 1))
  // ^ (l % 8). The lane's byte offset for k-block 0; k-block kb adds kb * 2048 (16 rows).
  __host__ __device__ static constexpr uint32_t trans_off(int w, int lane) {
    return uint32_t((8 * ((lane >> 3) >> 1) + (lane & 7)) * 128 + (((2 * w + ((lane >> 3) & 1)) ^ (lane & 7)) << 4));
  }
  // Tiles whose rows are the fragment's rows ([v][k]: the state_v_first state, K/64 boxes
  // of [64 v][64 k] at 8192 bytes), written without .trans: row 16w + 8(m & 1) + l % 8,
  // chunk ((16kb + 8(m >> 1)) / 8) % 8 ^ (l % 8), box kb / 4.
  __host__ __device__ static constexpr uint32_t direct_off(int w, int lane, int kb) {
    return uint32_t((kb >> 2) * 8192 + (16 * w + 8 * ((lane >> 3) & 1) + (lane & 7)) * 128 +
                    (((2 * (kb & 3) + ((lane >> 3) >> 1)) ^ (lane & 7)) << 4));
  }
};

// The wgmma atoms: m64nNk16, fp32 accumulators; RS: A K-major from registers, SS: A and
// B MN-major from shared memory (QD: do^T and q).
template <class T, int N> struct SsAtom;
template <> struct SsAtom<cutlass::bfloat16_t, 64> {
  using type = SM90_64x64x16_F32BF16BF16_SS<GMMA::Major::MN, GMMA::Major::MN>;
};
template <> struct SsAtom<cutlass::bfloat16_t, 128> {
  using type = SM90_64x128x16_F32BF16BF16_SS<GMMA::Major::MN, GMMA::Major::MN>;
};
template <> struct SsAtom<cutlass::half_t, 64> {
  using type = SM90_64x64x16_F32F16F16_SS<GMMA::Major::MN, GMMA::Major::MN>;
};
template <> struct SsAtom<cutlass::half_t, 128> {
  using type = SM90_64x128x16_F32F16F16_SS<GMMA::Major::MN, GMMA::Major::MN>;
};
template <class T, int N, GMMA::Major MB, GMMA::ScaleIn SA> struct RsAtom;
template <GMMA::Major MB, GMMA::ScaleIn SA> struct RsAtom<cutlass::bfloat16_t, 64, MB, SA> {
  using type = SM90_64x64x16_F32BF16BF16_RS<GMMA::Major::K, MB, SA>;
};
template <GMMA::Major MB, GMMA::ScaleIn SA> struct RsAtom<cutlass::bfloat16_t, 128, MB, SA> {
  using type = SM90_64x128x16_F32BF16BF16_RS<GMMA::Major::K, MB, SA>;
};
template <GMMA::Major MB, GMMA::ScaleIn SA> struct RsAtom<cutlass::half_t, 64, MB, SA> {
  using type = SM90_64x64x16_F32F16F16_RS<GMMA::Major::K, MB, SA>;
};
template <GMMA::Major MB, GMMA::ScaleIn SA> struct RsAtom<cutlass::half_t, 128, MB, SA> {
  using type = SM90_64x128x16_F32F16F16_RS<GMMA::Major::K, MB, SA>;
};

// One register-A wgmma: A = 4 registers (one k-block), B = a shared-memory descriptor,
// D = the NACC fp32 accumulator registers of the thread.
template <class Op, int NACC, size_t... I>
__device__ __forceinline__ void rs_mma_impl(const uint32_t* a, uint64_t desc_b, float (&d)[NACC],
                                            GMMA::ScaleOut scale_d, cute::index_sequence<I...>) {
  Op::fma(a[0], a[1], a[2], a[3], desc_b, d[I]..., scale_d);
}
template <class Op, int NACC>
__device__ __forceinline__ void rs_mma(const uint32_t* a, uint64_t desc_b, float (&d)[NACC], GMMA::ScaleOut scale_d) {
  rs_mma_impl<Op>(a, desc_b, d, scale_d, cute::make_index_sequence<NACC>{});
}

// One shared-memory wgmma: A and B descriptors, D = the NACC accumulator registers.
template <class Op, int NACC, size_t... I>
__device__ __forceinline__ void ss_mma_impl(uint64_t desc_a, uint64_t desc_b, float (&d)[NACC], GMMA::ScaleOut scale_d,
                                            cute::index_sequence<I...>) {
  Op::fma(desc_a, desc_b, d[I]..., scale_d);
}
template <class Op, int NACC>
__device__ __forceinline__ void ss_mma(uint64_t desc_a, uint64_t desc_b, float (&d)[NACC], GMMA::ScaleOut scale_d) {
  ss_mma_impl<Op>(desc_a, desc_b, d, scale_d, cute::make_index_sequence<NACC>{});
}

// Registers read or written by wgmma: the compiler must not move other accesses across
// the points where these are called (CUTLASS's warpgroup_fence_operand, for arrays).
template <int N> __device__ __forceinline__ void fence_regs(float (&r)[N]) {
  CUTE_UNROLL
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}
template <int N> __device__ __forceinline__ void fence_regs(uint32_t (&r)[N]) {
  CUTE_UNROLL
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(r[i])::"memory");
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t* r) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void stsm_x4_trans(uint32_t addr, const uint32_t* r) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r[0]),
               "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}
__device__ __forceinline__ void stsm_x4(uint32_t addr, const uint32_t* r) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(r[0]), "r"(r[1]),
               "r"(r[2]), "r"(r[3])
               : "memory");
}
__device__ __forceinline__ float2 ld_shared_f32x2(uint32_t addr) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(addr) : "memory");
  return v;
}

// A packed pair of 16-bit values as two floats, exactly: bf16 is the top half of an fp32
// (a shift and a mask, two instructions; unpack2's conversions take three).
template <class T> __device__ __forceinline__ float2 widen2(uint32_t u) {
  if constexpr (cute::is_same_v<T, cutlass::bfloat16_t>)
    return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
  else
    return unpack2<T>(u);
}

// The two 16-bit halves of a packed pair kept where their column (t, t + 1) is < rows.
__device__ __forceinline__ uint32_t mask_pair(uint32_t u, int t, int rows) {
  return u & ((t < rows ? 0x0000ffffu : 0u) | (t + 1 < rows ? 0xffff0000u : 0u));
}

// do rows of a [64 t][64 v] 128-byte-swizzled tile, in place, by one warpgroup: rows
// t >= rows zeroed, the others weighted by exp2(g[t]) (s_weight, rounded to T) with g.
// Generic-proxy writes: a fence.proxy.async and a barrier must follow before wgmma reads.
template <class T>
__device__ __forceinline__ void prepare_do_rows(uint32_t tile, int ctid, bool use_g, uint32_t s_weight, int rows) {
  // 64 rows x 8 chunks of 16 bytes; the swizzle permutes chunks within a row only.
  for (int j = ctid; j < BT * 8; j += 128) {
    const int row = j >> 3;
    const uint32_t a = tile + row * 128 + (j & 7) * 16;
    if (row >= rows) {
      st_shared_v4(a, make_uint4(0, 0, 0, 0));
    } else if (use_g) {
      const float e = ld_shared_f32(s_weight + row * 4);
      uint4 u = ld_shared_v4(a);
      uint32_t* w = reinterpret_cast<uint32_t*>(&u);
      CUTE_UNROLL
      for (int q = 0; q < 4; ++q) {
        const float2 f = widen2<T>(w[q]);
        w[q] = pack2<T>(f.x * e, f.y * e);
      }
      st_shared_v4(a, u);
    }
  }
}

// SUMMARY: the first pass of a sequence split (src/split.rs; NWG = 1). The launch runs
// segments seg_first + j, j = blockIdx.y / HV, with V widened by K columns: blockIdx.x
// < V / 64 are V tiles, the others identity tiles (columns of P_s). The launch's first
// segment in scan order (stage 4: its newest, j = last; FWD: its oldest, j = 0), the
// "live" one, runs as usual from dht and stores its outputs (its identity tiles exit);
// the others store nothing but their last state: from b = 0 (V tiles: u_s) and from b = I
// (identity tiles, whose do, dv and q (FWD: u) read as zeros: P_s, the product of the
// segment's A_c). Every CTA's last state goes to dh0 = the split's [.., K, V + K] buffer.
// KDA_DHU_EXP_SPLIT_LIVE: the live CTA's extent reaches the sequence's end (stage 4) or
// its start (FWD), covering the split's L live segments (src/split.rs, `Split::live`).
// Stage 4's launch segments run in reverse blockIdx.y order (j = last at blockIdx.y < HV),
// so its live CTAs are dispatched first, as FWD's are.
//
// FWD: the forward scan, fla's `chunk_gated_delta_rule_fwd_h` (SPEC.md, "The twin"):
// the same chain with the chunks oldest first and the products' roles swapped.
// The params carry the forward call: tma_w / tma_k its w and k, tma_dv its u, tma_dv2 its
// v_new, tma_dh its h, dht its initial_state (FLAG_DHT), dh0 its final_state (FLAG_DH0);
// q, do and scale unused. Per chunk, the state b^T = h^T:
//
//     h[chunk]^T   = bf16(b^T)                                registers -> sBh -> TMA store
//     -W^T [BV, BT] = -(bf16(b^T) [BV, K] . w^T [K, BT])       DV's wgmma, A scaled by -1 (exact)
//     v_new^T      = u^T + (-W^T)  (fp32: u - w.h, fla's order) -> u.dtype, stored
//     v_upd^T      = gate(t) * v_new^T (g), else v_new^T      -> k.dtype: WD's A fragment
//     b^T          = decay(k) * b^T + v_upd^T . k             the fold, then WD's wgmma (+)
//
// w sits in k's stage slot (DV's K-major B operand) and k in w's (WD's MN-major B); the q
// and do slots stay empty. No QD: DV is the only wgmma in flight at the epilogue.
template <int K, class T, int NWG, bool SVF, bool G, bool SUMMARY = false, bool FWD = false>
__device__ __forceinline__ void dhu_regstate_kernel(const DhuParams& p) {
  static_assert(!SUMMARY || NWG == 1, "a split's first pass has one warpgroup per CTA");
  // The forward scan's unsplit instances: their own ring where fwd_ring gives one (K = 128
  // with one warpgroup; dhu_layout.h); the host's launch asks the same map's bytes.
  using Map = SmemMap<K, NWG, (FWD && !SUMMARY) ? fwd_ring<K, NWG>() : 0>;
  constexpr int KB = K / 64;          // 64-wide K boxes per tile
  constexpr int CONSUMERS = NWG * WG_THREADS;
  constexpr int STAGES = Map::STAGES;
  constexpr int NS = K / 2;           // fp32 registers of b^T [64, K] per thread
  constexpr int NA = K / 4;           // registers of bf16(b^T) as an A fragment
  constexpr int ND = BT / 2;          // fp32 registers of DV^T [64, BT]
  // KDA_DHU_EXP_ABLATE's probes (stage 4's usual instances only; wrong results).
  constexpr bool ABL_QD = (KDA_DHU_EXP_ABLATE & 1) && !FWD && !SUMMARY && NWG == 1;
  constexpr bool ABL_NO_DH = (KDA_DHU_EXP_ABLATE & 2) && !FWD && !SUMMARY;
  constexpr bool ABL_NO_DH_STORE = (KDA_DHU_EXP_ABLATE & 4) && !FWD && !SUMMARY;
  constexpr bool ABL_NO_DH_STAGE = (KDA_DHU_EXP_ABLATE & 8) && !FWD && !SUMMARY;
  constexpr bool ABL_NO_DV2 = (KDA_DHU_EXP_ABLATE & 16) && !FWD && !SUMMARY;
  static_assert(!ABL_QD || NS * 4 * WG_THREADS <= 2 * Map::KTILE, "QD's probe reads the q and w slots");
  using OpDV = typename RsAtom<T, BT, GMMA::Major::K, FWD ? GMMA::ScaleIn::Neg : GMMA::ScaleIn::One>::type;
  using OpQD = typename SsAtom<T, K>::type;
  using OpWD = typename RsAtom<T, K, GMMA::Major::MN, FWD ? GMMA::ScaleIn::One : GMMA::ScaleIn::Neg>::type;
  // Chunk c of iteration i: newest first (stage 4), oldest first (FWD).
  auto chunk_of = [](int i, int nc) { return FWD ? i : nc - 1 - i; };

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  if constexpr (Map::SLACK == 0) {
    if (smem != smem_raw) __trap();
  }
  const uint32_t smem_u32 = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + Map::BAR_OFF);
  uint64_t* empty_bar = full_bar + STAGES;
  // KDA_DHU_EXP_EARLY_DV: the stage's DV operand alone (full_bar then counts the rest);
  // = 2 (EARLY_FREE): w's slot on w_full, and k's and w's slots handed back on their own
  // (empty_bar then counts q, do, dv and the gates).
  constexpr bool EARLY_DV = KDA_DHU_EXP_EARLY_DV != 0;
  constexpr bool EARLY_FREE = KDA_DHU_EXP_EARLY_DV >= 2;
  uint64_t* dv_full_bar = empty_bar + STAGES;
  uint64_t* w_full_bar = dv_full_bar + STAGES;
  uint64_t* k_empty_bar = w_full_bar + STAGES;
  uint64_t* w_empty_bar = k_empty_bar + STAGES;

  const int tid = threadIdx.x;
  // blockIdx.y = seg * HV + hv: seg is 0 unless the call is split (src/split.rs). Stage
  // 4's first pass counts seg from its last blockIdx.y row, so that its live CTAs (the
  // launch's newest segment) are dispatched first, as FWD's (segment 0) are: measured
  // 0.91 -> 0.81 ms at B1 T65536 H16 (benches/NOTES.md, "A long live segment"); with a
  // long live segment the summaries take more SMs than the live CTAs leave.
  constexpr bool SEG_REV = SUMMARY && !FWD;
  const int seg_y = int(blockIdx.y) / p.HV;
  const int hv = int(blockIdx.y) - seg_y * p.HV;
  const int seg = SEG_REV ? int(gridDim.y) / p.HV - 1 - seg_y : seg_y;
  const int n = blockIdx.z;
  // SUMMARY: whether this CTA runs the launch's live segment (with outputs: the newest,
  // FWD the oldest), and whether its tile is an identity tile (past V).
  const bool live = SUMMARY && (FWD ? seg == 0 : seg + 1 == int(gridDim.y) / p.HV);
  const bool ident = SUMMARY && int(blockIdx.x) * NWG * BV >= p.V;
  if (live && ident) return;
  const int h = hv / (p.HV / p.H);
  if (KDA_DHU_EXP_DENSE_ONLY && (p.flags & FLAG_VARLEN)) __trap();
  const bool varlen = !KDA_DHU_EXP_DENSE_ONLY && (p.flags & FLAG_VARLEN);
  // The scalar gate is the instance's (G: the host picks the `_g` entry point for a call
  // with g, FLAG_G); gk is the call's flag.
  constexpr bool use_g = G;
  constexpr bool gk_only = KDA_DHU_EXP_GK_ONLY && !G;
  if (gk_only && !(p.flags & FLAG_GK)) __trap();
  const bool use_gk = gk_only || (p.flags & FLAG_GK);

  // The sequence's extent, checked before anything is loaded or stored (scratch: stage
  // 0's first bytes, free until the barrier below), kept in shared memory across the
  // role split (values live across it would spill in the producer's few registers).
  {
    SeqExtent e = sequence_extent<num_threads<NWG>(), SEG_REV>(p, n, reinterpret_cast<int64_t*>(smem));
    if constexpr (SUMMARY && KDA_DHU_EXP_SPLIT_LIVE) {
      // The live segment reaches the sequence's start (FWD: chunks 0 .. the end of launch
      // segment 0) or its end (stage 4): with one live segment, its own extent.
      if (live) {
        if constexpr (FWD) {
          e.len = min(int64_t(p.seg_first + 1) * p.seg_chunks * BT, p.T);
          e.bos = 0;
          e.boh = int64_t(n) * p.NT;
        } else {
          e.len = p.T - e.bos;
        }
        e.nc = int(chunks_of(e.len));
      }
    }
    if (tid == 0) e.store(smem + Map::EXT_OFF);
  }
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      // Every producer lane arrives (after its own gate writes): no lane's writes are
      // published through another lane's arrival.
      cutlass::arch::ClusterTransactionBarrier::init(&full_bar[s], 32);
      cutlass::arch::ClusterBarrier::init(&empty_bar[s], CONSUMERS);
      if constexpr (EARLY_DV) cutlass::arch::ClusterTransactionBarrier::init(&dv_full_bar[s], 1);
      if constexpr (EARLY_FREE) {
        cutlass::arch::ClusterTransactionBarrier::init(&w_full_bar[s], 1);
        cutlass::arch::ClusterBarrier::init(&k_empty_bar[s], CONSUMERS);
        cutlass::arch::ClusterBarrier::init(&w_empty_bar[s], CONSUMERS);
      }
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  if (tid >= CONSUMERS) {
    // ------------------------------------------------------------------ producer warp
    if constexpr (NWG > 1) {
      cutlass::arch::warpgroup_reg_dealloc<PRODUCER_REGS_WG2>();
      if (tid >= CONSUMERS + 32) return;
    }
    const SeqExtent ext = SeqExtent::load(smem_u32 + Map::EXT_OFF);
    if (!ext.ok) return;
    // 32-bit token indices: T < 2^31 (the planner's grid clause).
    const int bos = int(ext.bos), len = int(ext.len);
    const int b_row = ext.b_row, NC = ext.nc;
    const int lane = tid - CONSUMERS;
    constexpr int KPL = K / 32;  // gk values per lane
    // An identity tile loads k and w only.
    const bool ident_p = SUMMARY && int(blockIdx.x) * NWG * BV >= p.V;
    // FWD: w and k, and u in dv's slot.
    // EARLY_DV: less the DV operand's tile, which dv_full counts; EARLY_FREE: and less w's
    // slot, which w_full counts.
    const uint32_t tx_bytes = (ident_p ? uint32_t(2 * Map::KTILE)
                               : FWD   ? uint32_t(2 * Map::KTILE + NWG * Map::VTILE)
                                       : uint32_t(3 * Map::KTILE + 2 * NWG * Map::VTILE)) -
                              (EARLY_DV ? uint32_t(Map::KTILE) : 0u) - (EARLY_FREE ? uint32_t(Map::KTILE) : 0u);
    const float* g_row = use_g ? p.g + int64_t(b_row) * p.T * p.HV + hv : nullptr;

    // One chunk's gate inputs, loaded PREFETCH chunks ahead of their use. Each set of
    // registers is refilled right after its chunk's gates are written, so no register copy
    // waits on an outstanding load: a load has PREFETCH - 1 whole iterations (each an empty
    // wait and a stage's copies) plus its own empty wait to land. With a loop-carried copy
    // (cur = nxt) the copy waited for the load issued just before it, and every iteration
    // paid a DRAM round trip before its copies were issued: below a wave that round trip,
    // not the consumers' chain, set the time per chunk. NWG = 2: the producer has 24
    // registers, one set.
    constexpr int PREFETCH = NWG == 1 ? 3 : 1;
    struct Pre {
      float gk[KPL];
      float g0, g1, g_last;
      int rows;  // tokens of the chunk
    };
    auto fetch = [&](int i, Pre& r) {
      const int c = chunk_of(i, NC);
      const int t0 = bos + c * BT;
      const int t_last = bos + min((c + 1) * BT, len) - 1;
      r.rows = t_last - t0 + 1;
      if (use_gk) {
        const float* row = p.gk + ((int64_t(b_row) * p.T + t_last) * p.HV + hv) * K + lane * KPL;
        if constexpr (KPL == 4) {
          const float4 v = *reinterpret_cast<const float4*>(row);
          r.gk[0] = v.x, r.gk[1] = v.y, r.gk[2] = v.z, r.gk[3] = v.w;
        } else {
          const float2 v = *reinterpret_cast<const float2*>(row);
          r.gk[0] = v.x, r.gk[1] = v.y;
        }
      }
      if (use_g) {
        r.g_last = g_row[int64_t(t_last) * p.HV];
        r.g0 = lane < r.rows ? g_row[int64_t(t0 + lane) * p.HV] : 0.f;
        r.g1 = lane + 32 < r.rows ? g_row[int64_t(t0 + lane + 32) * p.HV] : 0.f;
      }
    };
    Pre pre[PREFETCH];
    CUTE_UNROLL
    for (int u = 0; u < PREFETCH; ++u)
      if (u < NC) fetch(u, pre[u]);
    int s = 0;
    uint32_t phase = 0;
    for (int i0 = 0; i0 < NC; i0 += PREFETCH) {
      CUTE_UNROLL
      for (int u = 0; u < PREFETCH; ++u) {
        const int i = i0 + u;
        if (i >= NC) break;
        const int c = chunk_of(i, NC);
        Pre& cur = pre[u];
        // EARLY_DV: one of the stage's two K-wide slots onto `bar`: k's slot (DV's B: stage
        // 4 k, FWD w) or w's slot (WD's B: stage 4 w, FWD k).
        auto load_slot = [&](bool w_slot, uint64_t* bar) {
          const bool k_tensor = w_slot == FWD;
          uint8_t* at = smem + s * Map::STAGE + (w_slot ? Map::W_OFF : Map::K_OFF);
          for (int kb = 0; kb < KB; ++kb)
            SM90_TMA_LOAD_4D::copy(k_tensor ? &p.tma_k : &p.tma_w, bar, 0, at + kb * BT * 128, kb * 64,
                                   k_tensor ? h : hv, bos + c * BT, b_row);
        };
        if constexpr (EARLY_DV) {
          uint8_t* st = smem + s * Map::STAGE;
          const int t0 = bos + c * BT;
          // DV's operand first (k's slot: stage 4 k, FWD w) on dv_full, then the rest of the
          // stage on full_bar; EARLY_FREE: w's slot (stage 4 w, FWD k) on w_full after the
          // gates, each part once its slot is handed back.
          if (i >= STAGES) wait_bar(EARLY_FREE ? &k_empty_bar[s] : &empty_bar[s], phase ^ 1u);
          if (lane == 0) {
            cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&dv_full_bar[s], uint32_t(Map::KTILE));
            load_slot(false, &dv_full_bar[s]);
          }
          if (EARLY_FREE && i >= STAGES) wait_bar(&empty_bar[s], phase ^ 1u);
          if (lane == 0) {
            cutlass::arch::ClusterTransactionBarrier::expect_transaction(&full_bar[s], tx_bytes);
            for (int kb = 0; kb < KB && !FWD && !ident_p; ++kb)
              SM90_TMA_LOAD_4D::copy(&p.tma_q, &full_bar[s], 0, st + Map::Q_OFF + kb * BT * 128, kb * 64, h, t0, b_row);
            if constexpr (!EARLY_FREE) load_slot(true, &full_bar[s]);
            for (int wg = 0; wg < NWG && !ident_p; ++wg) {
              const int v0 = (blockIdx.x * NWG + wg) * BV;
              if (!FWD)
                SM90_TMA_LOAD_4D::copy(&p.tma_do, &full_bar[s], 0, st + Map::DO_OFF + wg * Map::VTILE, v0, hv, t0, b_row);
              SM90_TMA_LOAD_4D::copy(&p.tma_dv, &full_bar[s], 0, st + Map::DV_OFF + wg * Map::VTILE, v0, hv, t0, b_row);
            }
          }
        } else {
          if (i >= STAGES) wait_bar(&empty_bar[s], phase ^ 1u);
          if (lane == 0) {
            // The stage's bytes are expected first, then the copies; the arrival comes after
            // the gate vectors are written (the phase completes on both).
            cutlass::arch::ClusterTransactionBarrier::expect_transaction(&full_bar[s], tx_bytes);
            uint8_t* st = smem + s * Map::STAGE;
            const int t0 = bos + c * BT;
            if constexpr (FWD) {  // w in k's slot (DV's B), k in w's (WD's B), u in dv's
              for (int kb = 0; kb < KB; ++kb) {
                SM90_TMA_LOAD_4D::copy(&p.tma_w, &full_bar[s], 0, st + Map::K_OFF + kb * BT * 128, kb * 64, hv, t0, b_row);
                SM90_TMA_LOAD_4D::copy(&p.tma_k, &full_bar[s], 0, st + Map::W_OFF + kb * BT * 128, kb * 64, h, t0, b_row);
              }
              for (int wg = 0; wg < NWG && !ident_p; ++wg)
                SM90_TMA_LOAD_4D::copy(&p.tma_dv, &full_bar[s], 0, st + Map::DV_OFF + wg * Map::VTILE,
                                       (blockIdx.x * NWG + wg) * BV, hv, t0, b_row);
            }
            for (int kb = 0; kb < KB && !FWD; ++kb) {
              SM90_TMA_LOAD_4D::copy(&p.tma_k, &full_bar[s], 0, st + Map::K_OFF + kb * BT * 128, kb * 64, h, t0, b_row);
              if (!ident_p)
                SM90_TMA_LOAD_4D::copy(&p.tma_q, &full_bar[s], 0, st + Map::Q_OFF + kb * BT * 128, kb * 64, h, t0, b_row);
              SM90_TMA_LOAD_4D::copy(&p.tma_w, &full_bar[s], 0, st + Map::W_OFF + kb * BT * 128, kb * 64, hv, t0, b_row);
            }
            for (int wg = 0; wg < NWG && !ident_p && !FWD; ++wg) {
              const int v0 = (blockIdx.x * NWG + wg) * BV;
              SM90_TMA_LOAD_4D::copy(&p.tma_do, &full_bar[s], 0, st + Map::DO_OFF + wg * Map::VTILE, v0, hv, t0, b_row);
              SM90_TMA_LOAD_4D::copy(&p.tma_dv, &full_bar[s], 0, st + Map::DV_OFF + wg * Map::VTILE, v0, hv, t0, b_row);
            }
          }
        }
        if (use_gk) {
          const uint32_t d = smem_u32 + Map::DECAY_OFF + uint32_t((s * K + lane * KPL) * 4);
          if constexpr (KPL == 4) {
            st_shared_v4(d, __float_as_uint(fast_exp2(cur.gk[0])), __float_as_uint(fast_exp2(cur.gk[1])),
                         __float_as_uint(fast_exp2(cur.gk[2])), __float_as_uint(fast_exp2(cur.gk[3])));
          } else {
            st_shared_u32(d, __float_as_uint(fast_exp2(cur.gk[0])));
            st_shared_u32(d + 4, __float_as_uint(fast_exp2(cur.gk[1])));
          }
        }
        if (use_g) {
          float* gv = reinterpret_cast<float*>(smem + Map::GATE_OFF) + s * G_LEN;
          const bool ok0 = lane < cur.rows, ok1 = lane + 32 < cur.rows;
          gv[G_GATE + lane] = ok0 ? fast_exp2(cur.g_last - cur.g0) : 0.f;
          gv[G_GATE + 32 + lane] = ok1 ? fast_exp2(cur.g_last - cur.g1) : 0.f;
          gv[G_WEIGHT + lane] = ok0 ? fast_exp2(cur.g0) : 0.f;
          gv[G_WEIGHT + 32 + lane] = ok1 ? fast_exp2(cur.g1) : 0.f;
          if (lane == 0) gv[G_DECAY] = fast_exp2(cur.g_last);
        }
        arrive_bar(&full_bar[s]);
        if constexpr (EARLY_FREE) {
          if (i >= STAGES) wait_bar(&w_empty_bar[s], phase ^ 1u);
          if (lane == 0) {
            cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&w_full_bar[s], uint32_t(Map::KTILE));
            load_slot(true, &w_full_bar[s]);
          }
        }
        if (i + PREFETCH < NC) fetch(i + PREFETCH, cur);
        if (++s == STAGES) s = 0, phase ^= 1u;
      }
    }
    // A padded packed batch (cu_seqlens[-1] < T): the last sequence's CTAs write zeros
    // to dv2's padding rows for their (hv, V columns), as fla leaves them unwritten.
    if (varlen && ctaid_z() == int(gridDim.z) - 1) {
      const int64_t pad0 = int64_t(bos) + len;
      T* dv2 = reinterpret_cast<T*>(p.dv2);
      for (int64_t t = pad0 + lane / 8; t < p.T; t += 4) {
        for (int wg = 0; wg < NWG; ++wg) {
          const int v0 = (blockIdx.x * NWG + wg) * BV;
          uint4* dst = reinterpret_cast<uint4*>(dv2 + (t * p.HV + hv) * p.V + v0) + (lane % 8);
          *dst = make_uint4(0, 0, 0, 0);
        }
      }
    }
    return;
  }

  // -------------------------------------------------------------------- consumers
  if constexpr (NWG > 1) cutlass::arch::warpgroup_reg_alloc<CONSUMER_REGS_WG2>();
  const SeqExtent ext = SeqExtent::load(smem_u32 + Map::EXT_OFF);
  if (!ext.ok) {
    poison_sequence<K, T, SVF>(p, ext, ctaid_z(), hv, blockIdx.x * NWG * BV, NWG * BV, tid, CONSUMERS);
    return;
  }
  const int64_t bos = ext.bos, len = ext.len, boh = ext.boh;
  // NC broadcast from lane 0: ptxas then knows it is warp-uniform (read from shared
  // memory it is not, to ptxas), so the chunk loop's counters, the stage index and the
  // wgmma descriptors live in uniform registers (fewer instructions per chunk).
  const int NC = __shfl_sync(0xffffffffu, ext.nc, 0);
  const int wg = tid / WG_THREADS;
  const int ctid = tid % WG_THREADS;
  // Issues the warpgroup's TMA stores; a split's summary CTA stores none.
  const bool leader = ctid == 0 && (!SUMMARY || live);
  const int v0 = (blockIdx.x * NWG + wg) * BV;
  auto wg_sync = [&]() { named_sync(WG_THREADS, 1 + wg); };

  const FragGeom fg(ctid);
  const int warp = ctid >> 5, lane = ctid & 31;
  const uint32_t lane_tr = SmGeom::trans_off(warp, lane);  // .trans tiles, k-block 0
  const uint32_t sBh_u32 = smem_u32 + Map::BH_OFF + wg * Map::BH;
  const int DV2_OFF = Map::DV2_OFF + wg * Map::VTILE;
  const uint32_t sDv2_u32 = smem_u32 + DV2_OFF;
  const int DO_OFF = Map::DO_OFF + wg * Map::VTILE;  // within a stage
  const int DV_OFF = Map::DV_OFF + wg * Map::VTILE;
  const float scale = p.scale;

  // Descriptors of the B operands (CuTe's partitions of the stage tiles).
  using LayoutKt = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{}, Shape<Int<BT>, Int<K>>{}));
  using LayoutQt = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<T>{}, Shape<Int<K>, Int<BT>>{}, Step<_2, _1>{}));
  auto mma_dv = make_tiled_mma(OpDV{});
  auto mma_wd = make_tiled_mma(OpWD{});
  auto mma_qd = make_tiled_mma(OpQD{});
  auto thr_dv = mma_dv.get_thread_slice(ctid);
  auto thr_wd = mma_wd.get_thread_slice(ctid);
  auto thr_qd = mma_qd.get_thread_slice(ctid);
  auto s_at = [&](int off) { return make_smem_ptr(reinterpret_cast<T*>(smem + off)); };
  // DV's B: the k tile (N = t, K dim = k), K-major; k-block kb's descriptor.
  auto k_descs = [&](int stage) {
    return thr_dv.make_fragment_B(thr_dv.partition_B(make_tensor(s_at(stage * Map::STAGE + Map::K_OFF), LayoutKt{})));
  };
  // QD's / WD's B: the q / w tile (N = k, K dim = t), MN-major. QD's A: do^T (M = v,
  // K dim = t), MN-major (the [t][v] tile).
  using LayoutVt = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<T>{}, Shape<Int<BV>, Int<BT>>{}));
  auto do_descs = [&](int stage) {
    return thr_qd.make_fragment_A(thr_qd.partition_A(make_tensor(s_at(stage * Map::STAGE + DO_OFF), LayoutVt{})));
  };
  auto kt_descs = [&](auto& thr, int stage, int off) {
    return thr.make_fragment_B(thr.partition_B(make_tensor(s_at(stage * Map::STAGE + off), LayoutQt{})));
  };

  float b[NS];        // b^T [64 v, K], fp32
  float qd[NS];       // QD^T [64 v, K]
  float dv[ND];       // DV^T [64 v, 64 t]
  uint32_t ab[NA];    // bf16(b^T): DV's A fragment, and the dh checkpoint
  uint32_t adv2[ND / 2];  // bf16(dv2^T): WD's A fragment, and the dv2 tile
  // FWD with g: v_new^T as stored (WD's A, adv2, is the gated v_upd^T); else unused.
  uint32_t vst[FWD && G ? ND / 2 : 1];

  // (sequence, value head) of the state read (dht) and of the state written (dh0)
  // (blockIdx.z afresh: see ctaid_z). Without a split both are n * HV + hv. A split's
  // second pass reads its boundary states at blockIdx.y's place and writes dh0 from
  // segment 0 only; its first pass reads the caller's dht and writes every CTA's last
  // state to its [.., K, V + K] buffer at blockIdx.y's place.
  const int64_t nh_row = int64_t(ctaid_z()) * p.HV + hv;
  const int64_t nh_grid = SEG_REV ? int64_t(ctaid_z()) * gridDim.y + (seg * p.HV + hv)
                                  : int64_t(ctaid_z()) * gridDim.y + blockIdx.y;
  const int64_t nh_in = SUMMARY ? nh_row : nh_grid;
  const int64_t nh_out = SUMMARY ? nh_grid : nh_row;
  const int VO = SUMMARY ? p.V + K : p.V;  // columns of the state written
  // Element (v, k) of this warpgroup's slice of dht / dh0: [K, V], or [V, K] with SVF.
  auto state_in = [&](int v, int k) -> int64_t {
    return SVF ? (nh_in * p.V + v0 + v) * K + k : (nh_in * K + k) * p.V + v0 + v;
  };
  auto state_out = [&](int v, int k) -> int64_t {
    return SVF ? (nh_out * VO + v0 + v) * K + k : (nh_out * K + k) * VO + v0 + v;
  };
  CUTE_UNROLL
  for (int e = 0; e < NS; e += 2) {
    const int v = fg.row(e), k = fg.col(e);
    float2 x = make_float2(0.f, 0.f);
    if (SUMMARY && !live) {
      // u_s from zero; P_s from the identity: column v0 + v - V of P is e_{v0 + v - V}.
      const int m = v0 + v - p.V;
      if (ident) x = make_float2(k == m ? 1.f : 0.f, k + 1 == m ? 1.f : 0.f);
    } else if (p.flags & FLAG_DHT) {
      if constexpr (SVF)
        x = *reinterpret_cast<const float2*>(p.dht + state_in(v, k));
      else
        x = make_float2(p.dht[state_in(v, k)], p.dht[state_in(v, k + 1)]);
    }
    b[e] = x.x;
    b[e + 1] = x.y;
  }

  // dh0 = b after the oldest chunk: the launch's segment 0 (stage 4 scans newest first); FWD:
  // final_state = b after the newest chunk, the launch's last segment (a split's second pass
  // runs segments 1 .. S - 1 oldest first). Unsplit, both are the one segment; a first pass
  // (SUMMARY) writes every CTA's last state to its buffer (see nh_out).
  const bool dh0_seg = FWD ? seg + 1 == int(gridDim.y) / p.HV : seg == 0;
  auto store_dh0 = [&]() {
    if (SUMMARY || ((p.flags & FLAG_DH0) && dh0_seg)) {
      CUTE_UNROLL
      for (int e = 0; e < NS; e += 2) {
        const int v = fg.row(e), k = fg.col(e);
        if constexpr (SVF) {
          *reinterpret_cast<float2*>(p.dh0 + state_out(v, k)) = make_float2(b[e], b[e + 1]);
        } else {
          p.dh0[state_out(v, k)] = b[e];
          p.dh0[state_out(v, k + 1)] = b[e + 1];
        }
      }
    }
  };
  // An empty sequence of a packed batch: dh0 = dht, nothing else to store.
  if (NC == 0) {
    store_dh0();
    return;
  }

  // QD^T = do^T . q of a stage, into qd (do's rows already prepared).
  auto issue_qd = [&](int stage) {
    auto tA = do_descs(stage);
    auto tB = kt_descs(thr_qd, stage, Map::Q_OFF);
    fence_regs(qd);
    warpgroup_arrive();
    CUTE_UNROLL
    for (int kt = 0; kt < BT / 16; ++kt)
      ss_mma<OpQD>(uint64_t(tA(0, 0, kt)), uint64_t(tB(0, 0, kt)), qd,
                   kt == 0 ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One);
    warpgroup_commit_batch();
    fence_regs(qd);
  };
  auto gate_at = [&](int stage) { return smem_u32 + Map::GATE_OFF + stage * G_LEN * 4; };

  // The sequence's newest chunk (c = NC - 1: i = 0, FWD i = NC - 1) is the only one that
  // can be short; in a packed batch its rows past the sequence's end belong to the next
  // sequence and are masked.
  const int rows0 = int(min(int64_t(BT), len - int64_t(NC - 1) * BT));
  const bool partial = varlen && rows0 < BT;
  const int i_short = FWD ? NC - 1 : 0;  // the iteration of that chunk

  // The stores of staged tiles (after the barrier that follows every thread's writes to
  // them and its fence.proxy.async). dh[chunk] from sBh: TMA, by the leader.
  auto tma_store_dh = [&](int64_t chunk) {
    if constexpr (SVF) {
      CUTE_UNROLL
      for (int kb = 0; kb < KB; ++kb)  // [64 v][64 k] boxes of the [V, K] checkpoint
        SM90_TMA_STORE_4D::copy(&p.tma_dh, smem + Map::BH_OFF + wg * Map::BH + kb * 8192, kb * 64, v0, hv,
                                int(chunk));
    } else {
      SM90_TMA_STORE_4D::copy(&p.tma_dh, smem + Map::BH_OFF + wg * Map::BH, v0, 0, hv, int(chunk));
    }
  };
  // Chunk c's dv2 rows from sDv2: TMA, by the leader.
  auto tma_store_dv2 = [&](int c) {
    // The batch row from ctaid_z(), uniform to ptxas: from ext.b_row (a per-thread value to
    // ptxas) ptxas 13.0 moved it into the store's uniform register under a predicate that the
    // dh store's uniformizing loop had just set to true, so the move never ran and dv2 went to
    // a stale row (scripts/build/check_sass.py finds such dead moves).
    SM90_TMA_STORE_4D::copy(&p.tma_dv2, smem + DV2_OFF, v0, hv, int(bos + int64_t(c) * BT), batch_row(p, ctaid_z()));
  };
  // The short chunk c of a packed batch: its first `rows` dv2 rows from sDv2, plain stores by
  // every thread (the rows past the sequence's end belong to the next sequence).
  auto plain_store_dv2 = [&](int c, int rows) {
    T* dv2_g = reinterpret_cast<T*>(p.dv2);
    for (int j = ctid; j < rows * 8; j += WG_THREADS) {
      const int row = j >> 3, ch = j & 7;
      const uint4 u = ld_shared_v4(sDv2_u32 + row * 128 + ((ch ^ (row & 7)) << 4));
      const int64_t t = bos + int64_t(c) * BT + row;
      *reinterpret_cast<uint4*>(dv2_g + (t * p.HV + hv) * p.V + v0 + ch * 8) = u;
    }
  };
  // bf16(b^T) (the A fragment ab) -> sBh, and dv2^T (adv2) -> sDv2.
  auto stage_dh = [&]() {
    CUTE_UNROLL
    for (int kb = 0; kb < K / 16; ++kb) {
      if constexpr (SVF)
        stsm_x4(sBh_u32 + SmGeom::direct_off(warp, lane, kb), &ab[4 * kb]);
      else
        stsm_x4_trans(sBh_u32 + kb * 2048 + lane_tr, &ab[4 * kb]);
    }
  };
  auto stage_dv2 = [&]() {
    const uint32_t* src;
    if constexpr (FWD && G)
      src = vst;
    else
      src = adv2;
    CUTE_UNROLL
    for (int kt = 0; kt < BT / 16; ++kt) stsm_x4_trans(sDv2_u32 + kt * 2048 + lane_tr, &src[4 * kt]);
  };

  // The chunks (the schedule above). On entry to chunk i: b = b_i, stage s full and
  // prepared, no wgmma in flight. DEFER_DV2: dv2_i is staged and stored while DV_{i+1} runs,
  // where the warps wait for DV anyway, so that the section after WD's issue holds only the
  // next stage's wait; not with two warpgroups at K = 128, whose 240 registers do not hold
  // adv2 across the loop's back edge without spills (NVRTC 12.9).
  constexpr bool DEFER_DV2 = NWG == 1 || K == 64;
  // An identity tile's q, do and dv read as zeros (the producer loads none of them), so
  // QD = 0 and dv2 = gate . DV: the ring's slots zeroed once.
  if (SUMMARY && ident) {
    for (int st = 0; st < STAGES; ++st) {
      const uint32_t base = smem_u32 + st * Map::STAGE;
      for (int j = ctid; j < Map::KTILE / 16; j += WG_THREADS) st_shared_v4(base + Map::Q_OFF + j * 16, 0, 0, 0, 0);
      for (int j = ctid; j < Map::VTILE / 16; j += WG_THREADS) {
        st_shared_v4(base + DO_OFF + j * 16, 0, 0, 0, 0);
        st_shared_v4(base + DV_OFF + j * 16, 0, 0, 0, 0);
      }
    }
    fence_proxy_async();
    wg_sync();
  }
  // Prologue: stage 0 full and, for a packed batch's short newest chunk or with g, prepared;
  // no wgmma issued.
  if constexpr (EARLY_DV) wait_bar(&dv_full_bar[0], 0);
  if constexpr (EARLY_FREE) wait_bar(&w_full_bar[0], 0);
  wait_bar(&full_bar[0], 0);
  if (!FWD && (partial || use_g)) {
    // Rows past the sequence's end of a packed batch's short chunk are zeroed: do's
    // here, q's and w's too (0 * NaN from the memory past a sequence would not vanish
    // in QD and WD; fla masks these loads; k's rows only reach DV's columns past the
    // end, which are masked, as are dv's). q and w are shared: with two warpgroups
    // each zeroes one. With g, do[t] *= exp2(g[t]).
    prepare_do_rows<T>(smem_u32 + DO_OFF, ctid, use_g, gate_at(0) + G_WEIGHT * 4, partial ? rows0 : BT);
    if (partial) {
      for (int j = ctid; j < KB * BT * 8; j += WG_THREADS) {
        const int row = (j >> 3) % BT;
        if (row >= rows0) {
          const uint32_t off = (j >> 3) * 128 + (j & 7) * 16;
          if (NWG == 1 || wg == 0) st_shared_v4(smem_u32 + Map::Q_OFF + off, make_uint4(0, 0, 0, 0));
          if (NWG == 1 || wg == 1) st_shared_v4(smem_u32 + Map::W_OFF + off, make_uint4(0, 0, 0, 0));
        }
      }
    }
    fence_proxy_async();
    if (NWG > 1 && partial)
      named_sync(CONSUMERS, ALL_CONSUMERS);
    else
      wg_sync();
  }
  int s = 0;
  uint32_t phase = 0;  // full[s]'s phase for chunk i
#if KDA_DHU_EXP_STAMPS
  Stamps stamps;
  stamps.start(!SUMMARY && tid < 32 && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0, tid);
#endif
  for (int i = 0; i < NC; ++i) {
    const int c = chunk_of(i, NC);
    const int64_t chunk = boh + c;
    const bool last = i + 1 == NC;
    const bool part = partial && i == i_short;
    const int rows = part ? rows0 : BT;
    const bool wrap = s + 1 == STAGES;
    const int ns = wrap ? 0 : s + 1;  // stage of chunk i + 1
    const uint32_t nphase = wrap ? phase ^ 1u : phase;
    const uint32_t st_u32 = smem_u32 + s * Map::STAGE;

    // FWD, a packed batch's short last chunk: k's rows past the sequence's end (the next
    // sequence's) zeroed before WD reads them (0 * NaN would not vanish); w's and u's only
    // reach v_new's columns past the end, which are masked.
    // Two warpgroups share the tile: the first zeroes it, both wait.
    if (FWD && part) {
      if constexpr (EARLY_DV) wait_bar(EARLY_FREE ? &w_full_bar[s] : &full_bar[s], phase);  // k landed, then zeroed
      if (NWG == 1 || wg == 0) {
        for (int j = ctid; j < KB * BT * 8; j += WG_THREADS) {
          if ((j >> 3) % BT >= rows0)
            st_shared_v4(st_u32 + Map::W_OFF + (j >> 3) * 128 + (j & 7) * 16, make_uint4(0, 0, 0, 0));
        }
      }
      fence_proxy_async();
      if (NWG > 1)
        named_sync(CONSUMERS, ALL_CONSUMERS);
      else
        wg_sync();
    }

    // dh[chunk] = bf16(b), as DV's A fragment.
    CUTE_UNROLL
    for (int j = 0; j < NA; ++j) ab[j] = pack2<T>(b[2 * j], b[2 * j + 1]);
    KDA_DHU_STAMP(10);

    // DV^T = bf16(b^T) . k^T, from zero.
    {
      auto tB = k_descs(s);
      fence_regs(ab);
      fence_regs(dv);
      warpgroup_arrive();
      CUTE_UNROLL
      for (int kb = 0; kb < K / 16; ++kb)
        rs_mma<OpDV>(&ab[4 * kb], uint64_t(tB(0, 0, kb)), dv, kb == 0 ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One);
      warpgroup_commit_batch();
      fence_regs(dv);
    }
    KDA_DHU_STAMP(0);

    // While DV_i runs (the warps would wait for it here): once the stores committed in
    // chunk i - 1 have read sBh and sDv2 (the leader waits, then the barrier), bf16(b) ->
    // sBh and (DEFER_DV2) chunk i - 1's dv2, still in adv2, -> sDv2; the fence and barrier
    // that order them before the async proxy's reads; then their stores, one bulk group
    // (chunk 0 of a short packed sequence, i - 1 = 0: its dv2 rows by plain stores).
    if (leader) tma_store_wait<0>();
    wg_sync();
    KDA_DHU_STAMP(11);
    if constexpr (!(ABL_NO_DH || ABL_NO_DH_STAGE)) stage_dh();
    KDA_DHU_STAMP(12);
    if (!ABL_NO_DV2 && DEFER_DV2 && i > 0) stage_dv2();
    KDA_DHU_STAMP(13);
    fence_proxy_async();
    wg_sync();
    KDA_DHU_STAMP(14);
    // The previous chunk's (c + 1; FWD c - 1, never the short one: that is the last).
    const int c_prev = FWD ? c - 1 : c + 1;
    const bool prev_part = DEFER_DV2 && !FWD && partial && i == 1;
    if (leader) {
      if constexpr (!(ABL_NO_DH || ABL_NO_DH_STORE)) tma_store_dh(chunk);
      if (!ABL_NO_DV2 && DEFER_DV2 && i > 0 && !prev_part) tma_store_dv2(c_prev);
      tma_store_arrive();
    }
    if (prev_part) plain_store_dv2(c + 1, rows0);  // stage 4 only
    KDA_DHU_STAMP(1);
    // EARLY_DV: DV_i was issued on its operand alone; the rest of stage s from here.
    if constexpr (EARLY_DV) wait_bar(&full_bar[s], phase);

    // QD_i, queued behind DV_i (stage s's do rows were prepared before its barrier); issued
    // after the staging, which frees adv2 first (K = 128 with two warpgroups would spill).
    if constexpr (!FWD && !ABL_QD) issue_qd(s);
    if constexpr (!FWD && ABL_QD) {
      CUTE_UNROLL
      for (int j = 0; j < NS / 4; ++j) {
        const uint4 x = ld_shared_v4(st_u32 + Map::Q_OFF + (j * WG_THREADS + ctid) * 16);
        qd[4 * j] = __uint_as_float(x.x), qd[4 * j + 1] = __uint_as_float(x.y);
        qd[4 * j + 2] = __uint_as_float(x.z), qd[4 * j + 3] = __uint_as_float(x.w);
      }
    }
    // dv^T (FWD: u^T) of stage s, in DV's accumulator order (packed), for the epilogue.
    uint32_t dvr[ND / 2];
    CUTE_UNROLL
    for (int kt = 0; kt < BT / 16; ++kt) ldsm_x4_trans(st_u32 + DV_OFF + kt * 2048 + lane_tr, &dvr[4 * kt]);
    KDA_DHU_STAMP(2);

    // DV_i complete: dv2 = gate . DV + dv, rounded; zero past the sequence's end. QD_i
    // runs meanwhile.
    if constexpr (FWD || ABL_QD)
      warpgroup_wait<0>();  // DV is the only wgmma in flight
    else
      warpgroup_wait<1>();
    fence_regs(dv);
    KDA_DHU_STAMP(3);
    if constexpr (EARLY_FREE) arrive_bar(&k_empty_bar[s]);  // DV has read k's slot
    // Stage 4: dv2 = gate . DV + dv. FWD: v_new = u + (-W) in fp32, rounded (stored), and
    // v_upd = gate . v_new, rounded (WD's A).
    {
      const uint32_t sg = gate_at(s) + (G_GATE + fg.col0) * 4;
      CUTE_UNROLL
      for (int kt = 0; kt < BT / 16; ++kt) {
        CUTE_UNROLL
        for (int m = 0; m < 4; ++m) {
          const float2 d = widen2<T>(dvr[4 * kt + m]);
          const int e = 8 * kt + 2 * m;
          if constexpr (FWD) {
            const float x0 = d.x + dv[e], x1 = d.y + dv[e + 1];
            if constexpr (G) {
              const float2 gt = ld_shared_f32x2(sg + (16 * kt + 8 * (m >> 1)) * 4);
              vst[4 * kt + m] = pack2<T>(x0, x1);
              adv2[4 * kt + m] = pack2<T>(x0 * gt.x, x1 * gt.y);
            } else {
              adv2[4 * kt + m] = pack2<T>(x0, x1);
            }
          } else if (use_g) {
            const float2 gt = ld_shared_f32x2(sg + (16 * kt + 8 * (m >> 1)) * 4);
            adv2[4 * kt + m] = pack2<T>(fmaf(dv[e], gt.x, d.x), fmaf(dv[e + 1], gt.y, d.y));
          } else {
            adv2[4 * kt + m] = pack2<T>(dv[e] + d.x, dv[e + 1] + d.y);
          }
        }
      }
    }
    if (part) {
      CUTE_UNROLL
      for (int j = 0; j < ND / 2; ++j) adv2[j] = mask_pair(adv2[j], fg.col(2 * j), rows);
    }
    KDA_DHU_STAMP(4);

    // QD_i complete: b = decay . b + scale . QD_i (FWD: decay . b).
    if constexpr (!FWD && !ABL_QD) {
      warpgroup_wait<0>();
      fence_regs(qd);
    }
    KDA_DHU_STAMP(5);
    fence_regs(b);
    // (The decay row is read here, each pair used as it lands: read while QD_i runs, its
    // 32 registers live across the epilogue would spill at K = 128. b itself is not
    // touched while a wgmma is in flight: ptxas would then make the first such write wait
    // for every wgmma of the chunk, C7517.)
    // (FWD: b = decay . b; scale and QD are stage 4's.)
    if (use_gk) {
      const uint32_t sd = smem_u32 + Map::DECAY_OFF + s * K * 4 + fg.col0 * 4;
      CUTE_UNROLL
      for (int j = 0; j < NS / 4; ++j) {
        const float2 d = ld_shared_f32x2(sd + 32 * j);  // columns 8j + col0, + 1
        CUTE_UNROLL
        for (int hh = 0; hh < 2; ++hh) {
          const int e = 4 * j + 2 * hh;
          if constexpr (FWD) {
            b[e] = d.x * b[e];
            b[e + 1] = d.y * b[e + 1];
          } else {
            b[e] = fmaf(scale, qd[e], d.x * b[e]);
            b[e + 1] = fmaf(scale, qd[e + 1], d.y * b[e + 1]);
          }
        }
      }
    } else if (use_g) {
      const float d = ld_shared_f32(gate_at(s) + G_DECAY * 4);
      CUTE_UNROLL
      for (int e = 0; e < NS; ++e) {
        if constexpr (FWD)
          b[e] = d * b[e];
        else
          b[e] = fmaf(scale, qd[e], d * b[e]);
      }
    } else if constexpr (!FWD) {
      CUTE_UNROLL
      for (int e = 0; e < NS; ++e) b[e] = fmaf(scale, qd[e], b[e]);
    }

    KDA_DHU_STAMP(6);
    if constexpr (EARLY_FREE) {
      arrive_bar(&empty_bar[s]);  // q, do, dv and the gates read (QD complete, the fold done)
      wait_bar(&w_full_bar[s], phase);
    }
    // b^T += -(dv2^T . w)  (FWD: b^T += v_upd^T . k)
    {
      auto tB = kt_descs(thr_wd, s, Map::W_OFF);
      fence_regs(adv2);
      fence_regs(b);
      warpgroup_arrive();
      CUTE_UNROLL
      for (int kt = 0; kt < BT / 16; ++kt)
        rs_mma<OpWD>(&adv2[4 * kt], uint64_t(tB(0, 0, kt)), b, GMMA::ScaleOut::One);
      warpgroup_commit_batch();
      fence_regs(b);
    }
    KDA_DHU_STAMP(7);

    // While WD_i runs: the next stage full and, with g, its do rows weighted, ordered
    // before QD_{i+1}'s reads by the fence and the barrier. (DEFER_DV2: dv2_i is staged
    // and stored while DV_{i+1} runs, or after the loop; else below.)
    if (!last) {
      // EARLY_DV: DV's operand only (the rest is waited for after chunk i + 1's staging),
      // but stage 4 with g weights the do rows here.
      if constexpr (EARLY_DV) wait_bar(&dv_full_bar[ns], nphase);
      if (!EARLY_DV || (!FWD && use_g)) wait_bar(&full_bar[ns], nphase);
      if (!FWD && use_g) {
        prepare_do_rows<T>(smem_u32 + ns * Map::STAGE + DO_OFF, ctid, true, gate_at(ns) + G_WEIGHT * 4, BT);
        if (DEFER_DV2) {
          fence_proxy_async();
          wg_sync();
        }
      }
    }
    if constexpr (!DEFER_DV2 && !ABL_NO_DV2) {
      // dv2_i staged and stored here (sDv2 free: the leader's wait before this chunk's
      // first barrier covered chunk i - 1's stores); the fence and barrier also order the
      // do rows above.
      stage_dv2();
      fence_proxy_async();
      wg_sync();
      if (leader) {
        if (!part) tma_store_dv2(c);
        tma_store_arrive();
      }
      if (part) plain_store_dv2(c, rows);
    }

    KDA_DHU_STAMP(8);
    // WD_i complete: b = b_{i+1}. Every read of stage s is complete: hand it back
    // (EARLY_FREE: w's slot, the rest is back already).
    warpgroup_wait<0>();
    fence_regs(b);
    KDA_DHU_STAMP(9);
    arrive_bar(EARLY_FREE ? &w_empty_bar[s] : &empty_bar[s]);
    phase = nphase;
    s = ns;
    KDA_DHU_STAMP(15);
  }
  if constexpr (DEFER_DV2 && !ABL_NO_DV2) {
    // The last chunk's dv2 (c = 0; FWD c = NC - 1, the short one of a packed sequence).
    if (leader) tma_store_wait<0>();
    wg_sync();
    stage_dv2();
    fence_proxy_async();
    wg_sync();
    const int c_last = FWD ? NC - 1 : 0;
    const bool last_part = partial && (FWD || NC == 1);
    if (leader && !last_part) {
      tma_store_dv2(c_last);
      tma_store_arrive();
    }
    if (last_part) plain_store_dv2(c_last, rows0);
  }
  store_dh0();
  if (leader) tma_store_wait<0>();  // smem must outlive the last bulk stores' reads
#if KDA_DHU_EXP_STAMPS
  stamps.write(p.dh, NC);
#endif
}
}  // namespace sm90_regstate
}  // namespace kda_dhu
