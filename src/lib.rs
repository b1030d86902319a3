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
pub mod decide;
pub mod driver;
pub mod env;
pub mod error;
pub mod facts;
pub mod forward;
pub mod kernels;
pub mod launch;
pub mod plan;
#[cfg(test)]
mod ptxas;
mod py_cpu;
pub mod split;
pub mod tensor;
pub mod tma;
pub mod validate;
pub mod varlen;

use error::{Error, PyKind};
use plan::{Plan, Rule};
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
    flag_arg(arg, "state_v_first", false)
}

/// A bool argument `name` (Python's or numpy's). Not passed or None: `default`.
fn flag_arg(arg: &Arg<'_>, name: &'static str, default: bool) -> error::Result<bool> {
    let Some(o) = arg.0.as_ref().filter(|o| !o.is_none()) else { return Ok(default) };
    o.extract::<bool>().map_err(|_| Error::type_(name, format!("expected a bool, got {}", py_type_name(o))))
}
/// fla's arguments of one call as Python objects, in the order of `validate::ARGUMENTS`
/// (use_graph, which changes only where the outputs live, apart): what `op_pyfunction!`
/// hands every entry point.
pub(crate) struct OpObjects<'a, 'py> {
    pub q: &'a Bound<'py, PyAny>,
    pub k: &'a Bound<'py, PyAny>,
    pub w: &'a Bound<'py, PyAny>,
    pub do_: &'a Bound<'py, PyAny>,
    pub dv: &'a Bound<'py, PyAny>,
    pub g: Option<&'a Bound<'py, PyAny>>,
    pub gk: Option<&'a Bound<'py, PyAny>>,
    pub h0: Option<&'a Bound<'py, PyAny>>,
    pub dht: Option<&'a Bound<'py, PyAny>>,
    pub scale: Option<&'a Bound<'py, PyAny>>,
    pub state_v_first: &'a Arg<'py>,
    pub cu_seqlens: Option<&'a Bound<'py, PyAny>>,
    pub chunk_size: &'a Arg<'py>,
    pub chunk_indices: Option<&'a Bound<'py, PyAny>>,
    pub chunk_offsets: Option<&'a Bound<'py, PyAny>>,
}

