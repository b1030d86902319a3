// Stage 4 of fla's chunked gated delta rule backward on Blackwell (sm_100a):
// the reverse state scan `chunk_gated_delta_rule_bwd_dhu`, TMA + tcgen05 (UMMA) +
// tensor memory. The C++ port of seed/bwd_dhu_sm100_cutedsl.py: same warp roles, same
// two update accumulators (so fla's "scale after the fp32 dot" order is kept), with the
// state laid out [K, V] so that one bf16 copy of b serves as both the next DV's B
// operand and the dh checkpoint's TMA source (the seed kept b^T and staged a second,
// transposed copy for the checkpoint).
//
// One CTA owns (sequence n, value head hv, V tile of BV = 64 columns) and walks the
// sequence's chunks of BT = 64 tokens newest first. The state gradient b [K, BV] lives
// in fp32 registers of the recurrence warpgroup for the whole walk. Per chunk (SPEC.md):
//
//     dh[chunk]  = bf16(b)                                TMA store of sBh
//     DV [BT,BV] = k [BT,K] . bf16(b) [K,BV]               UMMA M=64,  A k-major,  B mn-major -> TMEM
//     dv2        = DV + dv  -> q.dtype                     SIMT: TMEM -> registers -> sDv2 -> TMA store
//     QD [K,BV]  = q^T [K,BT] . do [BT,BV]                 UMMA M=K,   A mn-major, B mn-major -> TMEM
//     WD [K,BV]  = w^T [K,BT] . dv2 [BT,BV]                UMMA M=K,   A mn-major, B mn-major -> TMEM
//     b          = exp2(gk[e-1]) . b + (scale * QD - WD)   SIMT fp32 registers, per-K-row decay
//   after the oldest chunk: dh0 = b (fp32, plain global stores).
//
// fla's arithmetic order is kept: b is rounded to q.dtype before k.b, dv2 is rounded
// before w^T.dv2, scale multiplies the fp32 q^T.do dot after accumulation, and the
// decay multiplies b before the two dots are added (fla: b *= exp2(gk_last); b += ...).
// Only the MMA's summation order differs from tl.dot.
//
// Envelope (the seed's kernel; src/plan.rs plans this kernel only inside it): gk gate,
// H == HV, dense batches, dht given, T % 64 == 0, K in {64, 128}, V % 64 == 0,
// bf16/fp16. FLAG_G and FLAG_VARLEN are never set for this kernel and it ignores them.
// The code is also written for no gate (decay 1), no dht (b starts at 0), H | HV and a
// short last chunk (TMA zero fill / clipped stores), but those are outside the planner's
// envelope and have never been exercised.
//
// Warp roles (256 threads, 8 warps):
//   warp 0      TMA producer (lane 0): k, q, w (K/64 boxes each), do, dv tiles and the gk
//               row e-1 (bulk copy) of chunk i into ring stage i % 2.
//   warp 1      MMA issuer (whole warp, one elected lane issues): DV, QD, WD with
//               tcgen05.mma, completion by tcgen05.commit to mbarriers; allocates and
//               frees the tensor memory (256 columns) and relinquishes the alloc permit.
//   warps 2, 3  idle (they only join the CTA-wide barriers), as in the seed: the
//               recurrence must be warps 4-7, a whole warpgroup, because warp w may only
//               tcgen05.ld lanes 32 (w % 4) .. 32 (w % 4) + 31 of tensor memory.
//   warps 4-7   recurrence warpgroup: tcgen05.ld of DV/QD/WD, dv2, the fp32 update, bf16
//               b, dht/dh0; its thread 0 (the "leader") issues the TMA stores.
//
// Tensor memory (256 columns allocated, fp32 accumulators):
//   DV at columns [0, 64)    M = 64 -> "layout F": row m in lane 32 (m / 16) + m % 16
//   QD at columns [64, 128)  M = K: K = 128 -> row m in lane m; K = 64 -> layout F
//   WD at columns [128, 192) like QD
// QD and WD are [K, BV] with M = K (the seed had [BV, K], M = BV = 64): for K = 128 they
// use the whole 128-lane datapath, and each recurrence thread then owns one row k of b,
// so it needs one decay value and writes bf16(b) as one 128-byte swizzled row (eight
// 16-byte stores) of the [k][v] tile that DV and the dh checkpoint both read.
// Fragments in registers: tcgen05.ld.16x256b of a layout-F accumulator gives warp q the
// rows 16q + l/4 and 16q + l/4 + 8 at columns 8j + 2(l%4) + {0,1} -- exactly the wgmma
// fragment geometry of dhu_sm90.cu (FragGeom below); tcgen05.ld.32x32b of an M = 128
// accumulator gives thread l of warp q the whole row 32q + l (64 consecutive columns).
//
// Barriers (mbarriers; "chunk i" = iteration i, parity i & 1 unless noted):
//   full[s]   count 1 + tx bytes      producer arrive.expect_tx; waited by MMA and SIMT (parity (i/2)&1)
//   empty[s]  count 2                 tcgen05.commit after WD(i) + SIMT leader after its last read of
//                                     the stage (dv, gk); only for chunks the producer will refill
//   bh_full   count 1                 SIMT leader: bf16 b of chunk i is in sBh[i % 3] (MMA waits)
//   dv_full   count 1                 tcgen05.commit after DV(i)  (SIMT waits)
//   qd_full   count 1                 tcgen05.commit after QD(i)  (SIMT waits)
//   dv2_full  count 1                 SIMT leader: dv2 of chunk i is in sDv2[i % 2] (MMA waits)
//   wd_full   count 1                 tcgen05.commit after WD(i)  (SIMT waits)
// Named barrier 1 (the 128 recurrence threads) orders their generic smem writes (sDv2,
// sBh; each thread fences with fence.proxy.async first) before the leader's mbarrier
// arrive / TMA store, both async-proxy consumers. Tensor-memory hand-offs follow the
// PTX canonical patterns: commit -> wait -> tcgen05.fence::after_thread_sync -> ld, and
// ld -> wait::ld -> tcgen05.fence::before_thread_sync -> barrier -> ... -> wait ->
// tcgen05.fence::after_thread_sync -> mma. docs/dhu_sm100_pipeline.md draws the schedule
// and proves every buffer reuse.
//
// Shared memory operands, all 128-byte swizzled (TMA SWIZZLE_128B == CuTe's UMMA SW128
// atoms), tile bases 1024-byte aligned; the TMA boxes are the sm90 kernel's (one set of
// maps for both architectures, dhu_params.h):
//   sK   (t, k)  k-major  : A of DV          [K/64 boxes][64 rows t][64 k]
//   sQ,sW(k, t)  mn-major : A of QD / WD     the same bytes as TMA wrote them (M = k contiguous)
//   sDo, sDv2 (v, t) mn-major : B of QD / WD [64 rows t][64 v]; sDv (same layout) is read by threads
//   sBh  (v, k)  mn-major : B of DV and the dh checkpoint's TMA source  [K rows k][64 v]
// sBh is triple-buffered and sDv2 double-buffered so that the TMA stores reading them
// never stall the serial chain (one bulk async-group per chunk, {dh, dv2}; the leader
// waits for the group of chunk i-1 to have read its smem just before barrier B of
// chunk i, which is what makes the writes of chunk i+1 safe).

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/copy_sm100.hpp>
#include <cute/arch/tmem_allocator_sm100.hpp>
#include <cute/atom/mma_traits_sm100.hpp>
#include <cutlass/arch/barrier.h>

