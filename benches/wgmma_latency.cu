// wgmma's issue-to-complete time on one SM, by shape, operand source and chain structure:
// the latencies the register-state kernel's serial chain is made of (benches/NOTES.md, "The
// chain per chunk, measured alone"). Each case times, in SM clock cycles per iteration,
//
//     wgmma.fence; <the case's wgmmas>; commit; wait<0>
//
// repeated ITERS times by one warpgroup (or two warpgroups of one CTA, each its own chain,
// both on the SM's tensor pipe: two chains per SM), bf16 inputs, fp32 accumulators,
// B (and SS's A) from 128-byte-swizzled shared memory as the kernel's tiles. Operands are
// random bf16 of magnitude [0.5, 1): with zeros the pipe runs faster than at its rated rate.
//
// Cases (the kernel's products at BT = 64, BV = 64, K = 128):
//   empty        fence, commit, wait only
//   rs64x1       one m64n64k16 RS
//   rs64x4       four dependent m64n64k16 RS (one accumulator)
//   rs64x8       eight dependent m64n64k16 RS: DV (K = 128)
//   rs64x8_2acc  the same eight as two accumulators, interleaved: KDA_DHU_EXP_DV_SPLIT
//   rs64x8_4acc  the same eight as four accumulators, interleaved
//   rs128x1      one m64n128k16 RS
//   rs128x4      four dependent m64n128k16 RS: WD (BT = 64)
//   rs128x4_n2   WD as two m64n64k16 halves of N, interleaved (two accumulators)
//   ss128x4      four dependent m64n128k16 SS: QD (BT = 64)
//   ss64x8       eight dependent m64n64k16 SS
//   dv_qd        DV (rs64x8) committed, then QD (ss128x4) committed, wait<1>, wait<0>: the
//                second column is the cycles until DV's wait<1> returns
//   rs128x4_mn   WD as the kernel issues it: B MN-major (w's tile, transposed in the pipe)
//   ss128x4_mn   QD as the kernel issues it: A and B MN-major (do's and q's tiles)
//   dv_qd_mn     dv_qd with QD's operands MN-major (the kernel's pair)
//   qd_dv        QD (ss128x4_mn) committed first, then DV; the second column: QD complete
//   dv_qd_1g     DV and QD (MN) in one commit group
//   dv_dv        two DV groups back to back; the second column: the first complete
//   dv_wd        DV, then WD (rs128x4_mn) as a second group; the second column: DV complete
//
// Build (here, no GPU; CUTLASS/CuTe headers of the nvidia-cutlass wheel):
//   nvcc -O3 -std=c++17 -arch=sm_90a -cudart static -I <cutlass>/include -Xptxas -v \
//        -o /tmp/wgmma_latency benches/wgmma_latency.cu
// Run (the GPU machine): /tmp/wgmma_latency [ITERS]   (prints one line per case and warpgroup count)
// ptxas must not print C7514-C7520 ("wgmma ... serialized"): a serialized case measures nothing.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>

using namespace cute;

