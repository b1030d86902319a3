// Stage 4 of fla's chunked gated delta rule backward on Hopper (sm_90a):
// the reverse state scan `chunk_gated_delta_rule_bwd_dhu`, TMA + wgmma.
//
// A consumer warpgroup owns (sequence n, value head hv, V tile of BV = 64 columns) and
// walks the sequence's chunks of BT = 64 tokens newest first; a CTA holds NWG = 1 or 2
// of them (NWG = 2: the two V tiles of 128 columns share the CTA's k, q, w loads and
// run two independent chains on one SM). The state gradient b [K, BV] lives
// in fp32 registers for the whole walk, kept negated (c = -b) so that the w^T dv2
// product accumulates straight into it (one fp32 accumulator less). Per chunk (SPEC.md):
//
//     dh[chunk]  = bf16(b)                                   TMA store of sBh
//     DV [BT,BV] = k [BT,K] . bf16(b) [K,BV]                  wgmma, A k-major, B mn-major (k-major: SVF)
//     dv2        = gate(t) * DV + dv  -> q.dtype              registers -> sDv2 -> TMA store
//     QD [K,BV]  = q^T [K,BT] . do [BT,BV]                    wgmma, A mn-major, B mn-major
//     c          = decay . c - scale * QD                     fp32 registers (scale after the dot, as fla)
//     c         += w^T [K,BT] . dv2 [BT,BV]                   wgmma into c (c = -b)
//
//   gate(t) = exp2(g[e-1] - g[t]) with the scalar gate g, else 1;
//   decay   = exp2(gk[e-1]) per K row, times exp2(g[e-1]) with g;
//   with g, q[t] is weighted by exp2(g[t]): applied to the rows of do in shared memory
//   (q^T diag(e) do == q^T (diag(e) do)), since do is the smaller operand.
//
// fla's arithmetic order is kept: b is rounded to q.dtype before k.b, dv2 is rounded
// before w^T.dv2, and scale multiplies the fp32 q^T.do dot after accumulation. One
// difference, with g only: do[t] * exp2(g[t]) is rounded to q.dtype in shared memory,
// where fla keeps q[t] * exp2(g[t]) in fp32 for a TF32 dot (measured within SPEC.md's
// bar on the H200: tests/gpu/test_gpu_kernel.py, gate "g").
//
// Warp roles (NWG = 1: 160 threads; NWG = 2: 384, the producer a whole warpgroup so that
// setmaxnreg can hand its registers to the consumers):
//   warpgroup wg < NWG  consumers of V tile wg: all wgmma, the fp32 recurrence,
//                       epilogues, TMA stores (issued by the warpgroup's thread 0)
//   next warp           producer: TMA loads of chunk tiles into a 2- or 3-stage mbarrier ring
//                       (k, q, w, NWG do and dv tiles + the gk row e-1 by a bulk copy +
//                       g by plain loads)
//
// Barriers per stage s: full[s] (producer arrive.expect_tx + TMA bytes; consumers wait),
// empty[s] (one arrive per consumer thread once its reads of the stage are complete).
// Named barrier 1 + wg (the warpgroup's 128 threads) orders generic smem writes (dv2,
// bf16 b, do rows) before their async-proxy readers (wgmma, TMA store), each preceded by
// fence.proxy.async in the writing threads; barrier 3 (all consumers) does so for the
// shared q / w rows zeroed in a varlen sequence's short chunk. The pipeline (NWG = 1)
// is drawn in docs/dhu_sm90_pipeline.md.
//
// Shared memory operands, all 128-byte swizzled (TMA SWIZZLE_128B == CuTe's GMMA SW128
// atoms), tile bases 1024-byte aligned:
//   sK   (t, k)  k-major  : A of DV          [K/64 boxes][64 rows t][64 k]
//   sQ,sW(k, t)  mn-major : A of QD / WD     same bytes as TMA wrote them
//   sDo, sDv, sDv2 (v, t) mn-major : B of QD / WD (dv read by threads)   [64 rows t][64 v]
//   sBh  (v, k)  mn-major : B of DV and the dh checkpoint's TMA source    [K rows k][64 v]
//                 (SVF, state_v_first: k-major, [K/64 boxes][64 rows v][64 k]: the [V, K] checkpoint)
// Per warpgroup, one sBh and two sDv2: chunk i's dh store (committed at its start) and
// chunk i-1's dv2 store are waited for, read side only, before the mid-chunk barrier,
// so sBh is free again by the chunk's end and sDv2[i % 2] by chunk i + 2.

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
#include "dhu_sm90_regstate.cuh"

