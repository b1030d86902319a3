// The boundary states of a sequence split (src/split.rs), between its two passes, in fp32.
//
// The reverse scan over one segment is affine in the state it starts from (DESIGN.md, "The
// state scan as an affine map"): the state leaving segment s is P_s x + u_s, x the state
// entering it. The first pass wrote, per batch row b, launch segment j (segment j + 1 of
// the row) and value head hv, the state U_j [K, V + K] ([V + K, K] with state_v_first):
// columns [0, V) are u_{j+1} and columns [V, V + K) are P_{j+1}, except for the newest
// (j = S1 - 1), whose columns [0, V) are already the true state leaving it. The second
// pass runs segments 0 .. S1 - 1 from X [B, S1, HV, K, V] ([.., V, K]):
//
//     X[S1 - 1] = U_{S1 - 1}[:, :V],    X[j - 1] = P_j X[j] + u_j = U_{j-1}[:, V:] X[j] + U_{j-1}[:, :V]
//
// for j = S1 - 1 down to 1 (fp32 fma, m ascending). The forward scan's split (REV) runs
// its segments oldest first: its first pass's launch segment j is segment j (the live one
// j = 0, the true state leaving segment 0), its second pass runs segments 1 .. S1 from
// X[j] = the state leaving segment j: X[0] = U_0[:, :V], X[j] = P_j X[j - 1] + u_j, the
// same recurrence with U's and X's segment index read as S1 - 1 - j. (With L live
// segments, src/split.rs: launch segment j is segment L - 1 + j, the live one runs
// segments 0 .. L - 1, the second pass L .. L + S1 - 1; stage 4's live one runs its
// launch segment to the last.) Grid (V / 16, HV, B), 2K threads: thread t owns row
// k = t / 2 and the 8 columns 8 (t % 2) of the CTA's 16. Each step's P [K, K] is read
// whole by 16-byte loads (K / 8 a thread, all in flight at once, the next step's issued
// before this step's products) into dynamic shared memory in U's own order (rows along the
// contiguous index, 16-byte stores), rows padded to K + 4 floats (smem_bytes): a warp's
// reads of its 16 rows at m .. m + 3 (one 16-byte load) take two wavefronts; with
// state_v_first, P's columns are the rows, and the 16 rows' elements at one m are
// consecutive words. Its numbers: cuda/dhu_layout.h (seg_merge).
#pragma once

#include <stdint.h>

#include "dhu_layout.h"

namespace kda_dhu {
namespace seg_merge {

template <int K, bool REV = false>
__device__ __forceinline__ void seg_merge_kernel(const float* __restrict__ u, float* __restrict__ x, int s1, int HV,
                                                 int V, int svf) {
  constexpr int NTHREADS = threads<K>();
  constexpr int NF = K * K / 4 / NTHREADS;  // 16-byte pieces of P per thread
  constexpr int PS = K + PAD;               // row pitch in shared memory, floats (16-byte rows)
  static_assert(K * K % (4 * NTHREADS) == 0 && PAD % 4 == 0, "P in 16-byte pieces and 16-byte rows");
  extern __shared__ float4 merge_dyn[];
  float* ps = reinterpret_cast<float*>(merge_dyn);  // P [K][PS]; with state_v_first P^T
  __shared__ float xs[K][COLS];
  const int t = threadIdx.x;
  const int k = t >> 1, half = (t & 1) * 8;
  const int c0 = int(blockIdx.x) * COLS + half;
  const int hv = blockIdx.y;
  const int64_t row = int64_t(blockIdx.z) * s1;
  const int VW = V + K;
  // U_j's first element (REV: U_{S1-1-j}'s), and its element (kk, c); X[j]'s (k, c).
  auto u_base = [&](int j) -> int64_t {
    if constexpr (REV) j = s1 - 1 - j;
    return ((row + j) * HV + hv) * int64_t(K) * VW;
  };
  auto u_at = [&](int j, int kk, int c) -> int64_t {
    return u_base(j) + (svf ? int64_t(c) * K + kk : int64_t(kk) * VW + c);
  };
  auto x_at = [&](int j, int c) -> int64_t {
    if constexpr (REV) j = s1 - 1 - j;
    const int64_t base = ((row + j) * HV + hv) * int64_t(K) * V;
    return base + (svf ? int64_t(c) * K + k : int64_t(k) * V + c);
  };
  // Piece i of this thread: 4 consecutive elements of P along its contiguous index (m of
  // row kk; with state_v_first kk of column m), consecutive threads on consecutive pieces.
  auto piece = [&](int i, int& kk, int& m) {
    const int e = 4 * (t + i * NTHREADS);
    kk = svf ? e % K : e / K;
    m = svf ? e / K : e % K;
  };
  auto load_p = [&](int j, float4 (&r)[NF]) {
    const float* pj = u + u_base(j);
#pragma unroll
    for (int i = 0; i < NF; ++i) {
      int kk, m;
      piece(i, kk, m);
      r[i] = *reinterpret_cast<const float4*>(pj + (svf ? int64_t(V + m) * K + kk : int64_t(kk) * VW + V + m));
    }
  };
  auto store_p = [&](const float4 (&r)[NF]) {
#pragma unroll
    for (int i = 0; i < NF; ++i) {
      int kk, m;
      piece(i, kk, m);
      *reinterpret_cast<float4*>(ps + (svf ? m * PS + kk : kk * PS + m)) = r[i];
    }
  };
  float4 pr[NF];
  if (s1 >= 2) load_p(s1 - 2, pr);
  float acc[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    acc[i] = u[u_at(s1 - 1, k, c0 + i)];
    xs[k][half + i] = acc[i];
    x[x_at(s1 - 1, c0 + i)] = acc[i];
  }
  for (int j = s1 - 1; j >= 1; --j) {
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = u[u_at(j - 1, k, c0 + i)];
    __syncthreads();  // xs written; the previous step's reads of ps done
    store_p(pr);
    __syncthreads();
    if (j >= 2) load_p(j - 2, pr);  // the next step's P, in flight during this step's products
    if (svf) {
#pragma unroll 8
      for (int m = 0; m < K; ++m) {
        const float pkm = ps[m * PS + k];
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = fmaf(pkm, xs[m][half + i], acc[i]);
      }
    } else {
#pragma unroll 2
      for (int m = 0; m < K; m += 4) {
        const float4 p4 = *reinterpret_cast<const float4*>(ps + k * PS + m);
        const float pq[4] = {p4.x, p4.y, p4.z, p4.w};
#pragma unroll
        for (int q = 0; q < 4; ++q) {
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[i] = fmaf(pq[q], xs[m + q][half + i], acc[i]);
        }
      }
    }
    __syncthreads();  // every thread's reads of xs done
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      xs[k][half + i] = acc[i];
      x[x_at(j - 1, c0 + i)] = acc[i];
    }
  }
}

}  // namespace seg_merge
}  // namespace kda_dhu
