//! NVRTC, loaded at build time (libloading) from a given libnvrtc: CUDA C++ source to a
//! SASS cubin, with ptxas's `-v` report in the program log. build.rs uses it for the
//! images that CUDA 12 drivers load (PyPI has NVRTC 12.9 but no CUDA 12 nvcc).

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::path::Path;

type Program = *mut c_void;
type NvrtcResult = c_int;

/// The NVRTC entry points build.rs calls (nvrtc.h), resolved once.
pub struct Nvrtc {
    _lib: libloading::Library,
    get_error_string: unsafe extern "C" fn(NvrtcResult) -> *const c_char,
    version: unsafe extern "C" fn(*mut c_int, *mut c_int) -> NvrtcResult,
    create_program: unsafe extern "C" fn(
        *mut Program,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> NvrtcResult,
    destroy_program: unsafe extern "C" fn(*mut Program) -> NvrtcResult,
    compile_program: unsafe extern "C" fn(Program, c_int, *const *const c_char) -> NvrtcResult,
    get_program_log_size: unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult,
    get_program_log: unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult,
    get_cubin_size: unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult,
    get_cubin: unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult,
}

// SAFETY: NVRTC's API may be called from several threads at once (each on its own
// program), and the library handle is only dropped with the struct.
unsafe impl Send for Nvrtc {}
unsafe impl Sync for Nvrtc {}

/// What one compilation gives back.
pub struct Output {
    /// The program log: compiler diagnostics, then ptxas's report.
    pub log: String,
    /// The cubin, or None when compilation failed.
    pub cubin: Option<Vec<u8>>,
}

impl Nvrtc {
    /// Loads libnvrtc from `path` (its builtins library is found next to it).
    pub fn load(path: &Path) -> Result<Nvrtc, String> {
        // SAFETY: loading NVRTC runs no initialisation with preconditions; every symbol
        // is given the signature nvrtc.h declares.
        unsafe {
            let lib = libloading::Library::new(path).map_err(|e| format!("cannot load {}: {e}", path.display()))?;
            macro_rules! sym {
                ($name:literal) => {
                    *lib.get($name.as_bytes()).map_err(|e| format!("{} has no {}: {e}", path.display(), $name))?
                };
            }
            Ok(Nvrtc {
                get_error_string: sym!("nvrtcGetErrorString"),
                version: sym!("nvrtcVersion"),
                create_program: sym!("nvrtcCreateProgram"),
                destroy_program: sym!("nvrtcDestroyProgram"),
                compile_program: sym!("nvrtcCompileProgram"),
                get_program_log_size: sym!("nvrtcGetProgramLogSize"),
                get_program_log: sym!("nvrtcGetProgramLog"),
                get_cubin_size: sym!("nvrtcGetCUBINSize"),
                get_cubin: sym!("nvrtcGetCUBIN"),
                _lib: lib,
            })
        }
    }

    /// (major, minor), e.g. (12, 9).
    pub fn version(&self) -> Result<(i32, i32), String> {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: out-pointers to locals.
        self.check(unsafe { (self.version)(&mut major, &mut minor) }, "nvrtcVersion")?;
        Ok((major, minor))
    }

    fn check(&self, res: NvrtcResult, what: &str) -> Result<(), String> {
        if res == 0 {
            return Ok(());
        }
        // SAFETY: NVRTC returns a static string for every result code.
        let text = unsafe { CStr::from_ptr((self.get_error_string)(res)) }.to_string_lossy();
        Err(format!("{what} failed: {text} ({res})"))
    }

    /// Compiles `source` (named `name` in diagnostics) with `options`. An Err is a failure
    /// of NVRTC itself; a compilation error comes back as an Output without a cubin.
    pub fn compile(&self, source: &str, name: &str, options: &[String]) -> Result<Output, String> {
        let c_source = CString::new(source).map_err(|_| format!("{name} contains a NUL byte"))?;
        let c_name = CString::new(name).map_err(|_| format!("{name}: a NUL byte in the name"))?;
        let c_opts: Vec<CString> = options
            .iter()
            .map(|o| CString::new(o.as_str()).map_err(|_| format!("option {o:?} contains a NUL byte")))
            .collect::<Result<_, _>>()?;
        let opt_ptrs: Vec<*const c_char> = c_opts.iter().map(|o| o.as_ptr()).collect();
        let mut prog: Program = std::ptr::null_mut();
        // SAFETY: every pointer is a live NUL-terminated string for the call; no headers
        // are passed in memory (they come from the include paths).
        self.check(
            unsafe {
                (self.create_program)(
                    &mut prog,
                    c_source.as_ptr(),
                    c_name.as_ptr(),
                    0,
                    std::ptr::null(),
                    std::ptr::null(),
                )
            },
            "nvrtcCreateProgram",
        )?;
        let result = self.compile_created(prog, &opt_ptrs);
        // SAFETY: prog was created above and is destroyed once.
        let _ = unsafe { (self.destroy_program)(&mut prog) };
        result
    }

    fn compile_created(&self, prog: Program, options: &[*const c_char]) -> Result<Output, String> {
        // SAFETY: prog is a live program; options point at live strings.
        let res = unsafe { (self.compile_program)(prog, options.len() as c_int, options.as_ptr()) };
        let log = self.read(prog, self.get_program_log_size, self.get_program_log, "log")?;
        let log = String::from_utf8_lossy(log.strip_suffix(&[0]).unwrap_or(&log)).into_owned();
        const NVRTC_ERROR_COMPILATION: NvrtcResult = 6;
        if res == NVRTC_ERROR_COMPILATION {
            return Ok(Output { log, cubin: None });
        }
        self.check(res, "nvrtcCompileProgram").map_err(|e| format!("{e}\n{log}"))?;
        let cubin = self.read(prog, self.get_cubin_size, self.get_cubin, "CUBIN")?;
        Ok(Output { log, cubin: Some(cubin) })
    }

    /// One of the program's outputs through its (size, copy) pair of calls.
    fn read(
        &self,
        prog: Program,
        size: unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult,
        copy: unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult,
        what: &str,
    ) -> Result<Vec<u8>, String> {
        let mut n = 0usize;
        // SAFETY: out-pointer to a local; the buffer holds the n bytes NVRTC reported.
        self.check(unsafe { size(prog, &mut n) }, &format!("nvrtcGet{what}Size"))?;
        let mut buf = vec![0u8; n];
        if n > 0 {
            self.check(unsafe { copy(prog, buf.as_mut_ptr() as *mut c_char) }, &format!("nvrtcGet{what}"))?;
        }
        Ok(buf)
    }
}
