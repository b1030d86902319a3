//! The op on the CPU: SPEC.md's recurrence (fla's `chunk_gated_delta_rule_bwd_dhu`),
//! every variant the kernels cover, in one of two arithmetics.
//!
//! For each sequence n and value head h (q/k head h / (HV / H)), chunks of BT = 64 tokens
//! [s, e) newest first, the last one of a sequence possibly short:
//!
//! ```text
//! b = dht[n, h]  (zeros without dht)                               [K, V]
//! for each chunk c, newest first:
//!     dh[c]  = b
//!     dv2[t] = exp2(g[e-1] - g[t]) * (k[t] @ R_k(b)) + dv[t]       t in [s, e); factor 1 without g
//!     b      = exp2(g[e-1]) * b                                    (g)
//!     b      = exp2(gk[e-1])[:, None] * b                          (gk: per-K-row decay)
//!     b      = b + (scale * sum_t (exp2(g[t]) q[t])^T R_do(do[t]) - sum_t w[t]^T R_w(dv2[t]))
//! dh0[n, h] = b
//! ```
//!
//! Modes ([`Mode`]):
//! - `Float64`: the reference arithmetic, every step in f64 and no rounding (R_* are the
//!   identity); outputs are float64. The oracle of the tests.
//! - `Fla`: fla's precision (its Triton kernel, fla-core 0.6.0): f32 arithmetic with fp32
//!   accumulation, and fla's roundings: R_k rounds b to k's dtype before `k @ b`
//!   (`b_dh.to(b_k.dtype)`), R_w rounds the fp32 dv2 to w's dtype before `w^T dv2`
//!   (`b_dv.to(b_w.dtype)`), R_do rounds do to q's dtype without g (`b_do.to(b_q.dtype)`;
//!   with g fla's gated q is fp32 and so is that dot), scale multiplies the finished fp32
//!   `q^T do` dot, and the update is `b * decay + (QD * scale - WD)` in that order.
//!   Outputs in fla's dtypes: dh in q's, dv2 in dv's (rounded to nearest even), dh0 fp32.
//!   Not modelled: the GEMMs' summation order, fla's TF32 dot on the g path (fp32 here,
//!   finer), and the approximate exp2 of the GPU.
//!
//! Work is split over (sequence, value head, V tile) with rayon: the V columns of the
//! state are independent, so few heads split V in tiles of 64 to keep every core busy.
//! GEMMs run through `matrixmultiply` (one thread each: rayon owns the parallelism).

use crate::error::{Error, Result};
use crate::facts::BT;
use crate::tensor::{DType, HostFloat, HostOut, HostView};
use crate::validate::{Dims, Dtypes, F64_DTYPES, FLA_DTYPES};
use crate::varlen;
use rayon::prelude::*;

/// The arithmetic of a run (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// The reference arithmetic: f64, no rounding, float64 outputs.
    Float64,
    /// fla's precision: f32 with fla's rounding points, outputs in fla's dtypes.
    Fla,
}

impl Mode {
    /// "float64" or "fla"; a ValueError naming `mode` otherwise.
    pub fn parse(s: &str) -> Result<Mode> {
        match s {
            "float64" => Ok(Mode::Float64),
            "fla" => Ok(Mode::Fla),
            _ => Err(Error::value("mode", format!("expected 'float64' or 'fla', got {s:?}"))),
        }
    }

    /// The element types the mode takes (validation's table).
    pub fn dtypes(self) -> &'static Dtypes {
        match self {
            Mode::Float64 => &F64_DTYPES,
            Mode::Fla => &FLA_DTYPES,
        }
    }

    /// dtypes of (dh, dh0, dv2) for q's and dv's dtypes.
    pub fn output_dtypes(self, qk: DType, dv: DType) -> (DType, DType, DType) {
        match self {
            Mode::Float64 => (DType::F64, DType::F64, DType::F64),
            Mode::Fla => (qk, DType::F32, dv),
        }
    }
}

/// One sequence: tokens [bos, bos + len) of batch row `batch`, its chunks at
/// `first_chunk ..` of dh's dim 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seq {
    pub batch: i64,
    pub bos: i64,
    pub len: i64,
    pub first_chunk: i64,
}

/// The sequences of a call and what of the outputs they cover.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sequences {
    pub seqs: Vec<Seq>,
    /// dh's dim 1.
    pub nt: i64,
    /// dh rows [0, covered_chunks) of each batch row hold a chunk; the rest are zeros.
    pub covered_chunks: i64,
    /// dv2 rows [0, covered_tokens) of each batch row belong to a sequence; the rest
    /// (a padded packed batch's padding) are zeros.
    pub covered_tokens: i64,
}