namespace kda_dhu {
namespace sm90 {

using namespace cute;

// BT, BV, WG_THREADS, num_stages, num_threads, DV2_BUFS and SmemMap (the shared memory
// map, in bytes from a 1024-aligned base; the host asks for SmemMap::DYNAMIC_BYTES):
// dhu_layout.h, their one owner.

// Named barrier ids (0 is __syncthreads): 1 + wg for warpgroup wg's 128 threads, and
// ALL_CONSUMERS for every consumer thread (NWG = 2: the shared q/w rows of a short chunk).
constexpr int ALL_CONSUMERS = 3;
// NWG = 2: setmaxnreg moves the producer warpgroup's registers to the consumers.
constexpr int PRODUCER_REGS_WG2 = 24;
constexpr int CONSUMER_REGS_WG2 = 240;  // 2 x 128 x 240 + 128 x 24 = 64512 <= 65536

// DV's B operand is sBh: (v, k) mn-major ([k][v], the [K, V] dh checkpoint's layout), or
// k-major ([v][k]) with state_v_first (SVF), whose dh checkpoints are [V, K].
template <class T, bool SVF> struct Mma;
template <bool SVF> struct Mma<cutlass::bfloat16_t, SVF> {
  using DV = SM90_64x64x16_F32BF16BF16_SS<GMMA::Major::K, SVF ? GMMA::Major::K : GMMA::Major::MN>;
  using UPD = SM90_64x64x16_F32BF16BF16_SS<GMMA::Major::MN, GMMA::Major::MN>;
};
template <bool SVF> struct Mma<cutlass::half_t, SVF> {
  using DV = SM90_64x64x16_F32F16F16_SS<GMMA::Major::K, SVF ? GMMA::Major::K : GMMA::Major::MN>;
  using UPD = SM90_64x64x16_F32F16F16_SS<GMMA::Major::MN, GMMA::Major::MN>;
};

// SVF: where a thread's elements go in the k-major sBh, [K/64 boxes][64 rows v][64 k]
// 16-bit, 128-byte swizzled (the 16-byte chunk index XORed with v % 8), box mb at
// mb * 8192: the TMA box of the [V, K] checkpoint. Element i of 64-row block mb (FragGeom:
// k = row0 + 8h, v = 8 (i / 4) + col0 + c) sits at base[h][c] + mb * 8192 + (i / 4) * 1024,
// since v % 8 = col0 + c and k / 8 = row0 / 8 + h do not depend on i / 4 or mb.
struct SvfGeom {
  uint32_t base[2][2];
  __device__ __forceinline__ explicit SvfGeom(const FragGeom& fg) {
    CUTE_UNROLL
    for (int h = 0; h < 2; ++h) {
      CUTE_UNROLL
      for (int c = 0; c < 2; ++c) {
        const int r = fg.row0 + 8 * h, v = fg.col0 + c;
        base[h][c] = uint32_t(v) * 128u + ((uint32_t(r >> 3) ^ uint32_t(v)) << 4) + uint32_t(r & 7) * 2u;
      }
    }
  }
};

// bf16(b) of a thread's element pair (i, i + 1) of 64-row block mb -> sBh.
template <class T, bool SVF>
__device__ __forceinline__ void store_bh_pair(uint32_t sBh_u32, const FragGeom& fg, const SvfGeom& sg, int i,
                                              int mb, float x, float y) {
  const uint32_t packed = pack2<T>(x, y);
  if constexpr (SVF) {
    // (k, v) and (k, v + 1): two rows of [v][k]
    const uint32_t at = sBh_u32 + uint32_t(mb) * 8192u + uint32_t(i >> 2) * 1024u;
    const int h = (i >> 1) & 1;
    st_shared_u16(at + sg.base[h][0], uint16_t(packed & 0xffffu));
    st_shared_u16(at + sg.base[h][1], uint16_t(packed >> 16));
  } else {
    st_shared_u32(sBh_u32 + fg.sw(i) + mb * 64 * 128, packed);
  }
}

template <int K, class T, int NWG, bool SVF>
__device__ __forceinline__ void dhu_kernel(const DhuParams& p) {
  using Map = SmemMap<K, NWG>;
  using MmaOps = Mma<T, SVF>;
  constexpr int KB = K / 64;  // 64-wide K boxes per tile
  constexpr int CONSUMERS = NWG * WG_THREADS;

  constexpr int STAGES = Map::STAGES;

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  if constexpr (Map::SLACK == 0) {
    // No room to align up: the base itself must be aligned (else the map would overrun).
    if (smem != smem_raw) __trap();
  }
  const uint32_t smem_u32 = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + Map::BAR_OFF);
  uint64_t* empty_bar = full_bar + STAGES;

