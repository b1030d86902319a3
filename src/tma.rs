//! TMA descriptors (CUtensorMap) for the stage-4 kernels, exactly as dhu_params.h
//! lists them. The parameter computation is a pure function (`dhu_specs`, tested
//! against the driver's documented limits); `build_tensor_maps` is the one place that
//! encodes them, so a later per-signature cache wraps a single function.

use crate::driver::{check, require_driver};
use crate::error::{Error, Result};
use crate::tensor::DType;
use cudarc::driver::sys::{
    self, CUtensorMap, CUtensorMapDataType, CUtensorMapFloatOOBfill, CUtensorMapInterleave,
    CUtensorMapL2promotion, CUtensorMapSwizzle,
};

/// Rows (tokens) and columns of one TMA box of q, k, w, do, dv, dv2.
pub const BOX_ROWS: u32 = 64;
pub const BOX_COLS: u32 = 64;
/// With 128-byte swizzle a box row may span at most 128 bytes.
pub const SWIZZLE_SPAN: u64 = 128;
pub const SWIZZLE: CUtensorMapSwizzle = CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B;
pub const L2_PROMOTION: CUtensorMapL2promotion = CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B;
/// Out-of-bounds elements read as zeros; out-of-bounds stores are clipped.
pub const OOB_FILL: CUtensorMapFloatOOBfill = CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE;
pub const INTERLEAVE: CUtensorMapInterleave = CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE;

/// The arguments of one cuTensorMapEncodeTiled call (rank 4, innermost dim first).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TmaSpec {
    /// Which tensor, for error messages.
    pub tensor: &'static str,
    pub dtype: CUtensorMapDataType,
    pub elem_bytes: u64,
    pub address: u64,
    pub dims: [u64; 4],
    /// Byte strides of dims 1..3 (dim 0 is contiguous).
    pub strides: [u64; 3],
    pub box_dim: [u32; 4],
    pub element_strides: [u32; 4],
}

/// Extents the maps are built from. `nt` is chunks per batch row (dense) or the total
/// chunk count (varlen, B == 1): dh has B*NT checkpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TmaShape {
    pub b: u64,
    pub t: u64,
    pub h: u64,
    pub hv: u64,
    pub k: u64,
    pub v: u64,
    pub nt: u64,
    /// BF16 or F16 (q, k, w, do, dv, dv2, dh share it).
    pub dtype: DType,
}

/// Device addresses of the tensors behind the maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TmaPointers {
    pub q: u64,
    pub k: u64,
    pub w: u64,
    pub do_: u64,
    pub dv: u64,
    pub dv2: u64,
    pub dh: u64,
}

fn tma_dtype(dtype: DType) -> Result<CUtensorMapDataType> {
    match dtype {
        DType::BF16 => Ok(CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16),
        DType::F16 => Ok(CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16),
        other => Err(Error::dtype("q", format!("expected dtype bfloat16 or float16 for the kernel, got {other}"))),
    }
}

/// A [rows..., row of `inner` elements] tensor tiled by (BOX_COLS, 1, BOX_ROWS, 1):
/// dims (inner, heads, T, B).
fn token_major(tensor: &'static str, s: &TmaShape, dt: CUtensorMapDataType, addr: u64, heads: u64, inner: u64) -> TmaSpec {
    let e = s.dtype.size_bytes();
    TmaSpec {
        tensor,
        dtype: dt,
        elem_bytes: e,
        address: addr,
        dims: [inner, heads, s.t, s.b],
        strides: [inner * e, heads * inner * e, s.t * heads * inner * e],
        box_dim: [BOX_COLS, 1, BOX_ROWS, 1],
        element_strides: [1; 4],
    }
}

