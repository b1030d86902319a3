//! What the host core knows about a tensor: a plain struct read once from DLPack
//! (`TensorMeta::from_py`), so that validation and planning are pure functions.

use crate::error::{Error, Result};
use std::fmt;

/// Element type, named as torch names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    BF16,
    F16,
    F32,
    F64,
    I32,
    I64,
    /// Anything else, as DLPack (code, bits, lanes).
    Other {
        code: u8,
        bits: u8,
        lanes: u16,
    },
}

impl DType {
    /// From a DLPack `DLDataType` (kDLInt = 0, kDLFloat = 2, kDLBfloat = 4).
    pub fn from_dlpack(code: u8, bits: u8, lanes: u16) -> DType {
        match (code, bits, lanes) {
            (4, 16, 1) => DType::BF16,
            (2, 16, 1) => DType::F16,
            (2, 32, 1) => DType::F32,
            (2, 64, 1) => DType::F64,
            (0, 32, 1) => DType::I32,
            (0, 64, 1) => DType::I64,
            _ => DType::Other { code, bits, lanes },
        }
    }

    pub fn size_bytes(self) -> u64 {
        match self {
            DType::BF16 | DType::F16 => 2,
            DType::F32 | DType::I32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::Other { bits, lanes, .. } => (bits as u64).div_ceil(8) * lanes as u64,
        }
    }

    pub fn is_float(self) -> bool {
        matches!(self, DType::BF16 | DType::F16 | DType::F32 | DType::F64)
    }

    /// bfloat16 or float16: the element types the kernels read through TMA.
    pub fn is_half16(self) -> bool {
        matches!(self, DType::BF16 | DType::F16)
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DType::BF16 => f.write_str("bfloat16"),
            DType::F16 => f.write_str("float16"),
            DType::F32 => f.write_str("float32"),
            DType::F64 => f.write_str("float64"),
            DType::I32 => f.write_str("int32"),
            DType::I64 => f.write_str("int64"),
            DType::Other { code, bits, lanes } => {
                // DLPack's DLDataTypeCode; the sub-byte and 8-bit float formats are named
                // as torch names them (float8_e4m3fn, ...).
                let named = match code {
                    0 => format!("int{bits}"),
                    1 => format!("uint{bits}"),
                    2 => format!("float{bits}"),
                    3 => "opaque handle".to_string(),
                    4 => format!("bfloat{bits}"),
                    5 => format!("complex{bits}"),
                    6 if *bits == 8 => "bool".to_string(),
                    6 => format!("bool{bits}"),
                    7 => "float8_e3m4".to_string(),
                    8 => "float8_e4m3".to_string(),
                    9 => "float8_e4m3b11fnuz".to_string(),
                    10 => "float8_e4m3fn".to_string(),
                    11 => "float8_e4m3fnuz".to_string(),
                    12 => "float8_e5m2".to_string(),
                    13 => "float8_e5m2fnuz".to_string(),
                    14 => "float8_e8m0fnu".to_string(),
                    15 => "float6_e2m3fn".to_string(),
                    16 => "float6_e3m2fn".to_string(),
                    17 => "float4_e2m1fn".to_string(),
                    _ => format!("DLPack type code {code} ({bits} bits)"),
                };
                f.write_str(&named)?;
                if *lanes != 1 {
                    write!(f, "x{lanes}")?;
                }
                Ok(())
            }
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Cpu,
    Cuda,
    CudaHost,
    CudaManaged,
    Rocm,
    Other(u32),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Device {
    pub kind: DeviceKind,
    pub id: i32,
}

impl Device {
    /// From a DLPack `DLDevice` (kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3,
    /// kDLROCM = 10, kDLCUDAManaged = 13).
    pub fn from_dlpack(device_type: u32, id: i32) -> Device {
        let kind = match device_type {
            1 => DeviceKind::Cpu,
            2 => DeviceKind::Cuda,
            3 => DeviceKind::CudaHost,
            10 => DeviceKind::Rocm,
            13 => DeviceKind::CudaManaged,
            other => DeviceKind::Other(other),
        };
        Device { kind, id }
    }

    pub const fn cuda(id: i32) -> Device {
        Device { kind: DeviceKind::Cuda, id }
    }

    pub const fn cpu() -> Device {
        Device { kind: DeviceKind::Cpu, id: 0 }
    }

    /// Memory the kernels can read: device memory (managed memory included).
    pub fn is_cuda(self) -> bool {
        matches!(self.kind, DeviceKind::Cuda | DeviceKind::CudaManaged)
    }

    /// Memory the CPU can read: host memory (pinned CUDA host memory included).
    pub fn is_host(self) -> bool {
        matches!(self.kind, DeviceKind::Cpu | DeviceKind::CudaHost)
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            DeviceKind::Cpu => f.write_str("cpu"),
            DeviceKind::Cuda => write!(f, "cuda:{}", self.id),
            DeviceKind::CudaHost => f.write_str("cpu (pinned CUDA host memory)"),
            DeviceKind::CudaManaged => write!(f, "cuda:{} (managed memory)", self.id),
            DeviceKind::Rocm => write!(f, "rocm:{}", self.id),
            DeviceKind::Other(t) => write!(f, "DLPack device type {t}:{}", self.id),
        }
    }
}

/// One tensor argument, as DLPack described it.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorMeta {
    /// Address of the first element (DLPack's data + byte_offset).
    pub ptr: u64,
    pub shape: Vec<i64>,
    /// Strides in elements; None means compact row-major.
    pub strides: Option<Vec<i64>>,
    pub dtype: DType,
    pub device: Device,
}