  const int tid = threadIdx.x;
  const int hv = blockIdx.y;
  const int n = blockIdx.z;
  const int h = hv / (p.HV / p.H);
  const bool varlen = p.flags & FLAG_VARLEN;
  const bool use_g = p.flags & FLAG_G;
  const bool use_gk = p.flags & FLAG_GK;

  // Sequence extent: tokens [bos, bos + len) of batch row b_row; chunks [boh, boh + NC) of
  // dh. A packed batch's entries are checked here, before anything is loaded or stored
  // (the scratch is stage 0's first bytes, free until the barrier below).
  // A failed sequence's CTA only poisons its outputs (the consumers, after the role split).
  // The extent goes through shared memory: values live across the split would be spilled
  // in the producer's few registers.
  {
    const SeqExtent e = sequence_extent<num_threads<NWG>()>(p, n, reinterpret_cast<int64_t*>(smem));
    if (tid == 0) e.store(smem + Map::EXT_OFF);
  }

  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      cutlass::arch::ClusterTransactionBarrier::init(&full_bar[s], 1);
      // Every consumer thread releases the stage itself (its own reads, its own arrive).
      cutlass::arch::ClusterBarrier::init(&empty_bar[s], CONSUMERS);
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
    // 32-bit token indices: T < 2^31 (the planner's grid clause), and with few registers.
    const SeqExtent ext = SeqExtent::load(smem_u32 + Map::EXT_OFF);
    if (!ext.ok) return;
    const int bos = int(ext.bos), len = int(ext.len);
    const int b_row = ext.b_row, NC = ext.nc;
    const int lane = tid - CONSUMERS;
    const uint32_t tx_bytes = uint32_t(3 * Map::KTILE + 2 * NWG * Map::VTILE + (use_gk ? K * 4 : 0));
    // Stage s and its empty-barrier phase advance with i (no division by STAGES).
    int s = 0;
    uint32_t phase = 0;
    for (int i = 0; i < NC; ++i) {
      const int c = NC - 1 - i;
      if (i >= STAGES) wait_bar(&empty_bar[s], phase ^ 1u);
      const int t0 = bos + c * BT;  // first token of the chunk (row in T)
      const int t_last = bos + min((c + 1) * BT, len) - 1;
      if (use_g) {
        float* sG = reinterpret_cast<float*>(smem + Map::G_OFF) + s * Map::G_LEN;
        const float* g_row = p.g + (int64_t(b_row) * p.T) * p.HV + hv;
        for (int j = lane; j < BT; j += 32) {
          const int t = t0 + j;
          sG[j] = (t <= t_last) ? g_row[int64_t(t) * p.HV] : 0.f;
        }
        if (lane == 0) sG[BT] = g_row[int64_t(t_last) * p.HV];
        __syncwarp();
      }
      if (lane == 0) {
        uint8_t* st = smem + s * Map::STAGE;
        cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&full_bar[s], tx_bytes);
        const int t0i = t0;
        for (int kb = 0; kb < KB; ++kb) {
          SM90_TMA_LOAD_4D::copy(&p.tma_k, &full_bar[s], 0, st + Map::K_OFF + kb * BT * 128, kb * 64, h, t0i, b_row);
          SM90_TMA_LOAD_4D::copy(&p.tma_q, &full_bar[s], 0, st + Map::Q_OFF + kb * BT * 128, kb * 64, h, t0i, b_row);
          SM90_TMA_LOAD_4D::copy(&p.tma_w, &full_bar[s], 0, st + Map::W_OFF + kb * BT * 128, kb * 64, hv, t0i, b_row);
        }
        for (int wg = 0; wg < NWG; ++wg) {
          const int v0 = (blockIdx.x * NWG + wg) * BV;
          SM90_TMA_LOAD_4D::copy(&p.tma_do, &full_bar[s], 0, st + Map::DO_OFF + wg * Map::VTILE, v0, hv, t0i, b_row);
          SM90_TMA_LOAD_4D::copy(&p.tma_dv, &full_bar[s], 0, st + Map::DV_OFF + wg * Map::VTILE, v0, hv, t0i, b_row);
        }
        if (use_gk) {
          const float* gk_row = p.gk + ((int64_t(b_row) * p.T + t_last) * p.HV + hv) * K;
          SM90_BULK_COPY_G2S::copy(gk_row, &full_bar[s], smem + Map::GK_OFF + s * K * 4, K * 4);
        }
      }
      if (++s == STAGES) s = 0, phase ^= 1u;
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
  const int b_row = ext.b_row, NC = ext.nc;
  // Warpgroup wg owns V columns [v0, v0 + 64): its own chain (c, sBh, sDv2, stores);
  // k, q, w and the gates of a stage are shared by the NWG warpgroups.
  const int wg = tid / WG_THREADS;
  const int ctid = tid % WG_THREADS;
  const bool leader = ctid == 0;  // issues the warpgroup's TMA stores
  const int v0 = (blockIdx.x * NWG + wg) * BV;
  auto wg_sync = [&]() { named_sync(WG_THREADS, 1 + wg); };