/// The seven maps of DhuParams, in its order: q, k, w, do, dv, dv2, dh.
pub fn dhu_specs(s: &TmaShape, p: &TmaPointers) -> Result<[TmaSpec; 7]> {
    let dt = tma_dtype(s.dtype)?;
    let e = s.dtype.size_bytes();
    let dh = TmaSpec {
        tensor: "dh",
        dtype: dt,
        elem_bytes: e,
        address: p.dh,
        dims: [s.v, s.k, s.hv, s.b * s.nt],
        strides: [s.v * e, s.k * s.v * e, s.hv * s.k * s.v * e],
        box_dim: [BOX_COLS, s.k as u32, 1, 1],
        element_strides: [1; 4],
    };
    let specs = [
        token_major("q", s, dt, p.q, s.h, s.k),
        token_major("k", s, dt, p.k, s.h, s.k),
        token_major("w", s, dt, p.w, s.hv, s.k),
        token_major("do", s, dt, p.do_, s.hv, s.v),
        token_major("dv", s, dt, p.dv, s.hv, s.v),
        token_major("dv2", s, dt, p.dv2, s.hv, s.v),
        dh,
    ];
    for spec in &specs {
        check_spec(spec)?;
    }
    Ok(specs)
}

/// The limits cuTensorMapEncodeTiled documents for a non-interleaved, 128B-swizzled
/// map, checked before the call so that a failure names the reason.
pub fn check_spec(s: &TmaSpec) -> Result<()> {
    let bad = |msg: String| Err(Error::layout(s.tensor, format!("cannot build its TMA descriptor: {msg}")));
    if s.address % 16 != 0 {
        return bad(format!("address {:#x} is not 16-byte aligned", s.address));
    }
    for (i, &d) in s.dims.iter().enumerate() {
        if d == 0 || d > (1u64 << 32) {
            return bad(format!("dim {i} = {d} is not in [1, 2^32]"));
        }
    }
    for (i, &st) in s.strides.iter().enumerate() {
        if st % 16 != 0 || st >= (1u64 << 40) {
            return bad(format!("stride {} = {st} bytes is not a multiple of 16 below 2^40", i + 1));
        }
    }
    for (i, &b) in s.box_dim.iter().enumerate() {
        if b == 0 || b > 256 {
            return bad(format!("box dim {i} = {b} is not in [1, 256]"));
        }
    }
    let row = s.box_dim[0] as u64 * s.elem_bytes;
    if row % 16 != 0 || row > SWIZZLE_SPAN {
        return bad(format!("a box row of {row} bytes does not fit the 128-byte swizzle"));
    }
    if s.element_strides.iter().any(|&x| x == 0 || x > 8) {
        return bad("element strides must be in [1, 8]".into());
    }
    Ok(())
}

/// Encodes one map (cuTensorMapEncodeTiled).
pub fn encode(s: &TmaSpec) -> Result<CUtensorMap> {
    require_driver()?;
    let mut map = CUtensorMap { opaque: [0; 16] };
    // SAFETY: every array has the rank's length (4, or 3 for the strides) and lives
    // across the call; the driver only writes `map`.
    let res = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            s.dtype,
            4,
            s.address as *mut std::ffi::c_void,
            s.dims.as_ptr(),
            s.strides.as_ptr(),
            s.box_dim.as_ptr(),
            s.element_strides.as_ptr(),
            INTERLEAVE,
            SWIZZLE,
            L2_PROMOTION,
            OOB_FILL,
        )
    };
    check(res, || format!("cuTensorMapEncodeTiled for {} (dims {:?}, byte strides {:?}, box {:?})", s.tensor, s.dims, s.strides, s.box_dim))?;
    Ok(map)
}