impl TensorMeta {
    /// A compact row-major tensor (tests and callers that build metadata by hand).
    pub fn contiguous(ptr: u64, shape: &[i64], dtype: DType, device: Device) -> TensorMeta {
        TensorMeta { ptr, shape: shape.to_vec(), strides: None, dtype, device }
    }

    pub fn ndim(&self) -> usize {
        self.shape.len()
    }

    pub fn numel(&self) -> i64 {
        self.shape.iter().product()
    }

    /// Compact row-major, ignoring the strides of extent-1 dimensions (as torch does);
    /// an empty tensor is contiguous.
    pub fn is_contiguous(&self) -> bool {
        let Some(strides) = &self.strides else { return true };
        if self.shape.contains(&0) {
            return true;
        }
        let mut expected = 1i64;
        for (&d, &s) in self.shape.iter().zip(strides).rev() {
            if d != 1 && s != expected {
                return false;
            }
            expected = expected.saturating_mul(d);
        }
        true
    }

    pub fn has_negative_stride(&self) -> bool {
        self.strides.as_ref().is_some_and(|s| s.iter().any(|&x| x < 0))
    }

    pub fn is_aligned(&self, bytes: u64) -> bool {
        self.ptr % bytes == 0
    }
}

/// "[2, 4, 64, 128]".
pub fn fmt_shape(shape: &[i64]) -> String {
    let parts: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    format!("[{}]", parts.join(", "))
}

/// An element type the CPU path reads and writes. Conversions to a narrower type round
/// to nearest even (the `half` crate's for bfloat16 and float16), as torch's `.to()` does.
pub trait HostElem: Copy + Send + Sync + 'static {
    const DTYPE: DType;
    fn to_f32(self) -> f32;
    fn to_f64(self) -> f64;
    fn from_f32(x: f32) -> Self;
    fn from_f64(x: f64) -> Self;
}

macro_rules! host_elem_16 {
    ($t:ty, $dtype:expr) => {
        impl HostElem for $t {
            const DTYPE: DType = $dtype;
            fn to_f32(self) -> f32 {
                <$t>::to_f32(self)
            }
            fn to_f64(self) -> f64 {
                <$t>::to_f64(self)
            }
            fn from_f32(x: f32) -> Self {
                <$t>::from_f32(x)
            }
            fn from_f64(x: f64) -> Self {
                <$t>::from_f64(x)
            }
        }
    };
}
host_elem_16!(half::bf16, DType::BF16);
host_elem_16!(half::f16, DType::F16);

impl HostElem for f32 {
    const DTYPE: DType = DType::F32;
    fn to_f32(self) -> f32 {
        self
    }
    fn to_f64(self) -> f64 {
        self as f64
    }
    fn from_f32(x: f32) -> Self {
        x
    }
    fn from_f64(x: f64) -> Self {
        x as f32
    }
}

impl HostElem for f64 {
    const DTYPE: DType = DType::F64;
    fn to_f32(self) -> f32 {
        self as f32
    }
    fn to_f64(self) -> f64 {
        self
    }
    fn from_f32(x: f32) -> Self {
        x as f64
    }
    fn from_f64(x: f64) -> Self {
        x
    }
}

/// The arithmetic types of the CPU path (f32, f64): what a view's elements are read as
/// and written from.
pub trait HostFloat: HostElem + Default {
    fn from_elem<E: HostElem>(e: E) -> Self;
    fn into_elem<E: HostElem>(self) -> E;
}

impl HostFloat for f32 {
    fn from_elem<E: HostElem>(e: E) -> Self {
        e.to_f32()
    }
    fn into_elem<E: HostElem>(self) -> E {
        E::from_f32(self)
    }
}

impl HostFloat for f64 {
    fn from_elem<E: HostElem>(e: E) -> Self {
        e.to_f64()
    }
    fn into_elem<E: HostElem>(self) -> E {
        E::from_f64(self)
    }
}

/// Calls `$body` with `$E` bound to the element type of a float `DType` (bf16, f16, f32,
/// f64); any other dtype is a bug of the caller (validation admits only these).
macro_rules! with_float_elem {
    ($dtype:expr, $E:ident => $body:expr) => {
        match $dtype {
            DType::BF16 => {
                type $E = half::bf16;
                $body
            }
            DType::F16 => {
                type $E = half::f16;
                $body
            }
            DType::F32 => {
                type $E = f32;
                $body
            }
            DType::F64 => {
                type $E = f64;
                $body
            }
            other => panic!("a host view of {other} elements read or written as floats"),
        }
    };
}

/// Compact row-major strides of `shape`, in elements.
fn compact_strides(shape: &[i64]) -> Vec<i64> {
    let mut strides = vec![1i64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1].max(1);
    }
    strides
}

/// A read-only view of a tensor in host memory, as DLPack described it (any strides):
/// elements are read by element offset and converted to f32 or f64. What the CPU path
/// reads its inputs through.
#[derive(Clone, Debug)]
pub struct HostView {
    ptr: *const u8,
    dtype: DType,
    shape: Vec<i64>,
    strides: Vec<i64>,
}

