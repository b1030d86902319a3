//! What the host core knows about a tensor: a plain struct read once from DLPack
//! (`TensorMeta::from_py`), so that validation and planning are pure functions.

use crate::error::{Error, Result};
use std::fmt;

/// Element type, named as torch names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    BF16,
    F16,
    F32,
    F64,
    I32,
    I64,
    /// Anything else, as DLPack (code, bits, lanes).
    Other { code: u8, bits: u8, lanes: u16 },
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
                let kind = match code {
                    0 => "int",
                    1 => "uint",
                    2 => "float",
                    4 => "bfloat",
                    5 => "complex",
                    6 => "bool",
                    _ => "dlpack-code-",
                };
                if *code > 6 {
                    write!(f, "{kind}{code} ({bits} bits)")?;
                } else {
                    write!(f, "{kind}{bits}")?;
                }
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

/// DLPack intake (the only PyO3 code outside lib.rs).
mod py {
    use super::*;
    use dlpack_rs::pyo3_glue::PyTensor;
    use pyo3::intern;
    use pyo3::prelude::*;
    use pyo3::sync::PyOnceLock;
    use pyo3::types::{PyDict, PyType};

    /// Hands a capsule made elsewhere to `PyTensor::from_pyany`, which asks its argument
    /// for `__dlpack__()`.
    #[pyclass(frozen)]
    struct Capsule(Py<PyAny>);

    #[pymethods]
    impl Capsule {
        fn __dlpack__(&self, py: Python<'_>) -> Py<PyAny> {
            self.0.clone_ref(py)
        }
    }

    /// torch's C exporter: `torch.Tensor.__dlpack__` is a Python method costing ~2.4 us
    /// a tensor (keyword handling, stream and device checks) where the C function it
    /// ends in, `torch.utils.dlpack.to_dlpack`, costs ~0.3 us; a launch reads a dozen
    /// tensors. Same capsule ("dltensor", DLPack 0.8), no stream synchronization (as
    /// `__dlpack__()` without a stream), and it also exports tensors that require grad
    /// and tensors on a device other than torch's current one.
    struct Torch {
        tensor: Py<PyType>,
        parameter: Py<PyType>,
        to_dlpack: Py<PyAny>,
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
                Ok(Torch {
                    tensor: torch.getattr("Tensor")?.cast_into::<PyType>()?.unbind(),
                    parameter: torch.getattr("nn")?.getattr("Parameter")?.cast_into::<PyType>()?.unbind(),
                    to_dlpack: py.import("torch.utils.dlpack")?.getattr("to_dlpack")?.unbind(),
                })
            })
            .ok()
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
            let holder;
            let detached;
            let source: &Bound<'_, PyAny> = match torch(py) {
                Some(t) if obj.get_type().is(&t.tensor) || obj.get_type().is(&t.parameter) => {
                    let cap = t
                        .to_dlpack
                        .bind(py)
                        .call1((obj,))
                        .map_err(|e| Error::value(arg, format!("torch.utils.dlpack.to_dlpack failed: {e}")))?;
                    holder = Bound::new(py, Capsule(cap.unbind()))
                        .map_err(|e| Error::Internal(format!("{arg}: {e}")))?
                        .into_any();
                    &holder
                }
                _ => {
                    if !obj.hasattr(intern!(py, "__dlpack__")).unwrap_or(false) {
                        let got = obj
                            .get_type()
                            .name()
                            .map(|n| n.to_string())
                            .unwrap_or_else(|_| "an object".to_string());
                        return Err(Error::NotTensor { arg, got });
                    }
                    // A torch subclass that requires grad: __dlpack__ refuses it; the
                    // data is the same without the autograd flag.
                    let needs_detach = obj
                        .getattr(intern!(py, "requires_grad"))
                        .is_ok_and(|r| r.is_truthy().unwrap_or(false));
                    if needs_detach {
                        detached = obj.call_method0(intern!(py, "detach")).map_err(|e| {
                            Error::value(arg, format!("requires grad and detach() failed: {e}"))
                        })?;
                        &detached
                    } else {
                        obj
                    }
                }
            };
            let t = PyTensor::from_pyany(py, source)
                .map_err(|e| Error::value(arg, format!("__dlpack__() failed: {e}")))?;
            let dt = t.dtype();
            let dev = t.device();
            Ok(TensorMeta {
                ptr: (t.data_ptr() as u64).wrapping_add(t.byte_offset()),
                shape: t.shape().to_vec(),
                strides: t.strides().map(|s| s.to_vec()),
                dtype: DType::from_dlpack(dt.code, dt.bits, dt.lanes),
                device: Device::from_dlpack(dev.device_type, dev.device_id),
            })
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
        assert_eq!(DType::from_dlpack(6, 8, 1).to_string(), "bool8");
        assert_eq!(DType::BF16.to_string(), "bfloat16");
        assert_eq!(Device::from_dlpack(1, 0).to_string(), "cpu");
        assert_eq!(Device::from_dlpack(2, 3).to_string(), "cuda:3");
        assert!(Device::from_dlpack(13, 0).is_cuda());
        assert!(!Device::from_dlpack(3, 0).is_cuda());
    }

    #[test]
    fn shapes_print_like_python_lists() {
        assert_eq!(fmt_shape(&[2, 4, 64, 128]), "[2, 4, 64, 128]");
        assert_eq!(fmt_shape(&[]), "[]");
    }
}
