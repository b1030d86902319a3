//! kda-dhu host core: the `kda_dhu._core` extension module.
//!
//! The `#[pyfunction]`s below only convert arguments and delegate: DLPack intake
//! (`tensor`), validation (`validate`), planning (`plan`), the kernel ABI (`abi`),
//! TMA descriptors and their cache (`tma`) and the launch (`launch`) are plain Rust,
//! tested by `cargo test` without Python or a GPU. Errors are one enum
//! (`error::Error`), mapped to Python exceptions here, in `to_pyerr`; a panic never
//! crosses into Python.
//!
//! The kernel path of one call is `prepare` (inputs read and validated once, the plan)
//! then `PreparedCall.launch` (only the outputs read): the stateless `launch` reads
//! and validates everything again, for callers that hold no `PreparedCall`.

// `x % n == 0` reads the same and builds with toolchains older than is_multiple_of.
#![allow(clippy::manual_is_multiple_of)]

pub mod abi;
pub mod cpu;
pub mod driver;
pub mod env;
pub mod error;
pub mod facts;
pub mod kernels;
pub mod launch;
pub mod plan;
#[cfg(test)]
mod ptxas;
mod py_cpu;
pub mod tensor;
pub mod tma;
pub mod validate;
pub mod varlen;

use error::{Error, PyKind};
use plan::Rule;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use tensor::TensorMeta;
use validate::{CallArgs, Outputs};

pyo3::create_exception!(
    _core,
    KernelUnavailableError,
    PyRuntimeError,
    "This device's driver or GPU cannot run kda-dhu's kernel image (the message, which starts with \
     UNAVAILABLE_PREFIX, names the GPU, the driver and what is needed). Not a bug: the call, and every \
     later one on that device, belongs to fla."
);

/// The one mapping from the error enum to Python exception types.
fn to_pyerr(e: Error) -> PyErr {
    let msg = e.to_string();
    match e.py_kind() {
        PyKind::TypeError => PyTypeError::new_err(msg),
        PyKind::ValueError => PyValueError::new_err(msg),
        PyKind::RuntimeError => PyRuntimeError::new_err(msg),
        PyKind::Unavailable => KernelUnavailableError::new_err(msg),
    }
}

/// Runs `f`, turning both its errors and any panic into Python exceptions.
fn guard<T>(f: impl FnOnce() -> error::Result<T>) -> PyResult<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r.map_err(to_pyerr),
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_string());
            Err(to_pyerr(Error::Internal(what)))
        }
    }
}

/// An argument read as a plain Python object, so that its conversion errors follow the
/// "arg: expected ..." convention (PyO3's own say "argument 'arg': ..." or, for an int
/// too large for i64, nothing about the argument). `Arg(None)`: not passed.
struct Arg<'py>(Option<Bound<'py, PyAny>>);

impl<'a, 'py> FromPyObject<'a, 'py> for Arg<'py> {
    type Error = PyErr;
    fn extract(obj: pyo3::Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        Ok(Arg(Some(obj.to_owned())))
    }
}

const NOT_PASSED: Arg<'static> = Arg(None);

fn py_type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().fully_qualified_name().map(|n| n.to_string()).unwrap_or_else(|_| "an object".into())
}

/// `scale`: None, or anything Python's float() takes except str/bytes, bools and complex
/// numbers (int, float, numpy real scalars, a one-element real tensor). Finiteness is
/// checked by `validate`.
fn scale_arg(obj: Option<&Bound<'_, PyAny>>) -> error::Result<Option<f64>> {
    let Some(o) = obj.filter(|o| !o.is_none()) else { return Ok(None) };
    if o.is_exact_instance_of::<pyo3::types::PyFloat>() {
        return o.extract::<f64>().map(Some).map_err(|_| Error::type_("scale", "expected a float or None"));
    }
    let py = o.py();
    let is_text = o.is_instance_of::<pyo3::types::PyString>() || o.is_instance_of::<pyo3::types::PyBytes>();
    if !is_text && !o.is_instance_of::<pyo3::types::PyBool>() && !is_complex_or_bool(o) {
        match o.extract::<f64>() {
            Ok(x) => return Ok(Some(x)),
            Err(e) if e.is_instance_of::<pyo3::exceptions::PyOverflowError>(py) => {
                return Err(Error::value(
                    "scale",
                    format!("expected a finite float, got {} (too large for float64)", py_type_name(o)),
                ));
            }
            Err(_) => {}
        }
    }
    Err(Error::type_("scale", format!("expected a float or None, got {}", py_type_name(o))))
}

