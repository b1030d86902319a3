// The kernels' shapes and shared-memory maps: the one owner of these numbers.
//
// The kernels include it (device code, nvcc and NVRTC alike), and build.rs compiles
// build/kernel_facts.cpp against it on the build host and runs it: that program writes
// OUT_DIR/kernel_facts.rs, the table the Rust core (src/facts.rs) plans and launches
// with (BT, the V tile, threads per CTA, dynamic shared memory per entry point) and
// exports to Python (kda_dhu._core.kernel_facts()). Plain constexpr C++17, no includes,
// so that both compilers and the host compiler take it.
#pragma once

namespace kda_dhu {

constexpr int BT = 64;      // tokens per chunk: fla's BT (chunk_size) on the kernel path
constexpr int LOG2_BT = 6;  // BT == 1 << LOG2_BT (chunk counts by shift on the device)
static_assert(BT == 1 << LOG2_BT, "LOG2_BT must match BT");
constexpr int BV = 64;                // V columns per consumer warpgroup (sm_90a) / per CTA (sm_100a)
constexpr int WG_THREADS = 128;       // threads of a warpgroup
constexpr int SEQ_EXTENT_BYTES = 32;  // the CTA's sequence extent in shared memory (SeqExtent)

namespace sm90 {

// The opt-in maximum of dynamic shared memory per block on sm_90 (227 KB), the shared
// memory of an SM (228 KB) and what the hardware reserves of it per resident CTA (1 KB).
constexpr int SMEM_OPTIN_MAX = 227 * 1024;
constexpr int SMEM_PER_SM = 228 * 1024;
constexpr int SMEM_RESERVED_PER_CTA = 1024;
// Depth of the TMA ring: 3 stages (two chunks of loads in flight while one is consumed)
// where shared memory allows, else 2: K = 64 with one warpgroup keeps 2 stages so that two
// CTAs share an SM; K = 128 with two warpgroups has no room for a third.
template <int K, int NWG> constexpr int num_stages() { return (K == 128) == (NWG == 1) ? 3 : 2; }
// NWG = 1: 4 consumer warps + 1 producer warp. NWG = 2: the producer is a whole warpgroup
// (one warp works, three leave) so that setmaxnreg can move its registers to the
// consumers: ptxas budgets a block in units of 4 warps, and 2 x 128 consumers need more
// than 65536 / 384 registers each.
template <int NWG> constexpr int num_threads() { return NWG == 1 ? WG_THREADS + 32 : (NWG + 1) * WG_THREADS; }

}  // namespace sm90

namespace sm90_regstate {

// KDA_DHU_EXP_EARLY_DV (an experiment, 0 in every release build; cuda/dhu_sm90_regstate.cuh
// says what it does): more mbarriers per stage.
#ifndef KDA_DHU_EXP_EARLY_DV
#define KDA_DHU_EXP_EARLY_DV 0
#endif

using sm90::num_stages;
using sm90::num_threads;
using sm90::SMEM_OPTIN_MAX;

// Per stage, the gate vectors the producer writes (fp32): exp2(g[e-1] - g[t]) at
// [G_GATE, G_GATE + 64), exp2(g[t]) at [G_WEIGHT, G_WEIGHT + 64) (both 0 past the chunk's
// last token), exp2(g[e-1]) at G_DECAY; G_LEN floats, a multiple of 4 (16-byte rows).
constexpr int G_GATE = 0;
constexpr int G_WEIGHT = 64;
constexpr int G_DECAY = 128;
constexpr int G_LEN = 136;

// The register-state kernel's shared memory (cuda/dhu_sm90_regstate.cuh), in bytes from
// a 1024-aligned base: the TMA ring; per warpgroup one dh and one dv2 staging
// tile; per stage the exp2(gk) row and the g gate vectors. RING = 0: stage 4's map (its
// stages by num_stages; the forward scan's instances use it too unless an experiment
// asks otherwise); RING = n > 0: the forward scan's own map, n stages of its loads only
// (w, k, u: no q or do slots).
template <int K, int NWG, int RING = 0>
struct SmemMapOf {
  static constexpr int STAGES = RING ? RING : num_stages<K, NWG>();
  static constexpr int KTILE = BT * K * 2;         // one of k, q, w for one chunk
  static constexpr int VTILE = BT * BV * 2;        // one warpgroup's tile of do, dv, dv2
  static constexpr int K_OFF = 0;
  static constexpr int Q_OFF = K_OFF + KTILE;      // RING > 0: no q slot (Q_OFF == W_OFF)
  static constexpr int W_OFF = Q_OFF + (RING ? 0 : KTILE);
  static constexpr int DO_OFF = W_OFF + KTILE;     // NWG tiles; RING > 0: none
  static constexpr int DV_OFF = DO_OFF + (RING ? 0 : NWG * VTILE);
  static constexpr int STAGE = DV_OFF + NWG * VTILE;
  static constexpr int BH_OFF = STAGES * STAGE;    // one sBh per warpgroup (the dh store's source)
  static constexpr int BH = K * BV * 2;
  static constexpr int DV2_OFF = BH_OFF + NWG * BH;  // one sDv2 per warpgroup
  static constexpr int DECAY_OFF = DV2_OFF + NWG * VTILE;  // STAGES x K fp32: exp2(gk[e-1])
  static constexpr int GATE_OFF = DECAY_OFF + STAGES * K * 4;  // STAGES x G_LEN fp32
  static constexpr int BAR_OFF = GATE_OFF + STAGES * G_LEN * 4;
  // full[s], empty[s]; KDA_DHU_EXP_EARLY_DV: and dv_full[s] (the stage's DV operand alone);
  // = 2: and w_full[s], k_empty[s], w_empty[s].
  static constexpr int BARS_PER_STAGE = KDA_DHU_EXP_EARLY_DV >= 2 ? 6 : KDA_DHU_EXP_EARLY_DV ? 3 : 2;
  static constexpr int EXT_OFF = (BAR_OFF + BARS_PER_STAGE * STAGES * 8 + 15) / 16 * 16;  // 16-byte accesses
  static constexpr int BYTES = EXT_OFF + SEQ_EXTENT_BYTES;
  // 1024 to align the base up where that fits, else none (the kernel then requires an
  // aligned base: K = 128 with one warpgroup).
  static constexpr int SLACK = BYTES + 1024 <= SMEM_OPTIN_MAX ? 1024 : 0;
  static constexpr int DYNAMIC_BYTES = BYTES + SLACK;
};

template <int K, int NWG, int RING = 0>
struct SmemMap : SmemMapOf<K, NWG, RING> {
  using Of = SmemMapOf<K, NWG, RING>;
  static_assert(Of::STAGE % 1024 == 0 && Of::BH % 1024 == 0 && Of::VTILE % 1024 == 0,
                "sw128 tiles need 1024-byte bases");
  static_assert(Of::EXT_OFF % 16 == 0, "the sequence extent is read as 16-byte vectors");
  static_assert(Of::DYNAMIC_BYTES <= SMEM_OPTIN_MAX, "shared memory map exceeds 227 KB");
};

// The forward scan's ring. Its unsplit instances with K = 128 and one warpgroup (the
// planner's below one wave: one CTA per SM, few CTAs) take a map of their own, RING =
// FWD_RING_K128_WG1 stages of w, k and u only (SmemMapOf's RING), so that more chunks of
// loads are in flight per SM: on the H200 4 stages run b1_t65536_h32 2.2 % faster, gva 1.6 %,
// the tail 3.5 %, and with two warpgroups (3 stages there) the dense rows 3-5 % slower, so
// the other instances keep stage 4's map (benches/NOTES.md, "The forward scan's ring").
// KDA_DHU_EXP_FWD_STAGES = n (an experiment, 0 in every release build): every unsplit
// instance takes the deepest ring of at most n stages that fits (K = 64 with one warpgroup:
// two CTAs per SM, as stage 4's).
constexpr int FWD_RING_K128_WG1 = 4;
#ifndef KDA_DHU_EXP_FWD_STAGES
#define KDA_DHU_EXP_FWD_STAGES 0
#endif
template <int K, int NWG, int N>
constexpr bool fwd_ring_fits() {
  using M = SmemMapOf<K, NWG, N>;
  constexpr int ctas = K == 64 && NWG == 1 ? 2 : 1;
  return M::BYTES <= SMEM_OPTIN_MAX && ctas * (M::DYNAMIC_BYTES + sm90::SMEM_RESERVED_PER_CTA) <= sm90::SMEM_PER_SM;
}
template <int K, int NWG,
          int N = KDA_DHU_EXP_FWD_STAGES ? KDA_DHU_EXP_FWD_STAGES : (K == 128 && NWG == 1 ? FWD_RING_K128_WG1 : 0)>
constexpr int fwd_ring() {
  if constexpr (N <= 0) {
    return 0;
  } else if constexpr (N <= 2) {
    return 2;
  } else if constexpr (fwd_ring_fits<K, NWG, N>()) {
    return N;
  } else {
    return fwd_ring<K, NWG, N - 1>();
  }
}

}  // namespace sm90_regstate

// The merge of a sequence split's boundary states (cuda/dhu_seg_merge.cuh): grid
// (V / COLS, HV, B), 2K threads, each step's P [K, K] in dynamic shared memory with rows
// of K + PAD floats (16-byte rows; PAD spreads a warp's 16 rows over the banks).
namespace seg_merge {
constexpr int COLS = 16;  // V columns per CTA
constexpr int PAD = 4;
template <int K> constexpr int threads() { return 2 * K; }
template <int K> constexpr int smem_bytes() { return K * (K + PAD) * 4; }
}  // namespace seg_merge

namespace sm100 {

constexpr int NUM_THREADS = 256;  // warps 0-3: producer, MMA, two idle; warps 4-7: the SIMT warpgroup
constexpr int STAGES = 2;
constexpr int BH_BUFS = 3;
constexpr int DV2_BUFS = 2;

// The Blackwell kernel's shared memory (cuda/dhu_sm100.cu), in bytes from a 1024-aligned base.
template <int K>
struct SmemMap {
  static constexpr int KTILE = BT * K * 2;         // one of k, q, w for one chunk
  static constexpr int VTILE = BT * BV * 2;        // one of do, dv, dv2
  static constexpr int K_OFF = 0;
  static constexpr int Q_OFF = K_OFF + KTILE;
  static constexpr int W_OFF = Q_OFF + KTILE;
  static constexpr int DO_OFF = W_OFF + KTILE;
  static constexpr int DV_OFF = DO_OFF + VTILE;
  static constexpr int STAGE = DV_OFF + VTILE;
  static constexpr int BH_OFF = STAGES * STAGE;
  static constexpr int BH = K * BV * 2;
  static constexpr int DV2_OFF = BH_OFF + BH_BUFS * BH;
  static constexpr int GK_OFF = DV2_OFF + DV2_BUFS * VTILE;
  static constexpr int BAR_OFF = GK_OFF + STAGES * K * 4;
  // full[2], empty[2], bh_full, dv_full, qd_full, dv2_full, wd_full
  static constexpr int NUM_BARS = 2 * STAGES + 5;
  static constexpr int TMEM_PTR_OFF = BAR_OFF + NUM_BARS * 8;
  static constexpr int BYTES = TMEM_PTR_OFF + 8;  // the tensor-memory address tcgen05.alloc writes
  static constexpr int DYNAMIC_BYTES = BYTES + 1024;  // the base aligned up to 1024
  static_assert(STAGE % 1024 == 0 && BH % 1024 == 0 && VTILE % 1024 == 0, "sw128 tiles need 1024-byte bases");
  static_assert(DYNAMIC_BYTES <= 227 * 1024, "over the 227 KB a block may have");
};

}  // namespace sm100
}  // namespace kda_dhu
