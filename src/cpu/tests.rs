//! The CPU path against an independent per-token loop written here (f64, SPEC.md's
//! recurrence token by token, optionally with fla's two operand roundings), on fresh
//! random inputs in every dtype, outputs poisoned with NaN before each run.

use super::*;
use crate::tensor::{Device, HostElem, TensorMeta};

/// splitmix64: reproducible inputs without a dependency.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    fn normal(&mut self) -> f64 {
        let (u, v) = (self.uniform(), self.uniform());
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}

/// A tensor's bytes in `dtype` and the values they hold (as f64), with optional strides.
struct Buf {
    bytes: Vec<u8>,
    vals: Vec<f64>,
    shape: Vec<i64>,
    strides: Option<Vec<i64>>,
    dtype: DType,
}

fn encode(vals: &[f64], dtype: DType) -> (Vec<u8>, Vec<f64>) {
    fn each<E: HostElem>(vals: &[f64]) -> (Vec<u8>, Vec<f64>) {
        let size = std::mem::size_of::<E>();
        let mut bytes = vec![0u8; vals.len() * size];
        let mut held = Vec::with_capacity(vals.len());
        for (i, &x) in vals.iter().enumerate() {
            let e = E::from_f64(x);
            held.push(e.to_f64());
            // SAFETY: inside `bytes`.
            unsafe { (bytes.as_mut_ptr().add(i * size) as *mut E).write_unaligned(e) };
        }
        (bytes, held)
    }
    match dtype {
        DType::BF16 => each::<half::bf16>(vals),
        DType::F16 => each::<half::f16>(vals),
        DType::F32 => each::<f32>(vals),
        DType::F64 => each::<f64>(vals),
        other => panic!("{other}"),
    }
}

fn decode(bytes: &[u8], dtype: DType) -> Vec<f64> {
    fn each<E: HostElem>(bytes: &[u8]) -> Vec<f64> {
        let size = std::mem::size_of::<E>();
        // SAFETY: inside `bytes`.
        (0..bytes.len() / size)
            .map(|i| unsafe { (bytes.as_ptr().add(i * size) as *const E).read_unaligned() }.to_f64())
            .collect()
    }
    match dtype {
        DType::BF16 => each::<half::bf16>(bytes),
        DType::F16 => each::<half::f16>(bytes),
        DType::F32 => each::<f32>(bytes),
        DType::F64 => each::<f64>(bytes),
        other => panic!("{other}"),
    }
}

impl Buf {
    fn new(rng: &mut Rng, shape: &[i64], dtype: DType, f: impl Fn(&mut Rng) -> f64) -> Buf {
        let n: i64 = shape.iter().product();
        let vals: Vec<f64> = (0..n).map(|_| f(rng)).collect();
        let (bytes, vals) = encode(&vals, dtype);
        Buf { bytes, vals, shape: shape.to_vec(), strides: None, dtype }
    }

    /// The same values, stored with the last two dimensions swapped in memory (a
    /// transposed view, as `x.mT.contiguous().mT` in torch).
    fn transposed_storage(mut self) -> Buf {
        let nd = self.shape.len();
        let (r, c) = (self.shape[nd - 2] as usize, self.shape[nd - 1] as usize);
        let outer = self.vals.len() / (r * c);
        let mut swapped = vec![0.0; self.vals.len()];
        for o in 0..outer {
            for i in 0..r {
                for j in 0..c {
                    swapped[o * r * c + j * r + i] = self.vals[o * r * c + i * c + j];
                }
            }
        }
        self.bytes = encode(&swapped, self.dtype).0;
        let mut strides = vec![0i64; nd];
        strides[nd - 2] = 1;
        strides[nd - 1] = r as i64;
        let mut acc = (r * c) as i64;
        for d in (0..nd - 2).rev() {
            strides[d] = acc;
            acc *= self.shape[d];
        }
        self.strides = Some(strides);
        self
    }

    fn meta(&self) -> TensorMeta {
        TensorMeta {
            ptr: self.bytes.as_ptr() as u64,
            shape: self.shape.clone(),
            strides: self.strides.clone(),
            dtype: self.dtype,
            device: Device::cpu(),
        }
    }