/// Not a real number although float() takes it: a complex number (Python's; numpy's
/// complex128 derives from it), or a numpy scalar / torch tensor of a complex or bool
/// dtype (float() would drop an imaginary part with a warning, or take True as 1.0).
fn is_complex_or_bool(o: &Bound<'_, PyAny>) -> bool {
    if o.is_instance_of::<pyo3::types::PyComplex>() {
        return true;
    }
    let Ok(dt) = o.getattr("dtype") else { return false };
    if let Ok(c) = dt.getattr("is_complex") {
        // a torch.dtype: is_complex is a bool attribute; torch.bool is its own dtype
        let bool_dtype = dt.repr().map(|r| r == "torch.bool").unwrap_or(false);
        return c.extract::<bool>().unwrap_or(false) || bool_dtype;
    }
    dt.getattr("kind").and_then(|k| k.extract::<String>()).map(|k| k == "c" || k == "b").unwrap_or(false)
}

/// `chunk_size`: a Python int (anything with __index__: int, numpy ints; not float, bool or
/// str). Not passed: 64. The range (>= 1) is checked by `validate`.
fn chunk_size_arg(arg: &Arg<'_>) -> error::Result<i64> {
    let Some(o) = &arg.0 else { return Ok(64) };
    let py = o.py();
    if o.is_instance_of::<pyo3::types::PyFloat>()
        || o.is_instance_of::<pyo3::types::PyBool>()
        || o.is_none()
        || !o.hasattr(pyo3::intern!(py, "__index__")).unwrap_or(false)
    {
        return Err(Error::type_("chunk_size", format!("expected an int, got {}", py_type_name(o))));
    }
    o.extract::<i64>().map_err(|e| {
        if e.is_instance_of::<pyo3::exceptions::PyOverflowError>(py) {
            let v = o.str().map(|s| s.to_string()).unwrap_or_default();
            Error::value("chunk_size", format!("expected a positive int that fits in int64, got {v}"))
        } else {
            Error::type_("chunk_size", format!("expected an int, got {}", py_type_name(o)))
        }
    })
}

/// `state_v_first`: a bool (Python's or numpy's). Not passed or None: False.
fn state_v_first_arg(arg: &Arg<'_>) -> error::Result<bool> {
    let Some(o) = arg.0.as_ref().filter(|o| !o.is_none()) else { return Ok(false) };
    o.extract::<bool>().map_err(|_| Error::type_("state_v_first", format!("expected a bool, got {}", py_type_name(o))))
}

/// fla's arguments, read through DLPack (the signature order of
/// `chunk_gated_delta_rule_bwd_dhu`). `nt`: dh's chunk count of a packed batch when the
/// caller knows it without chunk_indices.
#[allow(clippy::too_many_arguments)]
fn call_args(
    q: &Bound<'_, PyAny>,
    k: &Bound<'_, PyAny>,
    w: &Bound<'_, PyAny>,
    do_: &Bound<'_, PyAny>,
    dv: &Bound<'_, PyAny>,
    g: Option<&Bound<'_, PyAny>>,
    gk: Option<&Bound<'_, PyAny>>,
    h0: Option<&Bound<'_, PyAny>>,
    dht: Option<&Bound<'_, PyAny>>,
    scale: Option<&Bound<'_, PyAny>>,
    state_v_first: &Arg<'_>,
    cu_seqlens: Option<&Bound<'_, PyAny>>,
    chunk_size: &Arg<'_>,
    chunk_indices: Option<&Bound<'_, PyAny>>,
    chunk_offsets: Option<&Bound<'_, PyAny>>,
    nt: Option<i64>,
) -> error::Result<CallArgs> {
    // Scalars first: a bad scalar is reported even when the tensors are fine.
    let scale = scale_arg(scale)?;
    let state_v_first = state_v_first_arg(state_v_first)?;
    let chunk_size = chunk_size_arg(chunk_size)?;
    // fla ignores chunk_indices and chunk_offsets without cu_seqlens; so do we (not read).
    let varlen = cu_seqlens.is_some_and(|c| !c.is_none());
    Ok(CallArgs {
        q: TensorMeta::from_py(q, "q")?,
        k: TensorMeta::from_py(k, "k")?,
        w: TensorMeta::from_py(w, "w")?,
        do_: TensorMeta::from_py(do_, "do")?,
        dv: TensorMeta::from_py(dv, "dv")?,
        g: TensorMeta::from_py_opt(g, "g")?,
        gk: TensorMeta::from_py_opt(gk, "gk")?,
        h0: TensorMeta::from_py_opt(h0, "h0")?,
        dht: TensorMeta::from_py_opt(dht, "dht")?,
        scale,
        state_v_first,
        cu_seqlens: TensorMeta::from_py_opt(cu_seqlens, "cu_seqlens")?,
        chunk_size,
        chunk_indices: if varlen { TensorMeta::from_py_opt(chunk_indices, "chunk_indices")? } else { None },
        chunk_offsets: if varlen { TensorMeta::from_py_opt(chunk_offsets, "chunk_offsets")? } else { None },
        nt: if varlen { nt } else { None },
    })
}

