// Host-side check of the register-state kernel's fragment geometry (no GPU needed):
// compiled by scripts/build/layout_check_regstate.sh with nvcc, run on the CPU. Exits 0 when
// every check holds, 1 with the first mismatches printed otherwise.
//
// What it checks, against the kernel's own definitions (cuda/dhu_sm90_regstate.cuh):
//  1. CuTe's wgmma A and C layouts (the atoms the kernel uses) put register 4kb + m,
//     value c of thread t at the rows and columns the kernel assumes (FragGeom of
//     dhu_common.cuh): so an accumulator packed pairwise is the next product's A.
//  2. The CuTe shared-memory layouts behind the B (and QD's A) descriptors address the
//     bytes where TMA's 128-byte swizzle puts each element of the k, q, w, do tiles.
//  3. ldmatrix.x4.trans / stmatrix.x4(.trans) at SmGeom's lane addresses move exactly
//     the fragment's elements to and from the [t][v], [k][v] and [v][k] tiles (the PTX
//     ISA's semantics emulated: lane 8m + r gives row r of matrix m; without .trans
//     thread l holds row l/4, columns 2(l%4) + c; with .trans the transposed element).
#include <cstdio>
#include <cstdlib>

#include "dhu_sm90_regstate.cuh"

using namespace cute;
using namespace kda_dhu;
using namespace kda_dhu::sm90_regstate;

static int failures = 0;
#define EXPECT(cond, ...)                    \
  do {                                       \
    if (!(cond)) {                           \
      if (failures < 20) {                   \
        std::printf("FAIL %s:%d: ", __FILE__, __LINE__); \
        std::printf(__VA_ARGS__);            \
        std::printf("\n");                   \
      }                                      \
      ++failures;                            \
    }                                        \
  } while (0)

// Fragment coordinate (row, col) of register r, value c of thread t (the kernel's
// convention: register r = 4kb + m of an A fragment, or elements 2r, 2r + 1 of an
// accumulator; FragGeom of dhu_common.cuh gives the same for accumulators).
static void frag_coord(int t, int r, int c, int& row, int& col) {
  const int w = t / 32, l = t % 32, m = r % 4, kb = r / 4;
  row = 16 * w + l / 4 + 8 * (m & 1);
  col = 16 * kb + 8 * (m >> 1) + 2 * (l % 4) + c;
}

// Byte address of element (row, col) in a 128-byte swizzled tile of 128-byte rows
// (64 16-bit values), boxes of `box_rows` rows stacked every box_rows * 128 bytes along
// the column blocks of 64 (TMA SWIZZLE_128B, 1024-byte aligned boxes).
static int tma_addr(int row, int col, int box_rows) {
  return (col / 64) * box_rows * 128 + row * 128 + ((((col % 64) / 8) ^ (row % 8)) << 4) + (col % 8) * 2;
}
// The inverse within one box: (row, col) of a byte address.
static void tma_coord(int addr, int box_rows, int& row, int& col) {
  const int box = addr / (box_rows * 128), in = addr % (box_rows * 128);
  row = in / 128;
  col = box * 64 + ((((in % 128) / 16) ^ (row % 8)) * 8) + (in % 16) / 2;
}

// (check_a: the A operand comes from registers; an SS atom's A layout is shared memory's.)
template <class Op>
static void check_atom(const char* name, int n, bool check_a) {
  using Traits = MMA_Traits<Op>;
  auto a = typename Traits::ALayout{};  // (thr, val) -> m + 64 k   (64 x 16)
  auto cl = typename Traits::CLayout{};  // (thr, val) -> m + 64 n   (64 x n)
  for (int t = 0; t < 128; ++t) {
    for (int v = 0; v < (check_a ? 8 : 0); ++v) {
      const int idx = a(t, v);
      int row, col;
      frag_coord(t, v / 2, v % 2, row, col);
      EXPECT(idx % 64 == row && idx / 64 == col, "%s A: thread %d value %d at (%d, %d), expected (%d, %d)", name, t,
             v, idx % 64, idx / 64, row, col);
    }
    const FragGeom fg(t);
    for (int v = 0; v < n / 2; ++v) {
      const int idx = cl(t, v);
      int row, col;
      frag_coord(t, v / 2, v % 2, row, col);
      EXPECT(idx % 64 == row && idx / 64 == col, "%s C: thread %d value %d at (%d, %d), expected (%d, %d)", name, t,
             v, idx % 64, idx / 64, row, col);
      EXPECT(fg.row(v) == row && fg.col(v) + (v & 1) == col, "%s C vs FragGeom: thread %d value %d", name, t, v);
    }
  }
}