  // wgmma partitions. DV: (M = t, N = v, K = k). QD/WD: (M = k, N = v, K = t).
  using LayoutKt = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{}, Shape<Int<BT>, Int<K>>{}));
  using LayoutQt = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<T>{}, Shape<Int<K>, Int<BT>>{}, Step<_2, _1>{}));
  using LayoutVt = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<T>{}, Shape<Int<BV>, Int<BT>>{}));
  using LayoutBh = cute::conditional_t<
      SVF, decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{}, Shape<Int<BV>, Int<K>>{})),
      decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<T>{}, Shape<Int<BV>, Int<K>>{}))>;

  auto mma_dv = make_tiled_mma(typename MmaOps::DV{});
  auto mma_upd = make_tiled_mma(typename MmaOps::UPD{});
  auto thr_dv = mma_dv.get_thread_slice(ctid);
  auto thr_upd = mma_upd.get_thread_slice(ctid);

  // Register accumulators and the (row, col) each of their elements holds.
  Tensor accC = partition_fragment_C(mma_upd, Shape<Int<K>, Int<BV>>{});   // c = -b
  Tensor accQD = partition_fragment_C(mma_upd, Shape<Int<K>, Int<BV>>{});
  Tensor accDV = partition_fragment_C(mma_dv, Shape<Int<BT>, Int<BV>>{});
  constexpr int NB = BV / 2;          // accumulator elements per 64-row block per thread
  constexpr int MB = K / 64;          // 64-row blocks of the [K, BV] state
  static_assert(size(accDV) == NB && size(accC) == NB * MB, "wgmma D fragment layout");
  const FragGeom fg(ctid);
  const SvfGeom sg(fg);  // used with SVF only

  auto s_at = [&](int off) { return make_smem_ptr(reinterpret_cast<T*>(smem + off)); };
  const int BH_OFF = Map::BH_OFF + wg * Map::BH;          // this warpgroup's sBh
  const uint32_t sBh_u32 = smem_u32 + BH_OFF;
  const int DO_OFF = Map::DO_OFF + wg * Map::VTILE;       // within a stage
  const int DV_OFF = Map::DV_OFF + wg * Map::VTILE;

  // (sequence, value head) for dht / dh0, from blockIdx.z afresh: a 64-bit n kept from the
  // prologue would be live across the role split.
  const int64_t nh = int64_t(ctaid_z()) * p.HV + hv;
  // Element (k, v) of this CTA's [K, V] (or [V, K] with SVF) slice of dht / dh0.
  auto state_at = [&](int row, int col) -> int64_t {
    return SVF ? (nh * p.V + v0 + col) * K + row : (nh * K + row) * p.V + v0 + col;
  };

  // c = -dht (or 0); bf16(b) -> sBh.
  {
    CUTE_UNROLL
    for (int i = 0; i < NB * MB; i += 2) {
      const int e = i % NB, mb = i / NB;
      const int row = fg.row(e) + 64 * mb, col = fg.col(e);
      float2 x = make_float2(0.f, 0.f);
      if (p.flags & FLAG_DHT) {
        if constexpr (SVF)
          x = make_float2(p.dht[state_at(row, col)], p.dht[state_at(row, col + 1)]);
        else
          x = *reinterpret_cast<const float2*>(p.dht + state_at(row, col));
      }
      accC(i) = -x.x;
      accC(i + 1) = -x.y;
      store_bh_pair<T, SVF>(sBh_u32, fg, sg, e, mb, x.x, x.y);
    }
    fence_proxy_async();
    wg_sync();
  }

  // TMA store groups of a warpgroup (its leader thread): per chunk i, {dh[i]} is committed
  // at the chunk's start (source sBh) and {dv2[i]} mid-chunk (source sDv2[i % 2]). Before
  // the warpgroup barrier that precedes the dv2[i] store, the leader waits until every
  // earlier group has been read out of shared memory: dh[i] (so that sBh may be rewritten
  // at the chunk's end) and dv2[i - 1] (so that chunk i + 1 may rewrite sDv2[(i + 1) % 2]).
  for (int i = 0; i < NC; ++i) {
    const int c = NC - 1 - i;
    const int s = i % STAGES;
    const int64_t chunk = boh + c;
    const int rows = int(min(int64_t(BT), len - int64_t(c) * BT));  // valid tokens of the chunk
    const bool partial = varlen && rows < BT;
    uint8_t* st = smem + s * Map::STAGE;
    const uint32_t st_u32 = smem_u32 + s * Map::STAGE;
    const int dv2_buf = i % DV2_BUFS;
    const int DV2_OFF = Map::DV2_OFF + (wg * DV2_BUFS + dv2_buf) * Map::VTILE;
    const uint32_t sDv2_u32 = smem_u32 + DV2_OFF;

    // dh[chunk] = bf16(b), written to sBh by the previous chunk (or the prologue).
    if (leader) {
      if constexpr (SVF) {
        CUTE_UNROLL
        for (int kb = 0; kb < KB; ++kb)  // [64 v][64 k] boxes of the [V, K] checkpoint
          SM90_TMA_STORE_4D::copy(&p.tma_dh, smem + BH_OFF + kb * 8192, kb * 64, v0, hv, int(chunk));
      } else {
        SM90_TMA_STORE_4D::copy(&p.tma_dh, smem + BH_OFF, v0, 0, hv, int(chunk));
      }
      tma_store_arrive();
    }

    wait_bar(&full_bar[s], (i / STAGES) & 1);

    // Rows of do, q and w past the sequence's end (varlen) are zeroed; with g, do[t] *= exp2(g[t]).
    const float* sG = reinterpret_cast<const float*>(smem + Map::G_OFF) + s * Map::G_LEN;
    if (partial || use_g) {
      // 64 rows x 8 chunks of 16 bytes; the swizzle permutes chunks within a row only.
      for (int j = ctid; j < BT * 8; j += WG_THREADS) {
        const int row = j >> 3;
        const uint32_t a = st_u32 + DO_OFF + row * 128 + (j & 7) * 16;
        if (row >= rows) {
          st_shared_v4(a, make_uint4(0, 0, 0, 0));
        } else if (use_g) {
          const float e = fast_exp2(sG[row]);
          uint4 u = ld_shared_v4(a);
          uint32_t* w = reinterpret_cast<uint32_t*>(&u);
          CUTE_UNROLL
          for (int q = 0; q < 4; ++q) {
            float2 f = unpack2<T>(w[q]);
            w[q] = pack2<T>(f.x * e, f.y * e);
          }
          st_shared_v4(a, u);
        }
      }
      if (partial) {
        // q and w rows past the sequence's end are zeroed as well: the zero rows of do
        // and dv2 already remove their terms from QD and WD, but 0 * NaN or 0 * Inf in
        // memory outside the sequence (the never-written padding of a packed batch)
        // would not vanish. fla masks these loads. Each tile is K/64 boxes of
        // [64 rows][128 bytes]; q and w are shared, so with two warpgroups each zeroes one.
        for (int j = ctid; j < KB * BT * 8; j += WG_THREADS) {
          const int row = (j >> 3) % BT;
          if (row >= rows) {
            const uint32_t off = (j >> 3) * 128 + (j & 7) * 16;  // box * BT * 128 + row * 128 + chunk
            if (NWG == 1 || wg == 0) st_shared_v4(st_u32 + Map::Q_OFF + off, make_uint4(0, 0, 0, 0));
            if (NWG == 1 || wg == 1) st_shared_v4(st_u32 + Map::W_OFF + off, make_uint4(0, 0, 0, 0));
          }
        }
      }
      fence_proxy_async();
      if (NWG > 1 && partial)
        named_sync(CONSUMERS, ALL_CONSUMERS);
      else
        wg_sync();
    }

    // DV = k . bf16(b)  and  QD = q^T . do, one batch each.
    {
      Tensor sK = make_tensor(s_at(s * Map::STAGE + Map::K_OFF), LayoutKt{});
      Tensor sBh = make_tensor(s_at(BH_OFF), LayoutBh{});
      Tensor tA = thr_dv.make_fragment_A(thr_dv.partition_A(sK));
      Tensor tB = thr_dv.make_fragment_B(thr_dv.partition_B(sBh));
      warpgroup_fence_operand(accDV);
      warpgroup_arrive();
      mma_dv.accumulate_ = GMMA::ScaleOut::Zero;
      CUTE_UNROLL
      for (int kb = 0; kb < size<2>(tA); ++kb) {
        cute::gemm(mma_dv, tA(_, _, kb), tB(_, _, kb), accDV);
        mma_dv.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_fence_operand(accDV);
    }
    {
      Tensor sQ = make_tensor(s_at(s * Map::STAGE + Map::Q_OFF), LayoutQt{});
      Tensor sDo = make_tensor(s_at(s * Map::STAGE + DO_OFF), LayoutVt{});
      Tensor tA = thr_upd.make_fragment_A(thr_upd.partition_A(sQ));
      Tensor tB = thr_upd.make_fragment_B(thr_upd.partition_B(sDo));
      warpgroup_fence_operand(accQD);
      warpgroup_arrive();
      mma_upd.accumulate_ = GMMA::ScaleOut::Zero;
      CUTE_UNROLL
      for (int kb = 0; kb < size<2>(tA); ++kb) {
        cute::gemm(mma_upd, tA(_, _, kb), tB(_, _, kb), accQD);
        mma_upd.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_fence_operand(accQD);
    }
    warpgroup_wait<1>();
    warpgroup_fence_operand(accDV);

    // dv2 = gate . DV + dv, rounded; zero past the sequence's end.
    {
      // Per thread: two rows (h = 0, 1), so two gates and two row masks.
      float gate[2] = {1.f, 1.f};
      if (use_g) {
        const float g_last = sG[BT];
        gate[0] = fast_exp2(g_last - sG[fg.row(0)]);
        gate[1] = fast_exp2(g_last - sG[fg.row(2)]);
      }
      T* dv2_g = reinterpret_cast<T*>(p.dv2);
      CUTE_UNROLL
      for (int j = 0; j < NB; j += 2) {
        const int row = fg.row(j), col = fg.col(j);
        const float gt = gate[(j >> 1) & 1];
        const uint32_t off = fg.sw(j);
        const float2 d = unpack2<T>(ld_shared_u32(st_u32 + DV_OFF + off));
        uint32_t packed = pack2<T>(accDV(j) * gt + d.x, accDV(j + 1) * gt + d.y);
        if (row >= rows) packed = 0u;
        st_shared_u32(sDv2_u32 + off, packed);
        if (partial && row < rows) {
          const int64_t t = bos + int64_t(c) * BT + row;
          *reinterpret_cast<uint32_t*>(dv2_g + (t * p.HV + hv) * p.V + v0 + col) = packed;
        }
      }
      fence_proxy_async();
      if (leader) tma_store_wait<0>();  // dh[i] and dv2[i - 1] read out of smem
      wg_sync();
      if (leader) {
        if (!partial)
          SM90_TMA_STORE_4D::copy(&p.tma_dv2, smem + DV2_OFF, v0, hv, int(bos + int64_t(c) * BT), b_row);
        tma_store_arrive();
      }
    }

    // c = decay . c - scale . QD
    warpgroup_wait<0>();
    warpgroup_fence_operand(accQD);
    {
      const float* sGk = reinterpret_cast<const float*>(smem + Map::GK_OFF) + s * K;
      const float g_decay = use_g ? fast_exp2(sG[BT]) : 1.f;
      float decay[MB][2];  // the 2 * MB distinct rows this thread owns
      CUTE_UNROLL
      for (int mb = 0; mb < MB; ++mb) {
        CUTE_UNROLL
        for (int hh = 0; hh < 2; ++hh)
          decay[mb][hh] = use_gk ? fast_exp2(sGk[fg.row(2 * hh) + 64 * mb]) * g_decay : g_decay;
      }
      const float scale = p.scale;
      CUTE_UNROLL
      for (int j = 0; j < NB * MB; ++j) {
        accC(j) = decay[j / NB][((j % NB) >> 1) & 1] * accC(j) - scale * accQD(j);
      }
    }

    // c += w^T . dv2  (c = -b, so this is b -= w^T dv2)
    {
      Tensor sW = make_tensor(s_at(s * Map::STAGE + Map::W_OFF), LayoutQt{});
      Tensor sDv2 = make_tensor(s_at(DV2_OFF), LayoutVt{});
      Tensor tA = thr_upd.make_fragment_A(thr_upd.partition_A(sW));
      Tensor tB = thr_upd.make_fragment_B(thr_upd.partition_B(sDv2));
      warpgroup_fence_operand(accC);
      warpgroup_arrive();
      mma_upd.accumulate_ = GMMA::ScaleOut::One;
      CUTE_UNROLL
      for (int kb = 0; kb < size<2>(tA); ++kb) {
        cute::gemm(mma_upd, tA(_, _, kb), tB(_, _, kb), accC);
      }
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      warpgroup_fence_operand(accC);
    }

    // The stage's operands are consumed (every read of this thread, generic or wgmma,
    // is complete): hand it back to the producer.
    arrive_bar(&empty_bar[s]);

    // bf16(b) for the next chunk -> sBh (dh[i] was read out before the barrier above;
    // this warpgroup's DV wgmma, its other reader, has completed).
    if (i + 1 < NC) {
      CUTE_UNROLL
      for (int j = 0; j < NB * MB; j += 2) {
        store_bh_pair<T, SVF>(sBh_u32, fg, sg, j % NB, j / NB, -accC(j), -accC(j + 1));
      }
      fence_proxy_async();
      wg_sync();
    }
  }

  // dh0 = b after the oldest chunk.
  if (p.flags & FLAG_DH0) {
    CUTE_UNROLL
    for (int j = 0; j < NB * MB; j += 2) {
      const int row = fg.row(j % NB) + 64 * (j / NB), col = fg.col(j % NB);
      if constexpr (SVF) {
        p.dh0[state_at(row, col)] = -accC(j);
        p.dh0[state_at(row, col + 1)] = -accC(j + 1);
      } else {
        *reinterpret_cast<float2*>(p.dh0 + state_at(row, col)) = make_float2(-accC(j), -accC(j + 1));
      }
    }
  }
  if (leader) tma_store_wait<0>();  // smem must outlive the last bulk stores' reads
}

}  // namespace sm90
}  // namespace kda_dhu