/// Validates a call like fla's `chunk_gated_delta_rule_bwd_dhu` would take it, without
/// the device check (works on CPU tensors). Raises TypeError / ValueError; returns None.
#[pyfunction]
#[pyo3(name = "validate", signature = (q, k, w, r#do, dv, g=None, gk=None, h0=None, dht=None, scale=None, state_v_first=NOT_PASSED, cu_seqlens=None, chunk_size=NOT_PASSED, chunk_indices=None, chunk_offsets=None))]
#[allow(clippy::too_many_arguments)]
fn py_validate(
    q: &Bound<'_, PyAny>,
    k: &Bound<'_, PyAny>,
    w: &Bound<'_, PyAny>,
    r#do: &Bound<'_, PyAny>,
    dv: &Bound<'_, PyAny>,
    g: Option<&Bound<'_, PyAny>>,
    gk: Option<&Bound<'_, PyAny>>,
    h0: Option<&Bound<'_, PyAny>>,
    dht: Option<&Bound<'_, PyAny>>,
    scale: Option<&Bound<'_, PyAny>>,
    state_v_first: Arg<'_>,
    cu_seqlens: Option<&Bound<'_, PyAny>>,
    chunk_size: Arg<'_>,
    chunk_indices: Option<&Bound<'_, PyAny>>,
    chunk_offsets: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    guard(|| {
        let a = call_args(
            q,
            k,
            w,
            r#do,
            dv,
            g,
            gk,
            h0,
            dht,
            scale,
            &state_v_first,
            cu_seqlens,
            &chunk_size,
            chunk_indices,
            chunk_offsets,
            None,
        )?;
        validate::validate(&a, false).map(|_| ())
    })
}

fn parse_rule(rule: &str) -> error::Result<Rule> {
    Rule::parse(rule)
        .ok_or_else(|| Error::value("rule", format!("expected 'b2a', 'extended' or 'capable', got {rule:?}")))
}

/// A call read, validated and planned by `prepare`: the one decision of a call (inputs,
/// plan, inputs to copy, output shapes), which the Python layer allocates from and
/// launches. Launching it reads only the outputs. Holds the numbers of the call
/// (addresses, extents) and references to the input objects, so that their memory
/// outlives it; nothing is cached past its life.
#[pyclass(frozen, name = "PreparedCall", module = "kda_dhu._core")]
struct PyPrepared {
    call: launch::Prepared,
    plan: plan::Plan,
    /// q and dv (the outputs are allocated like them), then every other input.
    inputs: Vec<Py<PyAny>>,
}

/// dh in q's dtype, dh0 float32, dv2 in dv's dtype, on the inputs' device, through torch
/// (`new_empty`: the caching allocator, torch's current device of the inputs).
/// (dh, dh0 or None, dv2) as Python objects.
type PyOutputs<'py> = (Bound<'py, PyAny>, Option<Bound<'py, PyAny>>, Bound<'py, PyAny>);
/// (dh shape, dh0 shape or None, dv2 shape).
type ShapeTuple = ([i64; 5], Option<[i64; 4]>, [i64; 4]);

fn alloc_outputs<'py>(
    py: Python<'py>,
    q: &Bound<'py, PyAny>,
    dv: &Bound<'py, PyAny>,
    shapes: &validate::OutShapes,
) -> PyResult<PyOutputs<'py>> {
    let new_empty = pyo3::intern!(py, "new_empty");
    let dh = q.call_method1(new_empty, (shapes.dh,))?;
    let dh0 = match shapes.dh0 {
        Some(s) => Some(q.call_method(new_empty, (s,), Some(&float32_kwargs(py)?))?),
        None => None,
    };
    let dv2 = dv.call_method1(new_empty, (shapes.dv2,))?;
    Ok((dh, dh0, dv2))
}

/// The one-crossing launch: allocate, launch on torch's current stream of the inputs'
/// device, return (dh, dh0 or None, dv2). None where the call is not for this path (see
/// `py_run`).
fn run_prepared<'py>(
    py: Python<'py>,
    call: &launch::Prepared,
    plan: &plan::Plan,
    q: &Bound<'py, PyAny>,
    dv: &Bound<'py, PyAny>,
) -> PyResult<Option<Bound<'py, pyo3::types::PyTuple>>> {
    if !plan.runs_in_one_crossing() || !call.desc.copies().is_empty() || env::check_inputs() {
        return Ok(None);
    }
    let Some(shapes) = call.desc.out_shapes().filter(|s| s.dh[1] > 0) else { return Ok(None) };
    let (dh, dh0, dv2) = alloc_outputs(py, q, dv, &shapes)?;
    let stream = current_stream(py, call.desc.device.unwrap_or(0))?;
    let launched = guard(|| {
        let o = outputs(&dh, dh0.as_ref(), &dv2)?;
        match call.launch(&o, stream) {
            // The device turned out unable to run the image at launch: the general path
            // now plans the call as a fallback (and says why).
            Err(Error::Unavailable { .. }) => Ok(false),
            r => r.map(|()| true),
        }
    })?;
    if !launched {
        return Ok(None);
    }
    let dh0 = dh0.unwrap_or_else(|| py.None().into_bound(py));
    Ok(Some(pyo3::types::PyTuple::new(py, [dh, dh0, dv2])?))
}