/// The seven descriptors of one call, in DhuParams order (q, k, w, do, dv, dv2, dh).
pub fn build_tensor_maps(shape: &TmaShape, ptrs: &TmaPointers) -> Result<[CUtensorMap; 7]> {
    let specs = dhu_specs(shape, ptrs)?;
    let mut maps = [CUtensorMap { opaque: [0; 16] }; 7];
    for (m, s) in maps.iter_mut().zip(specs.iter()) {
        *m = encode(s)?;
    }
    Ok(maps)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(k: u64, v: u64) -> TmaShape {
        TmaShape { b: 2, t: 1000, h: 4, hv: 8, k, v, nt: 16, dtype: DType::BF16 }
    }

    fn ptrs() -> TmaPointers {
        TmaPointers { q: 0x1000, k: 0x2000, w: 0x3000, do_: 0x4000, dv: 0x5000, dv2: 0x6000, dh: 0x7000 }
    }

    #[test]
    fn specs_follow_dhu_params_h() {
        let s = dhu_specs(&shape(128, 64), &ptrs()).unwrap();
        let names: Vec<&str> = s.iter().map(|x| x.tensor).collect();
        assert_eq!(names, ["q", "k", "w", "do", "dv", "dv2", "dh"]);
        // q, k: dims (K, H, T, B), strides (K*2, H*K*2, T*H*K*2), box (64, 1, 64, 1)
        assert_eq!(s[0].dims, [128, 4, 1000, 2]);
        assert_eq!(s[0].strides, [256, 4 * 256, 1000 * 4 * 256]);
        assert_eq!(s[0].box_dim, [64, 1, 64, 1]);
        assert_eq!(s[0].address, 0x1000);
        assert_eq!(s[1].dims, s[0].dims);
        assert_eq!(s[1].address, 0x2000);
        // w: (K, HV, T, B)
        assert_eq!(s[2].dims, [128, 8, 1000, 2]);
        assert_eq!(s[2].strides, [256, 8 * 256, 1000 * 8 * 256]);
        // do, dv, dv2: (V, HV, T, B)
        for x in &s[3..6] {
            assert_eq!(x.dims, [64, 8, 1000, 2]);
            assert_eq!(x.strides, [128, 8 * 128, 1000 * 8 * 128]);
            assert_eq!(x.box_dim, [64, 1, 64, 1]);
        }
        // dh: (V, K, HV, B*NT), strides (V*2, K*V*2, HV*K*V*2), box (64, K, 1, 1)
        assert_eq!(s[6].dims, [64, 128, 8, 32]);
        assert_eq!(s[6].strides, [128, 128 * 64 * 2, 8 * 128 * 64 * 2]);
        assert_eq!(s[6].box_dim, [64, 128, 1, 1]);
        assert!(s.iter().all(|x| x.element_strides == [1; 4]));
        assert!(s.iter().all(|x| x.dtype == CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16));
    }

    #[test]
    fn k64_fp16_and_wide_v() {
        let mut sh = shape(64, 256);
        sh.dtype = DType::F16;
        let s = dhu_specs(&sh, &ptrs()).unwrap();
        assert!(s.iter().all(|x| x.dtype == CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16));
        assert_eq!(s[0].strides[0], 128);
        assert_eq!(s[3].dims[0], 256);
        assert_eq!(s[6].box_dim, [64, 64, 1, 1]);
    }

    #[test]
    fn limits_are_checked_with_the_tensor_named() {
        let mut p = ptrs();
        p.dv = 0x5008;
        let e = dhu_specs(&shape(128, 64), &p).unwrap_err();
        assert_eq!(e.to_string(), "dv: cannot build its TMA descriptor: address 0x5008 is not 16-byte aligned");

        let mut sh = shape(128, 64);
        sh.dtype = DType::F32;
        assert!(dhu_specs(&sh, &ptrs()).is_err());

        // A K that is not a multiple of 8 gives a stride that is not a multiple of 16.
        let e = dhu_specs(&shape(100, 64), &ptrs()).unwrap_err();
        assert!(e.to_string().starts_with("q: cannot build its TMA descriptor: stride 1 = 200"), "{e}");

        // dh's box spans K rows: K = 512 exceeds the 256 limit.
        let e = dhu_specs(&shape(512, 64), &ptrs()).unwrap_err();
        assert!(e.to_string().contains("box dim 1 = 512"), "{e}");
    }

    #[test]
    fn short_sequences_keep_a_full_box() {
        // T < 64: the box may exceed the tensor; TMA zero-fills / clips.
        let mut sh = shape(128, 64);
        sh.t = 5;
        sh.nt = 1;
        assert!(dhu_specs(&sh, &ptrs()).is_ok());
    }
}