#include "dhu_common.cuh"
#include "dhu_layout.h"
#include "dhu_params.h"

#if defined(__CUDA_ARCH__) && !(defined(CUTE_ARCH_TCGEN05_TMEM_ENABLED) && defined(CUTE_ARCH_TCGEN05_F16F32_MMA_ENABLED))
#error "dhu_sm100.cu needs sm_100a (tcgen05 MMA and tensor memory): compile with -gencode arch=compute_100a,code=sm_100a"
#endif

namespace kda_dhu {
namespace sm100 {

using namespace cute;

// BT, BV, NUM_THREADS, STAGES, BH_BUFS, DV2_BUFS and SmemMap (the shared memory map, in
// bytes from a 1024-aligned base; the host asks for SmemMap::DYNAMIC_BYTES): dhu_layout.h,
// their one owner.
constexpr int PRODUCER_WARP = 0;
constexpr int MMA_WARP = 1;
constexpr int SIMT_WARP0 = 4;                      // warps 4-7: one whole warpgroup
constexpr int NUM_SIMT_THREADS = 128;
constexpr int SIMT_BARRIER = 1;                    // named barrier id (0 is __syncthreads)
constexpr uint32_t TMEM_COLS = 256;                // power of two >= 32; DV + QD + WD = 192 used
constexpr uint32_t DV_COL = 0;
constexpr uint32_t QD_COL = 64;
constexpr uint32_t WD_COL = 128;

template <class T, int K>
struct Mma {
  // DV = k [t, k] . bh [k, v]:     M = t (BT), N = v, A k-major, B mn-major (v contiguous)
  using DV = SM100_MMA_F16BF16_SS<T, T, float, BT, BV, UMMA::Major::K, UMMA::Major::MN>;
  // QD = q^T . do, WD = w^T . dv2: M = k (K), N = v, A mn-major (k contiguous), B mn-major
  using UPD = SM100_MMA_F16BF16_SS<T, T, float, K, BV, UMMA::Major::MN, UMMA::Major::MN>;
};

__device__ __forceinline__ void simt_sync() { named_sync(NUM_SIMT_THREADS, SIMT_BARRIER); }

// tcgen05 ordering across threads (PTX ISA, tcgen05 memory consistency model).
__device__ __forceinline__ void tc_fence_before_sync() {
  asm volatile("tcgen05.fence::before_thread_sync;" ::: "memory");
}
__device__ __forceinline__ void tc_fence_after_sync() {
  asm volatile("tcgen05.fence::after_thread_sync;" ::: "memory");
}

// tcgen05.ld of 32 32-bit registers, then tcgen05.wait::ld. The empty asm statements
// after the wait "redefine" every register, so no use of a loaded value can be
// scheduled above the wait by the compiler (the ld's outputs are undefined until then).
template <class Op, size_t... I>
__device__ __forceinline__ void tmem_ld_impl(uint32_t taddr, uint32_t (&r)[32], cute::index_sequence<I...>) {
  Op::copy(taddr, r[I]...);
}
template <class Op>
__device__ __forceinline__ void tmem_ld32(uint32_t taddr, uint32_t (&r)[32]) {
  static_assert(sizeof(typename Op::DRegisters) == 32 * sizeof(uint32_t), "a 32-register tcgen05.ld");
  tmem_ld_impl<Op>(taddr, r, cute::make_index_sequence<32>{});
}
__device__ __forceinline__ void tmem_wait_ld(uint32_t (&r)[32]) {
  asm volatile("tcgen05.wait::ld.sync.aligned;" ::: "memory");
  CUTE_UNROLL
  for (int i = 0; i < 32; ++i) asm volatile("" : "+r"(r[i]));
}

using TmemLd16x256 = SM100::TMEM::LOAD::SM100_TMEM_LOAD_16dp256b8x;  // layout F, 64 columns
using TmemLd32x32 = SM100::TMEM::LOAD::SM100_TMEM_LOAD_32dp32b32x;   // M = 128, 32 columns

// How the recurrence warpgroup holds the fp32 state b [K, BV] (and reads QD / WD):
//   K = 128 (M = 128 accumulators): thread l of warp q owns row k = 32q + l, all 64
//     columns, element e = column e; read as two tcgen05.ld.32x32b.x32.
//   K = 64 (layout F): FragGeom, 32 elements, rows 16q + l/4 (+8); one 16x256b.x8.
template <int K>
struct State;

template <>
struct State<128> {
  static constexpr int N = 64;
  static constexpr int CHUNKS = 2;               // tcgen05.ld calls of 32 registers
  int k;                                         // this thread's row
  __device__ __forceinline__ explicit State(int t) : k(t) {}
  // Register e of chunk c is column 32c + e of this thread's lane (element 32c + e).
  __device__ __forceinline__ static void ld(uint32_t taddr, int chunk, uint32_t (&r)[32]) {
    tmem_ld32<TmemLd32x32>(taddr + uint32_t(32 * chunk), r);
  }
  // gk[e-1] of this thread's row (for element e), from the stage's gk row in smem.
  __device__ __forceinline__ float gk_last(uint32_t sgk, int /*e*/) const { return ld_shared_f32(sgk + 4u * uint32_t(k)); }
  template <class T>
  __device__ __forceinline__ void store_bh(uint32_t sbh, const float (&b)[N]) const {
    const uint32_t row = sbh + uint32_t(k) * 128u;
    const uint32_t x = uint32_t(k & 7);
    CUTE_UNROLL
    for (int j = 0; j < 8; ++j) {
      st_shared_v4(row + ((uint32_t(j) ^ x) << 4), pack2<T>(b[8 * j], b[8 * j + 1]), pack2<T>(b[8 * j + 2], b[8 * j + 3]),
                   pack2<T>(b[8 * j + 4], b[8 * j + 5]), pack2<T>(b[8 * j + 6], b[8 * j + 7]));
    }
  }
  // fp32 [K, V] rows in global memory (dht in, dh0 out), 16-byte vectors.
  __device__ __forceinline__ void load_global(const float* base, int64_t ld, float (&b)[N]) const {
    const float4* src = reinterpret_cast<const float4*>(base + int64_t(k) * ld);
    CUTE_UNROLL
    for (int j = 0; j < N / 4; ++j) {
      const float4 x = src[j];
      b[4 * j] = x.x;
      b[4 * j + 1] = x.y;
      b[4 * j + 2] = x.z;
      b[4 * j + 3] = x.w;
    }
  }
  __device__ __forceinline__ void store_global(float* base, int64_t ld, const float (&b)[N]) const {
    float4* dst = reinterpret_cast<float4*>(base + int64_t(k) * ld);
    CUTE_UNROLL
    for (int j = 0; j < N / 4; ++j) dst[j] = make_float4(b[4 * j], b[4 * j + 1], b[4 * j + 2], b[4 * j + 3]);
  }
};

template <>
struct State<64> {
  static constexpr int N = 32;
  static constexpr int CHUNKS = 1;
  FragGeom fg;
  __device__ __forceinline__ explicit State(int t) : fg(t) {}
  // Register i is FragGeom element i (CuTe's Copy_Traits<SM100_TMEM_LOAD_16dp256b8x>:
  // repetition j covers columns 8j..8j+7 in registers 4j..4j+3).
  __device__ __forceinline__ static void ld(uint32_t taddr, int /*chunk*/, uint32_t (&r)[32]) {
    tmem_ld32<TmemLd16x256>(taddr, r);
  }
  __device__ __forceinline__ float gk_last(uint32_t sgk, int e) const { return ld_shared_f32(sgk + 4u * uint32_t(fg.row(e))); }
  template <class T>
  __device__ __forceinline__ void store_bh(uint32_t sbh, const float (&b)[N]) const {
    CUTE_UNROLL
    for (int e = 0; e < N; e += 2) st_shared_u32(sbh + fg.sw(e), pack2<T>(b[e], b[e + 1]));
  }
  __device__ __forceinline__ void load_global(const float* base, int64_t ld, float (&b)[N]) const {
    CUTE_UNROLL
    for (int e = 0; e < N; e += 2) {
      const float2 x = *reinterpret_cast<const float2*>(base + int64_t(fg.row(e)) * ld + fg.col(e));
      b[e] = x.x;
      b[e + 1] = x.y;
    }
  }
  __device__ __forceinline__ void store_global(float* base, int64_t ld, const float (&b)[N]) const {
    CUTE_UNROLL
    for (int e = 0; e < N; e += 2)
      *reinterpret_cast<float2*>(base + int64_t(fg.row(e)) * ld + fg.col(e)) = make_float2(b[e], b[e + 1]);
  }
};

template <int K, class T>
__device__ __forceinline__ void dhu_kernel(const DhuParams& p) {
  using Map = SmemMap<K>;
  using St = State<K>;
  constexpr int KB = K / 64;  // 64-wide K boxes per tile

  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const uint32_t smem_u32 = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + Map::BAR_OFF);
  uint64_t* full_bar = bars;
  uint64_t* empty_bar = bars + STAGES;
  uint64_t* bh_full = bars + 2 * STAGES;
  uint64_t* dv_full = bh_full + 1;
  uint64_t* qd_full = bh_full + 2;
  uint64_t* dv2_full = bh_full + 3;
  uint64_t* wd_full = bh_full + 4;
  uint32_t* tmem_ptr_slot = reinterpret_cast<uint32_t*>(smem + Map::TMEM_PTR_OFF);

