//! Mirror of `cuda/dhu_params.h`: the one struct every stage-4 kernel takes by value
//! (`const __grid_constant__ kda_dhu::DhuParams`). Same fields, same order, same
//! sizes; a change there is a change here, and the size/offset checks below (numbers
//! printed by g++ from the header with CUDA 13's cuda.h) catch a drift.
//!
//! CUDA 13's CUtensorMap is `alignas(128)` (CUDA 12's was 64): the struct is
//! `alignas(128)` and 1024 bytes.

use cudarc::driver::sys::CUtensorMap;

pub const FLAG_G: u32 = 1 << 0;
pub const FLAG_GK: u32 = 1 << 1;
pub const FLAG_DHT: u32 = 1 << 2;
pub const FLAG_DH0: u32 = 1 << 3;
pub const FLAG_VARLEN: u32 = 1 << 4;
pub const FLAG_CU_I32: u32 = 1 << 5;
pub const FLAG_OFFSETS_I32: u32 = 1 << 6;

/// Mirror of `DhuError`: the host-mapped record of an input error found on the device.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct DhuError {
    pub code: u32,
    pub claim: u32,
    pub seq: i64,
    pub a: i64,
    pub b: i64,
    /// The failing call's T and NT (the message quotes them).
    pub t: i64,
    pub nt: i64,
}

#[repr(C, align(128))]
#[derive(Clone, Copy, Debug)]
pub struct DhuParams {
    pub tma_q: CUtensorMap,
    pub tma_k: CUtensorMap,
    pub tma_w: CUtensorMap,
    pub tma_do: CUtensorMap,
    pub tma_dv: CUtensorMap,
    pub tma_dv2: CUtensorMap,
    pub tma_dh: CUtensorMap,
    /// [B, T, HV] fp32, or null.
    pub g: u64,
    /// [B, T, HV, K] fp32, or null.
    pub gk: u64,
    /// [N, HV, K, V] fp32, or null.
    pub dht: u64,
    /// [N, HV, K, V] fp32 out, or null.
    pub dh0: u64,
    /// [N + 1] int64 / int32 (FLAG_CU_I32), or null.
    pub cu_seqlens: u64,
    /// [N + 1] first chunk of each sequence in dh (int64 / int32: FLAG_OFFSETS_I32), or
    /// null (the kernel sums the chunk counts).
    pub chunk_offsets: u64,
    /// [B, T, HV, V] out (plain stores of partial varlen chunks).
    pub dv2: u64,
    /// [B, NT, HV, K, V] out.
    pub dh: u64,
    /// Tokens per batch row (the packed length with cu_seqlens).
    pub t: i64,
    /// Chunks per batch row (dense); total chunks (varlen).
    pub nt: i32,
    pub h: i32,
    pub hv: i32,
    pub v: i32,
    /// Applied after the fp32 q^T do dot, as fla does.
    pub scale: f32,
    /// FLAG_* bits.
    pub flags: u32,
    /// Device address of the host-mapped `DhuError` record, or null.
    pub error: u64,
    /// Sequences: B, or len(cu_seqlens) - 1.
    pub n: i32,
    /// Chunks per segment of a sequence split (src/split.rs), or 0: no split.
    pub seg_chunks: i32,
    /// The segment that blockIdx.y = hv runs (stage 4's first pass 1, its second 0; the
    /// forward scan's first pass 0, its second 1).
    pub seg_first: i32,
}

/// sizeof / alignof / offsetof as g++ computes them for dhu_params.h with CUDA 13.0's
/// cuda.h (see `abi_matches_the_c_header` for how to recompute them).
pub const C_SIZEOF: usize = 1024;
pub const C_ALIGNOF: usize = 128;
pub const C_OFFSETS: [(&str, usize); 26] = [
    ("tma_q", 0),
    ("tma_k", 128),
    ("tma_w", 256),
    ("tma_do", 384),
    ("tma_dv", 512),
    ("tma_dv2", 640),
    ("tma_dh", 768),
    ("g", 896),
    ("gk", 904),
    ("dht", 912),
    ("dh0", 920),
    ("cu_seqlens", 928),
    ("chunk_offsets", 936),
    ("dv2", 944),
    ("dh", 952),
    ("T", 960),
    ("NT", 968),
    ("H", 972),
    ("HV", 976),
    ("V", 980),
    ("scale", 984),
    ("flags", 988),
    ("error", 992),
    ("N", 1000),
    ("seg_chunks", 1004),
    ("seg_first", 1008),
];

