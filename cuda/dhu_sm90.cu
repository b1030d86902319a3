// Stage 4 of fla's chunked gated delta rule backward on Hopper (sm_90a): the reverse state
// scan `chunk_gated_delta_rule_bwd_dhu`, TMA + wgmma. This file is the sm_90a image's
// translation unit: the kernel is cuda/dhu_sm90_regstate.cuh (the state held transposed in
// registers, both chain products with A from registers; its schedule:
// docs/dhu_sm90_regstate_pipeline.md), the entry points are below.

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "dhu_params.h"
#include "dhu_seg_merge.cuh"
#include "dhu_sm90_regstate.cuh"

// Entry points, in the slot order of src/plan.rs (SM90_ENTRIES): K 64 / 128 x bf16 / fp16,
// then the same with two warpgroups per CTA (`_wg2`: the 128 V columns of one head share the
// stage's k, q, w loads, two independent chains per SM), then those eight with
// state_v_first (`_svf`: dh, dht, dh0 are [.., V, K]; h0 only decides dh0); then those
// sixteen for calls with the scalar gate g (`_g`: the instances without it have no code for
// it, 2-3 % faster per chunk below one wave: benches/NOTES.md). Then a sequence split's
// kernels (src/split.rs; SPLIT_ENTRIES there): its first pass (`_sum`: the kernel with V
// widened by K identity columns, one warpgroup, [K, V] and [V, K] states, without and with
// g), the merge of its boundary states (K 64 / 128), the forward scan's first pass
// (`_fwd_.._sum`, the same sixteen shapes) and its merge (oldest first). Then the forward scan's (`_fwd`,
// fla's chunk_gated_delta_rule_fwd_h: the kernel's FWD instance; K 64 / 128 x bf16 / fp16,
// one or two warpgroups, [K, V] and [V, K] states, without and with g).
#define KDA_DHU_SM90_RS_ENTRY(NAME, K, T, NWG, SVF, G)                                       \
  extern "C" __global__ void __launch_bounds__(kda_dhu::sm90_regstate::num_threads<NWG>(), 1) \
      NAME(const __grid_constant__ kda_dhu::DhuParams p) {                                   \
    kda_dhu::sm90_regstate::dhu_regstate_kernel<K, T, NWG, SVF, G>(p);                        \
  }
#define KDA_DHU_SM90_SUM_ENTRY(NAME, K, T, SVF, G)                                          \
  extern "C" __global__ void __launch_bounds__(kda_dhu::sm90_regstate::num_threads<1>(), 1) \
      NAME(const __grid_constant__ kda_dhu::DhuParams p) {                                 \
    kda_dhu::sm90_regstate::dhu_regstate_kernel<K, T, 1, SVF, G, true>(p);                  \
  }
#define KDA_DHU_SM90_FWD_SUM_ENTRY(NAME, K, T, SVF, G)                                      \
  extern "C" __global__ void __launch_bounds__(kda_dhu::sm90_regstate::num_threads<1>(), 1) \
      NAME(const __grid_constant__ kda_dhu::DhuParams p) {                                 \
    kda_dhu::sm90_regstate::dhu_regstate_kernel<K, T, 1, SVF, G, true, true>(p);            \
  }
#define KDA_DHU_SM90_FWD_ENTRY(NAME, K, T, NWG, SVF, G)                                       \
  extern "C" __global__ void __launch_bounds__(kda_dhu::sm90_regstate::num_threads<NWG>(), 1) \
      NAME(const __grid_constant__ kda_dhu::DhuParams p) {                                   \
    kda_dhu::sm90_regstate::dhu_regstate_kernel<K, T, NWG, SVF, G, false, true>(p);           \
  }
#define KDA_DHU_SEG_MERGE_ENTRY(NAME, K, REV)                                                         \
  extern "C" __global__ void __launch_bounds__(kda_dhu::seg_merge::threads<K>(), 1)                    \
      NAME(const float* u, float* x, int s1, int HV, int V, int svf) {                                \
    kda_dhu::seg_merge::seg_merge_kernel<K, REV>(u, x, s1, HV, V, svf);                                \
  }

KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k64_bf16, 64, cutlass::bfloat16_t, 1, false, false)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k64_fp16, 64, cutlass::half_t, 1, false, false)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k128_bf16, 128, cutlass::bfloat16_t, 1, false, false)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k128_fp16, 128, cutlass::half_t, 1, false, false)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k64_bf16_wg2, 64, cutlass::bfloat16_t, 2, false, false)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k64_fp16_wg2, 64, cutlass::half_t, 2, false, false)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k128_bf16_wg2, 128, cutlass::bfloat16_t, 2, false, false)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k128_fp16_wg2, 128, cutlass::half_t, 2, false, false)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k64_bf16_svf, 64, cutlass::bfloat16_t, 1, true, false)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k64_fp16_svf, 64, cutlass::half_t, 1, true, false)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k128_bf16_svf, 128, cutlass::bfloat16_t, 1, true, false)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k128_fp16_svf, 128, cutlass::half_t, 1, true, false)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k64_bf16_wg2_svf, 64, cutlass::bfloat16_t, 2, true, false)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k64_fp16_wg2_svf, 64, cutlass::half_t, 2, true, false)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k128_bf16_wg2_svf, 128, cutlass::bfloat16_t, 2, true, false)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k128_fp16_wg2_svf, 128, cutlass::half_t, 2, true, false)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k64_bf16_g, 64, cutlass::bfloat16_t, 1, false, true)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k64_fp16_g, 64, cutlass::half_t, 1, false, true)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k128_bf16_g, 128, cutlass::bfloat16_t, 1, false, true)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k128_fp16_g, 128, cutlass::half_t, 1, false, true)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k64_bf16_wg2_g, 64, cutlass::bfloat16_t, 2, false, true)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k64_fp16_wg2_g, 64, cutlass::half_t, 2, false, true)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k128_bf16_wg2_g, 128, cutlass::bfloat16_t, 2, false, true)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k128_fp16_wg2_g, 128, cutlass::half_t, 2, false, true)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k64_bf16_svf_g, 64, cutlass::bfloat16_t, 1, true, true)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k64_fp16_svf_g, 64, cutlass::half_t, 1, true, true)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k128_bf16_svf_g, 128, cutlass::bfloat16_t, 1, true, true)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k128_fp16_svf_g, 128, cutlass::half_t, 1, true, true)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k64_bf16_wg2_svf_g, 64, cutlass::bfloat16_t, 2, true, true)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k64_fp16_wg2_svf_g, 64, cutlass::half_t, 2, true, true)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k128_bf16_wg2_svf_g, 128, cutlass::bfloat16_t, 2, true, true)
KDA_DHU_SM90_RS_ENTRY(kda_dhu_sm90_rs_k128_fp16_wg2_svf_g, 128, cutlass::half_t, 2, true, true)
KDA_DHU_SM90_SUM_ENTRY(kda_dhu_sm90_rs_k64_bf16_sum, 64, cutlass::bfloat16_t, false, false)
KDA_DHU_SM90_SUM_ENTRY(kda_dhu_sm90_rs_k64_fp16_sum, 64, cutlass::half_t, false, false)
KDA_DHU_SM90_SUM_ENTRY(kda_dhu_sm90_rs_k128_bf16_sum, 128, cutlass::bfloat16_t, false, false)
KDA_DHU_SM90_SUM_ENTRY(kda_dhu_sm90_rs_k128_fp16_sum, 128, cutlass::half_t, false, false)
KDA_DHU_SM90_SUM_ENTRY(kda_dhu_sm90_rs_k64_bf16_sum_svf, 64, cutlass::bfloat16_t, true, false)
KDA_DHU_SM90_SUM_ENTRY(kda_dhu_sm90_rs_k64_fp16_sum_svf, 64, cutlass::half_t, true, false)
KDA_DHU_SM90_SUM_ENTRY(kda_dhu_sm90_rs_k128_bf16_sum_svf, 128, cutlass::bfloat16_t, true, false)
KDA_DHU_SM90_SUM_ENTRY(kda_dhu_sm90_rs_k128_fp16_sum_svf, 128, cutlass::half_t, true, false)
KDA_DHU_SM90_SUM_ENTRY(kda_dhu_sm90_rs_k64_bf16_sum_g, 64, cutlass::bfloat16_t, false, true)
KDA_DHU_SM90_SUM_ENTRY(kda_dhu_sm90_rs_k64_fp16_sum_g, 64, cutlass::half_t, false, true)
KDA_DHU_SM90_SUM_ENTRY(kda_dhu_sm90_rs_k128_bf16_sum_g, 128, cutlass::bfloat16_t, false, true)
KDA_DHU_SM90_SUM_ENTRY(kda_dhu_sm90_rs_k128_fp16_sum_g, 128, cutlass::half_t, false, true)
KDA_DHU_SM90_SUM_ENTRY(kda_dhu_sm90_rs_k64_bf16_sum_svf_g, 64, cutlass::bfloat16_t, true, true)
KDA_DHU_SM90_SUM_ENTRY(kda_dhu_sm90_rs_k64_fp16_sum_svf_g, 64, cutlass::half_t, true, true)
KDA_DHU_SM90_SUM_ENTRY(kda_dhu_sm90_rs_k128_bf16_sum_svf_g, 128, cutlass::bfloat16_t, true, true)
KDA_DHU_SM90_SUM_ENTRY(kda_dhu_sm90_rs_k128_fp16_sum_svf_g, 128, cutlass::half_t, true, true)
KDA_DHU_SEG_MERGE_ENTRY(kda_dhu_sm90_seg_merge_k64, 64, false)
KDA_DHU_SEG_MERGE_ENTRY(kda_dhu_sm90_seg_merge_k128, 128, false)
KDA_DHU_SM90_FWD_SUM_ENTRY(kda_dhu_sm90_fwd_k64_bf16_sum, 64, cutlass::bfloat16_t, false, false)
KDA_DHU_SM90_FWD_SUM_ENTRY(kda_dhu_sm90_fwd_k64_fp16_sum, 64, cutlass::half_t, false, false)
KDA_DHU_SM90_FWD_SUM_ENTRY(kda_dhu_sm90_fwd_k128_bf16_sum, 128, cutlass::bfloat16_t, false, false)
KDA_DHU_SM90_FWD_SUM_ENTRY(kda_dhu_sm90_fwd_k128_fp16_sum, 128, cutlass::half_t, false, false)
KDA_DHU_SM90_FWD_SUM_ENTRY(kda_dhu_sm90_fwd_k64_bf16_sum_svf, 64, cutlass::bfloat16_t, true, false)
KDA_DHU_SM90_FWD_SUM_ENTRY(kda_dhu_sm90_fwd_k64_fp16_sum_svf, 64, cutlass::half_t, true, false)
KDA_DHU_SM90_FWD_SUM_ENTRY(kda_dhu_sm90_fwd_k128_bf16_sum_svf, 128, cutlass::bfloat16_t, true, false)
KDA_DHU_SM90_FWD_SUM_ENTRY(kda_dhu_sm90_fwd_k128_fp16_sum_svf, 128, cutlass::half_t, true, false)
KDA_DHU_SM90_FWD_SUM_ENTRY(kda_dhu_sm90_fwd_k64_bf16_sum_g, 64, cutlass::bfloat16_t, false, true)
KDA_DHU_SM90_FWD_SUM_ENTRY(kda_dhu_sm90_fwd_k64_fp16_sum_g, 64, cutlass::half_t, false, true)
KDA_DHU_SM90_FWD_SUM_ENTRY(kda_dhu_sm90_fwd_k128_bf16_sum_g, 128, cutlass::bfloat16_t, false, true)
KDA_DHU_SM90_FWD_SUM_ENTRY(kda_dhu_sm90_fwd_k128_fp16_sum_g, 128, cutlass::half_t, false, true)
KDA_DHU_SM90_FWD_SUM_ENTRY(kda_dhu_sm90_fwd_k64_bf16_sum_svf_g, 64, cutlass::bfloat16_t, true, true)
KDA_DHU_SM90_FWD_SUM_ENTRY(kda_dhu_sm90_fwd_k64_fp16_sum_svf_g, 64, cutlass::half_t, true, true)
KDA_DHU_SM90_FWD_SUM_ENTRY(kda_dhu_sm90_fwd_k128_bf16_sum_svf_g, 128, cutlass::bfloat16_t, true, true)
KDA_DHU_SM90_FWD_SUM_ENTRY(kda_dhu_sm90_fwd_k128_fp16_sum_svf_g, 128, cutlass::half_t, true, true)
KDA_DHU_SEG_MERGE_ENTRY(kda_dhu_sm90_fwd_seg_merge_k64, 64, true)
KDA_DHU_SEG_MERGE_ENTRY(kda_dhu_sm90_fwd_seg_merge_k128, 128, true)
KDA_DHU_SM90_FWD_ENTRY(kda_dhu_sm90_fwd_k64_bf16, 64, cutlass::bfloat16_t, 1, false, false)
KDA_DHU_SM90_FWD_ENTRY(kda_dhu_sm90_fwd_k64_fp16, 64, cutlass::half_t, 1, false, false)
KDA_DHU_SM90_FWD_ENTRY(kda_dhu_sm90_fwd_k128_bf16, 128, cutlass::bfloat16_t, 1, false, false)
KDA_DHU_SM90_FWD_ENTRY(kda_dhu_sm90_fwd_k128_fp16, 128, cutlass::half_t, 1, false, false)
KDA_DHU_SM90_FWD_ENTRY(kda_dhu_sm90_fwd_k64_bf16_wg2, 64, cutlass::bfloat16_t, 2, false, false)
KDA_DHU_SM90_FWD_ENTRY(kda_dhu_sm90_fwd_k64_fp16_wg2, 64, cutlass::half_t, 2, false, false)
KDA_DHU_SM90_FWD_ENTRY(kda_dhu_sm90_fwd_k128_bf16_wg2, 128, cutlass::bfloat16_t, 2, false, false)
KDA_DHU_SM90_FWD_ENTRY(kda_dhu_sm90_fwd_k128_fp16_wg2, 128, cutlass::half_t, 2, false, false)
KDA_DHU_SM90_FWD_ENTRY(kda_dhu_sm90_fwd_k64_bf16_svf, 64, cutlass::bfloat16_t, 1, true, false)
KDA_DHU_SM90_FWD_ENTRY(kda_dhu_sm90_fwd_k64_fp16_svf, 64, cutlass::half_t, 1, true, false)
KDA_DHU_SM90_FWD_ENTRY(kda_dhu_sm90_fwd_k128_bf16_svf, 128, cutlass::bfloat16_t, 1, true, false)
KDA_DHU_SM90_FWD_ENTRY(kda_dhu_sm90_fwd_k128_fp16_svf, 128, cutlass::half_t, 1, true, false)
KDA_DHU_SM90_FWD_ENTRY(kda_dhu_sm90_fwd_k64_bf16_wg2_svf, 64, cutlass::bfloat16_t, 2, true, false)
KDA_DHU_SM90_FWD_ENTRY(kda_dhu_sm90_fwd_k64_fp16_wg2_svf, 64, cutlass::half_t, 2, true, false)
KDA_DHU_SM90_FWD_ENTRY(kda_dhu_sm90_fwd_k128_bf16_wg2_svf, 128, cutlass::bfloat16_t, 2, true, false)
KDA_DHU_SM90_FWD_ENTRY(kda_dhu_sm90_fwd_k128_fp16_wg2_svf, 128, cutlass::half_t, 2, true, false)
KDA_DHU_SM90_FWD_ENTRY(kda_dhu_sm90_fwd_k64_bf16_g, 64, cutlass::bfloat16_t, 1, false, true)
KDA_DHU_SM90_FWD_ENTRY(kda_dhu_sm90_fwd_k64_fp16_g, 64, cutlass::half_t, 1, false, true)
KDA_DHU_SM90_FWD_ENTRY(kda_dhu_sm90_fwd_k128_bf16_g, 128, cutlass::bfloat16_t, 1, false, true)
KDA_DHU_SM90_FWD_ENTRY(kda_dhu_sm90_fwd_k128_fp16_g, 128, cutlass::half_t, 1, false, true)
KDA_DHU_SM90_FWD_ENTRY(kda_dhu_sm90_fwd_k64_bf16_wg2_g, 64, cutlass::bfloat16_t, 2, false, true)
KDA_DHU_SM90_FWD_ENTRY(kda_dhu_sm90_fwd_k64_fp16_wg2_g, 64, cutlass::half_t, 2, false, true)
KDA_DHU_SM90_FWD_ENTRY(kda_dhu_sm90_fwd_k128_bf16_wg2_g, 128, cutlass::bfloat16_t, 2, false, true)
KDA_DHU_SM90_FWD_ENTRY(kda_dhu_sm90_fwd_k128_fp16_wg2_g, 128, cutlass::half_t, 2, false, true)
KDA_DHU_SM90_FWD_ENTRY(kda_dhu_sm90_fwd_k64_bf16_svf_g, 64, cutlass::bfloat16_t, 1, true, true)
KDA_DHU_SM90_FWD_ENTRY(kda_dhu_sm90_fwd_k64_fp16_svf_g, 64, cutlass::half_t, 1, true, true)
KDA_DHU_SM90_FWD_ENTRY(kda_dhu_sm90_fwd_k128_bf16_svf_g, 128, cutlass::bfloat16_t, 1, true, true)
KDA_DHU_SM90_FWD_ENTRY(kda_dhu_sm90_fwd_k128_fp16_svf_g, 128, cutlass::half_t, 1, true, true)
KDA_DHU_SM90_FWD_ENTRY(kda_dhu_sm90_fwd_k64_bf16_wg2_svf_g, 64, cutlass::bfloat16_t, 2, true, true)
KDA_DHU_SM90_FWD_ENTRY(kda_dhu_sm90_fwd_k64_fp16_wg2_svf_g, 64, cutlass::half_t, 2, true, true)
KDA_DHU_SM90_FWD_ENTRY(kda_dhu_sm90_fwd_k128_bf16_wg2_svf_g, 128, cutlass::bfloat16_t, 2, true, true)
KDA_DHU_SM90_FWD_ENTRY(kda_dhu_sm90_fwd_k128_fp16_wg2_svf_g, 128, cutlass::half_t, 2, true, true)
