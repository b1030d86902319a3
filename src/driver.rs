//! The few helpers every driver call goes through. cudarc loads libcuda lazily and
//! *panics* on the first call when it is missing, so every device-needing path asks
//! `require_driver()` first, and the Python boundary catches panics as a last resort.

use crate::error::{Error, Result};
use cudarc::driver::sys::{self, CUresult};
use std::ffi::CStr;
use std::sync::OnceLock;

/// Whether libcuda can be loaded (checked once: `is_culib_present` opens the library).
pub fn driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to dlopen libcuda.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

pub fn require_driver() -> Result<()> {
    if driver_present() {
        Ok(())
    } else {
        Err(Error::NoDriver)
    }
}

/// "CUDA_ERROR_INVALID_VALUE (invalid argument)", from the driver when it can say.
pub fn error_name(res: CUresult) -> String {
    let mut name: *const std::ffi::c_char = std::ptr::null();
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: the driver returns pointers to static strings (or leaves them null).
    unsafe {
        if driver_present() {
            let _ = sys::cuGetErrorName(res, &mut name);
            let _ = sys::cuGetErrorString(res, &mut text);
        }
        let name =
            if name.is_null() { format!("{res:?}") } else { CStr::from_ptr(name).to_string_lossy().into_owned() };
        if text.is_null() {
            name
        } else {
            format!("{name} ({})", CStr::from_ptr(text).to_string_lossy())
        }
    }
}

/// Ok for CUDA_SUCCESS, else `Error::Cuda` naming the call (built lazily: the success
/// path formats nothing).
pub fn check(res: CUresult, what: impl FnOnce() -> String) -> Result<()> {
    if res == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(Error::Cuda { what: what(), code: error_name(res) })
    }
}