/// The Rust offsets, in the order of `C_OFFSETS`.
pub const RUST_OFFSETS: [usize; 26] = {
    use std::mem::offset_of;
    [
        offset_of!(DhuParams, tma_q),
        offset_of!(DhuParams, tma_k),
        offset_of!(DhuParams, tma_w),
        offset_of!(DhuParams, tma_do),
        offset_of!(DhuParams, tma_dv),
        offset_of!(DhuParams, tma_dv2),
        offset_of!(DhuParams, tma_dh),
        offset_of!(DhuParams, g),
        offset_of!(DhuParams, gk),
        offset_of!(DhuParams, dht),
        offset_of!(DhuParams, dh0),
        offset_of!(DhuParams, cu_seqlens),
        offset_of!(DhuParams, chunk_offsets),
        offset_of!(DhuParams, dv2),
        offset_of!(DhuParams, dh),
        offset_of!(DhuParams, t),
        offset_of!(DhuParams, nt),
        offset_of!(DhuParams, h),
        offset_of!(DhuParams, hv),
        offset_of!(DhuParams, v),
        offset_of!(DhuParams, scale),
        offset_of!(DhuParams, flags),
        offset_of!(DhuParams, error),
        offset_of!(DhuParams, n),
        offset_of!(DhuParams, seg_chunks),
        offset_of!(DhuParams, seg_first),
    ]
};

// Compile-time: the build fails if the mirror drifts from the C numbers.
const _: () = {
    assert!(std::mem::size_of::<DhuParams>() == C_SIZEOF);
    assert!(std::mem::align_of::<DhuParams>() == C_ALIGNOF);
    let mut i = 0;
    while i < C_OFFSETS.len() {
        assert!(RUST_OFFSETS[i] == C_OFFSETS[i].1);
        i += 1;
    }
};