    fn view(&self) -> HostView {
        // SAFETY: the buffer outlives the test's run.
        unsafe { HostView::new(&self.meta(), "x") }.unwrap()
    }

    /// The value at a row-major index of the logical shape.
    fn at(&self, idx: &[i64]) -> f64 {
        let mut flat = 0i64;
        for (&i, &d) in idx.iter().zip(&self.shape) {
            flat = flat * d + i;
        }
        self.vals[flat as usize]
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Gate {
    None,
    G,
    Gk,
}

#[derive(Clone, Debug)]
struct Case {
    b: i64,
    t: i64,
    h: i64,
    hv: i64,
    k: i64,
    v: i64,
    gate: Gate,
    dtype: DType,
    dht: bool,
    h0: bool,
    svf: bool,
    /// varlen sequence lengths (B == 1); T may exceed their sum (padding).
    lens: Option<Vec<i64>>,
    /// rows of dh past the chunks (fla's chunk_indices longer than the chunks)
    extra_nt: i64,
    /// store q and dht transposed in memory (strided views)
    strided: bool,
}

impl Case {
    #[allow(clippy::too_many_arguments)]
    fn new(b: i64, t: i64, h: i64, hv: i64, k: i64, v: i64, gate: Gate, dtype: DType) -> Case {
        Case {
            b,
            t,
            h,
            hv,
            k,
            v,
            gate,
            dtype,
            dht: true,
            h0: true,
            svf: false,
            lens: None,
            extra_nt: 0,
            strided: false,
        }
    }
    fn varlen(lens: &[i64], pad: i64, gate: Gate) -> Case {
        let t = lens.iter().sum::<i64>() + pad;
        Case { lens: Some(lens.to_vec()), ..Case::new(1, t, 2, 4, 32, 48, gate, DType::BF16) }
    }
    fn n(&self) -> i64 {
        self.lens.as_ref().map_or(self.b, |l| l.len() as i64)
    }
    fn cu(&self) -> Option<Vec<i64>> {
        self.lens.as_ref().map(|l| {
            let mut cu = vec![0];
            for &x in l {
                cu.push(cu.last().unwrap() + x);
            }
            cu
        })
    }
}

struct Data {
    q: Buf,
    k: Buf,
    w: Buf,
    do_: Buf,
    dv: Buf,
    g: Option<Buf>,
    gk: Option<Buf>,
    dht: Option<Buf>,
}

fn data(c: &Case, seed: u64) -> Data {
    let mut rng = Rng(seed);
    let (b, t, h, hv, k, v) = (c.b, c.t, c.h, c.hv, c.k, c.v);
    let inv = 1.0 / (k as f64).sqrt();
    let q = Buf::new(&mut rng, &[b, t, h, k], c.dtype, |r| r.normal() * inv);
    let q = if c.strided { q.transposed_storage() } else { q };
    let state = if c.svf { [c.n(), hv, v, k] } else { [c.n(), hv, k, v] };
    Data {
        q,
        k: Buf::new(&mut rng, &[b, t, h, k], c.dtype, |r| r.normal() * inv),
        w: Buf::new(&mut rng, &[b, t, hv, k], c.dtype, |r| 0.25 * r.normal() * inv),
        do_: Buf::new(&mut rng, &[b, t, hv, v], c.dtype, |r| r.normal()),
        dv: Buf::new(&mut rng, &[b, t, hv, v], c.dtype, |r| r.normal()),
        g: (c.gate == Gate::G).then(|| Buf::new(&mut rng, &[b, t, hv], DType::F32, |r| -r.uniform())),
        gk: (c.gate == Gate::Gk).then(|| Buf::new(&mut rng, &[b, t, hv, k], DType::F32, |r| -r.uniform())),
        dht: c.dht.then(|| {
            let d = Buf::new(&mut rng, &state, DType::F32, |r| r.normal());
            if c.strided {
                d.transposed_storage()
            } else {
                d
            }
        }),
    }
}

/// The outputs of a run as f64, dh and dh0 in [.., K, V] order whatever state_v_first.
struct Out {
    dh: Vec<f64>,
    dh0: Option<Vec<f64>>,
    dv2: Vec<f64>,
    nt: i64,
}

fn sequences_of(c: &Case) -> Sequences {
    let dims = dims_of(c);
    match c.cu() {
        None => Sequences::dense(&dims),
        Some(cu) => {
            let total: i64 = c.lens.as_ref().unwrap().iter().map(|&l| varlen::chunks(l)).sum();
            let co: Vec<i64> = {
                let mut co = vec![0];
                for &l in c.lens.as_ref().unwrap() {
                    co.push(co.last().unwrap() + varlen::chunks(l));
                }
                co
            };
            let nt = (c.extra_nt > 0).then_some(total + c.extra_nt);
            Sequences::varlen(&dims, &cu, Some(&co), nt).unwrap()
        }
    }
}

fn dims_of(c: &Case) -> Dims {
    Dims { b: c.b, t: c.t, h: c.h, hv: c.hv, k: c.k, v: c.v, n: c.n() }
}

/// From [.., V, K] to [.., K, V] order (state_v_first outputs).
fn untranspose(x: Vec<f64>, k: i64, v: i64) -> Vec<f64> {
    let (k, v) = (k as usize, v as usize);
    let mut y = vec![0.0; x.len()];
    for o in 0..x.len() / (k * v) {
        for i in 0..v {
            for j in 0..k {
                y[o * k * v + j * v + i] = x[o * k * v + i * k + j];
            }
        }
    }
    y
}

fn scale_of(c: &Case) -> f64 {
    (c.k as f64).powf(-0.5)
}

fn run_cpu(c: &Case, x: &Data, mode: Mode) -> Out {
    let dims = dims_of(c);
    let s = sequences_of(c);
    let (dh_t, dh0_t, dv2_t) = mode.output_dtypes(c.dtype, c.dtype);
    let alloc = |n: i64, dtype: DType| vec![0u8; n as usize * dtype.size_bytes() as usize];
    let state = c.n() * c.hv * c.k * c.v;
    let mut dh = alloc(c.b * s.nt * c.hv * c.k * c.v, dh_t);
    let mut dh0 = alloc(if c.h0 { state } else { 0 }, dh0_t);
    let mut dv2 = alloc(c.b * c.t * c.hv * c.v, dv2_t);
    let out = |buf: &mut Vec<u8>, shape: &[i64], dtype| {
        let meta = TensorMeta::contiguous(buf.as_mut_ptr() as u64, shape, dtype, Device::cpu());
        // SAFETY: the buffers outlive the run and nothing else touches them.
        unsafe { HostOut::new(&meta) }.unwrap()
    };
    let o = Outputs {
        dh: out(&mut dh, &[c.b, s.nt, c.hv, c.k, c.v], dh_t),
        dh0: c.h0.then(|| out(&mut dh0, &[c.n(), c.hv, c.k, c.v], dh0_t)),
        dv2: out(&mut dv2, &[c.b, c.t, c.hv, c.v], dv2_t),
    };
    let inputs = Inputs {
        q: x.q.view(),
        k: x.k.view(),
        w: x.w.view(),
        do_: x.do_.view(),
        dv: x.dv.view(),
        g: x.g.as_ref().map(Buf::view),
        gk: x.gk.as_ref().map(Buf::view),
        dht: x.dht.as_ref().map(Buf::view),
    };
    let p = Problem { dims, scale: scale_of(c), state_v_first: c.svf, mode };
    poison(&o);
    run(&p, &inputs, &s, &o);
    let fix = |x: Vec<f64>| if c.svf { untranspose(x, c.k, c.v) } else { x };
    Out { dh: fix(decode(&dh, dh_t)), dh0: c.h0.then(|| fix(decode(&dh0, dh0_t))), dv2: decode(&dv2, dv2_t), nt: s.nt }
}

/// SPEC.md's recurrence token by token in f64. `rounding`: fla's two operand casts
/// (b to k's dtype before k @ b, dv2 to w's dtype before w^T dv2), else exact.
fn naive(c: &Case, x: &Data, rounding: bool, nt: i64) -> Out {
    let (hv, k, v, t_len) = (c.hv as usize, c.k as usize, c.v as usize, c.t as usize);
    let group = (c.hv / c.h) as usize;
    let round = |val: f64| if rounding { encode(&[val], c.dtype).1[0] } else { val };
    let scale = scale_of(c);
    let mut dh = vec![0.0; c.b as usize * nt as usize * hv * k * v];
    let mut dh0 = vec![0.0; c.n() as usize * hv * k * v];
    let mut dv2 = vec![0.0; c.b as usize * t_len * hv * v];
    // (batch, bos, len, first chunk)
    let seqs: Vec<(usize, usize, usize, usize)> = match c.cu() {
        None => (0..c.b as usize).map(|n| (n, 0, t_len, 0)).collect(),
        Some(cu) => {
            let mut first = 0;
            (0..cu.len() - 1)
                .map(|n| {
                    let s = (0, cu[n] as usize, (cu[n + 1] - cu[n]) as usize, first);
                    first += ((cu[n + 1] - cu[n]) as usize).div_ceil(64);
                    s
                })
                .collect()
        }
    };
    for (n, &(batch, bos, len, first)) in seqs.iter().enumerate() {
        for h in 0..hv {
            let hq = h / group;
            let (bi, hi, ni) = (batch as i64, h as i64, n as i64);
            let mut b = vec![vec![0.0; v]; k];
            if let Some(d) = &x.dht {
                for (kk, row) in b.iter_mut().enumerate() {
                    for (j, y) in row.iter_mut().enumerate() {
                        let (kk, j) = (kk as i64, j as i64);
                        *y = if c.svf { d.at(&[ni, hi, j, kk]) } else { d.at(&[ni, hi, kk, j]) };
                    }
                }
            }
            let nc = len.div_ceil(64);
            for ch in (0..nc).rev() {
                let s = bos + ch * 64;
                let e = (s + 64).min(bos + len);
                let base = (((batch * nt as usize) + first + ch) * hv + h) * k * v;
                for kk in 0..k {
                    for j in 0..v {
                        dh[base + kk * v + j] = b[kk][j];
                    }
                }
                let g_at = |t: usize| x.g.as_ref().map_or(0.0, |g| g.at(&[bi, t as i64, hi]));
                let mut d2 = vec![vec![0.0; v]; e - s];
                for t in s..e {
                    let ti = t as i64;
                    let fac = if x.g.is_some() { (g_at(e - 1) - g_at(t)).exp2() } else { 1.0 };
                    for j in 0..v {
                        let mut acc = 0.0;
                        for (kk, row) in b.iter().enumerate() {
                            acc += x.k.at(&[bi, ti, hq as i64, kk as i64]) * round(row[j]);
                        }
                        let y = fac * acc + x.dv.at(&[bi, ti, hi, j as i64]);
                        d2[t - s][j] = y;
                        dv2[((batch * t_len + t) * hv + h) * v + j] = y;
                    }
                }
                for (kk, row) in b.iter_mut().enumerate() {
                    let mut decay = if x.g.is_some() { g_at(e - 1).exp2() } else { 1.0 };
                    if let Some(gk) = &x.gk {
                        decay *= gk.at(&[bi, e as i64 - 1, hi, kk as i64]).exp2();
                    }
                    for (j, y) in row.iter_mut().enumerate() {
                        let mut upd = 0.0;
                        for t in s..e {
                            let ti = t as i64;
                            let gq = if x.g.is_some() { g_at(t).exp2() } else { 1.0 };
                            upd += scale
                                * gq
                                * x.q.at(&[bi, ti, hq as i64, kk as i64])
                                * x.do_.at(&[bi, ti, hi, j as i64])
                                - x.w.at(&[bi, ti, hi, kk as i64]) * round(d2[t - s][j]);
                        }
                        *y = decay * *y + upd;
                    }
                }
            }
            let base = (n * hv + h) * k * v;
            for kk in 0..k {
                for j in 0..v {
                    dh0[base + kk * v + j] = b[kk][j];
                }
            }
        }
    }
    Out { dh, dh0: c.h0.then_some(dh0), dv2, nt }
}

/// ‖out − ref‖ / ‖ref‖; infinite for a non-finite `out`.
fn rel(out: &[f64], r: &[f64]) -> f64 {
    assert_eq!(out.len(), r.len());
    if out.iter().any(|x| !x.is_finite()) {
        return f64::INFINITY;
    }
    let num: f64 = out.iter().zip(r).map(|(a, b)| (a - b) * (a - b)).sum::<f64>().sqrt();
    let den: f64 = r.iter().map(|b| b * b).sum::<f64>().sqrt();
    if den > 0.0 {
        num / den
    } else {
        num
    }
}

/// Every output's relative error against `r` (dh, dh0, dv2), checking shapes and that
/// dh0 is there iff h0 was given.
fn errors(o: &Out, r: &Out) -> [f64; 3] {
    assert_eq!(o.dh0.is_some(), r.dh0.is_some());
    let e0 = o.dh0.as_ref().map_or(0.0, |d| rel(d, r.dh0.as_ref().unwrap()));
    [rel(&o.dh, &r.dh), e0, rel(&o.dv2, &r.dv2)]
}

fn cases() -> Vec<(&'static str, Case)> {
    use DType::*;
    let base = |gate| Case::new(2, 130, 2, 2, 32, 24, gate, BF16);
    vec![
        ("gk", base(Gate::Gk)),
        ("g", base(Gate::G)),
        ("no gate", base(Gate::None)),
        ("GVA H=1 HV=4", Case::new(1, 100, 1, 4, 16, 16, Gate::Gk, BF16)),
        ("GVA H=2 HV=4 g", Case::new(2, 70, 2, 4, 16, 16, Gate::G, BF16)),
        ("T=1", Case::new(2, 1, 1, 1, 16, 8, Gate::Gk, BF16)),
        ("T=63", Case::new(1, 63, 1, 2, 16, 8, Gate::G, BF16)),
        ("T=64", Case::new(1, 64, 1, 2, 16, 8, Gate::Gk, BF16)),
        ("T=65", Case::new(1, 65, 1, 2, 16, 8, Gate::None, BF16)),
        ("K=64 V=128 fp16", Case::new(1, 200, 2, 2, 64, 128, Gate::Gk, F16)),
        ("K=128 V=64", Case::new(1, 96, 1, 1, 128, 64, Gate::G, BF16)),
        ("V=96 (a partial V tile)", Case::new(1, 90, 1, 1, 16, 96, Gate::Gk, F32)),
        ("float32", Case::new(2, 80, 2, 2, 16, 16, Gate::G, F32)),
        ("float64", Case::new(2, 80, 2, 2, 16, 16, Gate::Gk, F64)),
        ("no dht", Case { dht: false, ..base(Gate::Gk) }),
        ("no h0", Case { h0: false, ..base(Gate::G) }),
        ("no dht, no h0", Case { dht: false, h0: false, ..base(Gate::None) }),
        ("state_v_first", Case { svf: true, ..base(Gate::Gk) }),
        ("state_v_first g", Case { svf: true, ..base(Gate::G) }),
        ("strided q and dht", Case { strided: true, ..base(Gate::Gk) }),
        ("strided state_v_first", Case { strided: true, svf: true, ..base(Gate::G) }),
        ("varlen 1/63/65/128", Case::varlen(&[1, 63, 65, 128], 0, Gate::Gk)),
        ("varlen g", Case::varlen(&[1, 63, 65, 128], 0, Gate::G)),
        ("varlen no gate", Case::varlen(&[1, 63, 65, 128], 0, Gate::None)),
        ("varlen empty sequences", Case::varlen(&[0, 70, 0, 3], 0, Gate::Gk)),
        ("varlen padded", Case::varlen(&[30, 100], 37, Gate::Gk)),
        ("varlen chunk_indices longer", Case { extra_nt: 3, ..Case::varlen(&[5, 64, 66], 10, Gate::G) }),
        ("varlen state_v_first", Case { svf: true, ..Case::varlen(&[1, 63, 65, 128], 0, Gate::Gk) }),
    ]
}

#[test]
fn float64_mode_is_the_recurrence() {
    for (i, (name, c)) in cases().into_iter().enumerate() {
        let x = data(&c, 1000 + i as u64);
        let out = run_cpu(&c, &x, Mode::Float64);
        let r = naive(&c, &x, false, out.nt);
        for (what, e) in ["dh", "dh0", "dv2"].iter().zip(errors(&out, &r)) {
            assert!(e <= 1e-12, "{name}: {what} relative error {e:e}");
        }
        // the reference is not trivially zero anywhere it is compared
        assert!(r.dh0.as_ref().is_none_or(|d| d.iter().any(|&y| y != 0.0)), "{name}");
        assert!(r.dv2.iter().any(|&y| y != 0.0), "{name}");
    }
}

#[test]
fn fla_mode_is_within_16_bit_rounding_of_the_recurrence() {
    for (i, (name, c)) in cases().into_iter().enumerate() {
        let x = data(&c, 2000 + i as u64);
        let fla = match c.dtype {
            DType::F64 => {
                // fla takes no float64 (validation refuses it); its arithmetic is f32
                continue;
            }
            _ => run_cpu(&c, &x, Mode::Fla),
        };
        let exact = naive(&c, &x, false, fla.nt);
        let emulated = naive(&c, &x, true, fla.nt);
        // bf16 carries 8 significant bits (unit roundoff 2^-9), fp16 11, fp32 24.
        let (bound_exact, bound_emulated) = match c.dtype {
            DType::BF16 => (1e-2, 4e-3),
            DType::F16 => (2e-3, 6e-4),
            _ => (1e-5, 1e-5),
        };
        let (ee, em) = (errors(&fla, &exact), errors(&fla, &emulated));
        for (j, what) in ["dh", "dh0", "dv2"].iter().enumerate() {
            assert!(ee[j] <= bound_exact, "{name}: {what} vs exact {:e}", ee[j]);
            assert!(em[j] <= bound_emulated, "{name}: {what} vs emulated {:e}", em[j]);
        }
        // dh0 is stored in fp32: against the emulated roundings its error is fp32
        // accumulation order (1e-7), or where that flips one 16-bit rounding of b or dv2
        // on the way, ~1e-4: well below the operand roundings themselves (~1e-3).
        if c.h0 && c.dtype == DType::BF16 && c.lens.as_ref().is_none_or(|l| l.iter().any(|&x| x > 64)) {
            assert!(em[1] <= 4e-4, "{name}: dh0 vs emulated {:e}", em[1]);
            assert!(em[1] * 4.0 < ee[1], "{name}: emulated {:e} not closer than exact {:e}", em[1], ee[1]);
        }
    }
}

#[test]
fn v_tiles_and_thread_counts_give_the_same_bits() {
    // V = 96 with one (sequence, head) splits into tiles of 64 + 32 on many threads and
    // runs whole on one: the columns are independent, the per-element sums the same.
    let c = Case::new(1, 150, 1, 1, 32, 96, Gate::Gk, DType::BF16);
    let x = data(&c, 7);
    for mode in [Mode::Float64, Mode::Fla] {
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let many = rayon::ThreadPoolBuilder::new().num_threads(8).build().unwrap();
        let a = one.install(|| run_cpu(&c, &x, mode));
        let b = many.install(|| run_cpu(&c, &x, mode));
        assert_eq!(v_tile(1, 96, 1), 96);
        assert_eq!(v_tile(1, 96, 8), 64);
        assert_eq!(a.dh, b.dh, "{mode:?}");
        assert_eq!(a.dh0, b.dh0, "{mode:?}");
        assert_eq!(a.dv2, b.dv2, "{mode:?}");
    }
}

#[test]
fn padding_rows_are_zeros() {
    let c = Case { extra_nt: 2, ..Case::varlen(&[30, 100], 37, Gate::Gk) };
    let x = data(&c, 11);
    for mode in [Mode::Float64, Mode::Fla] {
        let o = run_cpu(&c, &x, mode);
        let row = (c.hv * c.k * c.v) as usize;
        let covered = 1 + 2; // ceil(30/64) + ceil(100/64)
        assert_eq!(o.nt, covered + 2);
        assert!(o.dh[covered as usize * row..].iter().all(|&y| y == 0.0));
        assert!(o.dh[..covered as usize * row].iter().all(|y| y.is_finite()));
        let tok = (c.hv * c.v) as usize;
        assert!(o.dv2[130 * tok..].iter().all(|&y| y == 0.0));
        assert!(o.dv2[..130 * tok].iter().any(|&y| y != 0.0));
    }
}

#[test]
fn modes_parse_and_name_their_dtypes() {
    assert_eq!(Mode::parse("float64").unwrap(), Mode::Float64);
    assert_eq!(Mode::parse("fla").unwrap(), Mode::Fla);
    assert_eq!(Mode::parse("f64").unwrap_err().to_string(), "mode: expected 'float64' or 'fla', got \"f64\"");
    assert_eq!(Mode::Fla.output_dtypes(DType::BF16, DType::F32), (DType::BF16, DType::F32, DType::F32));
    assert_eq!(Mode::Float64.output_dtypes(DType::BF16, DType::F16), (DType::F64, DType::F64, DType::F64));
}

#[test]
fn varlen_tables_are_checked_by_the_one_checker() {
    let dims = Dims { b: 1, t: 200, h: 1, hv: 1, k: 8, v: 8, n: 3 };
    let ok = Sequences::varlen(&dims, &[0, 5, 69, 133], None, None).unwrap();
    assert_eq!(ok.nt, 3);
    assert_eq!(ok.covered_tokens, 133);
    assert_eq!(ok.seqs[2], Seq { batch: 0, bos: 69, len: 64, first_chunk: 2 });
    // chunk_offsets [N + 1], checked against cu_seqlens
    assert_eq!(Sequences::varlen(&dims, &[0, 5, 69, 133], Some(&[0, 1, 2, 3]), None).unwrap(), ok);
    let e = Sequences::varlen(&dims, &[0, 5, 69, 133], Some(&[0, 1, 3, 4]), None).unwrap_err();
    assert!(e.to_string().contains("got chunk_offsets[1] = 1, chunk_offsets[2] = 3"), "{e}");
    let e = Sequences::varlen(&dims, &[0, 5, 69, 133], Some(&[0, 2, 3, 4]), None).unwrap_err();
    assert!(e.to_string().starts_with("chunk_offsets: expected the chunk offsets of cu_seqlens"), "{e}");
    assert!(e.to_string().contains("chunk_offsets[0] = 0, chunk_offsets[1] = 2"), "{e}");
    let e = Sequences::varlen(&dims, &[0, 5, 69, 233], Some(&[0, 1, 2, 3]), None).unwrap_err();
    assert_eq!(e.to_string(), "cu_seqlens: expected cu_seqlens[3] <= T = 200, got 233");
    let e = Sequences::varlen(&dims, &[0, 5, 69, 133], None, Some(2)).unwrap_err();
    assert!(e.to_string().starts_with("chunk_indices: expected at least as many rows"), "{e}");
    let e = Sequences::varlen(&dims, &[1, 5, 69, 133], None, None).unwrap_err();
    assert_eq!(e.to_string(), "cu_seqlens: expected cu_seqlens[0] == 0, got 1");
    // overflow-sized values are errors, not panics
    assert!(Sequences::varlen(&dims, &[0, 5, i64::MIN, 133], Some(&[0, 1, 2, 3]), None).is_err());
    assert!(Sequences::varlen(&dims, &[0, 5, 69, 133], Some(&[0, 1, 2, i64::MAX]), None).is_err());
}