#[pymethods]
impl PyPrepared {
    /// (True, "kernel-sm90a") or (False, the first failing clause).
    #[getter]
    fn verdict(&self) -> (bool, String) {
        self.plan.describe()
    }

    /// The plan of this call under another rule: (True, "kernel-sm90a") or (False, reason).
    fn replan(&self, rule: &str) -> PyResult<(bool, String)> {
        guard(|| Ok(self.call.replan(parse_rule(rule)?).describe()))
    }

    /// Names of the inputs that are not packed (contiguous, 16-byte aligned where the
    /// kernel needs it) and must be copied before the kernel or fla's function reads them.
    #[getter]
    fn copies(&self) -> Vec<&'static str> {
        self.call.desc.copies()
    }

    /// dh's NT (chunks per batch row, or of the packed batch), or None while unknown on
    /// the host (a packed batch without chunk_indices).
    #[getter]
    fn nt(&self) -> Option<i64> {
        self.call.desc.nt
    }

    /// (dh shape, dh0 shape or None, dv2 shape), or None while NT is unknown.
    fn out_shapes(&self) -> Option<ShapeTuple> {
        self.call.desc.out_shapes().map(|s| (s.dh, s.dh0, s.dv2))
    }

    /// Launches the kernel on `stream` writing dh, dh0 and dv2 (allocated by the caller);
    /// only the outputs are read. Raises ValueError when the "capable" plan is a
    /// fallback. Does not synchronize.
    #[pyo3(signature = (dh, dh0, dv2, stream))]
    fn launch(
        &self,
        dh: &Bound<'_, PyAny>,
        dh0: Option<&Bound<'_, PyAny>>,
        dv2: &Bound<'_, PyAny>,
        stream: u64,
    ) -> PyResult<()> {
        guard(|| {
            let o = outputs(dh, dh0, dv2)?;
            self.call.launch(&o, stream)
        })
    }

    /// Allocates the outputs and launches on torch's current stream, in this one call:
    /// (dh, dh0 or None, dv2), or None where the call must take the general path (the plan
    /// is not the verified sm_90a kernel, an input needs a copy, NT is unknown or 0, or
    /// KDA_DHU_CHECK_INPUTS is set).
    fn run<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, pyo3::types::PyTuple>>> {
        let q = self.inputs[0].bind(py);
        let dv = self.inputs[1].bind(py);
        run_prepared(py, &self.call, &self.plan, q, dv)
    }

    fn __repr__(&self) -> String {
        let d = &self.call.desc.dims;
        format!(
            "PreparedCall(B={}, T={}, H={}, HV={}, K={}, V={}, N={}, NT={:?}, {}, cuda:{}, {})",
            d.b,
            d.t,
            d.h,
            d.hv,
            d.k,
            d.v,
            d.n,
            self.call.desc.nt,
            self.call.desc.qk_dtype,
            self.call.desc.device.unwrap_or(-1),
            self.plan
        )
    }
}