/// A `#[pyfunction]` taking fla's arguments of the op (`validate::ARGUMENTS`, use_graph
/// aside) after its own leading parameters and before its trailing ones: the one place
/// that spells them as PyO3 parameters. The body sees them as `$op: OpObjects`.
/// `tests/unit/test_op_arguments.py` checks each compiled signature against ARGUMENTS.
macro_rules! op_pyfunction {
    (
        $(#[doc = $doc:literal])*
        #[name = $py_name:literal]
        fn $name:ident<$lt:lifetime>($py:ident $(, $lead:ident: $lead_ty:ty)* ; $op:ident $(; $($tail:ident: $tail_ty:ty),*)?)
            signature_tail($($sig:tt)*) -> $ret:ty $body:block
    ) => {
        $(#[doc = $doc])*
        #[pyfunction]
        #[pyo3(name = $py_name, signature = ($($lead,)* q, k, w, r#do, dv, g=None, gk=None, h0=None, dht=None, scale=None, state_v_first=NOT_PASSED, cu_seqlens=None, chunk_size=NOT_PASSED, chunk_indices=None, chunk_offsets=None $($sig)*))]
        #[allow(clippy::too_many_arguments)]
        pub(crate) fn $name<$lt>(
            $py: Python<$lt>,
            $($lead: $lead_ty,)*
            q: &Bound<$lt, PyAny>,
            k: &Bound<$lt, PyAny>,
            w: &Bound<$lt, PyAny>,
            r#do: &Bound<$lt, PyAny>,
            dv: &Bound<$lt, PyAny>,
            g: Option<&Bound<$lt, PyAny>>,
            gk: Option<&Bound<$lt, PyAny>>,
            h0: Option<&Bound<$lt, PyAny>>,
            dht: Option<&Bound<$lt, PyAny>>,
            scale: Option<&Bound<$lt, PyAny>>,
            state_v_first: $crate::Arg<$lt>,
            cu_seqlens: Option<&Bound<$lt, PyAny>>,
            chunk_size: $crate::Arg<$lt>,
            chunk_indices: Option<&Bound<$lt, PyAny>>,
            chunk_offsets: Option<&Bound<$lt, PyAny>>,
            $($($tail: $tail_ty),*)?
        ) -> $ret {
            let $op = $crate::OpObjects {
                q, k, w, do_: r#do, dv, g, gk, h0, dht, scale,
                state_v_first: &state_v_first, cu_seqlens, chunk_size: &chunk_size, chunk_indices, chunk_offsets,
            };
            let _ = &$py;
            $body
        }
    };
}
pub(crate) use op_pyfunction;

impl<'py> OpObjects<'_, 'py> {
    /// The call read through DLPack. `nt`: dh's chunk count of a packed batch when the
    /// caller knows it without chunk_indices.
    pub fn args(&self, nt: Option<i64>) -> error::Result<CallArgs> {
        // Scalars first: a bad scalar is reported even when the tensors are fine.
        let scale = scale_arg(self.scale)?;
        let state_v_first = state_v_first_arg(self.state_v_first)?;
        let chunk_size = chunk_size_arg(self.chunk_size)?;
        // fla ignores chunk_indices and chunk_offsets without cu_seqlens; so do we (not read).
        let varlen = self.cu_seqlens.is_some_and(|c| !c.is_none());
        Ok(CallArgs {
            q: TensorMeta::from_py(self.q, "q")?,
            k: TensorMeta::from_py(self.k, "k")?,
            w: TensorMeta::from_py(self.w, "w")?,
            do_: TensorMeta::from_py(self.do_, "do")?,
            dv: TensorMeta::from_py(self.dv, "dv")?,
            g: TensorMeta::from_py_opt(self.g, "g")?,
            gk: TensorMeta::from_py_opt(self.gk, "gk")?,
            h0: TensorMeta::from_py_opt(self.h0, "h0")?,
            dht: TensorMeta::from_py_opt(self.dht, "dht")?,
            scale,
            state_v_first,
            cu_seqlens: TensorMeta::from_py_opt(self.cu_seqlens, "cu_seqlens")?,
            chunk_size,
            chunk_indices: if varlen { TensorMeta::from_py_opt(self.chunk_indices, "chunk_indices")? } else { None },
            chunk_offsets: if varlen { TensorMeta::from_py_opt(self.chunk_offsets, "chunk_offsets")? } else { None },
            nt: if varlen { nt } else { None },
        })
    }

    /// The tensor arguments (None where not passed).
    fn tensors(&self) -> [Option<&Bound<'py, PyAny>>; 12] {
        [
            Some(self.q),
            Some(self.k),
            Some(self.w),
            Some(self.do_),
            Some(self.dv),
            self.g,
            self.gk,
            self.h0,
            self.dht,
            self.cu_seqlens,
            self.chunk_indices,
            self.chunk_offsets,
        ]
    }

    /// Every tensor argument a plain torch.Tensor (or None). Another object (a subclass,
    /// an array of another library) is read through its own __dlpack__, which the Python
    /// layer calls under the inputs' device (torch exports only from the current one).
    fn all_plain(&self) -> bool {
        self.tensors().into_iter().all(|t| t.is_none_or(|t| t.is_none() || tensor::is_plain_tensor(t)))
    }

    /// The decision of the call under `rule` and `sw`: validated (device included; host
    /// inputs as the CPU path validates them), planned once.
    fn decide(&self, rule: &str, nt: Option<i64>, sw: decide::Switches) -> PyResult<PyCall> {
        let (decision, prepared) = guard(|| {
            let rule = parse_rule(rule)?;
            let a = self.args(nt)?;
            if a.q.device.is_host() {
                py_cpu::check_fla(&a)?;
                // What a launch of it would raise: the device check, naming the input.
                let not_on_device = validate::validate(&a, true).err();
                return Ok((decide::Decision::cpu(), Err(not_on_device)));
            }
            let (mut prepared, planned) = launch::Prepared::new(a, rule)?;
            let facts = decide::Facts {
                copies: prepared.desc.copies(),
                nt: prepared.desc.nt,
                varlen: prepared.desc.varlen(),
                unavailable: prepared.unavailable.clone(),
            };
            let decision = decide::Decision::on_device(facts, planned, || prepared.replan(Rule::Capable), sw)?;
            // What the launch runs: the decision's kernel (the capable plan's under
            // KDA_DHU_FORCE=kernel).
            if let Plan::Kernel { arch, config } = &decision.plan {
                prepared.kernel = Some((*arch, *config));
            }
            Ok((decision, Ok(prepared)))
        })?;
        let keep = |o: Option<&Bound<'py, PyAny>>| o.filter(|o| !o.is_none()).map(|o| o.clone().unbind());
        Ok(PyCall {
            decision,
            prepared,
            switches: sw,
            q: self.q.clone().unbind(),
            dv: self.dv.clone().unbind(),
            dht: keep(self.dht),
            inputs: self.tensors().into_iter().filter_map(keep).collect(),
        })
    }
}

op_pyfunction! {
    /// Validates a call like fla's `chunk_gated_delta_rule_bwd_dhu` would take it, without
    /// the device check (works on CPU tensors). Raises TypeError / ValueError; returns None.
    #[name = "validate"]
    fn py_validate<'py>(_py; op) signature_tail() -> PyResult<()> {
        guard(|| validate::validate(&op.args(None)?, false).map(|_| ()))
    }
}

fn parse_rule(rule: &str) -> error::Result<Rule> {
    Rule::parse(rule)
        .ok_or_else(|| Error::value("rule", format!("expected 'b2a', 'extended' or 'capable', got {rule:?}")))
}