// A CuTe smem layout L of shape (R, C) against the TMA tile: element (i, j) of a tensor
// on a 1024-aligned shared-memory base (the swizzle applies to the address, as on the
// device) is tile element (row, col) = map(i, j).
template <class T, class L, class Map>
static void check_smem_layout(const char* name, int R, int C, int box_rows, Map map) {
  const uintptr_t base = uintptr_t(1) << 16;
  auto tensor = make_tensor(make_smem_ptr(reinterpret_cast<T*>(base)), L{});
  for (int i = 0; i < R; ++i) {
    for (int j = 0; j < C; ++j) {
      int row, col;
      map(i, j, row, col);
      const int want = tma_addr(row, col, box_rows);
      const int got = int(reinterpret_cast<uintptr_t>(&tensor(i, j)) - base);
      EXPECT(got == want, "%s (%d, %d): CuTe byte %d, TMA byte %d", name, i, j, got, want);
    }
  }
}

// ldmatrix.x4.trans / stmatrix.x4.trans over k-block kb of a .trans tile: thread t's
// register 4kb + m value c lives at tile (row, col) = (fragment col, fragment row).
static void check_trans(const char* name, int tile_rows) {
  for (int kb = 0; kb < tile_rows / 16; ++kb) {
    for (int w = 0; w < 4; ++w) {
      int addr[32];
      for (int lane = 0; lane < 32; ++lane) addr[lane] = kb * 2048 + int(SmGeom::trans_off(w, lane));
      for (int l = 0; l < 32; ++l) {
        for (int m = 0; m < 4; ++m) {
          for (int c = 0; c < 2; ++c) {
            // .trans: thread l, matrix m, value c is element (row 2(l%4) + c, column l/4)
            // of the matrix whose row j is at addr[8m + j].
            const int a = addr[8 * m + 2 * (l % 4) + c] + 2 * (l / 4);
            int row, col, frow, fcol;
            tma_coord(a, tile_rows, row, col);
            frag_coord(32 * w + l, 4 * kb + m, c, frow, fcol);
            EXPECT(row == fcol && col == frow, "%s kb %d thread %d reg %d.%d: tile (%d, %d), fragment (%d, %d)", name,
                   kb, 32 * w + l, m, c, row, col, frow, fcol);
          }
        }
      }
      for (int lane = 0; lane < 32; ++lane)
        EXPECT(addr[lane] % 16 == 0, "%s: lane %d's row address is not 16-byte aligned", name, lane);
    }
  }
}

// stmatrix.x4 (no .trans) into the state_v_first tile [K/64 boxes][64 v][64 k].
static void check_direct(int K) {
  for (int kb = 0; kb < K / 16; ++kb) {
    for (int w = 0; w < 4; ++w) {
      for (int l = 0; l < 32; ++l) {
        for (int m = 0; m < 4; ++m) {
          for (int c = 0; c < 2; ++c) {
            const int a = int(SmGeom::direct_off(w, 8 * m + l / 4, kb)) + 2 * (2 * (l % 4) + c);
            int row, col, frow, fcol;
            tma_coord(a, 64, row, col);
            frag_coord(32 * w + l, 4 * kb + m, c, frow, fcol);
            EXPECT(row == frow && col == fcol, "svf K=%d kb %d thread %d reg %d.%d: tile (%d, %d), fragment (%d, %d)",
                   K, kb, 32 * w + l, m, c, row, col, frow, fcol);
          }
        }
      }
    }
  }
}