// SAFETY: a view only reads, and `HostView::new`'s contract keeps the memory alive and
// unwritten while views of it are used (from any thread).
unsafe impl Send for HostView {}
unsafe impl Sync for HostView {}

impl HostView {
    /// A view of the tensor `meta` describes; a Device error naming `arg` where its memory
    /// is not host memory.
    ///
    /// # Safety
    /// `meta` must describe live memory (a validated DLPack tensor: non-negative strides,
    /// every element in its allocation) that stays alive and unwritten while the view or a
    /// clone of it is used.
    pub unsafe fn new(meta: &TensorMeta, arg: &'static str) -> Result<HostView> {
        if !meta.device.is_host() {
            return Err(Error::device(arg, format!("expected a CPU tensor, got a tensor on {}", meta.device)));
        }
        Ok(HostView {
            ptr: meta.ptr as *const u8,
            dtype: meta.dtype,
            shape: meta.shape.clone(),
            strides: meta.strides.clone().unwrap_or_else(|| compact_strides(&meta.shape)),
        })
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn shape(&self) -> &[i64] {
        &self.shape
    }

    /// Stride of dimension `dim`, in elements.
    pub fn stride(&self, dim: usize) -> i64 {
        self.strides[dim]
    }

    /// Element offset of the element at `idx` (one index per dimension, each in range).
    pub fn offset(&self, idx: &[i64]) -> i64 {
        debug_assert_eq!(idx.len(), self.shape.len());
        debug_assert!(idx.iter().zip(&self.shape).all(|(&i, &d)| (0..d).contains(&i)), "{idx:?} in {:?}", self.shape);
        idx.iter().zip(&self.strides).map(|(&i, &s)| i * s).sum()
    }

    /// Reads `out.len()` elements at element offsets `offset + i * step`, converted to `R`
    /// (exactly, except float64 read as f32). Every offset must be one of the view's
    /// elements (`offset` of an index in range, `step` a stride along a dimension it
    /// stays within).
    pub fn read<R: HostFloat>(&self, offset: i64, step: i64, out: &mut [R]) {
        with_float_elem!(self.dtype, E => self.read_as::<E, R>(offset, step, out))
    }

    fn read_as<E: HostElem, R: HostFloat>(&self, offset: i64, step: i64, out: &mut [R]) {
        let base = self.ptr as *const E;
        for (i, o) in out.iter_mut().enumerate() {
            // SAFETY: an element of the view (the caller's contract), live by `new`'s;
            // DLPack does not promise alignment to the element size.
            let e = unsafe { base.offset((offset + i as i64 * step) as isize).read_unaligned() };
            *o = R::from_elem(e);
        }
    }

    /// The integer at element offset `offset` of an int32 / int64 view (cu_seqlens,
    /// chunk_offsets).
    pub fn read_index(&self, offset: i64) -> i64 {
        // SAFETY: as `read_as`.
        unsafe {
            match self.dtype {
                DType::I64 => (self.ptr as *const i64).offset(offset as isize).read_unaligned(),
                DType::I32 => (self.ptr as *const i32).offset(offset as isize).read_unaligned() as i64,
                other => panic!("a host view of {other} elements read as an index"),
            }
        }
    }

    /// Every element of a 1-D int32 / int64 view, in order.
    pub fn read_indices(&self) -> Vec<i64> {
        debug_assert_eq!(self.shape.len(), 1);
        (0..self.shape[0]).map(|i| self.read_index(i * self.strides[0])).collect()
    }
}

/// A compact row-major output tensor in host memory, written by element offset from f32
/// or f64 values (rounded to its dtype). What the CPU path writes its outputs through;
/// threads may write disjoint elements at once.
#[derive(Debug)]
pub struct HostOut {
    ptr: *mut u8,
    dtype: DType,
    numel: i64,
}

// SAFETY: writers write disjoint elements (`write`'s contract) of memory that
// `HostOut::new`'s contract gives to this view alone.
unsafe impl Send for HostOut {}
unsafe impl Sync for HostOut {}

impl HostOut {
    /// The output tensor `meta` describes: compact row-major host memory of a float
    /// dtype (an Internal error otherwise: outputs are allocated by the caller of the
    /// CPU path, never by the user).
    ///
    /// # Safety
    /// `meta` must describe live, writable memory that nothing else reads or writes while
    /// the view is used.
    pub unsafe fn new(meta: &TensorMeta) -> Result<HostOut> {
        if !meta.device.is_host() || !meta.is_contiguous() || !meta.dtype.is_float() {
            return Err(Error::Internal(format!(
                "a CPU output must be a contiguous float tensor in host memory, got {} {} on {}",
                meta.dtype,
                fmt_shape(&meta.shape),
                meta.device
            )));
        }
        Ok(HostOut { ptr: meta.ptr as *mut u8, dtype: meta.dtype, numel: meta.numel() })
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    pub fn numel(&self) -> i64 {
        self.numel
    }

    /// Writes `src` to element offsets `offset + i * step`, rounded to the dtype.
    ///
    /// # Safety
    /// Every offset must be in `0..numel`, and no other thread may read or write those
    /// elements meanwhile.
    pub unsafe fn write<R: HostFloat>(&self, offset: i64, step: i64, src: &[R]) {
        with_float_elem!(self.dtype, E => self.write_as::<E, R>(offset, step, src))
    }

    unsafe fn write_as<E: HostElem, R: HostFloat>(&self, offset: i64, step: i64, src: &[R]) {
        let base = self.ptr as *mut E;
        for (i, &x) in src.iter().enumerate() {
            let at = offset + i as i64 * step;
            debug_assert!((0..self.numel).contains(&at));
            base.offset(at as isize).write_unaligned(x.into_elem::<E>());
        }
    }

    /// Sets elements `start .. start + len` to `value` (rounded to the dtype).
    ///
    /// # Safety
    /// As `write`.
    pub unsafe fn fill(&self, start: i64, len: i64, value: f64) {
        with_float_elem!(self.dtype, E => {
            let e = E::from_f64(value);
            let base = self.ptr as *mut E;
            for at in start..start + len {
                debug_assert!((0..self.numel).contains(&at));
                base.offset(at as isize).write_unaligned(e);
            }
        })
    }
}

/// DLPack intake (PyO3 code; the rest of this module is plain Rust).
pub use py::{current_cuda_stream, intake, is_plain_tensor, is_torch_tensor};

mod py {
    use super::*;
    use dlpack_rs::ffi::{DLManagedTensor, DLManagedTensorVersioned, DLTensor};
    use pyo3::intern;
    use pyo3::prelude::*;
    use pyo3::sync::PyOnceLock;
    use pyo3::types::{PyCapsule, PyDict, PyType};
    use std::os::raw::{c_int, c_void};