/// One reading of the switches a call's decision depends on (`KDA_DHU_FORCE`,
/// `KDA_DHU_CHECK_INPUTS`): taken once per call and handed to every decision of it (the
/// fla registry's verifier takes it, its implementation reuses it).
#[pyclass(frozen, name = "Switches", module = "kda_dhu._core")]
struct PySwitches(decide::Switches);

#[pymethods]
impl PySwitches {
    /// The switches now; ValueError naming KDA_DHU_FORCE for a value that is not kernel / fla / unset.
    #[staticmethod]
    fn now() -> PyResult<PySwitches> {
        guard(decide::Switches::now).map(PySwitches)
    }

    /// Given values: force None, "kernel" or "fla".
    #[new]
    #[pyo3(signature = (force=None, check_inputs=false))]
    fn new(force: Option<&str>, check_inputs: bool) -> PyResult<PySwitches> {
        let force = match force {
            None => None,
            Some(f) => Some(env::Force::parse(f).ok_or_else(|| {
                to_pyerr(Error::value("force", format!("expected 'kernel', 'fla' or None, got {f:?}")))
            })?),
        };
        Ok(PySwitches(decide::Switches { force, check_inputs }))
    }

    /// None, "kernel" or "fla".
    #[getter]
    fn force(&self) -> Option<&'static str> {
        self.0.force.map(env::Force::name)
    }

    #[getter]
    fn check_inputs(&self) -> bool {
        self.0.check_inputs
    }

    fn __repr__(&self) -> String {
        format!("Switches(force={:?}, check_inputs={})", self.force(), self.0.check_inputs)
    }
}

fn switches_or_now(sw: Option<&Bound<'_, PySwitches>>) -> PyResult<decide::Switches> {
    match sw {
        Some(s) => Ok(s.get().0),
        None => guard(decide::Switches::now),
    }
}

/// One call, decided once (`decide`): what it runs (`action`), the plan and why, the
/// inputs to copy first, and for the kernel everything the launch needs but the outputs.
/// Holds the numbers of the call (addresses, extents) and references to the input
/// objects, so that their memory outlives it; nothing is cached past its life.
#[pyclass(frozen, name = "Call", module = "kda_dhu._core")]
struct PyCall {
    decision: decide::Decision,
    /// The validated call on its device; for host inputs, what the device check says
    /// of them (raised where a launch is asked for).
    prepared: std::result::Result<launch::Prepared, Option<Error>>,
    switches: decide::Switches,
    q: Py<PyAny>,
    dv: Py<PyAny>,
    dht: Option<Py<PyAny>>,
    /// Every tensor argument: held (not read), so that the memory behind the call's
    /// addresses lives as long as the call.
    #[allow(dead_code)]
    inputs: Vec<Py<PyAny>>,
}

/// (dh, dh0 or None, dv2) as Python objects.
type PyOutputs<'py> = (Bound<'py, PyAny>, Option<Bound<'py, PyAny>>, Bound<'py, PyAny>);
/// (dh shape, dh0 shape or None, dv2 shape).
type ShapeTuple = ([i64; 5], Option<[i64; 4]>, [i64; 4]);

/// How `alloc_outputs` allocates.
#[derive(Clone, Copy, Default)]
struct AllocHow {
    /// fla's static buffers for CUDA-graph capture (`fla.ops.utils.graph`, fla's names).
    use_graph: bool,
    /// Outputs filled with NaN (tests: an element the kernel does not write stays NaN).
    poison: bool,
    /// No chunks to walk: dh0 = dht in float32 (zeros without dht), dv2 zeros.
    empty: bool,
}