impl Sequences {
    /// B sequences of T tokens, NT = ceil(T / 64) chunks each.
    pub fn dense(d: &Dims) -> Sequences {
        let nt = varlen::chunks(d.t);
        Sequences {
            seqs: (0..d.b).map(|n| Seq { batch: n, bos: 0, len: d.t, first_chunk: 0 }).collect(),
            nt,
            covered_chunks: nt,
            covered_tokens: d.t,
        }
    }

    /// The packed sequences of `cu` (cu_seqlens' values, N + 1 of them) in T = `d.t`
    /// tokens, checked by `varlen::check_tables` with the caller's chunk_offsets (N + 1
    /// values) where given and dh's chunk count `nt` (len(chunk_indices)) where given.
    /// NT is `nt`, else the total chunk count.
    pub fn varlen(d: &Dims, cu: &[i64], chunk_offsets: Option<&[i64]>, nt: Option<i64>) -> Result<Sequences> {
        let n = cu.len().saturating_sub(1);
        let offsets = varlen::check_tables(cu, d.t, chunk_offsets, nt)?;
        let total = offsets[n];
        Ok(Sequences {
            seqs: (0..n)
                .map(|i| Seq { batch: 0, bos: cu[i], len: cu[i + 1] - cu[i], first_chunk: offsets[i] })
                .collect(),
            nt: nt.unwrap_or(total),
            covered_chunks: total,
            covered_tokens: cu[n],
        })
    }
}

/// The tensors read: q, k [B, T, H, K]; w [B, T, HV, K]; do, dv [B, T, HV, V]; g
/// [B, T, HV]; gk [B, T, HV, K]; dht [N, HV, K, V] ([N, HV, V, K] with state_v_first).
pub struct Inputs {
    pub q: HostView,
    pub k: HostView,
    pub w: HostView,
    pub do_: HostView,
    pub dv: HostView,
    pub g: Option<HostView>,
    pub gk: Option<HostView>,
    pub dht: Option<HostView>,
}

/// The tensors written, compact row-major: dh [B, NT, HV, K, V] ([B, NT, HV, V, K] with
/// state_v_first); dh0 [N, HV, K, V] (or [N, HV, V, K]); dv2 [B, T, HV, V].
pub struct Outputs {
    pub dh: HostOut,
    pub dh0: Option<HostOut>,
    pub dv2: HostOut,
}

/// What a run computes besides its tensors.
#[derive(Clone, Copy, Debug)]
pub struct Problem {
    pub dims: Dims,
    /// Multiplies the `q^T do` dot (fla's; K^-0.5 when the caller gave None).
    pub scale: f64,
    pub state_v_first: bool,
    pub mode: Mode,
}

/// Fills outputs with NaN (tests: an element a run does not write shows).
pub fn poison(o: &Outputs) {
    for out in [Some(&o.dh), o.dh0.as_ref(), Some(&o.dv2)].into_iter().flatten() {
        // SAFETY: the whole tensor, before any task runs.
        unsafe { out.fill(0, out.numel(), f64::NAN) };
    }
}

/// Runs the op: writes every element of dh, dh0 and dv2 (zeros where no sequence covers
/// a row). The shapes of `x` and `o` must be those of `p.dims` and `s` (validated
/// inputs, outputs allocated for them); `s` must come from `Sequences::dense` or
/// `Sequences::varlen` (the sequences' rows are disjoint, which the threads rely on).
pub fn run(p: &Problem, x: &Inputs, s: &Sequences, o: &Outputs) {
    check_extents(p, s, o);
    match p.mode {
        Mode::Float64 => run_as::<f64>(p, x, s, o, false),
        Mode::Fla => run_as::<f32>(p, x, s, o, true),
    }
    let Dims { b, t, hv, k, v, .. } = p.dims;
    // SAFETY: rows no task wrote (the tasks are done), inside each batch row's block.
    unsafe {
        for batch in 0..b {
            let row = hv * k * v;
            let base = batch * s.nt * row;
            o.dh.fill(base + s.covered_chunks * row, (s.nt - s.covered_chunks) * row, 0.0);
            let base = batch * t * hv * v;
            o.dv2.fill(base + s.covered_tokens * hv * v, (t - s.covered_tokens) * hv * v, 0.0);
        }
    }
}