/// Reads, validates (device included) and plans a call under `rule` ("b2a", "extended" or
/// "capable"): (ok, reason, PreparedCall). Raises TypeError / ValueError naming the
/// argument for input that neither the kernel nor fla takes, and first raises a bad
/// packed batch that a kernel on that device found since the last call. `nt`: dh's NT
/// of a packed batch when known without chunk_indices. Does not synchronize.
#[pyfunction]
#[pyo3(name = "prepare", signature = (rule, q, k, w, r#do, dv, g=None, gk=None, h0=None, dht=None, scale=None, state_v_first=NOT_PASSED, cu_seqlens=None, chunk_size=NOT_PASSED, chunk_indices=None, chunk_offsets=None, nt=None))]
#[allow(clippy::too_many_arguments)]
fn py_prepare<'py>(
    py: Python<'py>,
    rule: &str,
    q: &Bound<'py, PyAny>,
    k: &Bound<'py, PyAny>,
    w: &Bound<'py, PyAny>,
    r#do: &Bound<'py, PyAny>,
    dv: &Bound<'py, PyAny>,
    g: Option<&Bound<'py, PyAny>>,
    gk: Option<&Bound<'py, PyAny>>,
    h0: Option<&Bound<'py, PyAny>>,
    dht: Option<&Bound<'py, PyAny>>,
    scale: Option<&Bound<'py, PyAny>>,
    state_v_first: Arg<'py>,
    cu_seqlens: Option<&Bound<'py, PyAny>>,
    chunk_size: Arg<'py>,
    chunk_indices: Option<&Bound<'py, PyAny>>,
    chunk_offsets: Option<&Bound<'py, PyAny>>,
    nt: Option<i64>,
) -> PyResult<(bool, String, Bound<'py, PyPrepared>)> {
    let (call, plan) = guard(|| {
        let rule = parse_rule(rule)?;
        let a = call_args(
            q,
            k,
            w,
            r#do,
            dv,
            g,
            gk,
            h0,
            dht,
            scale,
            &state_v_first,
            cu_seqlens,
            &chunk_size,
            chunk_indices,
            chunk_offsets,
            nt,
        )?;
        launch::Prepared::new(a, rule)
    })?;
    let (ok, reason) = plan.describe();
    let inputs =
        [Some(q), Some(dv), Some(k), Some(w), Some(r#do), g, gk, h0, dht, cu_seqlens, chunk_indices, chunk_offsets]
            .into_iter()
            .flatten()
            .filter(|o| !o.is_none())
            .map(|o| o.clone().unbind())
            .collect();
    let call = Bound::new(py, PyPrepared { call, plan, inputs })?;
    Ok((ok, reason, call))
}

/// The outputs through DLPack.
fn outputs(dh: &Bound<'_, PyAny>, dh0: Option<&Bound<'_, PyAny>>, dv2: &Bound<'_, PyAny>) -> error::Result<Outputs> {
    Ok(Outputs {
        dh: TensorMeta::from_py(dh, "dh")?,
        dh0: TensorMeta::from_py_opt(dh0, "dh0")?,
        dv2: TensorMeta::from_py(dv2, "dv2")?,
    })
}

/// Launches the kernel on `stream` (torch.cuda.current_stream(device).cuda_stream)
/// writing dh, dh0 and dv2 (allocated by the caller). Reads and validates everything
/// (`prepare` + `PreparedCall.launch` read the inputs once); raises
/// ValueError when the "capable" plan is a fallback (the kernel cannot compute the call).
/// Does not synchronize.
#[pyfunction]
#[pyo3(name = "launch", signature = (q, k, w, r#do, dv, g, gk, h0, dht, scale, state_v_first, cu_seqlens, chunk_size, chunk_indices, chunk_offsets, dh, dh0, dv2, stream))]
#[allow(clippy::too_many_arguments)]
fn py_launch(
    q: &Bound<'_, PyAny>,
    k: &Bound<'_, PyAny>,
    w: &Bound<'_, PyAny>,
    r#do: &Bound<'_, PyAny>,
    dv: &Bound<'_, PyAny>,
    g: Option<&Bound<'_, PyAny>>,
    gk: Option<&Bound<'_, PyAny>>,
    h0: Option<&Bound<'_, PyAny>>,
    dht: Option<&Bound<'_, PyAny>>,
    scale: Option<&Bound<'_, PyAny>>,
    state_v_first: Arg<'_>,
    cu_seqlens: Option<&Bound<'_, PyAny>>,
    chunk_size: Arg<'_>,
    chunk_indices: Option<&Bound<'_, PyAny>>,
    chunk_offsets: Option<&Bound<'_, PyAny>>,
    dh: &Bound<'_, PyAny>,
    dh0: Option<&Bound<'_, PyAny>>,
    dv2: &Bound<'_, PyAny>,
    stream: u64,
) -> PyResult<()> {
    guard(|| {
        let a = call_args(
            q,
            k,
            w,
            r#do,
            dv,
            g,
            gk,
            h0,
            dht,
            scale,
            &state_v_first,
            cu_seqlens,
            &chunk_size,
            chunk_indices,
            chunk_offsets,
            None,
        )?;
        let o = outputs(dh, dh0, dv2)?;
        launch::launch(&a, &o, stream)
    })
}

/// `new_empty`'s keyword arguments for dh0, {"dtype": torch.float32}: a new dict each
/// call (torch hands the dict itself to a TorchFunctionMode, which may change it).
fn float32_kwargs(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyDict>> {
    static F32: pyo3::sync::PyOnceLock<Py<PyAny>> = pyo3::sync::PyOnceLock::new();
    let f32 = F32.get_or_try_init(py, || -> PyResult<_> { Ok(py.import("torch")?.getattr("float32")?.unbind()) })?;
    let d = pyo3::types::PyDict::new(py);
    d.set_item(pyo3::intern!(py, "dtype"), f32.bind(py))?;
    Ok(d)
}

/// torch's current CUDA stream of `ordinal` (the exchange API's, else torch.cuda's).
fn current_stream(py: Python<'_>, ordinal: i32) -> PyResult<u64> {
    if let Some(s) = tensor::current_cuda_stream(py, ordinal) {
        return Ok(s);
    }
    py.import("torch")?.getattr("cuda")?.call_method1("current_stream", (ordinal,))?.getattr("cuda_stream")?.extract()
}

/// One call, kernel path only, in one crossing: reads, validates and plans the call as
/// `prepare` does, and where the plan under `rule` is the verified sm_90a kernel with
/// every input packed and NT known, allocates dh, dh0 and dv2 with torch and launches on
/// torch's current stream of the inputs' device. Returns (dh, dh0 or None, dv2), or None
/// where the caller must take the general path (a fallback or another architecture, an
/// input to copy, a packed batch without chunk_indices, KDA_DHU_FORCE or
/// KDA_DHU_CHECK_INPUTS set, a tensor argument that is not a plain torch.Tensor, or
/// q in host memory: the CPU path).
/// Raises as `prepare` for invalid input. Does not synchronize.
#[pyfunction]
#[pyo3(name = "run", signature = (rule, q, k, w, r#do, dv, g=None, gk=None, h0=None, dht=None, scale=None, state_v_first=NOT_PASSED, cu_seqlens=None, chunk_size=NOT_PASSED, chunk_indices=None, chunk_offsets=None))]
#[allow(clippy::too_many_arguments)]
fn py_run<'py>(
    py: Python<'py>,
    rule: &str,
    q: &Bound<'py, PyAny>,
    k: &Bound<'py, PyAny>,
    w: &Bound<'py, PyAny>,
    r#do: &Bound<'py, PyAny>,
    dv: &Bound<'py, PyAny>,
    g: Option<&Bound<'py, PyAny>>,
    gk: Option<&Bound<'py, PyAny>>,
    h0: Option<&Bound<'py, PyAny>>,
    dht: Option<&Bound<'py, PyAny>>,
    scale: Option<&Bound<'py, PyAny>>,
    state_v_first: Arg<'py>,
    cu_seqlens: Option<&Bound<'py, PyAny>>,
    chunk_size: Arg<'py>,
    chunk_indices: Option<&Bound<'py, PyAny>>,
    chunk_offsets: Option<&Bound<'py, PyAny>>,
) -> PyResult<Option<Bound<'py, pyo3::types::PyTuple>>> {
    // Plain torch tensors only, checked before anything is read: another object (a
    // subclass, an array of another library) is read through its own __dlpack__, which
    // the general path calls under the inputs' device (torch exports only from the
    // current one), and the outputs are allocated with q's and dv's methods.
    let plain = |t: Option<&Bound<'py, PyAny>>| t.is_none_or(|t| t.is_none() || tensor::is_plain_tensor(t));
    let tensors =
        [Some(q), Some(k), Some(w), Some(r#do), Some(dv), g, gk, h0, dht, cu_seqlens, chunk_indices, chunk_offsets];
    if !tensors.into_iter().all(plain) || env::force().map_or(true, |f| f.is_some()) {
        return Ok(None);
    }
    let (call, plan) = guard(|| {
        let rule = parse_rule(rule)?;
        let a = call_args(
            q,
            k,
            w,
            r#do,
            dv,
            g,
            gk,
            h0,
            dht,
            scale,
            &state_v_first,
            cu_seqlens,
            &chunk_size,
            chunk_indices,
            chunk_offsets,
            None,
        )?;
        if a.q.device.is_host() {
            validate::validate(&a, false)?; // bad input named here, as on the GPU
            return Ok(None); // the CPU path (the general path routes it)
        }
        launch::Prepared::new(a, rule).map(Some)
    })?
    .map_or((None, None), |(c, p)| (Some(c), Some(p)));
    match (call, plan) {
        (Some(call), Some(plan)) => run_prepared(py, &call, &plan, q, dv),
        _ => Ok(None),
    }
}

/// Checks a packed batch's tables on the host (`src/varlen.rs`, the one checker): cu_seqlens
/// [N + 1] of T tokens, chunk_offsets [N + 1] when given, against dh's `nt` rows when given.
/// Returns the chunk offsets [N + 1]; raises ValueError naming the argument.
#[pyfunction]
#[pyo3(signature = (cu_seqlens, t, chunk_offsets=None, nt=None))]
fn check_tables(cu_seqlens: Vec<i64>, t: i64, chunk_offsets: Option<Vec<i64>>, nt: Option<i64>) -> PyResult<Vec<i64>> {
    guard(|| varlen::check_tables(&cu_seqlens, t, chunk_offsets.as_deref(), nt))
}

/// Raises (ValueError naming the argument) a bad packed batch that a kernel on cuda:`ordinal`
/// found since the last look, once. Does not synchronize.
#[pyfunction]
fn check_input_errors(ordinal: i32) -> PyResult<()> {
    guard(|| launch::check_input_errors(ordinal))
}

/// KDA_DHU_FORCE: None, "kernel" or "fla"; raises ValueError for another value.
#[pyfunction]
fn force() -> PyResult<Option<&'static str>> {
    guard(|| {
        Ok(env::force()?.map(|f| match f {
            env::Force::Kernel => "kernel",
            env::Force::Fla => "fla",
        }))
    })
}

/// Kernel launches of this process so far (every route), for tests and benchmarks.
/// The kernels' numbers (cuda/dhu_layout.h, their one owner): {"BT", "BV", "WG_THREADS",
/// "SMEM_OPTIN_MAX_SM90": int, "sm90" / "sm90_regstate" / "sm100": [{"k", "nwg",
/// "stages", "threads", "smem_bytes"}, ...]}.
#[pyfunction]
fn kernel_facts(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyDict>> {
    let d = pyo3::types::PyDict::new(py);
    d.set_item("BT", facts::BT)?;
    d.set_item("BV", facts::BV)?;
    d.set_item("WG_THREADS", facts::WG_THREADS)?;
    d.set_item("SMEM_OPTIN_MAX_SM90", facts::SMEM_OPTIN_MAX_SM90)?;
    for (name, table) in
        [("sm90", &facts::SM90[..]), ("sm90_regstate", &facts::SM90_REGSTATE[..]), ("sm100", &facts::SM100[..])]
    {
        let rows = pyo3::types::PyList::empty(py);
        for l in table {
            let r = pyo3::types::PyDict::new(py);
            r.set_item("k", l.k)?;
            r.set_item("nwg", l.nwg)?;
            r.set_item("stages", l.stages)?;
            r.set_item("threads", l.threads)?;
            r.set_item("smem_bytes", l.smem_bytes)?;
            rows.append(r)?;
        }
        d.set_item(name, rows)?;
    }
    Ok(d)
}

/// The op's arguments in fla's order, (name, default's Python repr or None for a required
/// one): the one description the entry points are checked against.
#[pyfunction]
fn op_arguments() -> Vec<(&'static str, Option<&'static str>)> {
    validate::ARGUMENTS.to_vec()
}

/// The names of the switches read at each call (they change what a call runs), in
/// `switches()`'s order; the others are read once per process or device.
#[pyfunction]
fn per_call_switches() -> Vec<&'static str> {
    env::PER_CALL.to_vec()
}

#[pyfunction]
fn launch_count() -> u64 {
    launch::launch_count()
}

/// The value of the environment switch `name` (trimmed, lower-cased; None when unset: absent,
/// "", "0" or "auto"). ValueError for a name that is not one of kda-dhu's switches.
#[pyfunction]
fn switch(name: &str) -> PyResult<Option<String>> {
    guard(|| {
        if !env::SWITCHES.iter().any(|&(n, _)| n == name) {
            return Err(Error::value("name", format!("expected one of kda-dhu's switches (src/env.rs), got {name:?}")));
        }
        Ok(env::value(name))
    })
}

/// The Extended rule's measured clauses on cuda:`ordinal`:
/// [(name, when, measured on, record, what it means on this GPU)].
/// (name, when, measured on, record, note) of one measured clause.
type PolicyRow = (&'static str, &'static str, &'static str, &'static str, String);

#[pyfunction]
fn policy(ordinal: i32) -> PyResult<Vec<PolicyRow>> {
    guard(|| {
        let dev = launch::device_info(ordinal)?;
        Ok(plan::policy_notes(&dev)
            .into_iter()
            .map(|(c, note)| (c.name, c.when, c.measured_on, c.record, note))
            .collect())
    })
}

/// Every environment switch: [(name, meaning, current value or None)].
#[pyfunction]
fn switches() -> Vec<(&'static str, &'static str, Option<String>)> {
    env::SWITCHES.iter().map(|&(name, meaning)| (name, meaning, env::value(name))).collect()
}

/// How torch tensors are read: "exchange" (DLPack's C exchange API, torch >= 2.10),
/// "capsule" (torch.utils.dlpack.to_dlpack; KDA_DHU_NO_EXCHANGE_API=1 forces it), or
/// "none" while torch is not imported.
#[pyfunction]
fn dlpack_intake(py: Python<'_>) -> &'static str {
    tensor::intake(py)
}

/// The TMA descriptor cache: {"hits", "misses", "evictions", "size", "capacity"}.
#[pyfunction]
fn tma_cache_info(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyDict>> {
    let (stats, size, capacity) = tma::cache_info();
    let d = pyo3::types::PyDict::new(py);
    d.set_item("hits", stats.hits)?;
    d.set_item("misses", stats.misses)?;
    d.set_item("evictions", stats.evictions)?;
    d.set_item("size", size)?;
    d.set_item("capacity", capacity)?;
    Ok(d)
}

/// Empties the TMA descriptor cache and zeroes its counters.
#[pyfunction]
fn tma_cache_clear() {
    tma::cache_clear()
}

/// (usable, description): whether libcuda loads and initializes, and the devices.
#[pyfunction]
fn cuda_status() -> PyResult<(bool, String)> {
    guard(|| Ok(launch::cuda_status()))
}

/// "sm_90" for CUDA device `ordinal`.
#[pyfunction]
fn device_arch(ordinal: i32) -> PyResult<String> {
    guard(|| launch::device_arch(ordinal))
}

/// The compilers (nvcc, NVRTC 12) and their flags, the CUTLASS path and ptxas's
/// per-kernel summary of every image, from the build.
#[pyfunction]
fn build_info() -> String {
    kernels::BUILD_INFO.to_string()
}

/// [(file stem, SASS arch, image)] of the embedded cubins, e.g. ("dhu_sm90", "sm_90a", "cuda12").
#[pyfunction]
fn embedded_kernels() -> Vec<(String, String, String)> {
    kernels::EMBEDDED.iter().map(|c| (c.stem.to_string(), c.arch.to_string(), format!("cuda{}", c.cuda))).collect()
}

/// Why CUDA device `ordinal` cannot run kda-dhu's kernels (a message starting with
/// UNAVAILABLE_PREFIX, naming the GPU, the driver and what is needed), or None when it
/// can. The first call per device loads its kernel image; the answer is kept for the
/// process. Raises RuntimeError without a driver, ValueError for a bad ordinal.
#[pyfunction]
fn kernel_unavailable(ordinal: i32) -> PyResult<Option<String>> {
    guard(|| launch::unavailable(ordinal))
}

/// The image CUDA device `ordinal` runs its kernels from, e.g. "dhu_sm90 sm_90a, CUDA 12
/// image" (KDA_DHU_IMAGE selects it), loading it as `kernel_unavailable` does; None
/// where the device cannot run them. Raises as `kernel_unavailable`.
#[pyfunction]
fn kernel_image(ordinal: i32) -> PyResult<Option<String>> {
    guard(|| launch::kernel_image(ordinal))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(py_validate, m)?)?;
    m.add_function(wrap_pyfunction!(py_prepare, m)?)?;
    m.add_function(wrap_pyfunction!(check_tables, m)?)?;
    m.add_function(wrap_pyfunction!(check_input_errors, m)?)?;
    m.add_function(wrap_pyfunction!(force, m)?)?;
    m.add_function(wrap_pyfunction!(switches, m)?)?;
    m.add_function(wrap_pyfunction!(switch, m)?)?;
    m.add_function(wrap_pyfunction!(policy, m)?)?;
    m.add_function(wrap_pyfunction!(launch_count, m)?)?;
    m.add_function(wrap_pyfunction!(kernel_facts, m)?)?;
    m.add_function(wrap_pyfunction!(per_call_switches, m)?)?;
    m.add_function(wrap_pyfunction!(op_arguments, m)?)?;
    // Tokens per chunk of every kernel (fla's BT on the kernel path) and the V tile.
    m.add("BT", facts::BT)?;
    m.add("BV", facts::BV)?;
    m.add_function(wrap_pyfunction!(py_launch, m)?)?;
    m.add_function(wrap_pyfunction!(py_run, m)?)?;
    m.add_function(wrap_pyfunction!(dlpack_intake, m)?)?;
    m.add_class::<PyPrepared>()?;
    m.add_function(wrap_pyfunction!(tma_cache_info, m)?)?;
    m.add_function(wrap_pyfunction!(tma_cache_clear, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_status, m)?)?;
    m.add_function(wrap_pyfunction!(device_arch, m)?)?;
    m.add_function(wrap_pyfunction!(build_info, m)?)?;
    m.add_function(wrap_pyfunction!(embedded_kernels, m)?)?;
    m.add_function(wrap_pyfunction!(kernel_unavailable, m)?)?;
    m.add_function(wrap_pyfunction!(kernel_image, m)?)?;
    m.add("KernelUnavailableError", m.py().get_type::<KernelUnavailableError>())?;
    m.add("UNAVAILABLE_PREFIX", error::UNAVAILABLE_PREFIX)?;
    m.add_function(wrap_pyfunction!(py_cpu::py_cpu_bwd_dhu, m)?)?;
    m.add("MIN_CTAS_EXTENDED", plan::MIN_CTAS_EXTENDED)?;
    m.add("MIN_CTAS_B2A", plan::MIN_CTAS_B2A)?;
    m.add("TMA_CACHE_CAPACITY", tma::TMA_CACHE_CAPACITY)?;
    Ok(())
}