/// The one allocator of the outputs: dh in q's dtype, dh0 float32, dv2 in dv's dtype, on
/// q's device, through torch (its caching allocator: `new_empty` for plain tensors,
/// `torch.empty` for others), or fla's static buffers under use_graph.
fn alloc_outputs<'py>(
    py: Python<'py>,
    q: &Bound<'py, PyAny>,
    dv: &Bound<'py, PyAny>,
    dht: Option<&Bound<'py, PyAny>>,
    desc: &validate::CallDesc,
    how: AllocHow,
) -> PyResult<PyOutputs<'py>> {
    let Some(shapes) = desc.out_shapes() else {
        return Err(to_pyerr(Error::Internal("outputs allocated before the chunk count is known".into())));
    };
    let plain = tensor::is_plain_tensor(q) && tensor::is_plain_tensor(dv);
    let (dh, dh0, dv2) = if plain && !how.use_graph && !how.empty {
        let new_empty = pyo3::intern!(py, "new_empty");
        let dh = q.call_method1(new_empty, (shapes.dh,))?;
        let dh0 = match shapes.dh0 {
            Some(s) => Some(q.call_method(new_empty, (s,), Some(&float32_kwargs(py)?))?),
            None => None,
        };
        (dh, dh0, dv.call_method1(new_empty, (shapes.dv2,))?)
    } else {
        let torch = py.import("torch")?;
        let f32 = torch.getattr("float32")?;
        let device = q.getattr("device")?;
        let (q_dtype, dv_dtype) = (q.getattr("dtype")?, dv.getattr("dtype")?);
        let kw = |dtype: &Bound<'py, PyAny>| -> PyResult<Bound<'py, pyo3::types::PyDict>> {
            let d = pyo3::types::PyDict::new(py);
            d.set_item("dtype", dtype)?;
            d.set_item("device", &device)?;
            Ok(d)
        };
        if how.use_graph {
            let get = py.import("fla.ops.utils.graph")?.getattr("get_static_buffer")?;
            let dh_name = if desc.state_v_first { "dhu_dh_vf" } else { "dhu_dh" };
            let buf = |name: &str, shape: &[i64], dtype: &Bound<'py, PyAny>| {
                get.call1((name, pyo3::types::PyTuple::new(py, shape)?, dtype, &device))
            };
            let dh0 = match shapes.dh0 {
                Some(s) => Some(buf("dhu_dh0", &s, &f32)?),
                None => None,
            };
            (buf(dh_name, &shapes.dh, &q_dtype)?, dh0, buf("dhu_dv2", &shapes.dv2, &dv_dtype)?)
        } else {
            let fill = if how.empty { "zeros" } else { "empty" };
            let dh = torch.call_method("empty", (shapes.dh,), Some(&kw(&q_dtype)?))?;
            let dh0 = match (shapes.dh0, how.empty, dht) {
                (Some(_), true, Some(dht)) => Some(dht.call_method0("float")?.call_method0("clone")?),
                (Some(s), _, _) => Some(torch.call_method(fill, (s,), Some(&kw(&f32)?))?),
                (None, _, _) => None,
            };
            (dh, dh0, torch.call_method(fill, (shapes.dv2,), Some(&kw(&dv_dtype)?))?)
        }
    };
    if how.poison {
        let nan = f64::NAN;
        for out in [Some(&dh), dh0.as_ref(), Some(&dv2)].into_iter().flatten() {
            out.call_method1("fill_", (nan,))?;
        }
    }
    Ok((dh, dh0, dv2))
}

/// (dh, dh0 or None, dv2) as a tuple.
fn out_tuple<'py>(py: Python<'py>, (dh, dh0, dv2): PyOutputs<'py>) -> PyResult<Bound<'py, pyo3::types::PyTuple>> {
    let dh0 = dh0.unwrap_or_else(|| py.None().into_bound(py));
    pyo3::types::PyTuple::new(py, [dh, dh0, dv2])
}

impl PyCall {
    fn prepared(&self) -> PyResult<&launch::Prepared> {
        self.prepared.as_ref().map_err(|e| {
            let host = || Error::value("call", "expected a call on a CUDA device, got inputs in host memory");
            to_pyerr(e.clone().unwrap_or_else(host))
        })
    }

    /// Allocates and launches on torch's current stream of the inputs' device. Err(Unavailable)
    /// where the device turns out unable to run the image.
    fn alloc_and_launch<'py>(&self, py: Python<'py>, how: AllocHow) -> PyResult<Bound<'py, pyo3::types::PyTuple>> {
        let call = self.prepared()?;
        let (q, dv) = (self.q.bind(py), self.dv.bind(py));
        let outs = alloc_outputs(py, q, dv, None, &call.desc, how)?;
        let stream = current_stream(py, call.desc.device.unwrap_or(0))?;
        guard(|| call.launch(&outputs(&outs.0, outs.1.as_ref(), &outs.2)?, stream))?;
        out_tuple(py, outs)
    }
}