namespace wl {

using RsN64 = SM90_64x64x16_F32BF16BF16_RS<GMMA::Major::K, GMMA::Major::K>;
using RsN128 = SM90_64x128x16_F32BF16BF16_RS<GMMA::Major::K, GMMA::Major::K>;
using SsN64 = SM90_64x64x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>;
using SsN128 = SM90_64x128x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>;
using RsN128Mn = SM90_64x128x16_F32BF16BF16_RS<GMMA::Major::K, GMMA::Major::MN>;
using SsN128Mn = SM90_64x128x16_F32BF16BF16_SS<GMMA::Major::MN, GMMA::Major::MN>;

template <class Op, int NA, size_t... I>
__device__ __forceinline__ void rs_impl(const uint32_t (&a)[4], uint64_t b, float (&d)[NA], GMMA::ScaleOut s,
                                        index_sequence<I...>) {
  Op::fma(a[0], a[1], a[2], a[3], b, d[I]..., s);
}
template <class Op, int NA>
__device__ __forceinline__ void rs(const uint32_t (&a)[4], uint64_t b, float (&d)[NA], GMMA::ScaleOut s) {
  rs_impl<Op>(a, b, d, s, make_index_sequence<NA>{});
}
template <class Op, int NA, size_t... I>
__device__ __forceinline__ void ss_impl(uint64_t a, uint64_t b, float (&d)[NA], GMMA::ScaleOut s,
                                        index_sequence<I...>) {
  Op::fma(a, b, d[I]..., s);
}
template <class Op, int NA>
__device__ __forceinline__ void ss(uint64_t a, uint64_t b, float (&d)[NA], GMMA::ScaleOut s) {
  ss_impl<Op>(a, b, d, s, make_index_sequence<NA>{});
}
template <int N> __device__ __forceinline__ void fence(float (&r)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// A K-major tile of `rows` rows, 128-byte swizzle, k-block kb (16 elements = 32 bytes) of
// 8 per 128-byte row pair group; 64 elements per swizzle box, boxes rows * 128 bytes apart.
__device__ __forceinline__ uint64_t desc_k(uint32_t base, int rows, int kb) {
  const uint32_t addr = base + (kb >> 2) * rows * 128 + (kb & 3) * 32;
  uint64_t d = 0;
  d |= uint64_t((addr >> 4) & 0x3FFF);
  d |= uint64_t(1) << 16;                  // leading byte offset (unused with 128-byte swizzle)
  d |= uint64_t(1024 >> 4) << 32;          // stride byte offset: 8 rows of 128 bytes
  d |= uint64_t(1) << 62;                  // 128-byte swizzle
  return d;
}

// Two bf16 of magnitude [0.5, 1) and random sign from an index: the tensor pipe is faster
// on zeros than on data, so the operands must look like data.
__device__ __forceinline__ uint32_t bf16x2_noise(uint32_t i) {
  uint32_t h = i * 2654435761u;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  return (h & 0x807F807Fu) | 0x3F003F00u;
}

enum Case {
  EMPTY, RS64X1, RS64X4, RS64X8, RS64X8_2ACC, RS64X8_4ACC, RS128X1, RS128X4, RS128X4_N2, SS128X4, SS64X8, DV_QD,
  RS128X4_MN, SS128X4_MN, DV_QD_MN, QD_DV, DV_QD_1G, DV_DV, DV_WD, NCASES
};
const char* kNames[NCASES] = {"empty",      "rs64x1",     "rs64x4",   "rs64x8", "rs64x8_2acc", "rs64x8_4acc",
                              "rs128x1",    "rs128x4",    "rs128x4_n2", "ss128x4", "ss64x8", "dv_qd",
                              "rs128x4_mn", "ss128x4_mn", "dv_qd_mn", "qd_dv", "dv_qd_1g", "dv_dv", "dv_wd"};

// A 128-byte-swizzled MN-major tile's descriptor for k-block kb (16 K rows of 128 bytes):
// the timing needs in-bounds addresses with the kernel's access pattern, not its exact tile.
__device__ __forceinline__ uint64_t desc_mn(uint32_t base, int kb) {
  const uint32_t addr = base + kb * 2048;
  uint64_t d = 0;
  d |= uint64_t((addr >> 4) & 0x3FFF);
  d |= uint64_t(4096 >> 4) << 16;          // leading byte offset: the next 64 columns of N
  d |= uint64_t(1024 >> 4) << 32;          // stride byte offset: 8 K rows of 128 bytes
  d |= uint64_t(1) << 62;                  // 128-byte swizzle
  return d;
}

constexpr int kSmem = 64 * 1024 + 1024;

template <int C>
__global__ void __launch_bounds__(256, 1) kernel(int iters, long long* out, float* sink) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  const uint32_t raw = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  const uint32_t base = (raw + 1023) & ~1023u;
  for (int i = threadIdx.x; i < 64 * 1024 / 4; i += blockDim.x)
    asm volatile("st.shared.u32 [%0], %1;" ::"r"(base + i * 4), "r"(bf16x2_noise(i)) : "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncthreads();
  const int wg = threadIdx.x / 128;
  const uint32_t tile_b = base + wg * 32768;        // B: up to 128 rows x 256 bytes
  const uint32_t tile_a = base + wg * 32768 + 16384;  // SS's A: 64 rows x 128 bytes
  uint32_t a[4];
  for (int i = 0; i < 4; ++i) a[i] = bf16x2_noise(1000003 * threadIdx.x + i);
  asm volatile("" : "+r"(a[0]), "+r"(a[1]), "+r"(a[2]), "+r"(a[3]));
  float d0[64], d1[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) d0[i] = d1[i] = 0.f;
  float d2[32], d3[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) d2[i] = d3[i] = 0.f;
  long long t_first = 0, total = 0;
  for (int it = -16; it < iters; ++it) {
    if (it == 0) {
      __syncwarp();
      total = 0;
      t_first = clock64();
    }
    const long long t0 = clock64();
    fence(d0);
    fence(d1);
    fence(d2);
    fence(d3);
    warpgroup_arrive();
    if constexpr (C == RS64X1 || C == RS64X4 || C == RS64X8 || C == DV_QD) {
      constexpr int S = C == RS64X1 ? 1 : C == RS64X4 ? 4 : 8;
      float(&d)[32] = *reinterpret_cast<float(*)[32]>(d0);
#pragma unroll
      for (int s = 0; s < S; ++s) rs<RsN64>(a, desc_k(tile_b, 64, s), d, s ? GMMA::ScaleOut::One : GMMA::ScaleOut::Zero);
    } else if constexpr (C == RS64X8_2ACC) {
      float(&x)[32] = *reinterpret_cast<float(*)[32]>(d0);
      float(&y)[32] = *reinterpret_cast<float(*)[32]>(d1);
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        rs<RsN64>(a, desc_k(tile_b, 64, s), x, s ? GMMA::ScaleOut::One : GMMA::ScaleOut::Zero);
        rs<RsN64>(a, desc_k(tile_b, 64, s + 4), y, s ? GMMA::ScaleOut::One : GMMA::ScaleOut::Zero);
      }
    } else if constexpr (C == RS64X8_4ACC) {
      float(&x)[32] = *reinterpret_cast<float(*)[32]>(d0);
      float(&y)[32] = *reinterpret_cast<float(*)[32]>(d1);
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        const GMMA::ScaleOut sc = s ? GMMA::ScaleOut::One : GMMA::ScaleOut::Zero;
        rs<RsN64>(a, desc_k(tile_b, 64, s), x, sc);
        rs<RsN64>(a, desc_k(tile_b, 64, s + 2), y, sc);
        rs<RsN64>(a, desc_k(tile_b, 64, s + 4), d2, sc);
        rs<RsN64>(a, desc_k(tile_b, 64, s + 6), d3, sc);
      }
    } else if constexpr (C == RS128X1 || C == RS128X4) {
      constexpr int S = C == RS128X1 ? 1 : 4;
#pragma unroll
      for (int s = 0; s < S; ++s) rs<RsN128>(a, desc_k(tile_b, 128, s), d0, GMMA::ScaleOut::One);
    } else if constexpr (C == RS128X4_N2) {
      float(&x)[32] = *reinterpret_cast<float(*)[32]>(d0);
      float(&y)[32] = *reinterpret_cast<float(*)[32]>(d0 + 32);
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        rs<RsN64>(a, desc_k(tile_b, 128, s), x, GMMA::ScaleOut::One);
        rs<RsN64>(a, desc_k(tile_b + 64 * 128, 128, s), y, GMMA::ScaleOut::One);
      }
    } else if constexpr (C == SS128X4) {
#pragma unroll
      for (int s = 0; s < 4; ++s)
        ss<SsN128>(desc_k(tile_a, 64, s), desc_k(tile_b, 128, s), d1, s ? GMMA::ScaleOut::One : GMMA::ScaleOut::Zero);
    } else if constexpr (C == SS64X8) {
      float(&d)[32] = *reinterpret_cast<float(*)[32]>(d0);
#pragma unroll
      for (int s = 0; s < 8; ++s)
        ss<SsN64>(desc_k(tile_a, 64, s & 3), desc_k(tile_b, 64, s), d, s ? GMMA::ScaleOut::One : GMMA::ScaleOut::Zero);
    }
    if constexpr (C == RS128X4_MN) {
#pragma unroll
      for (int s = 0; s < 4; ++s) rs<RsN128Mn>(a, desc_mn(tile_b, s), d0, GMMA::ScaleOut::One);
    } else if constexpr (C == SS128X4_MN || C == QD_DV) {
#pragma unroll
      for (int s = 0; s < 4; ++s)
        ss<SsN128Mn>(desc_mn(tile_a, s), desc_mn(tile_b, s), d1, s ? GMMA::ScaleOut::One : GMMA::ScaleOut::Zero);
    } else if constexpr (C == DV_QD_MN || C == DV_QD_1G || C == DV_DV || C == DV_WD) {
      float(&d)[32] = *reinterpret_cast<float(*)[32]>(d0);
#pragma unroll
      for (int s = 0; s < 8; ++s) rs<RsN64>(a, desc_k(tile_b, 64, s), d, s ? GMMA::ScaleOut::One : GMMA::ScaleOut::Zero);
      if constexpr (C == DV_QD_1G) {
#pragma unroll
        for (int s = 0; s < 4; ++s)
          ss<SsN128Mn>(desc_mn(tile_a, s), desc_mn(tile_b, s), d1, s ? GMMA::ScaleOut::One : GMMA::ScaleOut::Zero);
      }
    }
    warpgroup_commit_batch();
    if constexpr (C == DV_QD_MN || C == QD_DV || C == DV_DV || C == DV_WD) {
      warpgroup_arrive();
      if constexpr (C == DV_QD_MN) {
#pragma unroll
        for (int s = 0; s < 4; ++s)
          ss<SsN128Mn>(desc_mn(tile_a, s), desc_mn(tile_b, s), d1, s ? GMMA::ScaleOut::One : GMMA::ScaleOut::Zero);
      } else if constexpr (C == QD_DV) {
        float(&d)[32] = *reinterpret_cast<float(*)[32]>(d0);
#pragma unroll
        for (int s = 0; s < 8; ++s) rs<RsN64>(a, desc_k(tile_b, 64, s), d, s ? GMMA::ScaleOut::One : GMMA::ScaleOut::Zero);
      } else if constexpr (C == DV_DV) {
#pragma unroll
        for (int s = 0; s < 8; ++s) rs<RsN64>(a, desc_k(tile_b, 64, s), d2, s ? GMMA::ScaleOut::One : GMMA::ScaleOut::Zero);
      } else {
#pragma unroll
        for (int s = 0; s < 4; ++s) rs<RsN128Mn>(a, desc_mn(tile_b, s), d1, GMMA::ScaleOut::One);
      }
      warpgroup_commit_batch();
      warpgroup_wait<1>();
      fence(d0);
      fence(d1);
      total += clock64() - t0;  // until the first group is complete
    }
    if constexpr (C == DV_QD) {
      warpgroup_arrive();
#pragma unroll
      for (int s = 0; s < 4; ++s)
        ss<SsN128>(desc_k(tile_a, 64, s), desc_k(tile_b, 128, s), d1, s ? GMMA::ScaleOut::One : GMMA::ScaleOut::Zero);
      warpgroup_commit_batch();
      warpgroup_wait<1>();
      fence(d0);
      total += clock64() - t0;  // until DV is complete
    }
    warpgroup_wait<0>();
    fence(d0);
    fence(d1);
    fence(d2);
    fence(d3);
  }
  const long long t_end = clock64();
  if (threadIdx.x % 128 == 0) {
    out[2 * wg] = t_end - t_first;
    out[2 * wg + 1] = total;
  }
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 64; ++i) s += d0[i] + d1[i];
#pragma unroll
  for (int i = 0; i < 32; ++i) s += d2[i] + d3[i];
  if (s == 1234.5f) sink[threadIdx.x] = s;
}