#define KDA_DHU_SM90_ENTRY(NAME, K, T, NWG, SVF)                                           \
  extern "C" __global__ void __launch_bounds__(kda_dhu::sm90::num_threads<NWG>(), 1)     \
      NAME(const __grid_constant__ kda_dhu::DhuParams p) {                               \
    kda_dhu::sm90::dhu_kernel<K, T, NWG, SVF>(p);                                         \
  }

// One warpgroup per CTA (64 V columns): the most CTAs, for grids below a few waves.
KDA_DHU_SM90_ENTRY(kda_dhu_sm90_k64_bf16, 64, cutlass::bfloat16_t, 1, false)
KDA_DHU_SM90_ENTRY(kda_dhu_sm90_k64_fp16, 64, cutlass::half_t, 1, false)
KDA_DHU_SM90_ENTRY(kda_dhu_sm90_k128_bf16, 128, cutlass::bfloat16_t, 1, false)
KDA_DHU_SM90_ENTRY(kda_dhu_sm90_k128_fp16, 128, cutlass::half_t, 1, false)
// Two warpgroups per CTA (128 V columns of one head): k, q, w read once for both, two
// independent chains per SM.
KDA_DHU_SM90_ENTRY(kda_dhu_sm90_k64_bf16_wg2, 64, cutlass::bfloat16_t, 2, false)
KDA_DHU_SM90_ENTRY(kda_dhu_sm90_k64_fp16_wg2, 64, cutlass::half_t, 2, false)
KDA_DHU_SM90_ENTRY(kda_dhu_sm90_k128_bf16_wg2, 128, cutlass::bfloat16_t, 2, false)
KDA_DHU_SM90_ENTRY(kda_dhu_sm90_k128_fp16_wg2, 128, cutlass::half_t, 2, false)
// The same eight with state_v_first: dh, dht, dh0 are [.., V, K] (h0 only decides dh0).
KDA_DHU_SM90_ENTRY(kda_dhu_sm90_k64_bf16_svf, 64, cutlass::bfloat16_t, 1, true)
KDA_DHU_SM90_ENTRY(kda_dhu_sm90_k64_fp16_svf, 64, cutlass::half_t, 1, true)
KDA_DHU_SM90_ENTRY(kda_dhu_sm90_k128_bf16_svf, 128, cutlass::bfloat16_t, 1, true)
KDA_DHU_SM90_ENTRY(kda_dhu_sm90_k128_fp16_svf, 128, cutlass::half_t, 1, true)
KDA_DHU_SM90_ENTRY(kda_dhu_sm90_k64_bf16_wg2_svf, 64, cutlass::bfloat16_t, 2, true)
KDA_DHU_SM90_ENTRY(kda_dhu_sm90_k64_fp16_wg2_svf, 64, cutlass::half_t, 2, true)
KDA_DHU_SM90_ENTRY(kda_dhu_sm90_k128_bf16_wg2_svf, 128, cutlass::bfloat16_t, 2, true)
KDA_DHU_SM90_ENTRY(kda_dhu_sm90_k128_fp16_wg2_svf, 128, cutlass::half_t, 2, true)