#[pymethods]
impl PyCall {
    /// What the call runs: "kernel", "fla", "copy" (copy `copies`, count the chunks if
    /// `count_chunks`, then decide again), "count" (count the chunks, then decide again),
    /// "cpu" or "empty".
    #[getter]
    fn action(&self) -> &'static str {
        self.decision.action.name()
    }

    /// (True, "kernel-sm90a") or (False, the first failing clause, or the switch).
    #[getter]
    fn verdict(&self) -> (bool, String) {
        self.decision.verdict()
    }

    /// The verdict's reason, naming the inputs copied first.
    #[getter]
    fn reason(&self) -> String {
        self.decision.reason()
    }

    /// The plan of this call under another rule: (True, "kernel-sm90a") or (False, reason).
    fn replan(&self, rule: &str) -> PyResult<(bool, String)> {
        let call = self.prepared()?;
        guard(|| Ok(call.replan(parse_rule(rule)?).describe()))
    }

    /// Names of the inputs that are not packed (contiguous, 16-byte aligned where the
    /// kernel needs it) and must be copied before the kernel or fla's function reads them.
    #[getter]
    fn copies(&self) -> Vec<&'static str> {
        self.decision.copies.clone()
    }

    /// A packed batch without chunk_indices: its chunk count is unknown on the host.
    #[getter]
    fn count_chunks(&self) -> bool {
        self.decision.count_chunks
    }

    /// KDA_DHU_CHECK_INPUTS on a packed batch: check its tables on the host first.
    #[getter]
    fn check_tables(&self) -> bool {
        self.decision.check_tables
    }

    /// Why the device cannot run the kernel image (warn once), or None.
    #[getter]
    fn unavailable(&self) -> Option<String> {
        self.decision.unavailable.clone()
    }

    /// The kernel runs under the sm_100a self-check.
    #[getter]
    fn guarded(&self) -> bool {
        self.decision.guarded()
    }

    /// Launching (`run`) is all that is left.
    #[getter]
    fn launch_only(&self) -> bool {
        self.decision.launch_only()
    }

    /// The switches this decision read.
    #[getter]
    fn switches(&self) -> PySwitches {
        PySwitches(self.switches)
    }

    /// dh's NT (chunks per batch row, or of the packed batch), or None while unknown on
    /// the host (a packed batch without chunk_indices) and for host inputs.
    #[getter]
    fn nt(&self) -> Option<i64> {
        self.prepared.as_ref().ok().and_then(|p| p.desc.nt)
    }

    /// (dh shape, dh0 shape or None, dv2 shape), or None while NT is unknown.
    fn out_shapes(&self) -> Option<ShapeTuple> {
        self.prepared.as_ref().ok()?.desc.out_shapes().map(|s| (s.dh, s.dh0, s.dv2))
    }

    /// Carries out a "kernel" decision (allocates the outputs, launches on torch's current
    /// stream; KernelUnavailableError where the device cannot run the image) or an
    /// "empty" one (the outputs, no launch): (dh, dh0 or None, dv2). `use_graph`: fla's
    /// static buffers; `poison`: outputs NaN-filled first (tests). ValueError for another
    /// action. Does not synchronize.
    #[pyo3(signature = (use_graph=false, poison=false))]
    fn run<'py>(&self, py: Python<'py>, use_graph: bool, poison: bool) -> PyResult<Bound<'py, pyo3::types::PyTuple>> {
        match self.decision.action {
            decide::Action::Kernel => self.alloc_and_launch(py, AllocHow { use_graph, poison, empty: false }),
            decide::Action::Empty => {
                let call = self.prepared()?;
                let dht = self.dht.as_ref().map(|d| d.bind(py).clone());
                let how = AllocHow { use_graph: false, poison: false, empty: true };
                out_tuple(py, alloc_outputs(py, self.q.bind(py), self.dv.bind(py), dht.as_ref(), &call.desc, how)?)
            }
            decide::Action::Cpu => {
                self.prepared()?; // the device check's error, naming the input
                Err(to_pyerr(Error::Internal("a call in host memory with a device".into())))
            }
            other => Err(to_pyerr(Error::value(
                "call",
                format!("expected a 'kernel' or 'empty' decision, got {:?}", other.name()),
            ))),
        }
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
        let call = self.prepared()?;
        guard(|| call.launch(&outputs(dh, dh0, dv2)?, stream))
    }

    fn __repr__(&self) -> String {
        let Ok(call) = &self.prepared else { return format!("Call({}, host)", self.decision.action.name()) };
        let d = &call.desc.dims;
        format!(
            "Call({}, B={}, T={}, H={}, HV={}, K={}, V={}, N={}, NT={:?}, {}, cuda:{}, {})",
            self.decision.action.name(),
            d.b,
            d.t,
            d.h,
            d.hv,
            d.k,
            d.v,
            d.n,
            call.desc.nt,
            call.desc.qk_dtype,
            call.desc.device.unwrap_or(-1),
            self.decision.reason()
        )
    }
}

op_pyfunction! {
    /// The decision of a call under `rule` ("b2a", "extended" or "capable") and `switches`
    /// (None: read now): reads and validates it (device included; host inputs as the CPU
    /// path does), plans it once. Raises TypeError / ValueError naming the argument for
    /// input that neither the kernel nor fla takes (and first a bad packed batch that a
    /// kernel on that device found since the last call), RuntimeError for
    /// KDA_DHU_FORCE=kernel on a call the kernel cannot compute. `nt`: dh's NT of a packed
    /// batch counted by the caller. Does not synchronize.
    #[name = "decide"]
    fn py_decide<'py>(py, rule: &str; op; nt: Option<i64>, switches: Option<&Bound<'py, PySwitches>>)
        signature_tail(, nt=None, switches=None) -> PyResult<PyCall> {
        op.decide(rule, nt, switches_or_now(switches)?)
    }
}

/// The outputs through DLPack.
fn outputs(dh: &Bound<'_, PyAny>, dh0: Option<&Bound<'_, PyAny>>, dv2: &Bound<'_, PyAny>) -> error::Result<Outputs> {
    Ok(Outputs {
        dh: TensorMeta::from_py(dh, "dh")?,
        dh0: TensorMeta::from_py_opt(dh0, "dh0")?,
        dv2: TensorMeta::from_py(dv2, "dv2")?,
    })
}