    /// torch's C exporter: `torch.Tensor.__dlpack__` is a Python method costing ~2.4 us
    /// a tensor (keyword handling, stream and device checks) where the C function it
    /// ends in, `torch.utils.dlpack.to_dlpack`, costs ~0.3 us; a launch reads a dozen
    /// tensors. Same capsule ("dltensor", DLPack 0.8), no stream synchronization (as
    /// `__dlpack__()` without a stream), and it also exports tensors that require grad
    /// and tensors on a device other than torch's current one.
    ///
    /// Where torch offers DLPack's C exchange API (`torch.Tensor.__dlpack_c_exchange_api__`,
    /// DLPack 1.3, torch >= 2.10), plain tensors are read through its
    /// `dltensor_from_py_object_no_sync` instead: a non-owning DLTensor filled on the
    /// stack, no capsule and no allocation (the per-call host overhead).
    struct Torch {
        tensor: Py<PyType>,
        parameter: Py<PyType>,
        to_dlpack: Py<PyAny>,
        exchange: Option<Exchange>,
    }

    /// The two functions of torch's `DLPackExchangeAPI` that kda-dhu calls (the others
    /// allocate outside torch's caching allocator and are not used).
    #[derive(Clone, Copy)]
    struct Exchange {
        dltensor_from_py_object: unsafe extern "C" fn(*mut c_void, *mut DLTensor) -> c_int,
        current_work_stream: dlpack_rs::ffi::DLPackCurrentWorkStream,
    }

    /// torch's exchange API from its capsule, if this torch has one of a known layout
    /// (DLPack major version 1, minor >= 3, the non-owning exporter present). Taken from
    /// torch's own `torch._C._dlpack_exchange_api()` where it exists (the class attribute
    /// is a public slot another library could replace), else (missing, or not a capsule of
    /// a known layout) from `torch.Tensor.__dlpack_c_exchange_api__`.
    fn exchange_api(torch: &Bound<'_, PyModule>, tensor_type: &Bound<'_, PyAny>) -> Option<Exchange> {
        let own = torch.getattr("_C").and_then(|c| c.getattr("_dlpack_exchange_api")).and_then(|f| f.call0());
        // torch's own capsule first; the class attribute where that is missing or unusable.
        own.ok()
            .and_then(|cap| exchange_from_capsule(&cap))
            .or_else(|| exchange_from_capsule(&tensor_type.getattr("__dlpack_c_exchange_api__").ok()?))
    }

    /// The exchange API held by a "dlpack_exchange_api" capsule, if of a known layout.
    fn exchange_from_capsule(cap: &Bound<'_, PyAny>) -> Option<Exchange> {
        let cap = cap.cast::<PyCapsule>().ok()?;
        let ptr = cap.pointer_checked(Some(c"dlpack_exchange_api")).ok()?;
        // SAFETY: a "dlpack_exchange_api" capsule holds a DLPackExchangeAPI that lives as
        // long as torch's module (a static singleton); its header's version is read first.
        let api = unsafe { &*(ptr.as_ptr() as *const dlpack_rs::ffi::DLPackExchangeAPI) };
        if api.header.version.major != 1 || api.header.version.minor < 3 {
            return None;
        }
        Some(Exchange {
            dltensor_from_py_object: api.dltensor_from_py_object_no_sync?,
            current_work_stream: api.current_work_stream,
        })
    }

