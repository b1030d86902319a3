// Stub for the Blackwell (sm_100a) kernel: compiled in every build so its ptxas
// report is checked, never launched yet (the planner answers "no kernel for sm_100").
// The real port of seed/bwd_dhu_sm100_cutedsl.py (tcgen05 UMMA, accumulators in
// TMEM, warp 0 TMA / warp 1 MMA / warps 4-7 recurrence) replaces these bodies and
// keeps the entry-point names and the DhuParams ABI of dhu_params.h.
#include "dhu_params.h"

#define KDA_DHU_SM100_STUB(name) \
  extern "C" __global__ void name(const __grid_constant__ kda_dhu::DhuParams p) { __trap(); }

KDA_DHU_SM100_STUB(kda_dhu_sm100_k64_bf16)
KDA_DHU_SM100_STUB(kda_dhu_sm100_k64_fp16)
KDA_DHU_SM100_STUB(kda_dhu_sm100_k128_bf16)
KDA_DHU_SM100_STUB(kda_dhu_sm100_k128_fp16)