op_pyfunction! {
    /// Launches the kernel on `stream` (torch.cuda.current_stream(device).cuda_stream)
    /// writing dh, dh0 and dv2 (allocated by the caller; keyword arguments). Reads and validates everything
    /// (a `Call` reads the inputs once); raises ValueError when the "capable" plan is a
    /// fallback (the kernel cannot compute the call). Does not synchronize.
    #[name = "launch"]
    fn py_launch<'py>(_py; op; dh: &Bound<'py, PyAny>, dh0: Option<&Bound<'py, PyAny>>, dv2: &Bound<'py, PyAny>, stream: u64)
        signature_tail(, *, dh, dh0, dv2, stream) -> PyResult<()> {
        guard(|| launch::launch(&op.args(None)?, &outputs(dh, dh0, dv2)?, stream))
    }
}

op_pyfunction! {
    /// Tests only: the forward scan's kernel (fla's chunk_gated_delta_rule_fwd_h) on a
    /// stage-4 call that carries a forward call (`launch::launch_forward_probe`: k, w; dv = u;
    /// dht = initial_state; h0 given for final_state in dh0; outputs dh = h, dv2 = v_new; q
    /// and do read by validation only), planned as the forward op plans it (warpgroups,
    /// `KDA_DHU_SM90_SPLIT`). Raises as `launch`. Does not synchronize.
    #[name = "_fwd_h_probe"]
    fn py_fwd_h_probe<'py>(_py; op; dh: &Bound<'py, PyAny>, dh0: Option<&Bound<'py, PyAny>>, dv2: &Bound<'py, PyAny>, stream: u64)
        signature_tail(, *, dh, dh0, dv2, stream) -> PyResult<()> {
        guard(|| launch::launch_forward_probe(&op.args(None)?, &outputs(dh, dh0, dv2)?, stream))
    }
}

/// The forward call's arguments as Python objects (fla's `chunk_gated_delta_rule_fwd_h`,
/// `forward::ARGUMENTS`).
struct FwdObjects<'a, 'py> {
    k: &'a Bound<'py, PyAny>,
    w: &'a Bound<'py, PyAny>,
    u: &'a Bound<'py, PyAny>,
    g: Option<&'a Bound<'py, PyAny>>,
    gk: Option<&'a Bound<'py, PyAny>>,
    initial_state: Option<&'a Bound<'py, PyAny>>,
    output_final_state: &'a Arg<'py>,
    chunk_size: &'a Arg<'py>,
    save_new_value: &'a Arg<'py>,
    state_v_first: &'a Arg<'py>,
    cu_seqlens: Option<&'a Bound<'py, PyAny>>,
    chunk_indices: Option<&'a Bound<'py, PyAny>>,
    chunk_offsets: Option<&'a Bound<'py, PyAny>>,
}

impl FwdObjects<'_, '_> {
    fn args(&self) -> error::Result<forward::FwdArgs> {
        let output_final_state = flag_arg(self.output_final_state, "output_final_state", false)?;
        let save_new_value = flag_arg(self.save_new_value, "save_new_value", true)?;
        let state_v_first = state_v_first_arg(self.state_v_first)?;
        let chunk_size = chunk_size_arg(self.chunk_size)?;
        let varlen = self.cu_seqlens.is_some_and(|c| !c.is_none());
        Ok(forward::FwdArgs {
            k: TensorMeta::from_py(self.k, "k")?,
            w: TensorMeta::from_py(self.w, "w")?,
            u: TensorMeta::from_py(self.u, "u")?,
            g: TensorMeta::from_py_opt(self.g, "g")?,
            gk: TensorMeta::from_py_opt(self.gk, "gk")?,
            initial_state: TensorMeta::from_py_opt(self.initial_state, "initial_state")?,
            output_final_state,
            chunk_size,
            save_new_value,
            state_v_first,
            cu_seqlens: TensorMeta::from_py_opt(self.cu_seqlens, "cu_seqlens")?,
            chunk_indices: if varlen { TensorMeta::from_py_opt(self.chunk_indices, "chunk_indices")? } else { None },
            chunk_offsets: if varlen { TensorMeta::from_py_opt(self.chunk_offsets, "chunk_offsets")? } else { None },
        })
    }

    fn all_plain(&self) -> bool {
        [Some(self.k), Some(self.w), Some(self.u), self.g, self.gk, self.initial_state, self.cu_seqlens]
            .into_iter()
            .chain([self.chunk_indices, self.chunk_offsets])
            .all(|t| t.is_none_or(|t| t.is_none() || tensor::is_plain_tensor(t)))
    }
}

