//! `_core.cpu_bwd_dhu`: the CPU path's binding. It converts and delegates: the
//! arguments are read as every entry point reads them (`call_args`: DLPack for tensors,
//! the same scalar rules), validated by `validate` (the element types of the mode) and
//! `validate::check_host`, cu_seqlens checked by `varlen::check_tables` (through
//! `cpu::Sequences`); the arithmetic is `cpu::run`, with the GIL released.
//!
//! Outputs are of the caller's kind: torch tensors (allocated by `torch.empty`, torch's
//! CPU allocator) when q is a torch.Tensor, numpy arrays (allocated through the `numpy`
//! crate) otherwise.

use crate::cpu::{self, Mode, Problem, Sequences};
use crate::error::{Error, Result};
use crate::facts::BT;
use crate::tensor::{DType, HostOut, HostView, TensorMeta};
use crate::validate::{self, CallArgs, CallDesc};
use crate::{guard, NOT_PASSED};
use numpy::{Element, PyArrayDyn};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

/// Where outputs are allocated.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Torch,
    Numpy,
}

/// torch if `q` is a torch.Tensor (a subclass included), else numpy.
fn kind_of(q: &Bound<'_, PyAny>) -> Kind {
    if crate::tensor::is_torch_tensor(q) {
        Kind::Torch
    } else {
        Kind::Numpy
    }
}

/// An uninitialized compact output of `dtype`, and its memory.
fn alloc<'py>(
    py: Python<'py>,
    kind: Kind,
    shape: &[i64],
    dtype: DType,
    arg: &'static str,
) -> PyResult<(Bound<'py, PyAny>, HostOut)> {
    let obj = match kind {
        Kind::Torch => {
            let torch = py.import("torch")?;
            let name = match dtype {
                DType::BF16 => "bfloat16",
                DType::F16 => "float16",
                DType::F32 => "float32",
                DType::F64 => "float64",
                other => return Err(crate::to_pyerr(Error::Internal(format!("{arg}: no torch dtype for {other}")))),
            };
            let kw = PyDict::new(py);
            kw.set_item("dtype", torch.getattr(name)?)?;
            torch.getattr("empty")?.call((PyTuple::new(py, shape)?,), Some(&kw))?
        }
        Kind::Numpy => {
            py.import("numpy")?;
            let dims: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
            fn new<'py, E: Element>(py: Python<'py>, dims: Vec<usize>) -> Bound<'py, PyAny> {
                // SAFETY: uninitialized elements, each written by `cpu::run` before the
                // array is handed out.
                unsafe { PyArrayDyn::<E>::new(py, dims, false) }.into_any()
            }
            match dtype {
                DType::F16 => new::<half::f16>(py, dims),
                DType::F32 => new::<f32>(py, dims),
                DType::F64 => new::<f64>(py, dims),
                other => {
                    return Err(crate::to_pyerr(Error::dtype(
                        arg,
                        format!("a numpy output cannot be {other} (numpy has no such dtype): pass torch tensors"),
                    )))
                }
            }
        }
    };
    let meta = TensorMeta::from_py(&obj, arg).map_err(crate::to_pyerr)?;
    // SAFETY: a fresh tensor of ours, alive as long as `obj`, which the caller returns
    // only after the run.
    let out = unsafe { HostOut::new(&meta) }.map_err(crate::to_pyerr)?;
    Ok((obj, out))
}

/// Validation of a CPU call: every check of `validate` with the mode's element types,
/// then the host-memory check (where the GPU path checks CUDA), then the CPU path's one
/// limit, chunk_size == 64 (as fla's callers use; other chunk sizes are fla's GPU
/// kernel's alone).
pub fn validate_cpu(a: &CallArgs, mode: Mode) -> Result<CallDesc> {
    let desc = validate::validate_dtypes(a, false, mode.dtypes())?;
    validate::check_host(a)?;
    if desc.chunk_size != BT {
        return Err(Error::value("chunk_size", format!("the CPU path takes 64, got {}", desc.chunk_size)));
    }
    Ok(desc)
}

/// The sequences of a validated call, reading cu_seqlens and an N + 1 chunk_offsets
/// table (host memory, validated; a table of N entries is not used, as on the CUDA path,
/// where the kernel sums the chunk counts itself), dh's NT from len(chunk_indices) where
/// given.
fn sequences(a: &CallArgs, d: &CallDesc) -> Result<Sequences> {
    let Some(cu) = &a.cu_seqlens else { return Ok(Sequences::dense(&d.dims)) };
    // SAFETY: validated host tensors, read while the caller's objects hold them.
    let cu = unsafe { HostView::new(cu, "cu_seqlens")? }.read_indices();
    let co = match (&a.chunk_offsets, d.chunk_offsets) {
        (Some(co), Some(_)) => Some(unsafe { HostView::new(co, "chunk_offsets")? }.read_indices()),
        _ => None,
    };
    Sequences::varlen(&d.dims, &cu, co.as_deref(), d.nt)
}