/// The outputs' sizes are those of the call (the writes' bounds rest on them).
fn check_extents(p: &Problem, s: &Sequences, o: &Outputs) {
    let Dims { b, t, hv, k, v, n, .. } = p.dims;
    assert_eq!(o.dh.numel(), b * s.nt * hv * k * v, "dh's size");
    assert_eq!(o.dv2.numel(), b * t * hv * v, "dv2's size");
    if let Some(dh0) = &o.dh0 {
        assert_eq!(dh0.numel(), n * hv * k * v, "dh0's size");
    }
    assert_eq!(s.seqs.len() as i64, n, "one sequence per state");
    for q in &s.seqs {
        assert!(q.bos >= 0 && q.len >= 0 && q.bos + q.len <= t && q.batch < b, "{q:?}");
        assert!(q.first_chunk >= 0 && q.first_chunk + varlen::chunks(q.len) <= s.nt, "{q:?}");
    }
    assert!((0..=s.nt).contains(&s.covered_chunks) && (0..=t).contains(&s.covered_tokens));
}

/// f32 or f64 arithmetic with a GEMM.
trait Real: HostFloat + std::ops::Mul<Output = Self> + std::ops::Add<Output = Self> + std::ops::Sub<Output = Self> {
    fn exp2(self) -> Self;
    fn of_f64(x: f64) -> Self;
    /// C[m, n] = A[m, k] B[k, n] (C overwritten), A and B by (row, column) strides.
    ///
    /// # Safety
    /// Every element the strides reach (i < m, l < k, j < n) lies in a, b and c.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm(
        m: usize,
        k: usize,
        n: usize,
        a: *const Self,
        sa: (isize, isize),
        b: *const Self,
        sb: (isize, isize),
        c: *mut Self,
        sc: (isize, isize),
    );
}

impl Real for f32 {
    fn exp2(self) -> Self {
        f32::exp2(self)
    }
    fn of_f64(x: f64) -> Self {
        x as f32
    }
    unsafe fn gemm(
        m: usize,
        k: usize,
        n: usize,
        a: *const f32,
        sa: (isize, isize),
        b: *const f32,
        sb: (isize, isize),
        c: *mut f32,
        sc: (isize, isize),
    ) {
        matrixmultiply::sgemm(m, k, n, 1.0, a, sa.0, sa.1, b, sb.0, sb.1, 0.0, c, sc.0, sc.1)
    }
}

impl Real for f64 {
    fn exp2(self) -> Self {
        f64::exp2(self)
    }
    fn of_f64(x: f64) -> Self {
        x
    }
    unsafe fn gemm(
        m: usize,
        k: usize,
        n: usize,
        a: *const f64,
        sa: (isize, isize),
        b: *const f64,
        sb: (isize, isize),
        c: *mut f64,
        sc: (isize, isize),
    ) {
        matrixmultiply::dgemm(m, k, n, 1.0, a, sa.0, sa.1, b, sb.0, sb.1, 0.0, c, sc.0, sc.1)
    }
}

/// C[m, n] (row-major, overwritten) = A[m, k] B[k, n], where A is row-major (`a_t` false)
/// or A^T is stored row-major [k, m] (`a_t` true), and B is row-major.
fn matmul<R: Real>(m: usize, k: usize, n: usize, a: &[R], a_t: bool, b: &[R], c: &mut [R]) {
    assert!(a.len() >= m * k && b.len() >= k * n && c.len() >= m * n);
    let sa = if a_t { (1, m as isize) } else { (k as isize, 1) };
    if m == 0 || n == 0 {
        return;
    }
    // SAFETY: the extents are checked above; matrixmultiply reads a, b and writes c
    // within them.
    unsafe { R::gemm(m, k, n, a.as_ptr(), sa, b.as_ptr(), (n as isize, 1), c.as_mut_ptr(), (n as isize, 1)) }
}

/// Rounds every element to `dtype` and back (fla's casts; the identity for f32 and f64
/// values that already are of the arithmetic type).
fn round_to<R: Real>(dtype: DType, xs: &mut [R]) {
    fn each<E: crate::tensor::HostElem, R: Real>(xs: &mut [R]) {
        for x in xs {
            *x = R::from_elem(x.into_elem::<E>());
        }
    }
    match dtype {
        DType::BF16 => each::<half::bf16, R>(xs),
        DType::F16 => each::<half::f16, R>(xs),
        DType::F32 => each::<f32, R>(xs),
        _ => {}
    }
}

/// V tile width: the whole V where the (sequence, head) tasks keep every thread busy
/// (or there is one thread), else 64 columns (the state's columns are independent).
fn v_tile(tasks: usize, v: i64, threads: usize) -> i64 {
    if threads <= 1 || tasks >= 2 * threads || v <= 64 {
        v
    } else {
        64
    }
}