template <int C> void run_case(int iters, long long* dout, float* dsink) {
  auto k = kernel<C>;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  for (int nwg = 1; nwg <= 2; ++nwg) {
    long long h[4] = {0, 0, 0, 0};
    double best = 1e30, best_dv = 0;
    for (int rep = 0; rep < 5; ++rep) {
      k<<<1, 128 * nwg, kSmem>>>(iters, dout, dsink);
      cudaError_t e = cudaDeviceSynchronize();
      if (e != cudaSuccess) {
        std::printf("%s: %s\n", kNames[C], cudaGetErrorString(e));
        std::exit(1);
      }
      cudaMemcpy(h, dout, sizeof(h), cudaMemcpyDeviceToHost);
      double per = 0, per_dv = 0;
      for (int w = 0; w < nwg; ++w) {
        per = per > double(h[2 * w]) / iters ? per : double(h[2 * w]) / iters;
        per_dv += double(h[2 * w + 1]) / iters / nwg;
      }
      if (per < best) best = per, best_dv = per_dv;
    }
    if (C == DV_QD || C == DV_QD_MN || C == QD_DV || C == DV_DV || C == DV_WD)
      std::printf("%-12s nwg=%d  %8.1f cycles/iter  (first group complete at %.1f)\n", kNames[C], nwg, best, best_dv);
    else
      std::printf("%-12s nwg=%d  %8.1f cycles/iter\n", kNames[C], nwg, best);
  }
}

template <int... C> void run_all(int iters, long long* dout, float* dsink, std::integer_sequence<int, C...>) {
  (run_case<C>(iters, dout, dsink), ...);
}

}  // namespace wl
using namespace wl;

int main(int argc, char** argv) {
  const int iters = argc > 1 ? std::atoi(argv[1]) : 1024;
  cudaDeviceProp p;
  cudaGetDeviceProperties(&p, 0);
  int clk = 0;
  cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, 0);
  std::printf("%s, %d SMs, max SM clock %d MHz; %d iterations, best of 5 launches\n", p.name,
              p.multiProcessorCount, clk / 1000, iters);
  long long* dout;
  float* dsink;
  cudaMalloc(&dout, 4 * sizeof(long long));
  cudaMalloc(&dsink, 256 * sizeof(float));
  run_all(iters, dout, dsink, std::make_integer_sequence<int, NCASES>{});
  return 0;
}