/// Input views of a validated host call.
///
/// # Safety
/// The caller's objects behind `a` stay alive and unwritten while the views are used.
unsafe fn inputs(a: &CallArgs) -> Result<cpu::Inputs> {
    let opt = |t: &Option<TensorMeta>, arg| t.as_ref().map(|t| HostView::new(t, arg)).transpose();
    Ok(cpu::Inputs {
        q: HostView::new(&a.q, "q")?,
        k: HostView::new(&a.k, "k")?,
        w: HostView::new(&a.w, "w")?,
        do_: HostView::new(&a.do_, "do")?,
        dv: HostView::new(&a.dv, "dv")?,
        g: opt(&a.g, "g")?,
        gk: opt(&a.gk, "gk")?,
        dht: opt(&a.dht, "dht")?,
    })
}

/// (dh, dh0 or None, dv2).
type CpuOutputs<'py> = (Bound<'py, PyAny>, Option<Bound<'py, PyAny>>, Bound<'py, PyAny>);

/// The checks of a call in host memory that fla's precision runs (the verdict on host
/// inputs): `validate_cpu` in fla's mode and cu_seqlens' values.
pub(crate) fn check_fla(a: &CallArgs) -> Result<()> {
    let desc = validate_cpu(a, Mode::Fla)?;
    sequences(a, &desc).map(|_| ())
}

crate::op_pyfunction! {
    /// Stage 4 on the CPU, in `mode` ("float64" or "fla"): fla's arguments (read as
    /// `validate` reads them; with cu_seqlens, chunk_indices' length is dh's NT), outputs of
    /// the caller's kind: (dh, dh0 or None, dv2).
    /// `poison`: fill the outputs with NaN before the run (tests). `check_only`: every check
    /// of the call (cu_seqlens' values included) and nothing else: returns None (the planner's
    /// verdict on host inputs).
    #[name = "cpu_bwd_dhu"]
    fn py_cpu_bwd_dhu<'py>(py, mode: &str; op; poison: bool, check_only: bool)
        signature_tail(, *, poison=false, check_only=false) -> PyResult<Option<CpuOutputs<'py>>> {
        cpu_bwd_dhu(py, mode, &op, poison, check_only)
    }
}

fn cpu_bwd_dhu<'py>(
    py: Python<'py>,
    mode: &str,
    op: &crate::OpObjects<'_, 'py>,
    poison: bool,
    check_only: bool,
) -> PyResult<Option<CpuOutputs<'py>>> {
    let q = op.q;
    let (mode, args, desc, seqs) = guard(|| {
        let mode = Mode::parse(mode)?;
        let a = op.args(None)?;
        let mut desc = validate_cpu(&a, mode)?;
        let seqs = sequences(&a, &desc)?;
        desc.nt = Some(seqs.nt);
        Ok((mode, a, desc, seqs))
    })?;
    if check_only {
        return Ok(None);
    }
    let d = desc.dims;
    let (dh_dtype, dh0_dtype, dv2_dtype) = mode.output_dtypes(desc.qk_dtype, desc.dv_dtype);
    let shapes = desc.out_shapes().expect("NT is known");
    let kind = kind_of(q);
    let (dh, dh_out) = alloc(py, kind, &shapes.dh, dh_dtype, "dh")?;
    let dh0 = match shapes.dh0 {
        Some(shape) => Some(alloc(py, kind, &shape, dh0_dtype, "dh0")?),
        None => None,
    };
    let (dv2, dv2_out) = alloc(py, kind, &shapes.dv2, dv2_dtype, "dv2")?;
    let (dh0, dh0_out) = match dh0 {
        Some((obj, out)) => (Some(obj), Some(out)),
        None => (None, None),
    };
    let outs = cpu::Outputs { dh: dh_out, dh0: dh0_out, dv2: dv2_out };
    let problem = Problem { dims: d, scale: desc.scale, state_v_first: desc.state_v_first, mode };
    guard(|| {
        // SAFETY: the inputs are the caller's objects (q, k, ... of this call), alive
        // until it returns.
        let x = unsafe { inputs(&args)? };
        py.detach(|| {
            if poison {
                cpu::poison(&outs);
            }
            cpu::run(&problem, &x, &seqs, &outs)
        });
        Ok(())
    })?;
    Ok(Some((dh, dh0, dv2)))
}