fn run_as<R: Real>(p: &Problem, x: &Inputs, s: &Sequences, o: &Outputs, fla: bool) {
    let Dims { hv, v, .. } = p.dims;
    let bv = v_tile(s.seqs.len() * hv as usize, v, rayon::current_num_threads());
    let nv = (v + bv - 1) / bv;
    let tasks: Vec<(usize, i64, i64)> =
        (0..s.seqs.len()).flat_map(|i| (0..hv).flat_map(move |h| (0..nv).map(move |j| (i, h, j)))).collect();
    // One set of buffers per rayon work split, reused by its tasks (a packed batch of
    // many short sequences has many tasks of one chunk each).
    tasks.par_iter().for_each_init(
        || Buffers::<R>::new(p.dims.k as usize, bv as usize, fla),
        |buf, &(i, h, j)| {
            let v0 = j * bv;
            let scan = Scan { p, x, o, nt: s.nt, fla, v0, bv: bv.min(v - v0) };
            scan.run::<R>(i as i64, &s.seqs[i], h, buf);
        },
    );
}

/// A task's working memory, for V tiles of at most `bv` columns: every buffer is
/// written before it is read (b from dht or zeros at the task's start).
struct Buffers<R> {
    b: Vec<R>,
    bk: Vec<R>,
    kt: Vec<R>,
    qt: Vec<R>,
    wt: Vec<R>,
    dot: Vec<R>,
    dvt: Vec<R>,
    dv2: Vec<R>,
    dv2w: Vec<R>,
    qd: Vec<R>,
    wd: Vec<R>,
    gt: Vec<R>,
    gkl: Vec<R>,
}

impl<R: Real> Buffers<R> {
    fn new(k: usize, bv: usize, fla: bool) -> Self {
        let bt = BT as usize;
        let z = |n: usize| vec![R::default(); n];
        Buffers {
            b: z(k * bv),
            bk: z(if fla { k * bv } else { 0 }),
            kt: z(bt * k),
            qt: z(bt * k),
            wt: z(bt * k),
            dot: z(bt * bv),
            dvt: z(bt * bv),
            dv2: z(bt * bv),
            dv2w: z(if fla { bt * bv } else { 0 }),
            qd: z(k * bv),
            wd: z(k * bv),
            gt: z(bt),
            gkl: z(k),
        }
    }
}

/// One task: the reverse scan of one (sequence, value head, V tile [v0, v0 + bv)).
struct Scan<'a> {
    p: &'a Problem,
    x: &'a Inputs,
    o: &'a Outputs,
    nt: i64,
    fla: bool,
    v0: i64,
    bv: i64,
}