impl DhuParams {
    /// All zeros: null pointers, zeroed tensor maps.
    pub fn zeroed() -> DhuParams {
        // SAFETY: every field is an integer, a float or a plain array of integers.
        unsafe { std::mem::zeroed() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::{Path, PathBuf};
    use std::process::Command;

    #[test]
    fn layout_is_the_c_layout() {
        assert_eq!(std::mem::size_of::<DhuParams>(), 1024);
        assert_eq!(std::mem::align_of::<DhuParams>(), 128);
        assert_eq!(std::mem::size_of::<CUtensorMap>(), 128);
        for (i, (name, off)) in C_OFFSETS.iter().enumerate() {
            assert_eq!(RUST_OFFSETS[i], *off, "{name}");
        }
    }

    /// cuda.h from the CUDA_HOME toolkit or the nvidia-cuda-runtime wheel of PYO3_PYTHON.
    fn cuda_include() -> Option<PathBuf> {
        if let Some(home) = std::env::var_os("CUDA_HOME") {
            let inc = Path::new(&home).join("include");
            if inc.join("cuda.h").is_file() {
                return Some(inc);
            }
        }
        let py = std::env::var_os("PYO3_PYTHON").unwrap_or_else(|| "python3".into());
        let out =
            Command::new(py).args(["-c", "import nvidia.cu13 as m\nfor p in m.__path__: print(p)"]).output().ok()?;
        String::from_utf8(out.stdout)
            .ok()?
            .lines()
            .map(|l| Path::new(l.trim()).join("include"))
            .find(|inc| inc.join("cuda.h").is_file())
    }

    /// Recomputes the C numbers with g++ when g++ and cuda.h are around (skipped
    /// otherwise): the header is the source of truth.
    #[test]
    fn abi_matches_the_c_header() {
        let Some(inc) = cuda_include() else {
            eprintln!("skipped: no cuda.h (set CUDA_HOME or PYO3_PYTHON with nvidia-cuda-runtime)");
            return;
        };
        let dir = std::env::temp_dir().join(format!("kda_dhu_abi_{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut src = String::from(
            "#include <cstdio>\n#include <cstddef>\n#include \"dhu_params.h\"\nusing kda_dhu::DhuParams;\n\
             int main() {\n  printf(\"%zu %zu\", sizeof(DhuParams), alignof(DhuParams));\n",
        );
        for (name, _) in C_OFFSETS {
            src.push_str(&format!("  printf(\" %zu\", offsetof(DhuParams, {name}));\n"));
        }
        src.push_str(
            "  printf(\" %u %u %u %u %u %u %u\", (unsigned)kda_dhu::FLAG_G, (unsigned)kda_dhu::FLAG_GK, \
             (unsigned)kda_dhu::FLAG_DHT, (unsigned)kda_dhu::FLAG_DH0, (unsigned)kda_dhu::FLAG_VARLEN, \
             (unsigned)kda_dhu::FLAG_CU_I32, (unsigned)kda_dhu::FLAG_OFFSETS_I32);\n",
        );
        src.push_str(
            "  printf(\" %zu %zu %zu %zu %zu\", sizeof(kda_dhu::DhuError), offsetof(kda_dhu::DhuError, code), \
             offsetof(kda_dhu::DhuError, claim), offsetof(kda_dhu::DhuError, seq), offsetof(kda_dhu::DhuError, NT));\n",
        );
        src.push_str(
            "  printf(\" %u %u %u %u %u\", (unsigned)kda_dhu::DHU_ERR_FIRST_OFFSET, (unsigned)kda_dhu::DHU_ERR_DECREASING, \
             (unsigned)kda_dhu::DHU_ERR_PAST_T, (unsigned)kda_dhu::DHU_ERR_OFFSETS, (unsigned)kda_dhu::DHU_ERR_PAST_NT);\n  return 0;\n}\n",
        );
        let cpp = dir.join("abi.cpp");
        let exe = dir.join("abi");
        std::fs::write(&cpp, src).unwrap();
        let cuda_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("cuda");
        let Ok(st) = Command::new("g++")
            .args(["-std=c++17", "-I"])
            .arg(&cuda_dir)
            .arg("-I")
            .arg(&inc)
            .arg(&cpp)
            .arg("-o")
            .arg(&exe)
            .status()
        else {
            eprintln!("skipped: no g++");
            return;
        };
        assert!(st.success(), "g++ failed on dhu_params.h");
        let out = Command::new(&exe).output().unwrap();
        let nums: Vec<usize> =
            String::from_utf8(out.stdout).unwrap().split_whitespace().map(|n| n.parse().unwrap()).collect();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(nums[0], std::mem::size_of::<DhuParams>(), "sizeof");
        assert_eq!(nums[1], std::mem::align_of::<DhuParams>(), "alignof");
        for (i, (name, _)) in C_OFFSETS.iter().enumerate() {
            assert_eq!(nums[2 + i], RUST_OFFSETS[i], "offsetof {name}");
        }
        let flags = 2 + C_OFFSETS.len();
        assert_eq!(
            &nums[flags..flags + 7],
            &[FLAG_G, FLAG_GK, FLAG_DHT, FLAG_DH0, FLAG_VARLEN, FLAG_CU_I32, FLAG_OFFSETS_I32].map(|f| f as usize)
        );
        let e = std::mem::offset_of!(DhuError, nt);
        assert_eq!(&nums[flags + 7..flags + 12], &[std::mem::size_of::<DhuError>(), 0, 4, 8, e], "DhuError layout");
        use crate::varlen::*;
        assert_eq!(
            &nums[flags + 12..],
            &[ERR_FIRST_OFFSET, ERR_DECREASING, ERR_PAST_T, ERR_OFFSETS, ERR_PAST_NT].map(|c| c as usize),
            "error codes"
        );
    }
}