    /// torch's types and exporter, once torch is imported (never imports it itself).
    fn torch(py: Python<'_>) -> Option<&'static Torch> {
        static TORCH: PyOnceLock<Torch> = PyOnceLock::new();
        if let Some(t) = TORCH.get(py) {
            return Some(t);
        }
        let modules = py.import(intern!(py, "sys")).ok()?.getattr(intern!(py, "modules")).ok()?;
        let loaded = modules.cast::<PyDict>().ok()?.contains(intern!(py, "torch")).unwrap_or(false);
        if !loaded {
            return None;
        }
        TORCH
            .get_or_try_init(py, || -> PyResult<Torch> {
                let torch = py.import("torch")?;
                let tensor = torch.getattr("Tensor")?;
                let exchange = if crate::env::no_exchange_api() { None } else { exchange_api(&torch, &tensor) };
                Ok(Torch {
                    tensor: tensor.cast_into::<PyType>()?.unbind(),
                    parameter: torch.getattr("nn")?.getattr("Parameter")?.cast_into::<PyType>()?.unbind(),
                    to_dlpack: py.import("torch.utils.dlpack")?.getattr("to_dlpack")?.unbind(),
                    exchange,
                })
            })
            .ok()
    }

    /// "list", "numpy.float32", "mymodule.Thing": the type of `obj` for messages.
    fn type_name(obj: &Bound<'_, PyAny>) -> String {
        obj.get_type().fully_qualified_name().map(|n| n.to_string()).unwrap_or_else(|_| "an object".to_string())
    }

    /// torch's lazy negation (`x.is_neg()`, e.g. from `z.conj().imag`) is not in DLPack:
    /// both torch exporters hand out the un-negated memory, so reading it through the
    /// capsule would silently flip the sign. Refused, naming the fix.
    fn refuse_neg_bit(obj: &Bound<'_, PyAny>, arg: &'static str) -> Result<()> {
        let py = obj.py();
        let neg = obj.call_method0(intern!(py, "is_neg")).and_then(|r| r.is_truthy()).unwrap_or(false);
        if neg {
            return Err(Error::layout(
                arg,
                "expected a tensor without torch's lazy negation bit (is_neg() is True; DLPack \
                 cannot carry it), pass x.resolve_neg()",
            ));
        }
        Ok(())
    }

    /// Most dimensions accepted from a DLPack producer (torch's own limit is 64); a
    /// larger or negative `ndim` is a broken producer, and reading `ndim` shape entries
    /// would read past its arrays.
    pub(super) const MAX_NDIM: i32 = 64;

    /// The producer's managed tensor behind a capsule, by DLPack variant.
    #[derive(Clone, Copy)]
    enum Managed {
        Legacy(*mut DLManagedTensor),
        Versioned(*mut DLManagedTensorVersioned),
    }

    impl Managed {
        /// # Safety
        /// The pointer must be live (its deleter not yet called).
        unsafe fn dl_tensor<'a>(self) -> &'a DLTensor {
            match self {
                Managed::Legacy(p) => &(*p).dl_tensor,
                Managed::Versioned(p) => &(*p).dl_tensor,
            }
        }

        /// DLPack's name for the capsule once consumed.
        fn used_name(self) -> &'static std::ffi::CStr {
            match self {
                Managed::Legacy(_) => c"used_dltensor",
                Managed::Versioned(_) => c"used_dltensor_versioned",
            }
        }

        /// Calls the producer's deleter (when it gave one), once.
        ///
        /// # Safety
        /// The pointer must be live and the capsule consumed (renamed), so that nothing
        /// else calls the deleter.
        unsafe fn release(self) {
            match self {
                Managed::Legacy(p) => {
                    if let Some(d) = (*p).deleter {
                        d(p)
                    }
                }
                Managed::Versioned(p) => {
                    if let Some(d) = (*p).deleter {
                        d(p)
                    }
                }
            }
        }
    }

