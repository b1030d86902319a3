//! Validation of a stage-4 call (fla's `chunk_gated_delta_rule_bwd_dhu` arguments):
//! what fla itself would reject is an error here; what fla accepts but the kernel
//! does not cover is left to the planner (`plan.rs`), which answers "fallback".
//!
//! Checks run in this order: shapes, dtypes, strides, scalar arguments, devices. The
//! device check comes last and can be skipped (`check_device = false`) so that CPU
//! tests exercise everything else without a GPU.

use crate::error::{Error, Result};
use crate::facts::BT;
use crate::tensor::{fmt_shape, DType, TensorMeta};

/// fla's head-dimension limit (`assert K <= 256`).
pub const MAX_K: i64 = 256;

/// The op's arguments: fla's signature of `chunk_gated_delta_rule_bwd_dhu` (fla-core 0.6),
/// in order, as (name, default): None for a required argument, else the default's Python
/// repr. The one description every entry point, stub and wrapper is checked against
/// (`_core.op_arguments()`, tests/unit/test_op_arguments.py). [`CallArgs`] holds the first 15;
/// `use_graph` (fla's static output buffers for graph capture) is carried out in Python.
pub const ARGUMENTS: &[(&str, Option<&str>)] = &[
    ("q", None),
    ("k", None),
    ("w", None),
    ("do", None),
    ("dv", None),
    ("g", Some("None")),
    ("gk", Some("None")),
    ("h0", Some("None")),
    ("dht", Some("None")),
    ("scale", Some("None")),
    ("state_v_first", Some("False")),
    ("cu_seqlens", Some("None")),
    ("chunk_size", Some("64")),
    ("chunk_indices", Some("None")),
    ("chunk_offsets", Some("None")),
    ("use_graph", Some("False")),
];

/// The arguments of one call, in fla's order (`do` is a Rust keyword: `do_`).
#[derive(Clone, Debug)]
pub struct CallArgs {
    pub q: TensorMeta,
    pub k: TensorMeta,
    pub w: TensorMeta,
    pub do_: TensorMeta,
    pub dv: TensorMeta,
    pub g: Option<TensorMeta>,
    pub gk: Option<TensorMeta>,
    pub h0: Option<TensorMeta>,
    pub dht: Option<TensorMeta>,
    pub scale: Option<f64>,
    pub state_v_first: bool,
    pub cu_seqlens: Option<TensorMeta>,
    pub chunk_size: i64,
    /// fla's chunk table [NT, 2] of a packed batch: only its length (dh's NT) is used.
    pub chunk_indices: Option<TensorMeta>,
    pub chunk_offsets: Option<TensorMeta>,
    /// dh's NT for a packed batch when the caller knows it without chunk_indices (the
    /// Python layer's cached count), else None.
    pub nt: Option<i64>,
}

/// Extents of a call. N = B without cu_seqlens, len(cu_seqlens) - 1 with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    pub b: i64,
    pub t: i64,
    pub h: i64,
    pub hv: i64,
    pub k: i64,
    pub v: i64,
    pub n: i64,
}

/// One tensor's layout facts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorLayout {
    pub name: &'static str,
    pub contiguous: bool,
    pub aligned16: bool,
    /// The kernel reads it through TMA or vector loads: 16-byte alignment required.
    pub needs_align16: bool,
}

impl TensorLayout {
    /// Laid out as the kernel and fla's function read it: contiguous (fla's function reads
    /// every tensor as if it were), 16-byte aligned where the kernel needs it.
    pub fn packed(&self) -> bool {
        self.contiguous && (self.aligned16 || !self.needs_align16)
    }
}

/// A validated call, reduced to what planning and launching need (no pointers).
#[derive(Clone, Debug, PartialEq)]
pub struct CallDesc {
    pub dims: Dims,
    /// dtype of q, k and w.
    pub qk_dtype: DType,
    /// dtype of do and dv.
    pub dv_dtype: DType,
    pub has_g: bool,
    pub has_gk: bool,
    pub has_h0: bool,
    pub has_dht: bool,
    /// dtype of cu_seqlens when given (varlen).
    pub cu_seqlens: Option<DType>,
    /// dtype of chunk_offsets when given together with cu_seqlens with N + 1 entries
    /// (fla's table; the kernel reads it). None: the kernel sums the chunk counts itself.
    pub chunk_offsets: Option<DType>,
    /// dh's NT: ceil(T / 64) per batch row (dense); with cu_seqlens, len(chunk_indices)
    /// or the caller's count, None while unknown on the host.
    pub nt: Option<i64>,
    pub state_v_first: bool,
    /// The scale the kernel applies (K^-0.5 when None was given).
    pub scale: f64,
    pub chunk_size: i64,
    pub layouts: Vec<TensorLayout>,
    /// The CUDA ordinal every tensor is on; None when the device check was skipped.
    pub device: Option<i32>,
    /// fla's forward scan (`chunk_gated_delta_rule_fwd_h`, `crate::forward`) carried by
    /// this call's fields (k, w; dv = u; dht = initial_state; has_h0 = output_final_state),
    /// not stage 4.
    pub forward: bool,
    /// dtype of dht: float32 (validated) for stage 4; the forward scan's initial_state may
    /// be 16-bit (fla's kernel casts it on load), a call the planner leaves to fla.
    pub state_dtype: DType,
}

impl CallDesc {
    pub fn varlen(&self) -> bool {
        self.cu_seqlens.is_some()
    }

    /// The inputs to copy into packed tensors before either implementation reads them
    /// (fla's function reads every tensor as if contiguous; the kernel also needs 16-byte
    /// alignment). Empty for the usual call.
    pub fn copies(&self) -> Vec<&'static str> {
        self.layouts.iter().filter(|l| !l.packed()).map(|l| l.name).collect()
    }

    /// Output shapes (dh, dh0 or None, dv2), once NT is known.
    pub fn out_shapes(&self) -> Option<OutShapes> {
        let Dims { b, t, hv, k, v, n, .. } = self.dims;
        let nt = self.nt?;
        let (dh, state) =
            if self.state_v_first { ([b, nt, hv, v, k], [n, hv, v, k]) } else { ([b, nt, hv, k, v], [n, hv, k, v]) };
        Some(OutShapes { dh, dh0: self.has_h0.then_some(state), dv2: [b, t, hv, v] })
    }
}

/// What the caller allocates: dh in q's dtype, dh0 float32 (when h0 is given), dv2 like dv.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutShapes {
    pub dh: [i64; 5],
    pub dh0: Option<[i64; 4]>,
    pub dv2: [i64; 4],
}