// The register-state variant (dhu_sm90_regstate.cuh): the state held transposed in
// registers, both chain products with A from registers. Same slots, `_rs` names.
#define KDA_DHU_SM90_RS_ENTRY(NAME, K, T, NWG, SVF)                                          \
  extern "C" __global__ void __launch_bounds__(kda_dhu::sm90_regstate::num_threads<NWG>(), 1) \
      NAME(const __grid_constant__ kda_dhu::DhuParams p) {                                   \
    kda_dhu::sm90_regstate::dhu_regstate_kernel<K, T, NWG, SVF>(p);                           \
  }

KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k64_bf16, 64, cutlass::bfloat16_t, 1, false)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k64_fp16, 64, cutlass::half_t, 1, false)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k128_bf16, 128, cutlass::bfloat16_t, 1, false)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k128_fp16, 128, cutlass::half_t, 1, false)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k64_bf16_wg2, 64, cutlass::bfloat16_t, 2, false)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k64_fp16_wg2, 64, cutlass::half_t, 2, false)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k128_bf16_wg2, 128, cutlass::bfloat16_t, 2, false)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k128_fp16_wg2, 128, cutlass::half_t, 2, false)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k64_bf16_svf, 64, cutlass::bfloat16_t, 1, true)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k64_fp16_svf, 64, cutlass::half_t, 1, true)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k128_bf16_svf, 128, cutlass::bfloat16_t, 1, true)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k128_fp16_svf, 128, cutlass::half_t, 1, true)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k64_bf16_wg2_svf, 64, cutlass::bfloat16_t, 2, true)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k64_fp16_wg2_svf, 64, cutlass::half_t, 2, true)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k128_bf16_wg2_svf, 128, cutlass::bfloat16_t, 2, true)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k128_fp16_wg2_svf, 128, cutlass::half_t, 2, true)