    /// Reads the capsule `__dlpack__()` returned and consumes it: a capsule named
    /// "dltensor" (or "dltensor_versioned" of DLPack 1.x), not already consumed, with
    /// 0 <= ndim <= 64 and a shape array when ndim > 0. The metadata is copied out, then
    /// the capsule is renamed "used_dltensor" (DLPack's mark of a consumed capsule) and
    /// the producer's deleter called: the memory stays owned by the caller's object. A
    /// capsule refused here is not consumed: its own destructor frees it.
    fn consume_capsule(cap: &Bound<'_, PyAny>, obj: &Bound<'_, PyAny>, arg: &'static str) -> Result<TensorMeta> {
        let Ok(cap) = cap.cast::<PyCapsule>() else {
            return Err(Error::NotTensor {
                arg,
                got: format!("{} whose __dlpack__() returned {}, not a DLPack capsule", type_name(obj), type_name(cap)),
            });
        };
        let bad = |msg: String| Error::value(arg, msg);
        let name = cap.name().map_err(|e| bad(format!("__dlpack__() returned an unreadable capsule: {e}")))?;
        let Some(name) = name else {
            return Err(bad("__dlpack__() returned a capsule without a name, expected \"dltensor\"".into()));
        };
        // SAFETY: the name of a live capsule, read before anything renames it.
        let name = unsafe { name.as_cstr() };
        let ptr = |name: &std::ffi::CStr| {
            cap.pointer_checked(Some(name))
                .map_err(|e| bad(format!("__dlpack__() returned a capsule without a pointer: {e}")))
        };
        let managed = if name == c"dltensor" {
            // A "dltensor" capsule holds a DLManagedTensor (the DLPack protocol).
            Managed::Legacy(ptr(name)?.as_ptr() as *mut DLManagedTensor)
        } else if name == c"dltensor_versioned" {
            let p = ptr(name)?.as_ptr() as *mut DLManagedTensorVersioned;
            // SAFETY: a "dltensor_versioned" capsule holds a DLManagedTensorVersioned whose
            // leading `version` field is stable across DLPack versions.
            let version = unsafe { (*p).version };
            if version.major != 1 {
                return Err(bad(format!(
                    "__dlpack__() returned a DLPack {}.{} tensor, expected DLPack 1.x or the legacy capsule",
                    version.major, version.minor
                )));
            }
            Managed::Versioned(p)
        } else if name == c"used_dltensor" || name == c"used_dltensor_versioned" {
            return Err(bad("__dlpack__() returned a capsule that was already consumed".into()));
        } else {
            return Err(bad(format!("__dlpack__() returned a capsule named {name:?}, expected \"dltensor\"")));
        };
        // SAFETY: the capsule's pointer, alive until its deleter runs (below).
        let meta = meta_of(unsafe { managed.dl_tensor() }, arg)?;
        // SAFETY: a live capsule; the name is 'static. Renamed first, so that the capsule's
        // own destructor (which frees an unconsumed "dltensor") does not free it again.
        if unsafe { pyo3::ffi::PyCapsule_SetName(cap.as_ptr(), managed.used_name().as_ptr()) } != 0 {
            return Err(Error::Internal(format!("{arg}: PyCapsule_SetName failed: {}", PyErr::fetch(cap.py()))));
        }
        // SAFETY: consumed above; nothing reads the DLTensor after this.
        unsafe { managed.release() };
        Ok(meta)
    }

    /// The metadata of a producer's DLTensor, copied out: 0 <= ndim <= 64 and a shape
    /// array when ndim > 0, else an error naming `arg`.
    fn meta_of(dl: &DLTensor, arg: &'static str) -> Result<TensorMeta> {
        if !(0..=MAX_NDIM).contains(&dl.ndim) {
            return Err(Error::shape(
                arg,
                format!("expected 0 <= ndim <= {MAX_NDIM} from DLPack, got ndim = {}", dl.ndim),
            ));
        }
        if dl.ndim > 0 && dl.shape.is_null() {
            return Err(Error::value(arg, format!("DLPack shape pointer is NULL for a {}-D tensor", dl.ndim)));
        }
        let n = dl.ndim as usize;
        // SAFETY: shape (checked non-NULL above) and strides (when non-NULL) point at ndim
        // int64s, valid until the deleter runs. A 0-D tensor's may be NULL: not read.
        let (shape, strides) = unsafe {
            if n == 0 {
                (Vec::new(), None)
            } else {
                let shape = std::slice::from_raw_parts(dl.shape, n).to_vec();
                let strides = (!dl.strides.is_null()).then(|| std::slice::from_raw_parts(dl.strides, n).to_vec());
                (shape, strides)
            }
        };
        Ok(TensorMeta {
            ptr: (dl.data as u64).wrapping_add(dl.byte_offset),
            shape,
            strides,
            dtype: DType::from_dlpack(dl.dtype.code, dl.dtype.bits, dl.dtype.lanes),
            device: Device::from_dlpack(dl.device.device_type, dl.device.device_id),
        })
    }

    /// "arg: torch's DLPack export failed: <torch's message>", the message's first line
    /// (torch's C++ errors carry a backtrace after it).
    fn export_failed(arg: &'static str, why: &str) -> Error {
        let first = why.lines().next().unwrap_or("").trim_end();
        Error::value(arg, format!("torch's DLPack export failed: {first}"))
    }

    /// Reads a torch tensor through the exchange API's non-owning exporter: torch fills
    /// a DLTensor on our stack whose shape and strides point into the tensor, valid
    /// while `obj` lives and is not resized (we hold it, under the GIL, for this call).
    fn read_exchange(x: Exchange, obj: &Bound<'_, PyAny>, arg: &'static str) -> Result<TensorMeta> {
        let mut dl = std::mem::MaybeUninit::<DLTensor>::zeroed();
        // SAFETY: obj is a live torch.Tensor (or Parameter), the type the API was taken
        // from; dl is writable stack memory of the right layout.
        let rc = unsafe { (x.dltensor_from_py_object)(obj.as_ptr() as *mut c_void, dl.as_mut_ptr()) };
        if rc != 0 {
            let why = PyErr::take(obj.py()).map(|e| e.to_string()).unwrap_or_else(|| format!("returned {rc}"));
            return Err(export_failed(arg, &why));
        }
        // SAFETY: filled by the exporter (a zeroed DLTensor is also a valid one).
        meta_of(unsafe { dl.assume_init_ref() }, arg)
    }