/// fla's forward scan on the kernel, in one crossing: the switches read, the call read
/// and validated (errors name the forward call's arguments), planned (`CallDesc::forward`),
/// and where the plan is the kernel, the outputs allocated with torch and the kernel
/// launched on torch's current stream of k's device: returns (h, v_new or None,
/// final_state or None) as fla does. Returns None where the call is fla's to run: a tensor
/// argument that is not a plain torch.Tensor or is in host memory, an input to copy first
/// (not packed), a 16-bit initial_state, a packed batch without chunk_indices, no chunks, KDA_DHU_FORCE=fla,
/// KDA_DHU_FWD_H off (`fwd_h_on`; KDA_DHU_FORCE=kernel wins over it),
/// KDA_DHU_CHECK_INPUTS=1 with a packed batch, the planner's fallback, a device that
/// cannot run the kernel image. Raises TypeError / ValueError naming the argument for
/// input neither takes (and first a bad packed batch that a kernel on that device found
/// since the last call), RuntimeError for KDA_DHU_FORCE=kernel where the kernel does not
/// run the call. Does not synchronize.
#[pyfunction]
#[pyo3(name = "fwd_h_run", signature = (k, w, u, g=None, gk=None, initial_state=None, output_final_state=NOT_PASSED, chunk_size=NOT_PASSED, save_new_value=NOT_PASSED, state_v_first=NOT_PASSED, cu_seqlens=None, cu_seqlens_cpu=None, chunk_indices=None, chunk_offsets=None))]
#[allow(clippy::too_many_arguments)]
fn py_fwd_h_run<'py>(
    py: Python<'py>,
    k: &Bound<'py, PyAny>,
    w: &Bound<'py, PyAny>,
    u: &Bound<'py, PyAny>,
    g: Option<&Bound<'py, PyAny>>,
    gk: Option<&Bound<'py, PyAny>>,
    initial_state: Option<&Bound<'py, PyAny>>,
    output_final_state: Arg<'py>,
    chunk_size: Arg<'py>,
    save_new_value: Arg<'py>,
    state_v_first: Arg<'py>,
    cu_seqlens: Option<&Bound<'py, PyAny>>,
    cu_seqlens_cpu: Option<&Bound<'py, PyAny>>,
    chunk_indices: Option<&Bound<'py, PyAny>>,
    chunk_offsets: Option<&Bound<'py, PyAny>>,
) -> PyResult<Option<Bound<'py, pyo3::types::PyTuple>>> {
    let _ = cu_seqlens_cpu; // a host copy of cu_seqlens: not read
    let objs = FwdObjects {
        k,
        w,
        u,
        g,
        gk,
        initial_state,
        output_final_state: &output_final_state,
        chunk_size: &chunk_size,
        save_new_value: &save_new_value,
        state_v_first: &state_v_first,
        cu_seqlens,
        chunk_indices,
        chunk_offsets,
    };
    if !objs.all_plain() {
        // Another library's arrays go to fla, but bad input is named on every route.
        guard(|| objs.args().and_then(|a| forward::validate(&a, false)).map(|_| ()))?;
        return Ok(None);
    }
    let sw = guard(decide::Switches::now)?;
    if sw.force == Some(env::Force::Fla) {
        return Ok(None);
    }
    let a = guard(|| objs.args())?;
    if a.k.device.is_host() {
        guard(|| forward::validate(&a, false).map(|_| ()))?; // bad input is named on every route
        return Ok(None);
    }
    if sw.force.is_none() && !guard(env::fwd_h)? {
        return Ok(None); // KDA_DHU_FWD_H off: fla's own forward scan
    }
    let (prepared, plan) = guard(|| launch::Prepared::new_forward(&a, Rule::Extended))?;
    let copies = prepared.desc.copies();
    let why_not: Option<String> = match &plan {
        Plan::Fallback { reason } => Some(reason.clone()),
        Plan::Kernel { .. } if !copies.is_empty() => {
            let names: Vec<&str> = copies.iter().map(|n| forward::rename(n)).collect();
            Some(format!("inputs to copy first: {}", names.join(", ")))
        }
        Plan::Kernel { .. } if prepared.desc.nt.is_none() => {
            Some("a packed batch without chunk_indices (its chunk count)".to_string())
        }
        Plan::Kernel { .. } if prepared.desc.nt == Some(0) => Some("no chunks".to_string()),
        Plan::Kernel { .. } if sw.check_inputs && prepared.desc.varlen() => {
            Some("KDA_DHU_CHECK_INPUTS=1 with a packed batch".to_string())
        }
        Plan::Kernel { .. } => None,
    };
    if let Some(why) = why_not {
        return match sw.force {
            Some(env::Force::Kernel) => Err(to_pyerr(Error::Forced(why))),
            _ => Ok(None),
        };
    }
    let outs = alloc_outputs(py, k, u, None, &prepared.desc, AllocHow::default())?;
    let stream = current_stream(py, prepared.desc.device.unwrap_or(0))?;
    match guard(|| prepared.launch(&outputs(&outs.0, outs.1.as_ref(), &outs.2)?, stream)) {
        Ok(()) => {}
        Err(e) if e.is_instance_of::<KernelUnavailableError>(py) && sw.force != Some(env::Force::Kernel) => {
            return Ok(None)
        }
        Err(e) => return Err(e),
    }
    let none = || py.None().into_bound(py);
    let (h, final_state, v_new) = outs;
    let v_new = if a.save_new_value { v_new } else { none() };
    Ok(Some(pyo3::types::PyTuple::new(py, [h, v_new, final_state.unwrap_or_else(none)])?))
}