fn fmt_f64(x: f64) -> String {
    if x.is_nan() {
        "nan".into()
    } else if x.is_infinite() {
        if x > 0.0 {
            "inf".into()
        } else {
            "-inf".into()
        }
    } else {
        format!("{x}")
    }
}

fn expect_shape(t: &TensorMeta, arg: &'static str, want: &[i64], names: &[&str], like: &str) -> Result<()> {
    if t.shape.as_slice() == want {
        return Ok(());
    }
    let parts: Vec<String> = names.iter().zip(want).map(|(n, d)| format!("{n}={d}")).collect();
    Err(Error::shape(arg, format!("expected shape [{}]{like}, got {}", parts.join(", "), fmt_shape(&t.shape))))
}

fn expect_rank(t: &TensorMeta, arg: &'static str, rank: usize, what: &str) -> Result<()> {
    if t.ndim() == rank {
        Ok(())
    } else {
        Err(Error::shape(arg, format!("expected a {rank}-D tensor {what}, got shape {}", fmt_shape(&t.shape))))
    }
}

fn expect_dtype_in(t: &TensorMeta, arg: &'static str, allowed: &[DType], words: &str) -> Result<()> {
    if allowed.contains(&t.dtype) {
        Ok(())
    } else {
        Err(Error::dtype(arg, format!("expected dtype {words}, got {}", t.dtype)))
    }
}

fn expect_dtype_like(t: &TensorMeta, arg: &'static str, want: DType, other: &str) -> Result<()> {
    if t.dtype == want {
        Ok(())
    } else {
        Err(Error::dtype(arg, format!("expected dtype {want} like {other}, got {}", t.dtype)))
    }
}

