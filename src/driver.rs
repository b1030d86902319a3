//! The few helpers every driver call goes through. cudarc loads libcuda lazily and
//! *panics* on the first call when it is missing, so every device-needing path asks
//! `require_driver()` first, and the Python boundary catches panics as a last resort.
//!
//! cudarc (feature `dynamic-loading`) also looks every entry point up lazily, by its plain
//! name, on its first call, and panics when the driver lacks it: the bindings' CUDA
//! version (`cuda-13040`, the newest: its CUresult enum knows every code a driver up to
//! 13.4 returns) sets no driver floor. The entry points the host core calls are listed
//! below (a test keeps the lists complete); every one is in each driver since CUDA 12.0.

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

/// Entry points without which no device can even be listed (every CUDA driver has them).
pub const BASIC_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetAttribute",
    "cuGetErrorName",
    "cuGetErrorString",
];

/// Entry points of the kernel path (context, module, launch, TMA descriptors): a driver
/// without one cannot run the kernels (CUDA 12.0 added the tensor-map ones).
pub const KERNEL_SYMBOLS: &[&str] = &[
    "cuDevicePrimaryCtxRetain",
    "cuCtxGetCurrent",
    "cuCtxSetCurrent",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuFuncSetAttribute",
    "cuLaunchKernel",
    "cuTensorMapEncodeTiled",
    "cuMemHostAlloc",
    "cuMemHostGetDevicePointer_v2",
    "cuMemAllocAsync",
    "cuMemFreeAsync",
];

/// Entry points used where the driver has them (tma.rs: without it every call encodes
/// its descriptors anew).
pub const OPTIONAL_SYMBOLS: &[&str] = &["cuTensorMapReplaceAddress"];

/// The names in `names` that the loaded libcuda does not export (all of them without
/// a driver).
pub fn missing_symbols(names: &[&'static str]) -> Vec<&'static str> {
    if !driver_present() {
        return names.to_vec();
    }
    // SAFETY: only looks symbols up in the loaded libcuda; nothing is called.
    let lib = unsafe { sys::culib() };
    names.iter().copied().filter(|n| unsafe { lib.get::<unsafe extern "C" fn()>(n.as_bytes()) }.is_err()).collect()
}

/// Whether a failed module load or launch means "this driver or GPU cannot run the
/// image" (an image for another architecture or a newer driver, a damaged image, no JIT
/// for it), as opposed to a bug or a transient failure (out of memory, a bad handle),
/// which still raise.
pub fn means_unusable_image(res: CUresult) -> bool {
    use CUresult::*;
    matches!(
        res,
        CUDA_ERROR_UNSUPPORTED_PTX_VERSION
            | CUDA_ERROR_NO_BINARY_FOR_GPU
            | CUDA_ERROR_INVALID_IMAGE
            | CUDA_ERROR_INVALID_SOURCE
            | CUDA_ERROR_INVALID_PTX
            | CUDA_ERROR_SHARED_OBJECT_INIT_FAILED
            | CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND
            | CUDA_ERROR_JIT_COMPILER_NOT_FOUND
            | CUDA_ERROR_INSUFFICIENT_LOADER_VERSION
    )
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

#[cfg(test)]
mod tests {
    use super::*;
    use cudarc::driver::sys::CUresult::*;

    #[test]
    fn image_failures_are_told_from_bugs() {
        for res in [
            CUDA_ERROR_UNSUPPORTED_PTX_VERSION,
            CUDA_ERROR_NO_BINARY_FOR_GPU,
            CUDA_ERROR_INVALID_IMAGE,
            CUDA_ERROR_INVALID_SOURCE,
            CUDA_ERROR_INVALID_PTX,
            CUDA_ERROR_SHARED_OBJECT_INIT_FAILED,
            CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND,
            CUDA_ERROR_JIT_COMPILER_NOT_FOUND,
            CUDA_ERROR_INSUFFICIENT_LOADER_VERSION,
        ] {
            assert!(means_unusable_image(res), "{res:?}");
        }
        for res in [
            CUDA_SUCCESS,
            CUDA_ERROR_OUT_OF_MEMORY,
            CUDA_ERROR_INVALID_VALUE,
            CUDA_ERROR_INVALID_HANDLE,
            CUDA_ERROR_INVALID_CONTEXT,
            CUDA_ERROR_NOT_FOUND,
            CUDA_ERROR_LAUNCH_FAILED,
            CUDA_ERROR_ILLEGAL_ADDRESS,
            CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES,
            CUDA_ERROR_NOT_INITIALIZED,
        ] {
            assert!(!means_unusable_image(res), "{res:?}");
        }
    }

    /// Every `sys::cu*` entry point called anywhere in src/ is in one of the lists, and
    /// every listed one is called: the driver check covers what the code uses.
    #[test]
    fn the_symbol_lists_are_the_entry_points_the_code_calls() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let needle = ["sys", "::", "cu"].concat();
        let mut used = std::collections::BTreeSet::new();
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).unwrap();
                for (i, _) in text.match_indices(&needle) {
                    let rest = &text[i + needle.len() - 2..];
                    let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                    if name != "culib" && name.len() > 2 {
                        used.insert(name);
                    }
                }
            }
        }
        let listed: std::collections::BTreeSet<String> =
            BASIC_SYMBOLS.iter().chain(KERNEL_SYMBOLS).chain(OPTIONAL_SYMBOLS).map(|s| s.to_string()).collect();
        assert_eq!(used, listed);
        // A machine without libcuda lacks them all.
        if !driver_present() {
            assert_eq!(missing_symbols(KERNEL_SYMBOLS), KERNEL_SYMBOLS.to_vec());
        }
    }
}