/// Whether the forward scan runs kda-dhu's kernel now (`KDA_DHU_FWD_H`, else
/// `env::FWD_H_DEFAULT`): what fla's registry verifier and `fwd_h_run` ask. Raises
/// ValueError naming the switch for a value other than on / off / 1 / 0 / auto / "".
#[pyfunction]
fn fwd_h_on() -> PyResult<bool> {
    guard(env::fwd_h)
}

/// The forward scan's arguments in fla's order, (name, default's Python repr or None for a
/// required one): the description its entry points are checked against.
#[pyfunction]
fn fwd_h_arguments() -> Vec<(&'static str, Option<&'static str>)> {
    forward::ARGUMENTS.to_vec()
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

op_pyfunction! {
    /// One call in one crossing: the switches read, the call decided (as `decide` under
    /// `rule`), and where the decision is the unguarded kernel without a host check of
    /// the tables, the outputs allocated with torch and the kernel launched on torch's
    /// current stream of the inputs' device; where it is "empty", the outputs. Returns
    /// (dh, dh0 or None, dv2); else the `Call` for the caller to carry out; None where a
    /// tensor argument is not a plain torch.Tensor (the caller decides under the inputs'
    /// device). Raises as `decide`. Does not synchronize.
    #[name = "run"]
    fn py_run<'py>(py, rule: &str; op; use_graph: bool)
        signature_tail(, use_graph=false) -> PyResult<Option<Bound<'py, PyAny>>> {
        if !op.all_plain() {
            return Ok(None);
        }
        let call = op.decide(rule, None, guard(decide::Switches::now)?)?;
        let how = AllocHow { use_graph, ..AllocHow::default() };
        if call.decision.launch_only() {
            match call.alloc_and_launch(py, how) {
                Ok(out) => return Ok(Some(out.into_any())),
                // The device turned out unable to run the image at launch: the caller
                // carries the decision out (the launch raises, the call goes to fla).
                Err(e) if e.is_instance_of::<KernelUnavailableError>(py) => {}
                Err(e) => return Err(e),
            }
        } else if call.decision.action == decide::Action::Empty && !call.decision.check_tables {
            return call.run(py, false, false).map(|t| Some(t.into_any()));
        }
        Ok(Some(Bound::new(py, call)?.into_any()))
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
    guard(|| Ok(env::force()?.map(env::Force::name)))
}

/// The kernels' numbers (cuda/dhu_layout.h, their one owner): {"BT", "BV", "WG_THREADS",
/// "SMEM_OPTIN_MAX_SM90": int, "sm90" / "sm90_fwd" (the forward scan's unsplit kernels) /
/// "sm100": [{"k", "nwg",
/// "stages", "threads", "smem_bytes"}, ...]}.
#[pyfunction]
fn kernel_facts(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyDict>> {
    let d = pyo3::types::PyDict::new(py);
    d.set_item("BT", facts::BT)?;
    d.set_item("BV", facts::BV)?;
    d.set_item("WG_THREADS", facts::WG_THREADS)?;
    d.set_item("SMEM_OPTIN_MAX_SM90", facts::SMEM_OPTIN_MAX_SM90)?;
    let tables = [("sm90", &facts::SM90[..]), ("sm90_fwd", &facts::SM90_FWD[..]), ("sm100", &facts::SM100[..])];
    for (name, table) in tables {
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
    m.add_function(wrap_pyfunction!(py_decide, m)?)?;
    m.add_class::<PySwitches>()?;
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
    m.add_function(wrap_pyfunction!(py_fwd_h_probe, m)?)?;
    m.add_function(wrap_pyfunction!(py_fwd_h_run, m)?)?;
    m.add_function(wrap_pyfunction!(fwd_h_on, m)?)?;
    m.add_function(wrap_pyfunction!(fwd_h_arguments, m)?)?;
    m.add_function(wrap_pyfunction!(py_run, m)?)?;
    m.add_function(wrap_pyfunction!(dlpack_intake, m)?)?;
    m.add_class::<PyCall>()?;
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
    m.add("FORCE_ENV", env::FORCE)?;
    m.add_function(wrap_pyfunction!(py_cpu::py_cpu_bwd_dhu, m)?)?;
    m.add("MIN_CTAS_EXTENDED", plan::MIN_CTAS_EXTENDED)?;
    m.add("MIN_CTAS_B2A", plan::MIN_CTAS_B2A)?;
    m.add("TMA_CACHE_CAPACITY", tma::TMA_CACHE_CAPACITY)?;
    Ok(())
}