  const int tid = threadIdx.x;
  const int warp = tid >> 5;
  const int lane = tid & 31;
  const int v_tile = blockIdx.x;
  const int hv = blockIdx.y;
  const int n = blockIdx.z;                    // batch row (dense: sequence == batch row)
  const int h = hv / (p.HV / p.H);
  const bool use_gk = p.flags & FLAG_GK;
  const int NC = p.NT;                         // chunks of this sequence (dense: ceil(T / 64))
  const int64_t boh = int64_t(n) * p.NT;       // its first chunk in dh
  const int v0 = v_tile * BV;

  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      cutlass::arch::ClusterTransactionBarrier::init(&full_bar[s], 1);
      cutlass::arch::ClusterBarrier::init(&empty_bar[s], 2);
    }
    for (int b = 0; b < 5; ++b) cutlass::arch::ClusterBarrier::init(&bh_full[b], 1);
    cutlass::arch::fence_barrier_init();
  }
  // Tensor memory: warp 1 allocates it (and frees it at the end) and then relinquishes
  // the allocation permit: this CTA never allocates again.
  cute::TMEM::Allocator1Sm tmem_alloc;
  if (warp == MMA_WARP) {
    tmem_alloc.allocate(TMEM_COLS, tmem_ptr_slot);
    tmem_alloc.release_allocation_lock();
  }
  tc_fence_before_sync();
  __syncthreads();
  tc_fence_after_sync();
  const uint32_t tmem_base = *reinterpret_cast<volatile uint32_t*>(tmem_ptr_slot);

  if (warp == PRODUCER_WARP) {
    // ------------------------------------------------------------------ TMA producer
    if (lane == 0) {
      const uint32_t tx_bytes = uint32_t(3 * Map::KTILE + 2 * Map::VTILE + (use_gk ? K * 4 : 0));
      for (int i = 0; i < NC; ++i) {
        const int c = NC - 1 - i;
        const int s = i % STAGES;
        if (i >= STAGES) wait_bar(&empty_bar[s], ((i / STAGES) + 1) & 1);
        const int t0 = c * BT;
        const int64_t t_last = min(int64_t(c + 1) * BT, p.T) - 1;
        uint8_t* st = smem + s * Map::STAGE;
        cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&full_bar[s], tx_bytes);
        for (int kb = 0; kb < KB; ++kb) {
          SM90_TMA_LOAD_4D::copy(&p.tma_k, &full_bar[s], 0, st + Map::K_OFF + kb * BT * 128, kb * 64, h, t0, n);
          SM90_TMA_LOAD_4D::copy(&p.tma_q, &full_bar[s], 0, st + Map::Q_OFF + kb * BT * 128, kb * 64, h, t0, n);
          SM90_TMA_LOAD_4D::copy(&p.tma_w, &full_bar[s], 0, st + Map::W_OFF + kb * BT * 128, kb * 64, hv, t0, n);
        }
        SM90_TMA_LOAD_4D::copy(&p.tma_do, &full_bar[s], 0, st + Map::DO_OFF, v0, hv, t0, n);
        SM90_TMA_LOAD_4D::copy(&p.tma_dv, &full_bar[s], 0, st + Map::DV_OFF, v0, hv, t0, n);
        if (use_gk) {
          const float* gk_row = p.gk + ((int64_t(n) * p.T + t_last) * p.HV + hv) * K;
          SM90_BULK_COPY_G2S::copy(gk_row, &full_bar[s], smem + Map::GK_OFF + s * K * 4, K * 4);
        }
      }
    }
    __syncwarp();
  } else if (warp == MMA_WARP) {
    // ------------------------------------------------------------------ MMA issuer
    // Shared-memory operand views (the sm90 kernel's layouts; CuTe turns them into UMMA
    // smem descriptors and checks at compile time that they are canonical SW128 layouts).
    using LayoutKt = decltype(tile_to_shape(UMMA::Layout_K_SW128_Atom<T>{}, Shape<Int<BT>, Int<K>>{}));
    using LayoutQt = decltype(tile_to_shape(UMMA::Layout_MN_SW128_Atom<T>{}, Shape<Int<K>, Int<BT>>{}, Step<_2, _1>{}));
    using LayoutVt = decltype(tile_to_shape(UMMA::Layout_MN_SW128_Atom<T>{}, Shape<Int<BV>, Int<BT>>{}));
    using LayoutBh = decltype(tile_to_shape(UMMA::Layout_MN_SW128_Atom<T>{}, Shape<Int<BV>, Int<K>>{}));
    auto s_at = [&](int off) { return make_smem_ptr(reinterpret_cast<T*>(smem + off)); };

    TiledMMA mma_dv = make_tiled_mma(typename Mma<T, K>::DV{});
    TiledMMA mma_upd = make_tiled_mma(typename Mma<T, K>::UPD{});
    ThrMMA thr_dv = mma_dv.get_slice(0);
    ThrMMA thr_upd = mma_upd.get_slice(0);
    Tensor accDV = partition_fragment_C(mma_dv, Shape<Int<BT>, Int<BV>>{});
    Tensor accQD = partition_fragment_C(mma_upd, Shape<Int<K>, Int<BV>>{});
    Tensor accWD = partition_fragment_C(mma_upd, Shape<Int<K>, Int<BV>>{});
    accDV.data() = tmem_base + DV_COL;
    accQD.data() = tmem_base + QD_COL;
    accWD.data() = tmem_base + WD_COL;

    for (int i = 0; i < NC; ++i) {
      const int s = i % STAGES;
      const int stage = s * Map::STAGE;
      wait_bar(&full_bar[s], (i / STAGES) & 1);
      // bf16(b) of chunk i is in sBh[i % 3]; also: the recurrence has read DV, QD and
      // WD of chunk i-1 out of tensor memory (it loads them before publishing b).
      wait_bar(bh_full, i & 1);
      tc_fence_after_sync();
      {  // DV = k . bf16(b)
        Tensor sK = make_tensor(s_at(stage + Map::K_OFF), LayoutKt{});
        Tensor sBh = make_tensor(s_at(Map::BH_OFF + (i % BH_BUFS) * Map::BH), LayoutBh{});
        Tensor tA = thr_dv.make_fragment_A(thr_dv.partition_A(sK));
        Tensor tB = thr_dv.make_fragment_B(thr_dv.partition_B(sBh));
        mma_dv.accumulate_ = UMMA::ScaleOut::Zero;
        CUTE_UNROLL
        for (int kb = 0; kb < size<2>(tA); ++kb) {
          cute::gemm(mma_dv, tA(_, _, kb), tB(_, _, kb), accDV);
          mma_dv.accumulate_ = UMMA::ScaleOut::One;
        }
        cutlass::arch::umma_arrive(dv_full);
      }
      {  // QD = q^T . do (independent of b: runs while the recurrence builds dv2)
        Tensor sQ = make_tensor(s_at(stage + Map::Q_OFF), LayoutQt{});
        Tensor sDo = make_tensor(s_at(stage + Map::DO_OFF), LayoutVt{});
        Tensor tA = thr_upd.make_fragment_A(thr_upd.partition_A(sQ));
        Tensor tB = thr_upd.make_fragment_B(thr_upd.partition_B(sDo));
        mma_upd.accumulate_ = UMMA::ScaleOut::Zero;
        CUTE_UNROLL
        for (int kb = 0; kb < size<2>(tA); ++kb) {
          cute::gemm(mma_upd, tA(_, _, kb), tB(_, _, kb), accQD);
          mma_upd.accumulate_ = UMMA::ScaleOut::One;
        }
        cutlass::arch::umma_arrive(qd_full);
      }
      // dv2 of chunk i is in sDv2[i % 2].
      wait_bar(dv2_full, i & 1);
      tc_fence_after_sync();
      {  // WD = w^T . dv2
        Tensor sW = make_tensor(s_at(stage + Map::W_OFF), LayoutQt{});
        Tensor sDv2 = make_tensor(s_at(Map::DV2_OFF + (i % DV2_BUFS) * Map::VTILE), LayoutVt{});
        Tensor tA = thr_upd.make_fragment_A(thr_upd.partition_A(sW));
        Tensor tB = thr_upd.make_fragment_B(thr_upd.partition_B(sDv2));
        mma_upd.accumulate_ = UMMA::ScaleOut::Zero;
        CUTE_UNROLL
        for (int kb = 0; kb < size<2>(tA); ++kb) {
          cute::gemm(mma_upd, tA(_, _, kb), tB(_, _, kb), accWD);
          mma_upd.accumulate_ = UMMA::ScaleOut::One;
        }
        cutlass::arch::umma_arrive(wd_full);
      }
      // Every MMA reading stage s has been issued: the commit frees it once they are
      // done. Only for stages the producer refills (no arrive may land after exit).
      if (i + STAGES < NC) cutlass::arch::umma_arrive(&empty_bar[s]);
    }
  } else if (warp >= SIMT_WARP0) {
    // ------------------------------------------------------------------ recurrence
    const int t = tid - SIMT_WARP0 * 32;       // 0..127 within the warpgroup
    const bool leader = (t == 0);
    const St geo(t);
    const FragGeom fg(t);                      // DV's fragment (layout F, all K)
    // This warp's tensor-memory lane quarter: lanes 32 (warp % 4) .. +31.
    const uint32_t lane_base = uint32_t((warp & 3) * 32) << 16;
    const uint32_t t_dv = tmem_base + lane_base + DV_COL;
    const uint32_t t_qd = tmem_base + lane_base + QD_COL;
    const uint32_t t_wd = tmem_base + lane_base + WD_COL;
    const int64_t nh = int64_t(n) * p.HV + hv;  // (sequence, value head) for dht/dh0
    const float scale = p.scale;

    // b = dht (or 0); bf16(b) -> sBh[0]; checkpoint NC-1 is exactly that value.
    float b[St::N];
    if (p.flags & FLAG_DHT) {
      geo.load_global(p.dht + nh * K * p.V + v0, p.V, b);
    } else {
      CUTE_UNROLL
      for (int e = 0; e < St::N; ++e) b[e] = 0.f;
    }
    if (NC > 0) {
      geo.template store_bh<T>(smem_u32 + Map::BH_OFF, b);
      fence_proxy_async();
      simt_sync();
      if (leader) {
        arrive_bar(bh_full);
        SM90_TMA_STORE_4D::copy(&p.tma_dh, smem + Map::BH_OFF, v0, 0, hv, int(boh + NC - 1));
      }
    }

    for (int i = 0; i < NC; ++i) {
      const int c = NC - 1 - i;
      const int s = i % STAGES;
      const uint32_t st_u32 = smem_u32 + s * Map::STAGE;
      const uint32_t sDv2 = smem_u32 + Map::DV2_OFF + (i % DV2_BUFS) * Map::VTILE;

      // Stage s has landed: dv tile and the gk row of chunk i.
      wait_bar(&full_bar[s], (i / STAGES) & 1);
      uint32_t dv_in[16];
      CUTE_UNROLL
      for (int e = 0; e < 32; e += 2) dv_in[e / 2] = ld_shared_u32(st_u32 + Map::DV_OFF + fg.sw(e));
      // Per-row decay exp2(gk[e-1]): one row per thread (K = 128), two (K = 64: rows of
      // elements 0 and 2, see FragGeom).
      constexpr int ND = St::N == 64 ? 1 : 2;
      float decay[ND];
      {
        const uint32_t sGk = smem_u32 + Map::GK_OFF + s * K * 4;
        CUTE_UNROLL
        for (int d = 0; d < ND; ++d) decay[d] = use_gk ? fast_exp2(geo.gk_last(sGk, 2 * d)) : 1.f;
      }

      // dv2 = DV + dv, rounded to q.dtype -> sDv2[i % 2] (WD's B operand, dv2's TMA source).
      {
        uint32_t r[32];
        wait_bar(dv_full, i & 1);
        tc_fence_after_sync();
        tmem_ld32<TmemLd16x256>(t_dv, r);
        tmem_wait_ld(r);
        tc_fence_before_sync();
        CUTE_UNROLL
        for (int e = 0; e < 32; e += 2) {
          const float2 d = unpack2<T>(dv_in[e / 2]);
          st_shared_u32(sDv2 + fg.sw(e), pack2<T>(__uint_as_float(r[e]) + d.x, __uint_as_float(r[e + 1]) + d.y));
        }
        fence_proxy_async();
      }
      simt_sync();  // barrier A(i): sDv2 written; dv and gk of stage s read
      if (leader) {
        arrive_bar(dv2_full);
        if (i + STAGES < NC) arrive_bar(&empty_bar[s]);
        SM90_TMA_STORE_4D::copy(&p.tma_dv2, smem + Map::DV2_OFF + (i % DV2_BUFS) * Map::VTILE, v0, hv, c * BT, n);
        tma_store_arrive();  // bulk group G(i) = {dh[chunk i], dv2 tile of chunk i}
      }

      // b = decay . b + (scale . QD - WD)
      float sq[St::N];  // scale . QD
      wait_bar(qd_full, i & 1);
      tc_fence_after_sync();
      CUTE_UNROLL
      for (int ch = 0; ch < St::CHUNKS; ++ch) {
        uint32_t r[32];
        St::ld(t_qd, ch, r);
        tmem_wait_ld(r);
        CUTE_UNROLL
        for (int e = 0; e < 32; ++e) sq[32 * ch + e] = scale * __uint_as_float(r[e]);
      }
      CUTE_UNROLL
      for (int e = 0; e < St::N; ++e) b[e] *= decay[ND == 1 ? 0 : ((e >> 1) & 1)];
      wait_bar(wd_full, i & 1);
      tc_fence_after_sync();
      CUTE_UNROLL
      for (int ch = 0; ch < St::CHUNKS; ++ch) {
        uint32_t r[32];
        St::ld(t_wd, ch, r);
        tmem_wait_ld(r);
        CUTE_UNROLL
        for (int e = 0; e < 32; ++e) b[32 * ch + e] += sq[32 * ch + e] - __uint_as_float(r[e]);
      }
      tc_fence_before_sync();  // DV, QD, WD of chunk i are out of tensor memory

      // bf16(b) for chunk i+1 -> sBh[(i+1) % 3] (its last readers, DV(i-2) and the bulk
      // group G(i-2), are done: see docs/dhu_sm100_pipeline.md).
      if (i + 1 < NC) {
        geo.template store_bh<T>(smem_u32 + Map::BH_OFF + ((i + 1) % BH_BUFS) * Map::BH, b);
        fence_proxy_async();
      }
      if (leader) tma_store_wait<1>();  // G(i-1) has read its smem (G(i) may still be in flight)
      simt_sync();  // barrier B(i)
      if (leader && i + 1 < NC) {
        arrive_bar(bh_full);
        SM90_TMA_STORE_4D::copy(&p.tma_dh, smem + Map::BH_OFF + ((i + 1) % BH_BUFS) * Map::BH, v0, 0, hv,
                                int(boh + c - 1));
      }
    }

    // dh0 = b after the oldest chunk.
    if (p.flags & FLAG_DH0) geo.store_global(p.dh0 + nh * K * p.V + v0, p.V, b);
    if (leader) tma_store_wait<0>();  // smem must outlive the last bulk stores' reads
    __syncwarp();
  }

  // Teardown: every tensor-memory access is complete (the recurrence waited for the last
  // WD commit, which tracks every MMA, and fenced its own loads) before warp 1 frees it.
  tc_fence_before_sync();
  __syncthreads();
  if (warp == MMA_WARP) {
    tc_fence_after_sync();
    tmem_alloc.free(tmem_base, TMEM_COLS);
  }
}

}  // namespace sm100
}  // namespace kda_dhu

#define KDA_DHU_SM100_ENTRY(NAME, K, T)                                                    \
  extern "C" __global__ void __launch_bounds__(kda_dhu::sm100::NUM_THREADS, 1)           \
      NAME(const __grid_constant__ kda_dhu::DhuParams p) {                               \
    kda_dhu::sm100::dhu_kernel<K, T>(p);                                                  \
  }

KDA_DHU_SM100_ENTRY(kda_dhu_sm100_k64_bf16, 64, cutlass::bfloat16_t)
KDA_DHU_SM100_ENTRY(kda_dhu_sm100_k64_fp16, 64, cutlass::half_t)
KDA_DHU_SM100_ENTRY(kda_dhu_sm100_k128_bf16, 128, cutlass::bfloat16_t)
KDA_DHU_SM100_ENTRY(kda_dhu_sm100_k128_fp16, 128, cutlass::half_t)