/// A group of tensors that share one dtype (q, k, w; do, dv): each of an `allowed` dtype,
/// then all of one. The error names the odd one out: the expected dtype is the one most
/// of the group has (a tie goes to `hint`, the other group's dtype, then to the first
/// argument's), and the first argument of another dtype is blamed. Returns the dtype.
fn expect_one_dtype(
    group: &[(&'static str, &TensorMeta)],
    allowed: &[DType],
    words: &str,
    hint: Option<DType>,
) -> Result<DType> {
    for &(name, t) in group {
        expect_dtype_in(t, name, allowed, words)?;
    }
    let score = |d: DType| (group.iter().filter(|(_, t)| t.dtype == d).count(), hint == Some(d));
    let mut want = group[0].1.dtype;
    for &(_, t) in group {
        if score(t.dtype) > score(want) {
            want = t.dtype;
        }
    }
    match group.iter().find(|(_, t)| t.dtype != want) {
        None => Ok(want),
        Some(&(name, t)) => {
            let like: Vec<&str> = group.iter().filter(|(_, t)| t.dtype == want).map(|&(n, _)| n).collect();
            Err(Error::dtype(name, format!("expected dtype {want} like {}, got {}", like.join(" and "), t.dtype)))
        }
    }
}

/// The element types a path takes: `data` for q, k, w, do and dv, `fp32` for g, gk and
/// dht (the fp32 tensors of fla's signature), with the words of their error messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dtypes {
    pub data: &'static [DType],
    pub data_words: &'static str,
    pub fp32: &'static [DType],
    pub fp32_words: &'static str,
}

/// fla's element types, and so the kernels' and the CPU path's `fla` mode: q, k, w, do,
/// dv in bfloat16, float16 or float32; g, gk, dht in float32.
pub const FLA_DTYPES: Dtypes = Dtypes {
    data: &[DType::BF16, DType::F16, DType::F32],
    data_words: "bfloat16, float16 or float32",
    fp32: &[DType::F32],
    fp32_words: "float32",
};

/// The CPU path's `float64` mode (the reference arithmetic): fla's element types and
/// float64 throughout.
pub const F64_DTYPES: Dtypes = Dtypes {
    data: &[DType::BF16, DType::F16, DType::F32, DType::F64],
    data_words: "bfloat16, float16, float32 or float64",
    fp32: &[DType::F32, DType::F64],
    fp32_words: "float32 or float64",
};

const INDEX: &[DType] = &[DType::I64, DType::I32];
const INDEX_WORDS: &str = "int64 or int32";

/// Every extent >= 0 and numel * element size <= i64::MAX.
fn extents_fit(t: &TensorMeta) -> bool {
    let mut bytes = t.dtype.size_bytes().max(1) as i64;
    for &d in &t.shape {
        if d < 0 {
            return false;
        }
        match bytes.checked_mul(d) {
            Some(b) => bytes = b,
            None => return false,
        }
    }
    true
}

/// Every tensor argument with its name, in fla's order (chunk_indices and chunk_offsets
/// only with cu_seqlens: fla ignores them otherwise).
fn named_tensors(a: &CallArgs) -> Vec<(&'static str, &TensorMeta)> {
    let mut v: Vec<(&'static str, &TensorMeta)> =
        vec![("q", &a.q), ("k", &a.k), ("w", &a.w), ("do", &a.do_), ("dv", &a.dv)];
    for (name, t) in [("g", &a.g), ("gk", &a.gk), ("h0", &a.h0), ("dht", &a.dht), ("cu_seqlens", &a.cu_seqlens)] {
        if let Some(t) = t {
            v.push((name, t));
        }
    }
    if a.cu_seqlens.is_some() {
        for (name, t) in [("chunk_indices", &a.chunk_indices), ("chunk_offsets", &a.chunk_offsets)] {
            if let Some(t) = t {
                v.push((name, t));
            }
        }
    }
    v
}

/// Validates a call. `check_device`: also require every tensor on one CUDA device
/// (the full check, used by planning and launching; `validate()` on CPU skips it).
pub fn validate(a: &CallArgs, check_device: bool) -> Result<CallDesc> {
    validate_dtypes(a, check_device, &FLA_DTYPES)
}

/// `validate` with the element types of a path (`FLA_DTYPES` for fla's, the kernels' and
/// the CPU `fla` mode; `F64_DTYPES` for the CPU `float64` mode): every other check and
/// every message is the same.
pub fn validate_dtypes(a: &CallArgs, check_device: bool, dtypes: &Dtypes) -> Result<CallDesc> {
    // ---- extents: what any real producer gives (guards the arithmetic below and in
    // the planner against a broken DLPack producer's shapes) ----
    for (name, t) in named_tensors(a) {
        if !extents_fit(t) {
            return Err(Error::shape(
                name,
                format!(
                    "expected non-negative extents whose size in bytes fits in int64, got shape {}",
                    fmt_shape(&t.shape)
                ),
            ));
        }
    }

    // ---- shapes ----
    expect_rank(&a.q, "q", 4, "[B, T, H, K]")?;
    let (b, t, h, k) = (a.q.shape[0], a.q.shape[1], a.q.shape[2], a.q.shape[3]);
    // Formatted only for a message (validation runs on every call).
    let qs = || fmt_shape(&a.q.shape);
    if b < 1 {
        return Err(Error::shape("q", format!("expected B >= 1 (shape [B, T, H, K]), got {}", qs())));
    }
    if t < 1 {
        return Err(Error::shape("q", format!("expected T >= 1 (shape [B, T, H, K]), got {}", qs())));
    }
    if h < 1 {
        return Err(Error::shape("q", format!("expected H >= 1 (shape [B, T, H, K]), got {}", qs())));
    }
    if !(1..=MAX_K).contains(&k) {
        return Err(Error::shape(
            "q",
            format!("expected 1 <= K <= {MAX_K} (shape [B, T, H, K]), got K={k} in {}", qs()),
        ));
    }
    expect_shape(&a.k, "k", &a.q.shape, &["B", "T", "H", "K"], " like q")?;

    expect_rank(&a.w, "w", 4, "[B, T, HV, K]")?;
    let hv = a.w.shape[2];
    expect_shape(&a.w, "w", &[b, t, hv, k], &["B", "T", "HV", "K"], "")?;
    if hv < 1 || hv % h != 0 {
        return Err(Error::shape(
            "w",
            format!("expected HV (dim 2) to be a positive multiple of H={h} (q's heads), got HV={hv}"),
        ));
    }

    expect_rank(&a.do_, "do", 4, "[B, T, HV, V]")?;
    let v = a.do_.shape[3];
    expect_shape(&a.do_, "do", &[b, t, hv, v], &["B", "T", "HV", "V"], "")?;
    if v < 1 {
        return Err(Error::shape("do", format!("expected V >= 1, got shape {}", fmt_shape(&a.do_.shape))));
    }
    expect_shape(&a.dv, "dv", &a.do_.shape, &["B", "T", "HV", "V"], " like do")?;

    if let Some(g) = &a.g {
        expect_shape(g, "g", &[b, t, hv], &["B", "T", "HV"], "")?;
    }
    if let Some(gk) = &a.gk {
        expect_shape(gk, "gk", &[b, t, hv, k], &["B", "T", "HV", "K"], "")?;
    }

    let n = match &a.cu_seqlens {
        None => b,
        Some(cu) => {
            if cu.ndim() != 1 || cu.shape[0] < 2 {
                return Err(Error::shape(
                    "cu_seqlens",
                    format!("expected a 1-D tensor [N+1] with N >= 1, got shape {}", fmt_shape(&cu.shape)),
                ));
            }
            if b != 1 {
                return Err(Error::shape(
                    "q",
                    format!("expected B == 1 with cu_seqlens (sequences packed along T), got B={b}"),
                ));
            }
            cu.shape[0] - 1
        }
    };
    let mut nt = Some((t + BT - 1) / BT);
    if a.cu_seqlens.is_some() {
        if let Some(co) = &a.chunk_offsets {
            // fla's prepare_chunk_offsets gives N+1 entries (the kernel reads them); a
            // table of N (fla's kernel reads only those) is not used: the kernel sums.
            if co.ndim() != 1 || (co.shape[0] != n && co.shape[0] != n + 1) {
                return Err(Error::shape(
                    "chunk_offsets",
                    format!("expected shape [N={n}] or [N+1={}], got {}", n + 1, fmt_shape(&co.shape)),
                ));
            }
        }
        nt = match (&a.chunk_indices, a.nt) {
            (Some(ci), _) => {
                if ci.ndim() != 2 || ci.shape[1] != 2 {
                    return Err(Error::shape(
                        "chunk_indices",
                        format!("expected shape [NT, 2] (sequence, chunk) rows, got {}", fmt_shape(&ci.shape)),
                    ));
                }
                Some(ci.shape[0])
            }
            (None, hint) => hint,
        };
        if let Some(x) = nt {
            // sum ceil(len_i / BT) <= ceil(T / BT) + N - 1 with the call's chunk size (fla's
            // CUDA-graph budget is that bound); dh's extents reach the kernel as int32.
            let bt = a.chunk_size.max(1);
            let bound = (t + bt - 1) / bt + n - 1;
            if x < 0 || x > bound || x > i32::MAX as i64 {
                return Err(Error::shape(
                    "chunk_indices",
                    format!("expected at most {bound} rows (chunks of {n} sequences in T={t} tokens), got NT={x}"),
                ));
            }
        }
    }

    let (state_want, state_names): ([i64; 4], [&str; 4]) =
        if a.state_v_first { ([n, hv, v, k], ["N", "HV", "V", "K"]) } else { ([n, hv, k, v], ["N", "HV", "K", "V"]) };
    let state_like = if a.state_v_first { " (state_v_first=True)" } else { "" };
    if let Some(h0) = &a.h0 {
        expect_shape(h0, "h0", &state_want, &state_names, state_like)?;
    }
    if let Some(dht) = &a.dht {
        expect_shape(dht, "dht", &state_want, &state_names, state_like)?;
    }

    // ---- dtypes ----
    let (data, words) = (dtypes.data, dtypes.data_words);
    let qk_dtype = expect_one_dtype(&[("q", &a.q), ("k", &a.k), ("w", &a.w)], data, words, None)?;
    expect_one_dtype(&[("do", &a.do_), ("dv", &a.dv)], data, words, Some(qk_dtype))?;
    if let Some(g) = &a.g {
        expect_dtype_in(g, "g", dtypes.fp32, dtypes.fp32_words)?;
    }
    if let Some(gk) = &a.gk {
        expect_dtype_in(gk, "gk", dtypes.fp32, dtypes.fp32_words)?;
    }
    if let Some(h0) = &a.h0 {
        if !h0.dtype.is_float() {
            return Err(Error::dtype("h0", format!("expected a floating-point dtype, got {}", h0.dtype)));
        }
    }
    if let Some(dht) = &a.dht {
        expect_dtype_in(dht, "dht", dtypes.fp32, dtypes.fp32_words)?;
    }
    let mut cu_dtype = None;
    let mut co_dtype = None;
    if let Some(cu) = &a.cu_seqlens {
        expect_dtype_in(cu, "cu_seqlens", INDEX, INDEX_WORDS)?;
        cu_dtype = Some(cu.dtype);
        if let Some(ci) = &a.chunk_indices {
            expect_dtype_in(ci, "chunk_indices", INDEX, INDEX_WORDS)?;
        }
        if let Some(co) = &a.chunk_offsets {
            expect_dtype_in(co, "chunk_offsets", INDEX, INDEX_WORDS)?;
            co_dtype = (co.shape[0] == n + 1).then_some(co.dtype);
        }
    }

    // ---- strides ----
    let tensors = named_tensors(a);
    for (name, t) in &tensors {
        if t.has_negative_stride() {
            let s = t.strides.as_deref().unwrap_or(&[]);
            return Err(Error::layout(name, format!("expected non-negative strides, got strides {}", fmt_shape(s))));
        }
        // torch's ZeroTensor (torch._efficientzerotensor) exports a null data pointer: no
        // memory for a kernel (or fla's) to read.
        if t.ptr == 0 && t.numel() > 0 {
            return Err(Error::layout(
                name,
                "expected a tensor backed by memory, got a null data pointer (a ZeroTensor? pass torch.zeros)"
                    .to_string(),
            ));
        }
    }

    // ---- scalars ----
    if a.chunk_size < 1 {
        return Err(Error::value("chunk_size", format!("expected a positive int, got {}", a.chunk_size)));
    }
    // The kernels (and fla's Triton kernel) take scale as a float32: a float64 beyond
    // float32's range would become inf there.
    let scale = match a.scale {
        None => (k as f64).powf(-0.5),
        Some(s) if s.is_finite() && s.abs() <= f32::MAX as f64 => s,
        Some(s) if s.is_finite() => {
            return Err(Error::value(
                "scale",
                format!("expected a finite float (within float32's range, as the kernel applies it), got {s:e}"),
            ))
        }
        Some(s) => return Err(Error::value("scale", format!("expected a finite float, got {}", fmt_f64(s)))),
    };

    // ---- devices ----
    let device = if check_device {
        let d0 = a.q.device;
        for (name, t) in &tensors {
            if !t.device.is_cuda() {
                return Err(Error::device(name, format!("expected a CUDA tensor, got a tensor on {}", t.device)));
            }
            if t.device.id != d0.id {
                return Err(Error::device(
                    name,
                    format!("expected a tensor on cuda:{} like q, got a tensor on {}", d0.id, t.device),
                ));
            }
        }
        Some(d0.id)
    } else {
        None
    };

    let layouts = tensors
        .iter()
        .map(|(name, t)| {
            let needs_align16 = matches!(*name, "q" | "k" | "w" | "do" | "dv" | "gk" | "dht");
            // h0 is never read (only its shape and dtype matter), but fla's function
            // allocates dh0 like it and writes it as if contiguous: a strided h0 is
            // replaced by a contiguous one (no data copied) on every route.
            TensorLayout { name, contiguous: t.is_contiguous(), aligned16: t.is_aligned(16), needs_align16 }
        })
        .collect();

    Ok(CallDesc {
        dims: Dims { b, t, h, hv, k, v, n },
        qk_dtype: a.q.dtype,
        dv_dtype: a.do_.dtype,
        has_g: a.g.is_some(),
        has_gk: a.gk.is_some(),
        has_h0: a.h0.is_some(),
        has_dht: a.dht.is_some(),
        cu_seqlens: cu_dtype,
        chunk_offsets: co_dtype,
        nt,
        state_v_first: a.state_v_first,
        scale,
        chunk_size: a.chunk_size,
        layouts,
        device,
        forward: false,
        state_dtype: DType::F32,
    })
}

/// The CPU path's device check, the counterpart of `validate`'s CUDA check and, like it,
/// run after every other check: every tensor argument in host memory (CPU memory, pinned
/// CUDA host memory included), else a ValueError naming the first one that is not.
pub fn check_host(a: &CallArgs) -> Result<()> {
    for (name, t) in named_tensors(a) {
        if !t.device.is_host() {
            return Err(Error::device(name, format!("expected a CPU tensor, got a tensor on {}", t.device)));
        }
    }
    Ok(())
}

/// The outputs `launch` writes, allocated by Python.
#[derive(Clone, Debug)]
pub struct Outputs {
    pub dh: TensorMeta,
    pub dh0: Option<TensorMeta>,
    pub dv2: TensorMeta,
}

fn expect_output_layout(t: &TensorMeta, arg: &'static str, device: Option<i32>) -> Result<()> {
    if !t.is_contiguous() || t.has_negative_stride() {
        let s = t.strides.as_deref().map(fmt_shape).unwrap_or_default();
        return Err(Error::layout(arg, format!("expected a contiguous output tensor, got strides {s}")));
    }
    if !t.is_aligned(16) {
        return Err(Error::layout(arg, format!("expected a 16-byte aligned data pointer, got {:#x}", t.ptr)));
    }
    if let Some(d) = device {
        if !t.device.is_cuda() || t.device.id != d {
            return Err(Error::device(
                arg,
                format!("expected a tensor on cuda:{d} like q, got a tensor on {}", t.device),
            ));
        }
    }
    Ok(())
}

/// Checks the outputs against a validated call and returns NT, the number of dh
/// checkpoints per batch row: ceil(T/64) dense; with cu_seqlens it is dh.shape[1]
/// (len(chunk_indices) where given), bounded by what N sequences packed in T tokens can
/// have. Whether the sequences' chunks fit in it is checked on the device.
pub fn validate_outputs(d: &CallDesc, o: &Outputs) -> Result<i64> {
    let Dims { b, t, hv, k, v, n, .. } = d.dims;
    let bt = d.chunk_size;
    let dense_nt = (t + bt - 1) / bt;
    expect_rank(&o.dh, "dh", 5, "[B, NT, HV, K, V]")?;
    let nt = if d.varlen() {
        let nt = o.dh.shape[1];
        if d.nt.is_some_and(|want| want != nt) {
            return Err(Error::shape(
                "dh",
                format!(
                    "expected dim 1 = NT = {} (len(chunk_indices)), got shape {}",
                    d.nt.unwrap_or(0),
                    fmt_shape(&o.dh.shape)
                ),
            ));
        }
        // sum ceil(len_i/BT) <= ceil(T/BT) + N - 1; a padded packed batch
        // (cu_seqlens[-1] < T) has fewer chunks than ceil(T/BT), so 1 is the lower bound
        // (a call with no chunks at all never reaches a kernel).
        if nt < 1 || nt > dense_nt + n - 1 {
            return Err(Error::shape(
                "dh",
                format!(
                    "expected dim 1 (total chunks of the {n} sequences) in [1, {}], got shape {}",
                    dense_nt + n - 1,
                    fmt_shape(&o.dh.shape)
                ),
            ));
        }
        nt
    } else {
        dense_nt
    };
    let (dh_want, dh_names): ([i64; 5], [&str; 5]) = if d.state_v_first {
        ([b, nt, hv, v, k], ["B", "NT", "HV", "V", "K"])
    } else {
        ([b, nt, hv, k, v], ["B", "NT", "HV", "K", "V"])
    };
    expect_shape(&o.dh, "dh", &dh_want, &dh_names, "")?;
    expect_dtype_like(&o.dh, "dh", d.qk_dtype, "q")?;
    expect_output_layout(&o.dh, "dh", d.device)?;

    match (&o.dh0, d.has_h0) {
        (Some(dh0), true) => {
            let want = if d.state_v_first { [n, hv, v, k] } else { [n, hv, k, v] };
            let names = if d.state_v_first { ["N", "HV", "V", "K"] } else { ["N", "HV", "K", "V"] };
            expect_shape(dh0, "dh0", &want, &names, "")?;
            expect_dtype_in(dh0, "dh0", &[DType::F32], "float32")?;
            expect_output_layout(dh0, "dh0", d.device)?;
        }
        (None, true) => {
            return Err(Error::NotTensor { arg: "dh0", got: "None (h0 was given, so dh0 is returned)".into() })
        }
        (Some(_), false) => return Err(Error::value("dh0", "expected None since h0 is None")),
        (None, false) => {}
    }

    expect_shape(&o.dv2, "dv2", &[b, t, hv, v], &["B", "T", "HV", "V"], " like dv")?;
    expect_dtype_like(&o.dv2, "dv2", d.dv_dtype, "dv")?;
    expect_output_layout(&o.dv2, "dv2", d.device)?;
    Ok(nt)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::error::PyKind;
    use crate::tensor::Device;

    #[test]
    fn the_op_s_chunk_size_default_is_the_kernels_chunk() {
        let default = ARGUMENTS.iter().find(|(name, _)| *name == "chunk_size").and_then(|(_, d)| *d);
        assert_eq!(default, Some(BT.to_string().as_str()));
        assert_eq!(ARGUMENTS.len(), 16);
    }

    /// A valid KDA-style call (gk path, dht and h0 given) on CPU tensors.
    pub fn call(b: i64, t: i64, h: i64, hv: i64, k: i64, v: i64, dtype: DType) -> CallArgs {
        let dev = Device::cpu();
        let mut next = 0x10_0000u64;
        let mut tm = |shape: &[i64], dt: DType| {
            next += 0x100_0000;
            TensorMeta::contiguous(next, shape, dt, dev)
        };
        CallArgs {
            q: tm(&[b, t, h, k], dtype),
            k: tm(&[b, t, h, k], dtype),
            w: tm(&[b, t, hv, k], dtype),
            do_: tm(&[b, t, hv, v], dtype),
            dv: tm(&[b, t, hv, v], dtype),
            g: None,
            gk: Some(tm(&[b, t, hv, k], DType::F32)),
            h0: Some(tm(&[b, hv, k, v], DType::F32)),
            dht: Some(tm(&[b, hv, k, v], DType::F32)),
            scale: None,
            state_v_first: false,
            cu_seqlens: None,
            chunk_size: 64,
            chunk_indices: None,
            chunk_offsets: None,
            nt: None,
        }
    }

    pub fn base() -> CallArgs {
        call(2, 128, 4, 4, 128, 64, DType::BF16)
    }

    fn to_cuda(a: &mut CallArgs, id: i32) {
        for t in [&mut a.q, &mut a.k, &mut a.w, &mut a.do_, &mut a.dv] {
            t.device = Device::cuda(id);
        }
        for t in
            [&mut a.g, &mut a.gk, &mut a.h0, &mut a.dht, &mut a.cu_seqlens, &mut a.chunk_offsets].into_iter().flatten()
        {
            t.device = Device::cuda(id);
        }
    }

    type Case = (Box<dyn Fn(&mut CallArgs)>, &'static str);

    fn err(a: &CallArgs) -> Error {
        validate(a, true).expect_err("expected a validation error")
    }

    #[test]
    fn a_valid_call_describes_itself() {
        let d = validate(&base(), false).unwrap();
        assert_eq!(d.dims, Dims { b: 2, t: 128, h: 4, hv: 4, k: 128, v: 64, n: 2 });
        assert_eq!(d.qk_dtype, DType::BF16);
        assert!(d.has_gk && d.has_h0 && d.has_dht && !d.has_g);
        assert!((d.scale - 128f64.powf(-0.5)).abs() < 1e-15);
        assert_eq!(d.device, None);
        assert!(d.layouts.iter().all(|l| l.contiguous && l.aligned16));
    }

    #[test]
    fn device_check_comes_last_and_names_the_tensor() {
        let a = base();
        assert!(validate(&a, false).is_ok());
        let e = err(&a);
        assert_eq!(e.to_string(), "q: expected a CUDA tensor, got a tensor on cpu");
        assert_eq!(e.py_kind(), PyKind::ValueError);

        let mut a = base();
        to_cuda(&mut a, 0);
        assert_eq!(validate(&a, true).unwrap().device, Some(0));
        a.dht.as_mut().unwrap().device = Device::cuda(1);
        assert_eq!(err(&a).to_string(), "dht: expected a tensor on cuda:0 like q, got a tensor on cuda:1");
        a.dht.as_mut().unwrap().device = Device::cpu();
        assert_eq!(err(&a).to_string(), "dht: expected a CUDA tensor, got a tensor on cpu");

        // A shape error wins over a device error.
        let mut a = base();
        a.k.shape[3] = 64;
        assert_eq!(err(&a).py_kind(), PyKind::ValueError);
        assert!(err(&a).to_string().starts_with("k: expected shape"));
    }

    #[test]
    fn shape_errors_name_argument_and_expectation() {
        let cases: Vec<Case> = vec![
            (Box::new(|a| a.q.shape = vec![2, 128, 4]), "q: expected a 4-D tensor [B, T, H, K], got shape [2, 128, 4]"),
            (Box::new(|a| a.q.shape[1] = 0), "q: expected T >= 1 (shape [B, T, H, K]), got [2, 0, 4, 128]"),
            (Box::new(|a| a.q.shape[0] = 0), "q: expected B >= 1 (shape [B, T, H, K]), got [0, 128, 4, 128]"),
            (
                Box::new(|a| a.q.shape[3] = 512),
                "q: expected 1 <= K <= 256 (shape [B, T, H, K]), got K=512 in [2, 128, 4, 512]",
            ),
            (Box::new(|a| a.k.shape[2] = 2), "k: expected shape [B=2, T=128, H=4, K=128] like q, got [2, 128, 2, 128]"),
            (Box::new(|a| a.w.shape[3] = 64), "w: expected shape [B=2, T=128, HV=4, K=128], got [2, 128, 4, 64]"),
            (Box::new(|a| a.w.shape[1] = 64), "w: expected shape [B=2, T=128, HV=4, K=128], got [2, 64, 4, 128]"),
            (
                Box::new(|a| a.w.shape[2] = 6),
                "w: expected HV (dim 2) to be a positive multiple of H=4 (q's heads), got HV=6",
            ),
            (Box::new(|a| a.do_.shape[2] = 8), "do: expected shape [B=2, T=128, HV=4, V=64], got [2, 128, 8, 64]"),
            (
                Box::new(|a| a.dv.shape[3] = 32),
                "dv: expected shape [B=2, T=128, HV=4, V=64] like do, got [2, 128, 4, 32]",
            ),
            (
                Box::new(|a| a.g = Some(TensorMeta::contiguous(0, &[2, 128], DType::F32, Device::cpu()))),
                "g: expected shape [B=2, T=128, HV=4], got [2, 128]",
            ),
            (
                Box::new(|a| a.gk.as_mut().unwrap().shape[3] = 64),
                "gk: expected shape [B=2, T=128, HV=4, K=128], got [2, 128, 4, 64]",
            ),
            (
                Box::new(|a| a.dht.as_mut().unwrap().shape = vec![2, 4, 64, 128]),
                "dht: expected shape [N=2, HV=4, K=128, V=64], got [2, 4, 64, 128]",
            ),
            (
                Box::new(|a| a.h0.as_mut().unwrap().shape[0] = 3),
                "h0: expected shape [N=2, HV=4, K=128, V=64], got [3, 4, 128, 64]",
            ),
        ];
        for (mutate, msg) in cases {
            let mut a = base();
            mutate(&mut a);
            let e = err(&a);
            assert_eq!(e.to_string(), msg);
            assert_eq!(e.py_kind(), PyKind::ValueError, "{msg}");
        }
    }

    #[test]
    fn state_v_first_transposes_the_state_shapes() {
        let mut a = base();
        a.state_v_first = true;
        let e = err(&a);
        assert_eq!(
            e.to_string(),
            "h0: expected shape [N=2, HV=4, V=64, K=128] (state_v_first=True), got [2, 4, 128, 64]"
        );
        a.h0.as_mut().unwrap().shape = vec![2, 4, 64, 128];
        a.dht.as_mut().unwrap().shape = vec![2, 4, 64, 128];
        assert!(validate(&a, false).unwrap().state_v_first);
    }

    #[test]
    fn gva_and_optional_tensors_are_accepted() {
        let mut a = call(1, 100, 2, 8, 64, 128, DType::F16);
        a.gk = None;
        a.g = Some(TensorMeta::contiguous(64, &[1, 100, 8], DType::F32, Device::cpu()));
        a.h0 = None;
        a.dht = None;
        let d = validate(&a, false).unwrap();
        assert_eq!((d.dims.h, d.dims.hv), (2, 8));
        assert!(d.has_g && !d.has_gk && !d.has_h0 && !d.has_dht);
        // h0 may be any float dtype.
        let mut a = base();
        a.h0.as_mut().unwrap().dtype = DType::BF16;
        assert!(validate(&a, false).is_ok());
    }

    #[test]
    fn varlen_rules() {
        let mut a = call(1, 1000, 4, 4, 128, 64, DType::BF16);
        a.h0.as_mut().unwrap().shape[0] = 3;
        a.dht.as_mut().unwrap().shape[0] = 3;
        a.cu_seqlens = Some(TensorMeta::contiguous(0x40, &[4], DType::I64, Device::cpu()));
        let d = validate(&a, false).unwrap();
        assert_eq!(d.dims.n, 3);
        assert_eq!(d.cu_seqlens, Some(DType::I64));

        for (len, ok) in [(3, true), (4, true), (2, false), (5, false)] {
            let mut b = a.clone();
            b.chunk_offsets = Some(TensorMeta::contiguous(0x80, &[len], DType::I64, Device::cpu()));
            assert_eq!(validate(&b, false).is_ok(), ok, "chunk_offsets len {len}");
        }
        // chunk_offsets without cu_seqlens is ignored, as fla does.
        let mut b = base();
        b.chunk_offsets = Some(TensorMeta::contiguous(0x80, &[7, 7], DType::F32, Device::cpu()));
        assert!(validate(&b, false).is_ok());

        let mut b = a.clone();
        b.cu_seqlens.as_mut().unwrap().dtype = DType::I32;
        assert_eq!(validate(&b, false).unwrap().cu_seqlens, Some(DType::I32));
        b.cu_seqlens.as_mut().unwrap().dtype = DType::F32;
        let e = validate(&b, false).unwrap_err();
        assert_eq!(e.to_string(), "cu_seqlens: expected dtype int64 or int32, got float32");
        assert_eq!(e.py_kind(), PyKind::TypeError);

        let mut b = a.clone();
        b.cu_seqlens.as_mut().unwrap().shape = vec![1];
        assert_eq!(
            validate(&b, false).unwrap_err().to_string(),
            "cu_seqlens: expected a 1-D tensor [N+1] with N >= 1, got shape [1]"
        );

        let mut b = base();
        b.cu_seqlens = Some(TensorMeta::contiguous(0x40, &[3], DType::I64, Device::cpu()));
        assert_eq!(
            validate(&b, false).unwrap_err().to_string(),
            "q: expected B == 1 with cu_seqlens (sequences packed along T), got B=2"
        );
    }

    #[test]
    fn dtype_errors_are_type_errors() {
        let cases: Vec<Case> = vec![
            (Box::new(|a| a.q.dtype = DType::I64), "q: expected dtype bfloat16, float16 or float32, got int64"),
            (Box::new(|a| a.w.dtype = DType::F16), "w: expected dtype bfloat16 like q and k, got float16"),
            (Box::new(|a| a.k.dtype = DType::F32), "k: expected dtype bfloat16 like q and w, got float32"),
            // the odd one out is named, q too
            (Box::new(|a| a.q.dtype = DType::F32), "q: expected dtype bfloat16 like k and w, got float32"),
            (Box::new(|a| a.do_.dtype = DType::F64), "do: expected dtype bfloat16, float16 or float32, got float64"),
            (Box::new(|a| a.dv.dtype = DType::F16), "dv: expected dtype bfloat16 like do, got float16"),
            // do against dv: a tie, settled by q's dtype
            (Box::new(|a| a.do_.dtype = DType::F16), "do: expected dtype bfloat16 like dv, got float16"),
            (
                Box::new(|a| {
                    a.do_.dtype = DType::F16;
                    a.dv.dtype = DType::F32;
                }),
                "dv: expected dtype float16 like do, got float32",
            ),
            (
                Box::new(|a| {
                    a.k.dtype = DType::F16;
                    a.w.dtype = DType::F32;
                }),
                "k: expected dtype bfloat16 like q, got float16",
            ),
            (Box::new(|a| a.gk.as_mut().unwrap().dtype = DType::BF16), "gk: expected dtype float32, got bfloat16"),
            (Box::new(|a| a.dht.as_mut().unwrap().dtype = DType::F16), "dht: expected dtype float32, got float16"),
            (Box::new(|a| a.h0.as_mut().unwrap().dtype = DType::I32), "h0: expected a floating-point dtype, got int32"),
        ];
        for (mutate, msg) in cases {
            let mut a = base();
            mutate(&mut a);
            let e = validate(&a, false).unwrap_err();
            assert_eq!(e.to_string(), msg);
            assert_eq!(e.py_kind(), PyKind::TypeError, "{msg}");
        }
        // do/dv may differ from q (fla accepts it); the planner decides.
        let mut a = base();
        a.do_.dtype = DType::F32;
        a.dv.dtype = DType::F32;
        assert_eq!(validate(&a, false).unwrap().dv_dtype, DType::F32);
    }

    #[test]
    fn scalar_and_stride_errors_are_value_errors() {
        let mut a = base();
        a.scale = Some(f64::NAN);
        assert_eq!(err(&a).to_string(), "scale: expected a finite float, got nan");
        a.scale = Some(f64::INFINITY);
        assert_eq!(err(&a).to_string(), "scale: expected a finite float, got inf");
        a.scale = Some(0.25);
        assert_eq!(validate(&a, false).unwrap().scale, 0.25);

        let mut a = base();
        a.chunk_size = 0;
        assert_eq!(err(&a).to_string(), "chunk_size: expected a positive int, got 0");

        let mut a = base();
        a.dv.strides = Some(vec![-32768, 256, 64, 1]);
        let e = err(&a);
        assert_eq!(e.to_string(), "dv: expected non-negative strides, got strides [-32768, 256, 64, 1]");
        assert_eq!(e.py_kind(), PyKind::ValueError);

        // Non-contiguous is not an error (fla copies): it shows up in the layouts.
        let mut a = base();
        a.w.strides = Some(vec![1, 2, 3, 4]);
        a.dv.ptr += 2;
        let d = validate(&a, false).unwrap();
        let w = d.layouts.iter().find(|l| l.name == "w").unwrap();
        assert!(!w.contiguous);
        let dv = d.layouts.iter().find(|l| l.name == "dv").unwrap();
        assert!(!dv.aligned16 && dv.needs_align16);
    }

    #[test]
    fn scale_must_fit_in_float32() {
        let mut a = base();
        a.scale = Some(1e300);
        let e = err(&a);
        assert_eq!(
            e.to_string(),
            "scale: expected a finite float (within float32's range, as the kernel applies it), got 1e300"
        );
        assert_eq!(e.py_kind(), PyKind::ValueError);
        a.scale = Some(-1e39);
        assert!(err(&a).to_string().starts_with("scale: expected a finite float"));
        for ok in [f32::MAX as f64, -(f32::MAX as f64), 0.0, -0.5, 1e-300] {
            a.scale = Some(ok);
            assert_eq!(validate(&a, false).unwrap().scale, ok);
        }
    }

    #[test]
    fn broken_producer_extents_are_shape_errors_not_overflows() {
        // Negative extents anywhere, and shapes whose byte size overflows int64 (as a
        // DLPack producer could claim; torch cannot make them): clear errors, no panic.
        let cases: Vec<Case> = vec![
            (Box::new(|a| a.w.shape[2] = -4), "w: expected non-negative extents whose size in bytes fits in int64, got shape [2, 128, -4, 128]"),
            (Box::new(|a| a.do_.shape[3] = -64), "do: expected non-negative extents whose size in bytes fits in int64, got shape [2, 128, 4, -64]"),
            (Box::new(|a| a.q.shape[1] = -1), "q: expected non-negative extents whose size in bytes fits in int64, got shape [2, -1, 4, 128]"),
            (
                Box::new(|a| a.dht.as_mut().unwrap().shape = vec![i64::MAX, 4, 128, 64]),
                "dht: expected non-negative extents whose size in bytes fits in int64, got shape [9223372036854775807, 4, 128, 64]",
            ),
            (
                Box::new(|a| {
                    a.q.shape = vec![1 << 40, 1 << 40, 1, 1];
                }),
                "q: expected non-negative extents whose size in bytes fits in int64, got shape [1099511627776, 1099511627776, 1, 1]",
            ),
            (
                Box::new(|a| a.cu_seqlens = Some(TensorMeta::contiguous(0x40, &[-3], DType::I64, Device::cpu()))),
                "cu_seqlens: expected non-negative extents whose size in bytes fits in int64, got shape [-3]",
            ),
        ];
        for (mutate, msg) in cases {
            let mut a = base();
            mutate(&mut a);
            let e = err(&a);
            assert_eq!(e.to_string(), msg);
            assert_eq!(e.py_kind(), PyKind::ValueError, "{msg}");
        }
        // The largest T a 2-byte q can have still validates, and ceil(T / 64) cannot overflow.
        let mut a = call(1, i64::MAX / 2, 1, 1, 1, 1, DType::BF16);
        a.gk = None;
        a.h0 = None;
        a.dht = None;
        let d = validate(&a, false).unwrap();
        assert_eq!(d.dims.t, i64::MAX / 2);
        // Extent 0 of an optional state is a shape mismatch, reported as such.
        let mut a = base();
        a.h0.as_mut().unwrap().shape[0] = 0;
        assert_eq!(err(&a).to_string(), "h0: expected shape [N=2, HV=4, K=128, V=64], got [0, 4, 128, 64]");
    }

    #[test]
    fn numpy_style_zero_d_and_rank_errors() {
        // A 0-D or 5-D q, a 3-D cu_seqlens: rank errors naming the argument.
        let mut a = base();
        a.q.shape = vec![];
        assert_eq!(err(&a).to_string(), "q: expected a 4-D tensor [B, T, H, K], got shape []");
        let mut a = call(1, 100, 4, 4, 128, 64, DType::BF16);
        a.h0 = None;
        a.dht = None;
        a.cu_seqlens = Some(TensorMeta::contiguous(0x40, &[1, 2, 2], DType::I64, Device::cpu()));
        assert_eq!(err(&a).to_string(), "cu_seqlens: expected a 1-D tensor [N+1] with N >= 1, got shape [1, 2, 2]");
    }

    /// Views that fla takes (it copies) are valid input: validation passes and the
    /// planner names the layout in its fallback reason. The torch views of
    /// tests/unit/test_bad_input.py, as DLPack describes them.
    #[test]
    fn views_are_planned_as_packed_and_named_for_a_copy() {
        use crate::plan::{plan, DeviceInfo, Rule};
        const H200: DeviceInfo = DeviceInfo { cc_major: 9, cc_minor: 0, sm_count: 132 };
        let mut a = base(); // [2, 128, 4, 128] q/k/w, [2, 128, 4, 64] do/dv
        to_cuda(&mut a, 0);
        let d = validate(&a, true).unwrap();
        assert!(d.copies().is_empty(), "the contiguous call copies nothing");
        assert!(plan(&d, &H200, Rule::Extended).is_kernel());

        type View = (&'static str, fn(&mut CallArgs), &'static [&'static str]);
        let views: Vec<View> = vec![
            // torch.randn(B, H, T, K).transpose(1, 2)
            ("q transposed", |a| a.q.strides = Some(vec![128 * 4 * 128, 128, 128 * 128, 1]), &["q"]),
            // torch.randn(B, T, H, 2K)[..., ::2]
            ("k [..., ::2]", |a| a.k.strides = Some(vec![128 * 4 * 256, 4 * 256, 256, 2]), &["k"]),
            // do expanded along T (stride 0)
            ("do expanded", |a| a.do_.strides = Some(vec![4 * 64, 0, 64, 1]), &["do"]),
            // flat[1:].view(shape) of a bf16 buffer: 2 bytes past an aligned pointer
            ("dv offset by one element", |a| a.dv.ptr += 2, &["dv"]),
            ("w offset by 8 elements", |a| a.w.ptr += 16, &[]),
            ("gk offset by one float", |a| a.gk.as_mut().unwrap().ptr += 4, &["gk"]),
            ("dht offset by one float", |a| a.dht.as_mut().unwrap().ptr += 4, &["dht"]),
            // dht.mT.contiguous().mT: right shape, K and V strides swapped
            (
                "dht column-major",
                |a| a.dht.as_mut().unwrap().strides = Some(vec![4 * 128 * 64, 128 * 64, 1, 128]),
                &["dht"],
            ),
            // h0 is never read: its alignment does not matter, its layout does (fla allocates dh0 like it)
            ("h0 offset", |a| a.h0.as_mut().unwrap().ptr += 4, &[]),
            ("h0 transposed", |a| a.h0.as_mut().unwrap().strides = Some(vec![4 * 128 * 64, 128 * 64, 1, 128]), &["h0"]),
            (
                "q and dv",
                |a| {
                    a.q.strides = Some(vec![128 * 4 * 128, 128, 128 * 128, 1]);
                    a.dv.ptr += 2;
                },
                &["q", "dv"],
            ),
        ];
        for (what, mutate, want) in views {
            let mut b = a.clone();
            mutate(&mut b);
            let d = validate(&b, true).expect("a view is valid input");
            assert_eq!(d.copies(), want.to_vec(), "{what}");
            for rule in [Rule::Extended, Rule::Capable] {
                assert!(plan(&d, &H200, rule).is_kernel(), "{what} {rule:?}: the packed call's plan");
            }
        }
        // A negative stride is the one layout that is an error (fla cannot take it either).
        let mut b = a.clone();
        b.gk.as_mut().unwrap().strides = Some(vec![-(128 * 4 * 128), 4 * 128, 128, 1]);
        let e = validate(&b, true).unwrap_err();
        assert_eq!(e.to_string(), "gk: expected non-negative strides, got strides [-65536, 512, 128, 1]");
    }

    fn outputs(d: &CallDesc, nt: i64, dev: Device) -> Outputs {
        let Dims { b, t, hv, k, v, n, .. } = d.dims;
        Outputs {
            dh: TensorMeta::contiguous(0x1000, &[b, nt, hv, k, v], d.qk_dtype, dev),
            dh0: d.has_h0.then(|| TensorMeta::contiguous(0x2000, &[n, hv, k, v], DType::F32, dev)),
            dv2: TensorMeta::contiguous(0x3000, &[b, t, hv, v], d.dv_dtype, dev),
        }
    }

    #[test]
    fn outputs_are_checked() {
        let mut a = call(2, 100, 4, 4, 128, 64, DType::BF16);
        to_cuda(&mut a, 0);
        let d = validate(&a, true).unwrap();
        let o = outputs(&d, 2, Device::cuda(0));
        assert_eq!(validate_outputs(&d, &o).unwrap(), 2);

        let mut bad = o.clone();
        bad.dh.shape[1] = 3;
        assert_eq!(
            validate_outputs(&d, &bad).unwrap_err().to_string(),
            "dh: expected shape [B=2, NT=2, HV=4, K=128, V=64], got [2, 3, 4, 128, 64]"
        );
        let mut bad = o.clone();
        bad.dh.dtype = DType::F32;
        assert_eq!(
            validate_outputs(&d, &bad).unwrap_err().to_string(),
            "dh: expected dtype bfloat16 like q, got float32"
        );
        let mut bad = o.clone();
        bad.dh0 = None;
        assert_eq!(validate_outputs(&d, &bad).unwrap_err().py_kind(), PyKind::TypeError);
        let mut bad = o.clone();
        bad.dv2.strides = Some(vec![1, 2, 3, 4]);
        assert!(validate_outputs(&d, &bad).unwrap_err().to_string().starts_with("dv2: expected a contiguous"));
        let mut bad = o.clone();
        bad.dv2.device = Device::cuda(1);
        assert_eq!(
            validate_outputs(&d, &bad).unwrap_err().to_string(),
            "dv2: expected a tensor on cuda:0 like q, got a tensor on cuda:1"
        );
        let mut bad = o.clone();
        bad.dh0.as_mut().unwrap().ptr += 4;
        assert!(validate_outputs(&d, &bad).unwrap_err().to_string().starts_with("dh0: expected a 16-byte aligned"));
    }

    #[test]
    fn varlen_outputs_take_nt_from_dh() {
        let mut a = call(1, 1000, 4, 4, 128, 64, DType::BF16);
        a.h0 = None;
        a.dht = None;
        a.cu_seqlens = Some(TensorMeta::contiguous(0x40, &[4], DType::I64, Device::cpu()));
        let d = validate(&a, false).unwrap();
        // 1 <= NT <= ceil(1000/64) + 3 - 1 = 18; fewer than 16 is a padded packed batch
        for (nt, ok) in [(0, false), (1, true), (15, true), (16, true), (18, true), (19, false)] {
            let o = outputs(&d, nt, Device::cpu());
            assert_eq!(validate_outputs(&d, &o).is_ok(), ok, "NT={nt}");
        }
    }
}