impl Scan<'_> {
    /// Writes the state block b [K, bv] (row-major) at the [K, V] (or, state_v_first,
    /// [V, K]) matrix starting at element `base` of `out`.
    ///
    /// # Safety
    /// The block is this task's alone.
    unsafe fn write_state<R: Real>(&self, out: &HostOut, base: i64, b: &[R]) {
        let Dims { k, v, .. } = self.p.dims;
        let bv = self.bv as usize;
        for kk in 0..k {
            let row = &b[kk as usize * bv..][..bv];
            if self.p.state_v_first {
                out.write(base + self.v0 * k + kk, k, row);
            } else {
                out.write(base + kk * v + self.v0, 1, row);
            }
        }
    }

    fn run<R: Real>(&self, n: i64, seq: &Seq, h: i64, buf: &mut Buffers<R>) {
        let Dims { t: tt, h: hq_count, hv, k, v, .. } = self.p.dims;
        let (p, x, o) = (self.p, self.x, self.o);
        let hq = h / (hv / hq_count);
        let (ku, bv, v0) = (k as usize, self.bv as usize, self.v0);
        let scale = R::of_f64(p.scale);
        // Buffers hold tiles of the widest V tile: a narrower one uses their first
        // elements, with its own row length bv.
        let Buffers { b, bk, kt, qt, wt, dot, dvt, dv2, dv2w, qd, wd, gt, gkl } = buf;

        // b <- dht[n, h] (its [K, V] or [V, K] block), or zeros
        if let Some(dht) = &x.dht {
            for kk in 0..k {
                let row = &mut b[kk as usize * bv..][..bv];
                if p.state_v_first {
                    dht.read(dht.offset(&[n, h, v0, kk]), dht.stride(2), row);
                } else {
                    dht.read(dht.offset(&[n, h, kk, v0]), dht.stride(3), row);
                }
            }
        } else {
            b.fill(R::default());
        }

        let batch = seq.batch;
        let state = k * v;
        for c in (0..varlen::chunks(seq.len)).rev() {
            let s = seq.bos + c * BT;
            let e = (s + BT).min(seq.bos + seq.len);
            let l = (e - s) as usize;

            // dh[batch, first_chunk + c, h] = b
            let dh_base = ((batch * self.nt + seq.first_chunk + c) * hv + h) * state;
            // SAFETY: this (chunk row, head, V tile) block is this task's: sequences'
            // chunk rows are disjoint (Sequences), heads and V tiles split the rest.
            unsafe { self.write_state(&o.dh, dh_base, b) };

            // DV = k @ R_k(b); dv2 = gate * DV + dv
            for i in 0..l {
                let t = s + i as i64;
                x.k.read(x.k.offset(&[batch, t, hq, 0]), x.k.stride(3), &mut kt[i * ku..][..ku]);
                x.dv.read(x.dv.offset(&[batch, t, h, v0]), x.dv.stride(3), &mut dvt[i * bv..][..bv]);
            }
            let b_k: &[R] = if self.fla {
                bk.copy_from_slice(b);
                round_to(x.k.dtype(), bk);
                bk
            } else {
                b
            };
            matmul(l, ku, bv, kt, false, b_k, dv2);
            let g_last = if let Some(g) = &x.g {
                for i in 0..l {
                    g.read(g.offset(&[batch, s + i as i64, h]), 1, &mut gt[i..i + 1]);
                }
                let g_last = gt[l - 1];
                for i in 0..l {
                    let fac = (g_last - gt[i]).exp2();
                    for (y, &d) in dv2[i * bv..][..bv].iter_mut().zip(&dvt[i * bv..][..bv]) {
                        *y = *y * fac + d;
                    }
                }
                Some(g_last)
            } else {
                for (y, &d) in dv2[..l * bv].iter_mut().zip(&dvt[..l * bv]) {
                    *y = *y + d;
                }
                None
            };
            for i in 0..l {
                let at = ((batch * tt + s + i as i64) * hv + h) * v + v0;
                // SAFETY: token rows of a sequence are its own; heads and V tiles split them.
                unsafe { o.dv2.write(at, 1, &dv2[i * bv..][..bv]) };
            }
            let dv2_w: &[R] = if self.fla {
                dv2w[..l * bv].copy_from_slice(&dv2[..l * bv]);
                round_to(x.w.dtype(), &mut dv2w[..l * bv]);
                dv2w
            } else {
                dv2
            };

            // QD = (exp2(g) q)^T R_do(do); WD = w^T R_w(dv2)
            for i in 0..l {
                let t = s + i as i64;
                x.q.read(x.q.offset(&[batch, t, hq, 0]), x.q.stride(3), &mut qt[i * ku..][..ku]);
                x.w.read(x.w.offset(&[batch, t, h, 0]), x.w.stride(3), &mut wt[i * ku..][..ku]);
                x.do_.read(x.do_.offset(&[batch, t, h, v0]), x.do_.stride(3), &mut dot[i * bv..][..bv]);
                if x.g.is_some() {
                    let gate = gt[i].exp2();
                    for y in &mut qt[i * ku..][..ku] {
                        *y = *y * gate;
                    }
                }
            }
            if self.fla && x.g.is_none() {
                round_to(x.q.dtype(), &mut dot[..l * bv]);
            }
            matmul(ku, l, bv, qt, true, dot, qd);
            matmul(ku, l, bv, wt, true, dv2_w, wd);

            // b = decay * b + (QD * scale - WD)
            if let Some(g_last) = g_last {
                let decay = g_last.exp2();
                for y in b.iter_mut() {
                    *y = *y * decay;
                }
            }
            if let Some(gk) = &x.gk {
                gk.read(gk.offset(&[batch, e - 1, h, 0]), gk.stride(3), gkl);
                for (row, &gl) in b.chunks_exact_mut(bv).zip(gkl.iter()) {
                    let decay = gl.exp2();
                    for y in row {
                        *y = *y * decay;
                    }
                }
            }
            for ((y, &a), &w) in b.iter_mut().zip(qd.iter()).zip(wd.iter()) {
                *y = *y + (a * scale - w);
            }
        }
        if let Some(dh0) = &o.dh0 {
            // SAFETY: (sequence, head, V tile) is this task's.
            unsafe { self.write_state(dh0, (n * hv + h) * state, b) };
        }
    }
}

#[cfg(test)]
mod tests;
