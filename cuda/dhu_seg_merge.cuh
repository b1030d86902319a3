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
// launch segment to the last.) Grid (V / 16, HV, B), 2K threads:
// thread t owns row k = t / 2 and the 8 columns 8 (t % 2) of the CTA's 16. P is read in
// blocks of MB columns, staged in shared memory by coalesced loads (a thread's row of P is
// one of K strided rows: read directly, each warp load touched 16 rows).
#pragma once

#include <stdint.h>

namespace kda_dhu {
namespace seg_merge {

constexpr int COLS = 16;  // V columns per CTA
constexpr int MB = 32;    // columns of P per shared-memory block

template <int K, bool REV = false>
__device__ __forceinline__ void seg_merge_kernel(const float* __restrict__ u, float* __restrict__ x, int s1, int HV,
                                                 int V, int svf) {
  constexpr int NTHREADS = 2 * K;
  __shared__ float xs[K][COLS];
  __shared__ float ps[K][MB + 1];  // +1: rows k and k + 1 in different banks
  const int t = threadIdx.x;
  const int k = t >> 1, half = (t & 1) * 8;
  const int c0 = int(blockIdx.x) * COLS + half;
  const int hv = blockIdx.y;
  const int64_t row = int64_t(blockIdx.z) * s1;
  const int VW = V + K;
  // Element (kk, c) of U_j and (k, c) of X[j] (REV: of U_{S1-1-j}, X[S1-1-j]).
  auto u_at = [&](int j, int kk, int c) -> int64_t {
    if constexpr (REV) j = s1 - 1 - j;
    const int64_t base = ((row + j) * HV + hv) * int64_t(K) * VW;
    return base + (svf ? int64_t(c) * K + kk : int64_t(kk) * VW + c);
  };
  auto x_at = [&](int j, int c) -> int64_t {
    if constexpr (REV) j = s1 - 1 - j;
    const int64_t base = ((row + j) * HV + hv) * int64_t(K) * V;
    return base + (svf ? int64_t(c) * K + k : int64_t(k) * V + c);
  };
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
    for (int m0 = 0; m0 < K; m0 += MB) {
      __syncthreads();  // xs written, the previous block of ps read
      // P[:, m0 .. m0 + MB): consecutive threads along P's contiguous index.
#pragma unroll
      for (int e0 = 0; e0 < K * MB; e0 += NTHREADS) {
        const int e = e0 + t;
        const int kk = svf ? e % K : e / MB, mm = svf ? e / K : e % MB;
        ps[kk][mm] = u[u_at(j - 1, kk, V + m0 + mm)];
      }
      __syncthreads();
#pragma unroll 8
      for (int mm = 0; mm < MB; ++mm) {
        const float pkm = ps[k][mm];
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = fmaf(pkm, xs[m0 + mm][half + i], acc[i]);
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