    /// How torch tensors are read: "exchange" (DLPack's C exchange API), "capsule"
    /// (torch.utils.dlpack.to_dlpack), or "none" while torch is not imported.
    pub fn intake(py: Python<'_>) -> &'static str {
        match torch(py) {
            Some(t) if t.exchange.is_some() => "exchange",
            Some(_) => "capsule",
            None => "none",
        }
    }

    /// Exactly a torch.Tensor (not a subclass, whose methods could return the subclass).
    pub fn is_plain_tensor(obj: &Bound<'_, PyAny>) -> bool {
        torch(obj.py()).is_some_and(|t| obj.get_type().is(&t.tensor))
    }

    /// A torch.Tensor, subclasses included (false while torch is not imported).
    pub fn is_torch_tensor(obj: &Bound<'_, PyAny>) -> bool {
        torch(obj.py()).is_some_and(|t| obj.is_instance(t.tensor.bind(obj.py())).unwrap_or(false))
    }

    /// torch's current CUDA stream of device `ordinal` as a raw handle, through the
    /// exchange API; None where this torch has none.
    pub fn current_cuda_stream(py: Python<'_>, ordinal: i32) -> Option<u64> {
        let f = torch(py)?.exchange?.current_work_stream?;
        let mut stream: *mut c_void = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; kDLCUDA = 2.
        let rc = unsafe { f(2, ordinal, &mut stream) };
        if rc != 0 {
            let _ = PyErr::take(py);
            return None;
        }
        Some(stream as u64)
    }

    impl TensorMeta {
        /// Reads `obj` through DLPack (`obj.__dlpack__()` without a stream argument: no
        /// synchronization; plain torch tensors through torch's C exporter, see `Torch`).
        /// `arg` names the argument in errors. The metadata is copied out and the
        /// capsule released at once; the caller's Python object keeps the memory alive
        /// for the duration of the call.
        pub fn from_py(obj: &Bound<'_, PyAny>, arg: &'static str) -> Result<TensorMeta> {
            let py = obj.py();
            if obj.is_none() {
                return Err(Error::NotTensor { arg, got: "None".into() });
            }
            let torch = torch(py);
            let cap = match torch {
                Some(t) if obj.get_type().is(&t.tensor) || obj.get_type().is(&t.parameter) => {
                    refuse_neg_bit(obj, arg)?;
                    if let Some(x) = t.exchange {
                        return read_exchange(x, obj, arg);
                    }
                    t.to_dlpack.bind(py).call1((obj,)).map_err(|e| export_failed(arg, &e.to_string()))?
                }
                _ => {
                    if !obj.hasattr(intern!(py, "__dlpack__")).unwrap_or(false) {
                        return Err(Error::NotTensor { arg, got: type_name(obj) });
                    }
                    if torch.is_some_and(|t| obj.is_instance(t.tensor.bind(py)).unwrap_or(false)) {
                        refuse_neg_bit(obj, arg)?;
                    }
                    // A torch subclass that requires grad: __dlpack__ refuses it; the
                    // data is the same without the autograd flag.
                    let needs_detach =
                        obj.getattr(intern!(py, "requires_grad")).is_ok_and(|r| r.is_truthy().unwrap_or(false));
                    let source = if needs_detach {
                        obj.call_method0(intern!(py, "detach"))
                            .map_err(|e| Error::value(arg, format!("requires grad and detach() failed: {e}")))?
                    } else {
                        obj.clone()
                    };
                    source
                        .call_method0(intern!(py, "__dlpack__"))
                        .map_err(|e| Error::value(arg, format!("__dlpack__() failed: {e}")))?
                }
            };
            consume_capsule(&cap, obj, arg)
        }

        /// `None` for Python None, else as `from_py`.
        pub fn from_py_opt(obj: Option<&Bound<'_, PyAny>>, arg: &'static str) -> Result<Option<TensorMeta>> {
            match obj {
                None => Ok(None),
                Some(o) if o.is_none() => Ok(None),
                Some(o) => TensorMeta::from_py(o, arg).map(Some),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(shape: &[i64], strides: Option<&[i64]>) -> TensorMeta {
        TensorMeta {
            ptr: 0x1000,
            shape: shape.to_vec(),
            strides: strides.map(|s| s.to_vec()),
            dtype: DType::BF16,
            device: Device::cuda(0),
        }
    }

    #[test]
    fn contiguity_ignores_extent_one_dims() {
        assert!(t(&[2, 3, 4], None).is_contiguous());
        assert!(t(&[2, 3, 4], Some(&[12, 4, 1])).is_contiguous());
        assert!(t(&[1, 3, 4], Some(&[999, 4, 1])).is_contiguous());
        assert!(t(&[2, 1, 4], Some(&[4, 0, 1])).is_contiguous());
        assert!(!t(&[2, 3, 4], Some(&[1, 2, 6])).is_contiguous());
        assert!(!t(&[2, 3, 4], Some(&[24, 4, 1])).is_contiguous());
        assert!(!t(&[2, 3, 4], Some(&[0, 4, 1])).is_contiguous());
        assert!(t(&[0, 3, 4], Some(&[1, 1, 1])).is_contiguous());
    }

    #[test]
    fn negative_strides_are_seen() {
        assert!(t(&[2, 3], Some(&[-3, 1])).has_negative_stride());
        assert!(!t(&[2, 3], Some(&[3, 1])).has_negative_stride());
        assert!(!t(&[2, 3], None).has_negative_stride());
    }

    #[test]
    fn dtypes_and_devices_read_from_dlpack_codes() {
        assert_eq!(DType::from_dlpack(4, 16, 1), DType::BF16);
        assert_eq!(DType::from_dlpack(2, 16, 1), DType::F16);
        assert_eq!(DType::from_dlpack(2, 32, 1), DType::F32);
        assert_eq!(DType::from_dlpack(0, 64, 1), DType::I64);
        assert_eq!(DType::from_dlpack(0, 8, 1).to_string(), "int8");
        assert_eq!(DType::BF16.to_string(), "bfloat16");
        // Types torch exports that the op refuses, named as torch names them.
        assert_eq!(DType::from_dlpack(6, 8, 1).to_string(), "bool");
        assert_eq!(DType::from_dlpack(10, 8, 1).to_string(), "float8_e4m3fn");
        assert_eq!(DType::from_dlpack(12, 8, 1).to_string(), "float8_e5m2");
        assert_eq!(DType::from_dlpack(14, 8, 1).to_string(), "float8_e8m0fnu");
        assert_eq!(DType::from_dlpack(17, 4, 1).to_string(), "float4_e2m1fn");
        assert_eq!(DType::from_dlpack(5, 64, 1).to_string(), "complex64");
        assert_eq!(DType::from_dlpack(1, 8, 1).to_string(), "uint8");
        assert_eq!(DType::from_dlpack(4, 16, 2).to_string(), "bfloat16x2");
        assert_eq!(DType::from_dlpack(3, 64, 1).to_string(), "opaque handle");
        assert_eq!(DType::from_dlpack(99, 16, 1).to_string(), "DLPack type code 99 (16 bits)");
        assert_eq!(Device::from_dlpack(1, 0).to_string(), "cpu");
        assert_eq!(Device::from_dlpack(2, 3).to_string(), "cuda:3");
        assert!(Device::from_dlpack(13, 0).is_cuda());
        assert!(!Device::from_dlpack(3, 0).is_cuda());
    }

    #[test]
    fn host_views_read_strided_elements_of_every_dtype() {
        // [2, 3] float64 values stored column-major (strides [1, 2])
        let vals = [1.0f64, 4.0, 2.0, 5.0, 3.0, 6.0];
        let meta = TensorMeta {
            ptr: vals.as_ptr() as u64,
            shape: vec![2, 3],
            strides: Some(vec![1, 2]),
            dtype: DType::F64,
            device: Device::cpu(),
        };
        // SAFETY: `vals` outlives the view.
        let v = unsafe { HostView::new(&meta, "x") }.unwrap();
        let mut row = [0f32; 3];
        v.read(v.offset(&[1, 0]), v.stride(1), &mut row);
        assert_eq!(row, [4.0, 5.0, 6.0]);
        // bfloat16 and int32, compact
        let b = [half::bf16::from_f32(1.5), half::bf16::from_f32(-2.0)];
        let meta = TensorMeta::contiguous(b.as_ptr() as u64, &[2], DType::BF16, Device::cpu());
        let mut out = [0f64; 2];
        unsafe { HostView::new(&meta, "x") }.unwrap().read(0, 1, &mut out);
        assert_eq!(out, [1.5, -2.0]);
        let idx = [0i32, 7, 9];
        let meta = TensorMeta::contiguous(idx.as_ptr() as u64, &[3], DType::I32, Device::cpu());
        assert_eq!(unsafe { HostView::new(&meta, "cu_seqlens") }.unwrap().read_indices(), vec![0, 7, 9]);
        // not host memory: a Device error naming the argument
        let meta = TensorMeta::contiguous(0x1000, &[3], DType::F32, Device::cuda(0));
        let e = unsafe { HostView::new(&meta, "k") }.unwrap_err();
        assert_eq!(e.to_string(), "k: expected a CPU tensor, got a tensor on cuda:0");
    }

    #[test]
    fn host_outputs_round_to_nearest_even() {
        let mut buf = [half::bf16::ZERO; 4];
        let meta = TensorMeta::contiguous(buf.as_mut_ptr() as u64, &[4], DType::BF16, Device::cpu());
        // SAFETY: `buf` outlives the view and nothing else touches it.
        let out = unsafe { HostOut::new(&meta) }.unwrap();
        // 1 + 2^-8 is halfway between bf16's 1 and 1 + 2^-7: to even (1); 1 + 3 * 2^-8
        // is halfway between 1 + 2^-7 and 1 + 2^-6: to even (1 + 2^-6)
        unsafe { out.write(0, 2, &[1.0f32 + 2f32.powi(-8), 1.0 + 3.0 * 2f32.powi(-8)]) };
        unsafe { out.fill(1, 1, f64::NAN) };
        assert_eq!(buf[0].to_f32(), 1.0);
        assert!(buf[1].is_nan());
        assert_eq!(buf[2].to_f32(), 1.0 + 2f32.powi(-6));
        assert_eq!(buf[3].to_f32(), 0.0);
        // an output must be compact host memory of a float dtype
        let meta =
            TensorMeta { strides: Some(vec![2]), ..TensorMeta::contiguous(0x10, &[4], DType::F32, Device::cpu()) };
        assert!(matches!(unsafe { HostOut::new(&meta) }, Err(Error::Internal(_))));
    }

    #[test]
    fn shapes_print_like_python_lists() {
        assert_eq!(fmt_shape(&[2, 4, 64, 128]), "[2, 4, 64, 128]");
        assert_eq!(fmt_shape(&[]), "[]");
    }
}
