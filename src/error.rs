//! The one error type of the host core. Every message names the argument and what was
//! expected; `lib.rs` maps the kinds to Python exceptions in one place:
//! TypeError for `NotTensor` / `Dtype` / `Type`, ValueError for `Shape` / `Layout` / `Value` /
//! `Device` / `NotPlanned`, RuntimeError for `NoDriver` / `Cuda` / `Forced` /
//! `Internal`, and
//! `kda_dhu._core.KernelUnavailableError` (a RuntimeError) for `Unavailable`.

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// A tensor was required and something else was given (TypeError).
    NotTensor { arg: &'static str, got: String },
    /// Wrong element type (TypeError).
    Dtype { arg: &'static str, msg: String },
    /// A scalar argument of the wrong Python type, e.g. `scale="x"` (TypeError).
    Type { arg: &'static str, msg: String },
    /// Wrong rank or extent (ValueError).
    Shape { arg: &'static str, msg: String },
    /// Strides or alignment that are errors, not just "needs a copy" (ValueError).
    Layout { arg: &'static str, msg: String },
    /// A scalar argument out of range (ValueError).
    Value { arg: &'static str, msg: String },
    /// Not on a CUDA device, or not on the same one (ValueError).
    Device { arg: &'static str, msg: String },
    /// `launch` was called for a call the kernel does not cover (ValueError).
    NotPlanned(String),
    /// libcuda could not be loaded (RuntimeError).
    NoDriver,
    /// A driver call failed (RuntimeError). `what` says which call and on what.
    Cuda { what: String, code: String },
    /// This driver or GPU cannot run the kernel image (KernelUnavailableError): not a bug,
    /// the device's calls go to fla. `reason` names the driver and what is needed.
    Unavailable { ordinal: i32, reason: String },
    /// `KDA_DHU_FORCE=kernel` on a call the kernel cannot compute; the planner's reason
    /// (RuntimeError).
    Forced(String),
    /// A bug: a panic caught at the Python boundary, an impossible state (RuntimeError).
    Internal(String),
}

/// Python exception class for an [`Error`], kept here so the mapping is testable
/// without Python.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PyKind {
    TypeError,
    ValueError,
    RuntimeError,
    /// `kda_dhu._core.KernelUnavailableError`, a RuntimeError subclass.
    Unavailable,
}

/// How every `Unavailable` message starts ("kernel unavailable on cuda:0: ..."): the
/// planner's fallback reason for such a device, which the Python layer recognizes.
pub const UNAVAILABLE_PREFIX: &str = "kernel unavailable on cuda:";

impl Error {
    pub fn py_kind(&self) -> PyKind {
        match self {
            Error::NotTensor { .. } | Error::Dtype { .. } | Error::Type { .. } => PyKind::TypeError,
            Error::Shape { .. }
            | Error::Layout { .. }
            | Error::Value { .. }
            | Error::Device { .. }
            | Error::NotPlanned(_) => PyKind::ValueError,
            Error::NoDriver | Error::Cuda { .. } | Error::Forced(_) | Error::Internal(_) => PyKind::RuntimeError,
            Error::Unavailable { .. } => PyKind::Unavailable,
        }
    }

    pub fn dtype(arg: &'static str, msg: impl Into<String>) -> Self {
        Error::Dtype { arg, msg: msg.into() }
    }
    pub fn type_(arg: &'static str, msg: impl Into<String>) -> Self {
        Error::Type { arg, msg: msg.into() }
    }
    pub fn shape(arg: &'static str, msg: impl Into<String>) -> Self {
        Error::Shape { arg, msg: msg.into() }
    }
    pub fn layout(arg: &'static str, msg: impl Into<String>) -> Self {
        Error::Layout { arg, msg: msg.into() }
    }
    pub fn value(arg: &'static str, msg: impl Into<String>) -> Self {
        Error::Value { arg, msg: msg.into() }
    }
    pub fn device(arg: &'static str, msg: impl Into<String>) -> Self {
        Error::Device { arg, msg: msg.into() }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::NotTensor { arg, got } => {
                write!(f, "{arg}: expected a tensor (an object with __dlpack__), got {got}")
            }
            Error::Dtype { arg, msg }
            | Error::Type { arg, msg }
            | Error::Shape { arg, msg }
            | Error::Layout { arg, msg }
            | Error::Value { arg, msg }
            | Error::Device { arg, msg } => write!(f, "{arg}: {msg}"),
            Error::NotPlanned(reason) => {
                write!(f, "the kernel does not cover this call: {reason} (use the fallback)")
            }
            Error::NoDriver => write!(f, "no CUDA driver (libcuda) found"),
            Error::Cuda { what, code } => write!(f, "{what} failed: {code}"),
            Error::Unavailable { ordinal, reason } => write!(f, "{UNAVAILABLE_PREFIX}{ordinal}: {reason}"),
            Error::Forced(reason) => {
                write!(f, "{}=kernel, but the kernel cannot run this call: {reason}", crate::env::FORCE)
            }
            Error::Internal(msg) => write!(f, "kda_dhu internal error: {msg}"),
        }
    }
}

impl std::error::Error for Error {}

pub type Result<T> = std::result::Result<T, Error>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_map_to_the_documented_exceptions() {
        assert_eq!(Error::dtype("w", "x").py_kind(), PyKind::TypeError);
        assert_eq!(Error::NotTensor { arg: "q", got: "int".into() }.py_kind(), PyKind::TypeError);
        assert_eq!(Error::type_("scale", "x").py_kind(), PyKind::TypeError);
        assert_eq!(Error::shape("q", "x").py_kind(), PyKind::ValueError);
        assert_eq!(Error::layout("q", "x").py_kind(), PyKind::ValueError);
        assert_eq!(Error::value("scale", "x").py_kind(), PyKind::ValueError);
        assert_eq!(Error::device("q", "x").py_kind(), PyKind::ValueError);
        assert_eq!(Error::NotPlanned("x".into()).py_kind(), PyKind::ValueError);
        assert_eq!(Error::NoDriver.py_kind(), PyKind::RuntimeError);
        assert_eq!(Error::Cuda { what: "a".into(), code: "b".into() }.py_kind(), PyKind::RuntimeError);
        assert_eq!(Error::Unavailable { ordinal: 0, reason: "x".into() }.py_kind(), PyKind::Unavailable);
    }

    #[test]
    fn unavailable_messages_start_with_the_prefix_and_the_device() {
        let e = Error::Unavailable { ordinal: 3, reason: "CUDA driver 12.2: ...".into() };
        assert_eq!(e.to_string(), "kernel unavailable on cuda:3: CUDA driver 12.2: ...");
        assert!(e.to_string().starts_with(UNAVAILABLE_PREFIX));
    }

    #[test]
    fn messages_name_the_argument() {
        let e = Error::dtype("w", "expected dtype bfloat16 like q, got float16");
        assert_eq!(e.to_string(), "w: expected dtype bfloat16 like q, got float16");
        assert_eq!(Error::NoDriver.to_string(), "no CUDA driver (libcuda) found");
        let e = Error::type_("scale", "expected a float or None, got str");
        assert_eq!(e.to_string(), "scale: expected a float or None, got str");
    }
}