template <class T, int K>
static void check_k() {
  using OpDV = typename RsAtom<T, BT, GMMA::Major::K, GMMA::ScaleIn::One>::type;
  using OpWD = typename RsAtom<T, K, GMMA::Major::MN, GMMA::ScaleIn::Neg>::type;
  using OpQD = typename SsAtom<T, K>::type;
  check_atom<OpDV>("DV", BT, true);
  check_atom<OpWD>("WD", K, true);
  check_atom<OpQD>("QD", K, false);  // C only: its A comes from shared memory
  // The kernel's smem layouts (the same expressions as in dhu_regstate_kernel).
  using LayoutKt = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<T>{}, Shape<Int<BT>, Int<K>>{}));
  using LayoutQt = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<T>{}, Shape<Int<K>, Int<BT>>{}, Step<_2, _1>{}));
  using LayoutVt = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<T>{}, Shape<Int<BV>, Int<BT>>{}));
  // k as DV's B: (n = t, k = k) is tile (t, k) of the [t][k] boxes.
  check_smem_layout<T, LayoutKt>("k tile (t, k)", BT, K, BT, [](int i, int j, int& r, int& c) { r = i, c = j; });
  // q / w as QD's / WD's B: (n = k, k = t) is tile (t, k).
  check_smem_layout<T, LayoutQt>("q/w tile (k, t)", K, BT, BT, [](int i, int j, int& r, int& c) { r = j, c = i; });
  // do as QD's A: (m = v, k = t) is tile (t, v).
  check_smem_layout<T, LayoutVt>("do tile (v, t)", BV, BT, BT, [](int i, int j, int& r, int& c) { r = j, c = i; });
  // The descriptors CuTe derives from them (printed for the record).
  auto mma_dv = make_tiled_mma(OpDV{});
  auto mma_wd = make_tiled_mma(OpWD{});
  auto mma_qd = make_tiled_mma(OpQD{});
  // Descriptors need a shared-memory pointer; any 1024-aligned value does on the host.
  auto at = [](uintptr_t off) { return make_smem_ptr(reinterpret_cast<T*>(off)); };
  auto dB = mma_dv.get_thread_slice(0).make_fragment_B(mma_dv.get_thread_slice(0).partition_B(
      make_tensor(at(0x0), LayoutKt{})));
  auto wB = mma_wd.get_thread_slice(0).make_fragment_B(mma_wd.get_thread_slice(0).partition_B(
      make_tensor(at(0x0), LayoutQt{})));
  auto qA = mma_qd.get_thread_slice(0).make_fragment_A(mma_qd.get_thread_slice(0).partition_A(
      make_tensor(at(0x0), LayoutVt{})));
  EXPECT(size<2>(dB) == K / 16 && size<2>(wB) == BT / 16 && size<2>(qA) == BT / 16, "k-blocks per product");
  auto show = [](const char* what, int kb, GmmaDescriptor d) {
    std::printf("  %-8s kblock %d: start %5u B, LBO %5u B, SBO %5u B, layout %u\n", what, kb,
                unsigned(d.bitfield.start_address_) * 16, unsigned(d.bitfield.leading_byte_offset_) * 16,
                unsigned(d.bitfield.stride_byte_offset_) * 16, unsigned(d.bitfield.layout_type_));
  };
  std::printf("K = %d, %s:\n", K, sizeof(T) == 2 && std::is_same_v<T, cutlass::half_t> ? "fp16" : "bf16");
  for (int kb = 0; kb < K / 16; ++kb) {
    GmmaDescriptor d = dB(0, 0, kb);
    // k-block kb of the K-major k tile starts at box kb / 4, 32 bytes per k-block within it.
    EXPECT(int(d.bitfield.start_address_) * 16 == (kb / 4) * 8192 + (kb % 4) * 32, "DV B start, kblock %d", kb);
    EXPECT(int(d.bitfield.stride_byte_offset_) * 16 == 1024, "DV B SBO");
    EXPECT(int(d.bitfield.layout_type_) == 1, "DV B: 128-byte swizzle");
    if (kb < 2) show("DV B", kb, d);
  }
  for (int kb = 0; kb < BT / 16; ++kb) {
    GmmaDescriptor d = wB(0, 0, kb);
    // k-block kb (16 tokens) of the MN-major q / w tile starts 16 rows in; the second
    // 64-column box (N = 128) is LBO = 8192 bytes on.
    EXPECT(int(d.bitfield.start_address_) * 16 == kb * 2048, "WD/QD B start, kblock %d", kb);
    EXPECT(int(d.bitfield.stride_byte_offset_) * 16 == 1024, "WD/QD B SBO");
    EXPECT(K == 64 || int(d.bitfield.leading_byte_offset_) * 16 == 8192, "WD/QD B LBO (N = 128)");
    EXPECT(int(d.bitfield.layout_type_) == 1, "WD/QD B: 128-byte swizzle");
    show("WD/QD B", kb, d);
    GmmaDescriptor e = qA(0, 0, kb);
    EXPECT(int(e.bitfield.start_address_) * 16 == kb * 2048, "QD A start, kblock %d", kb);
    EXPECT(int(e.bitfield.stride_byte_offset_) * 16 == 1024, "QD A SBO");
    if (kb < 2) show("QD A", kb, e);
  }
}

int main() {
  check_k<cutlass::bfloat16_t, 64>();
  check_k<cutlass::bfloat16_t, 128>();
  check_k<cutlass::half_t, 64>();
  check_k<cutlass::half_t, 128>();
  check_trans("[t][v] tile (do, dv, dv2)", BT);
  check_trans("[k][v] state tile, K = 64", 64);
  check_trans("[k][v] state tile, K = 128", 128);
  check_direct(64);
  check_direct(128);
  // Shared memory: the map's tiles are 1024-byte aligned and the sums are the host's.
  static_assert(SmemMap<128, 1>::BH_OFF % 1024 == 0 && SmemMap<128, 1>::DV2_OFF % 1024 == 0, "tile bases");
  static_assert(SmemMap<64, 2>::BH_OFF % 1024 == 0 && SmemMap<64, 2>::DV2_OFF % 1024 == 0, "tile bases");
  if (failures) {
    std::printf("layout_check_regstate: %d mismatches\n", failures);
    return 1;
  }
  std::printf("layout_check_regstate: all checks hold\n");
  return 0;
}
