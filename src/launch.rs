//! Device side of the host core: the driver, per-device state (primary context,
//! module, functions), filling DhuParams and launching on the caller's stream.
//!
//! Everything is cached per device for the life of the process: the primary context
//! (torch uses the same one), the module loaded from the embedded cubin, the four
//! CUfunction handles with their dynamic-smem attribute set; the TMA descriptors are
//! cached per signature (`tma::tensor_maps`). A call is read and validated once
//! (`prepare`, which also plans it); launching the `Prepared` call then checks only
//! what is new, the outputs (and the chunk_offsets the Python layer computed), patches
//! the cached descriptors' addresses and calls cuLaunchKernel.
//!
//! A device whose driver or GPU cannot run the kernel image (an image too new for the
//! driver, no kernel for the architecture, a missing entry point: `Error::Unavailable`)
//! is found out once, when `prepare` first meets it, and from then on every plan on it
//! is a fallback whose reason says why (`unavailable`); errors that mean a bug still
//! raise.

use crate::abi::{DhuError, DhuParams};
use crate::driver::{
    check, error_name, means_unusable_image, missing_symbols, require_driver, BASIC_SYMBOLS, KERNEL_SYMBOLS,
};
use crate::env;
use crate::error::{Error, Result};
use crate::facts;
use crate::kernels;
use crate::plan::{plan, Arch, DeviceInfo, KernelConfig, Plan, Rule, MAX_SLOTS};
use crate::split::{self, Split, SPLIT_ENTRIES};
use crate::tensor::TensorMeta;
use crate::tma::{tensor_maps, TmaPointers, TmaShape};
use crate::validate::{validate, validate_outputs, CallArgs, CallDesc, Outputs};
use crate::varlen::Fault;
use cudarc::driver::sys::{
    self, CUcontext, CUdevice, CUdevice_attribute, CUfunction, CUfunction_attribute, CUmodule, CUresult,
};
use std::ffi::{c_void, CStr, CString};
use std::sync::OnceLock;

/// Dynamic shared memory of the kernel `config` names on `arch`: its shared-memory map's
/// bytes plus the alignment slack, as cuda/dhu_layout.h (their one owner) defines them,
/// through `crate::facts`.
pub fn smem_bytes(arch: Arch, config: &KernelConfig) -> u32 {
    let table: &[facts::Layout] = match arch {
        Arch::Sm90 if config.forward => &facts::SM90_FWD,
        Arch::Sm90 => &facts::SM90,
        Arch::Sm100 => &facts::SM100,
    };
    facts::layout(table, config.k, config.nwg)
        .unwrap_or_else(|| panic!("no entry point of {arch:?} has K = {} with {} warpgroups", config.k, config.nwg))
        .smem_bytes
}

/// Dynamic shared memory of a split's first-pass kernel (the one-warpgroup map of its K).
fn split_pass1_smem(k: u32) -> u32 {
    facts::layout(&facts::SM90, k, 1).expect("sm_90a has one-warpgroup kernels at K = 64 and 128").smem_bytes
}

/// Dynamic shared memory of the split kernel in `split::SPLIT_ENTRIES[slot]`: a first pass's
/// map, or the merge's P (cuda/dhu_layout.h, seg_merge).
fn split_slot_smem(slot: usize) -> u32 {
    let k = split::slot_k(slot);
    if split::is_summary_slot(slot) {
        split_pass1_smem(k)
    } else {
        split::merge_layout(k).smem_bytes
    }
}

/// Raw driver handles are plain pointers; the driver allows using them from any thread.
#[derive(Clone, Copy, Debug)]
struct Handle<T>(T);
// SAFETY: CUcontext / CUmodule / CUfunction are process-wide driver handles, valid on
// every thread once the context is current there.
unsafe impl<T> Send for Handle<T> {}
unsafe impl<T> Sync for Handle<T> {}

struct Kernels {
    _module: Handle<CUmodule>,
    /// Indexed by KernelConfig::slot(): k64 bf16, k64 fp16, k128 bf16, k128 fp16.
    funcs: [Handle<CUfunction>; MAX_SLOTS],
    /// sm_90a: the sequence split's kernels, indexed as `split::SPLIT_ENTRIES` (null on
    /// sm_100a, whose plans are never split).
    split: [Handle<CUfunction>; SPLIT_ENTRIES.len()],
    /// The image they came from, e.g. "dhu_sm90 sm_90a, CUDA 12 image".
    image: String,
}

/// An image to load: its bytes (embedded, or a file read once and kept), how messages
/// name it, and what it needs of the driver.
struct Image {
    bytes: &'static [u8],
    label: String,
    needs: String,
}

/// What the loader knows about the device it loads for.
struct Target {
    ordinal: i32,
    info: DeviceInfo,
    driver_version: i32,
    max_smem_optin: i32,
}

impl Target {
    /// `Error::Unavailable` for this device: the GPU and driver, what failed, what is needed.
    fn unavailable(&self, what: impl std::fmt::Display, needs: &str) -> Error {
        Error::Unavailable {
            ordinal: self.ordinal,
            reason: format!(
                "{} with CUDA driver {}: {what}; {needs}",
                self.info.sm_name(),
                kernels::driver_version_name(self.driver_version)
            ),
        }
    }
}

/// The driver calls that turn an image into the kernel table: a trait so that the tests
/// drive `load_kernels` with simulated driver answers.
trait ModuleApi {
    fn load(&self, image: &[u8]) -> std::result::Result<CUmodule, CUresult>;
    fn function(&self, module: CUmodule, name: &CStr) -> std::result::Result<CUfunction, CUresult>;
    fn set_max_dynamic_smem(&self, f: CUfunction, bytes: i32) -> std::result::Result<(), CUresult>;
}

/// The real driver (the device's context must be current).
struct DriverModules;

fn result<T>(res: CUresult, value: T) -> std::result::Result<T, CUresult> {
    if res == CUresult::CUDA_SUCCESS {
        Ok(value)
    } else {
        Err(res)
    }
}

impl ModuleApi for DriverModules {
    fn load(&self, image: &[u8]) -> std::result::Result<CUmodule, CUresult> {
        let mut module: CUmodule = std::ptr::null_mut();
        // SAFETY: the image is a complete, 128-byte aligned cubin kept for the process
        // lifetime (or rejected by the driver).
        let res = unsafe { sys::cuModuleLoadData(&mut module, image.as_ptr() as *const c_void) };
        result(res, module)
    }

    fn function(&self, module: CUmodule, name: &CStr) -> std::result::Result<CUfunction, CUresult> {
        let mut f: CUfunction = std::ptr::null_mut();
        // SAFETY: module was loaded by `load`; name outlives the call.
        let res = unsafe { sys::cuModuleGetFunction(&mut f, module, name.as_ptr()) };
        result(res, f)
    }

    fn set_max_dynamic_smem(&self, f: CUfunction, bytes: i32) -> std::result::Result<(), CUresult> {
        // SAFETY: f is a valid function handle.
        let res = unsafe {
            sys::cuFuncSetAttribute(f, CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes)
        };
        result(res, ())
    }
}

/// Loads `image` for `arch` on `target` and looks its entry points up. A failure that
/// means this driver or GPU cannot run the image (see `driver::means_unusable_image`, a
/// missing entry point, more shared memory than the GPU has) is `Error::Unavailable`;
/// any other is `Error::Cuda`.
fn load_kernels(api: &impl ModuleApi, arch: Arch, image: &Image, target: &Target) -> Result<Kernels> {
    let ordinal = target.ordinal;
    let module = api.load(image.bytes).map_err(|res| {
        let what = format!("cuModuleLoadData({}) failed: {}", image.label, error_name(res));
        if means_unusable_image(res) {
            target.unavailable(what, &image.needs)
        } else {
            Error::Cuda { what: format!("cuModuleLoadData({}) on cuda:{ordinal}", image.label), code: error_name(res) }
        }
    })?;
    // An entry point with `smem` bytes of dynamic shared memory (0: none asked for).
    let function = |name: &str, smem: u32| -> Result<CUfunction> {
        let cname = CString::new(name).expect("entry point names have no NUL");
        let f = api.function(module, &cname).map_err(|res| {
            if res == CUresult::CUDA_ERROR_NOT_FOUND {
                target.unavailable(
                    format!("{} has no entry point {name}", image.label),
                    "an image built from this release's cuda/ sources",
                )
            } else {
                Error::Cuda { what: format!("cuModuleGetFunction({name}) on cuda:{ordinal}"), code: error_name(res) }
            }
        })?;
        if smem == 0 {
            return Ok(f);
        }
        if smem as i64 > target.max_smem_optin as i64 {
            return Err(target.unavailable(
                format!(
                    "{name} needs {smem} bytes of shared memory per block, this GPU allows {}",
                    target.max_smem_optin
                ),
                "a GPU with 227 KB of shared memory per block (H100, H200, B200)",
            ));
        }
        api.set_max_dynamic_smem(f, smem as i32).map_err(|res| Error::Cuda {
            what: format!("cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES = {smem}) on {name}"),
            code: error_name(res),
        })?;
        Ok(f)
    };
    let mut funcs = [Handle(std::ptr::null_mut()); MAX_SLOTS];
    for (slot, cfg) in KernelConfig::all(arch).into_iter().enumerate() {
        debug_assert_eq!(cfg.slot(), slot);
        funcs[slot] = Handle(function(cfg.entry_point(arch), smem_bytes(arch, &cfg))?);
    }
    let mut split_funcs = [Handle(std::ptr::null_mut()); SPLIT_ENTRIES.len()];
    if arch == Arch::Sm90 {
        for (slot, name) in SPLIT_ENTRIES.iter().enumerate() {
            split_funcs[slot] = Handle(function(name, split_slot_smem(slot))?);
        }
    }
    Ok(Kernels { _module: Handle(module), funcs, split: split_funcs, image: image.label.clone() })
}

/// The image `arch`'s kernels load from on a driver of `driver_version`:
/// KDA_DHU_IMAGE_FILE's file, else the embedded image KDA_DHU_IMAGE selects (by
/// default the newest this driver loads).
fn image_for(arch: Arch, target: &Target) -> Result<Image> {
    if let Some(path) = env::image_file() {
        let data = std::fs::read(&path).map_err(|e| {
            Error::value(env::IMAGE_FILE, format!("expected a readable cubin file, got {}: {e}", path.display()))
        })?;
        return Ok(Image {
            bytes: leak_aligned(&data),
            label: format!("{}={}", env::IMAGE_FILE, path.display()),
            needs: format!("a cubin for {} that this driver loads", arch.sass()),
        });
    }
    let request = kernels::ImageRequest::parse(env::image().as_deref()).map_err(|e| Error::value(env::IMAGE, e))?;
    let c = kernels::select(kernels::EMBEDDED, arch.stem(), arch.sass(), target.driver_version, request)
        .map_err(|why| target.unavailable(why, "kda-dhu falls back to fla on this device"))?;
    let (v, branch) = kernels::min_driver(c.cuda, c.arch);
    Ok(Image {
        bytes: &c.image.0,
        label: format!("{} {}, CUDA {} image", c.stem, c.arch, c.cuda),
        needs: format!(
            "that image needs a driver for CUDA {} or newer ({branch}+) and a GPU of compute capability {}.{}",
            kernels::driver_version_name(v),
            target.info.cc_major,
            target.info.cc_minor
        ),
    })
}

/// `data` copied into 128-byte aligned memory kept for the process lifetime (a module
/// load reads it in place; loaded once per device).
fn leak_aligned(data: &[u8]) -> &'static [u8] {
    #[derive(Clone, Copy)]
    #[repr(C, align(128))]
    struct Block([u8; 128]);
    let mut blocks = vec![Block([0; 128]); data.len().div_ceil(128)];
    // SAFETY: `blocks` is data.len() rounded up to 128 bytes of plain bytes.
    let bytes = unsafe { std::slice::from_raw_parts_mut(blocks.as_mut_ptr() as *mut u8, blocks.len() * 128) };
    bytes[..data.len()].copy_from_slice(data);
    let leaked: &'static mut [Block] = Box::leak(blocks.into_boxed_slice());
    // SAFETY: the leaked blocks live for the process; the first data.len() bytes are `data`.
    unsafe { std::slice::from_raw_parts(leaked.as_ptr() as *const u8, data.len()) }
}

/// The device's `DhuError` record in host-mapped pinned memory: written by kernels that
/// find bad packed-batch entries, read (and cleared) by the host at the next call.
struct ErrorRecord {
    host: Handle<*mut DhuError>,
    device: u64,
}

struct DeviceState {
    ordinal: i32,
    dev: CUdevice,
    info: DeviceInfo,
    max_smem_optin: i32,
    ctx: OnceLock<Result<Handle<CUcontext>>>,
    kernels: OnceLock<Result<Kernels>>,
    errors: OnceLock<Result<ErrorRecord>>,
    /// Set when a launch found the loaded image unusable (a driver that loads functions
    /// lazily reports it there): the device's calls go to fla from then on.
    lost: OnceLock<Error>,
}

struct Driver {
    version: i32,
    /// Kernel-path entry points this driver lacks (driver::KERNEL_SYMBOLS): its devices
    /// cannot run the kernels.
    missing: Vec<&'static str>,
    devices: Vec<OnceLock<Result<DeviceState>>>,
}

fn driver() -> Result<&'static Driver> {
    static DRIVER: OnceLock<Result<Driver>> = OnceLock::new();
    require_driver()?;
    DRIVER
        .get_or_init(|| {
            // cudarc panics on a missing entry point: these are looked for first.
            let basic = missing_symbols(BASIC_SYMBOLS);
            if !basic.is_empty() {
                return Err(Error::Cuda {
                    what: "loading libcuda".into(),
                    code: format!("it lacks {}", basic.join(", ")),
                });
            }
            // SAFETY: plain driver queries with out-pointers to locals.
            unsafe {
                check(sys::cuInit(0), || "cuInit".into())?;
                let mut count = 0;
                check(sys::cuDeviceGetCount(&mut count), || "cuDeviceGetCount".into())?;
                let mut version = 0;
                check(sys::cuDriverGetVersion(&mut version), || "cuDriverGetVersion".into())?;
                Ok(Driver {
                    version,
                    missing: missing_symbols(KERNEL_SYMBOLS),
                    devices: (0..count.max(0)).map(|_| OnceLock::new()).collect(),
                })
            }
        })
        .as_ref()
        .map_err(Clone::clone)
}

fn attribute(dev: CUdevice, attr: CUdevice_attribute, ordinal: i32) -> Result<i32> {
    let mut v = 0;
    // SAFETY: out-pointer to a local.
    check(unsafe { sys::cuDeviceGetAttribute(&mut v, attr, dev) }, || {
        format!("cuDeviceGetAttribute({attr:?}) on cuda:{ordinal}")
    })?;
    Ok(v)
}

fn device(ordinal: i32) -> Result<&'static DeviceState> {
    let drv = driver()?;
    let slot = usize::try_from(ordinal).ok().and_then(|i| drv.devices.get(i)).ok_or_else(|| {
        Error::device("device", format!("expected a CUDA ordinal in [0, {}), got {ordinal}", drv.devices.len()))
    })?;
    slot.get_or_init(|| {
        let mut dev: CUdevice = 0;
        // SAFETY: out-pointer to a local.
        check(unsafe { sys::cuDeviceGet(&mut dev, ordinal) }, || format!("cuDeviceGet({ordinal})"))?;
        use CUdevice_attribute::*;
        let info = DeviceInfo {
            cc_major: attribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, ordinal)?,
            cc_minor: attribute(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, ordinal)?,
            sm_count: attribute(dev, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, ordinal)?,
        };
        let max_smem_optin = attribute(dev, CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, ordinal)?;
        Ok(DeviceState {
            ordinal,
            dev,
            info,
            max_smem_optin,
            ctx: OnceLock::new(),
            kernels: OnceLock::new(),
            errors: OnceLock::new(),
            lost: OnceLock::new(),
        })
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// Makes a context current for a scope and restores the previous one on drop.
struct CtxScope {
    prev: CUcontext,
    switched: bool,
}

impl CtxScope {
    fn enter(ctx: CUcontext) -> Result<CtxScope> {
        let mut prev: CUcontext = std::ptr::null_mut();
        // SAFETY: out-pointer to a local; ctx is a retained primary context.
        unsafe {
            check(sys::cuCtxGetCurrent(&mut prev), || "cuCtxGetCurrent".into())?;
            if prev == ctx {
                return Ok(CtxScope { prev, switched: false });
            }
            check(sys::cuCtxSetCurrent(ctx), || "cuCtxSetCurrent".into())?;
        }
        Ok(CtxScope { prev, switched: true })
    }
}

impl Drop for CtxScope {
    fn drop(&mut self) {
        if self.switched {
            // SAFETY: restores what was current before (possibly null, which is valid).
            let _ = unsafe { sys::cuCtxSetCurrent(self.prev) };
        }
    }
}

impl DeviceState {
    /// The device's primary context (retained once, never released: torch shares it).
    fn context(&self) -> Result<CUcontext> {
        self.ctx
            .get_or_init(|| {
                let mut ctx: CUcontext = std::ptr::null_mut();
                // SAFETY: out-pointer to a local.
                check(unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, self.dev) }, || {
                    format!("cuDevicePrimaryCtxRetain on cuda:{}", self.ordinal)
                })?;
                Ok(Handle(ctx))
            })
            .as_ref()
            .map(|h| h.0)
            .map_err(Clone::clone)
    }

    fn target(&self, driver_version: i32) -> Target {
        Target { ordinal: self.ordinal, info: self.info, driver_version, max_smem_optin: self.max_smem_optin }
    }

    /// The module of `arch` and its entry points, loaded once (the context must be
    /// current), or why this device cannot run them (`Error::Unavailable`, cached with
    /// every other failure).
    fn kernels(&self, drv: &Driver, arch: Arch) -> Result<&Kernels> {
        if let Some(e) = self.lost.get() {
            return Err(e.clone());
        }
        self.kernels
            .get_or_init(|| {
                let target = self.target(drv.version);
                if !drv.missing.is_empty() {
                    return Err(target.unavailable(
                        format_args!("the driver lacks {}", drv.missing.join(", ")),
                        "kda-dhu needs a driver for CUDA 12.0 or newer (R525+)",
                    ));
                }
                let image = image_for(arch, &target)?;
                load_kernels(&DriverModules, arch, &image, &target)
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The loaded kernels (loading them the first time, in the device's primary context),
    /// or why this device cannot run them (`Error::Unavailable`).
    fn loaded(&self, drv: &Driver) -> Result<&Kernels> {
        let Some(arch) = Arch::from_cc(self.info.cc_major, self.info.cc_minor) else {
            return Err(self.target(drv.version).unavailable(
                "kda-dhu has no kernel for this GPU",
                "a GPU of compute capability 9.0 (H100, H200) or 10.0 (B200, GB200)",
            ));
        };
        if let Some(e) = self.lost.get() {
            return Err(e.clone());
        }
        if let Some(k) = self.kernels.get() {
            return k.as_ref().map_err(Clone::clone);
        }
        let _scope = CtxScope::enter(self.context()?)?;
        self.kernels(drv, arch)
    }

    /// Why this device cannot run the kernels (None: it can), loading them the first
    /// time (in the device's primary context). Errors other than `Unavailable` propagate.
    fn unavailable(&self, drv: &Driver) -> Result<Option<String>> {
        match self.loaded(drv) {
            Ok(_) => Ok(None),
            Err(e @ Error::Unavailable { .. }) => Ok(Some(e.to_string())),
            Err(e) => Err(e),
        }
    }
}

/// Why CUDA device `ordinal` cannot run kda-dhu's kernels ("kernel unavailable on
/// cuda:N: ...", naming the GPU, the driver and what is needed), or None when it can.
/// The first call per device loads its kernel image (creating the primary context);
/// the answer is kept for the process. Raises for other failures (no driver, a bad
/// ordinal, a transient driver error).
pub fn unavailable(ordinal: i32) -> Result<Option<String>> {
    let drv = driver()?;
    device(ordinal)?.unavailable(drv)
}

/// The image device `ordinal` runs its kernels from (e.g. "dhu_sm90 sm_90a, CUDA 12
/// image"), loading it as `unavailable` does; None where the device cannot run them.
pub fn kernel_image(ordinal: i32) -> Result<Option<String>> {
    let drv = driver()?;
    match device(ordinal)?.loaded(drv) {
        Ok(k) => Ok(Some(k.image.clone())),
        Err(Error::Unavailable { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

/// `plan` on a device that cannot run the kernels says so, whatever the call.
fn on_device(p: Plan, unavailable: &Option<String>) -> Plan {
    match unavailable {
        Some(reason) => Plan::Fallback { reason: reason.clone() },
        None => p,
    }
}

impl DeviceState {
    /// The error record, allocated once per device (the context must be current): with
    /// the module, at the first launch, so that no later call allocates.
    fn error_record(&self) -> Result<&ErrorRecord> {
        self.errors
            .get_or_init(|| {
                let mut host: *mut c_void = std::ptr::null_mut();
                let size = std::mem::size_of::<DhuError>();
                let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
                // SAFETY: out-pointers to locals; the allocation lives for the process.
                unsafe {
                    check(sys::cuMemHostAlloc(&mut host, size, flags), || {
                        format!("cuMemHostAlloc({size} bytes, DEVICEMAP) on cuda:{}", self.ordinal)
                    })?;
                    std::ptr::write_volatile(host as *mut DhuError, DhuError::default());
                    let mut device: sys::CUdeviceptr = 0;
                    check(sys::cuMemHostGetDevicePointer_v2(&mut device, host, 0), || {
                        format!("cuMemHostGetDevicePointer on cuda:{}", self.ordinal)
                    })?;
                    Ok(ErrorRecord { host: Handle(host as *mut DhuError), device: device as u64 })
                }
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// A bad packed batch found on the device since the last look (no synchronization:
    /// what kernels still running find is reported later), as the host check words it,
    /// and the record cleared.
    fn take_input_error(&self) -> Option<Error> {
        let rec = self.errors.get()?.as_ref().ok()?;
        let p = rec.host.0;
        // SAFETY: p is the live host-mapped record; the kernels write it with atomics
        // and system-scope fences, details before the code.
        unsafe {
            let code = std::ptr::read_volatile(std::ptr::addr_of!((*p).code));
            if code == 0 {
                return None;
            }
            std::sync::atomic::fence(std::sync::atomic::Ordering::Acquire);
            let seq = std::ptr::read_volatile(std::ptr::addr_of!((*p).seq));
            let a = std::ptr::read_volatile(std::ptr::addr_of!((*p).a));
            let b = std::ptr::read_volatile(std::ptr::addr_of!((*p).b));
            let t = std::ptr::read_volatile(std::ptr::addr_of!((*p).t));
            let nt = std::ptr::read_volatile(std::ptr::addr_of!((*p).nt));
            std::ptr::write_volatile(p, DhuError::default());
            let e = match Fault::from_device(code, seq, a, b) {
                Some(f) => f.to_error(t, nt),
                None => Error::Internal(format!("unknown device error code {code}")),
            };
            Some(match e {
                Error::Value { arg, msg } => Error::Value {
                    arg,
                    msg: format!(
                        "{msg} (found on cuda:{} by an earlier call, whose outputs for sequence {seq} are NaN; \
                         KDA_DHU_CHECK_INPUTS=1 checks each call on the host instead)",
                        self.ordinal
                    ),
                },
                other => other,
            })
        }
    }
}

/// Raises (once) a bad packed batch that a kernel on cuda:`ordinal` found since the last
/// look. Does not synchronize: call after the device is synchronized to see every
/// finished launch.
pub fn check_input_errors(ordinal: i32) -> Result<()> {
    match device(ordinal)?.take_input_error() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// The planner's view of a device (no context needed).
pub fn device_info(ordinal: i32) -> Result<DeviceInfo> {
    Ok(device(ordinal)?.info)
}

/// (driver usable, a one-line description), without creating a context.
pub fn cuda_status() -> (bool, String) {
    let drv = match driver() {
        Ok(d) => d,
        Err(e) => return (false, e.to_string()),
    };
    let mut parts = Vec::new();
    for i in 0..drv.devices.len() as i32 {
        match device(i) {
            Ok(d) => parts.push(format!("cuda:{i} {} ({} SMs)", d.info.sm_name(), d.info.sm_count)),
            Err(e) => parts.push(format!("cuda:{i} unavailable ({e})")),
        }
    }
    let v = drv.version;
    let ok = !parts.is_empty();
    let list = if ok { parts.join(", ") } else { "no devices".to_string() };
    let images = match kernels::select(
        kernels::EMBEDDED,
        Arch::Sm90.stem(),
        Arch::Sm90.sass(),
        v,
        kernels::ImageRequest::Newest,
    ) {
        Ok(c) => format!("loads the CUDA {} kernel images", c.cuda),
        Err(why) => why,
    };
    let name = kernels::driver_version_name(v);
    (ok, format!("CUDA driver {name} ({images}), {} device(s): {list}", drv.devices.len()))
}

/// "sm_90" for an H100/H200.
pub fn device_arch(ordinal: i32) -> Result<String> {
    Ok(device_info(ordinal)?.sm_name())
}

/// Validation with the device check + the device's DeviceInfo + the plan.
/// On a device that cannot run the kernels (`unavailable`) the plan is a fallback that
/// says why.
pub fn plan_call(args: &CallArgs, rule: Rule) -> Result<(CallDesc, Plan)> {
    let desc = validate(args, true)?;
    let ordinal = validated_ordinal(&desc)?;
    let info = device_info(ordinal)?;
    let p = on_device(plan(&desc, &info, rule), &unavailable(ordinal)?);
    Ok((desc, p))
}

fn validated_ordinal(desc: &CallDesc) -> Result<i32> {
    desc.device.ok_or_else(|| Error::Internal("validated call without a device".into()))
}

/// A call read, validated (device included) and planned once: everything `launch`
/// needs but the outputs, as plain numbers (the tensors' addresses, not the tensors:
/// the caller keeps them alive until the launch).
#[derive(Clone, Debug)]
pub struct Prepared {
    pub args: CallArgs,
    pub desc: CallDesc,
    pub info: DeviceInfo,
    /// Why the device cannot run the kernels (`unavailable`): every plan of the call is
    /// then a fallback with this reason.
    pub unavailable: Option<String>,
    /// The kernel and its configuration where the plan of the call's rule is the kernel:
    /// what `launch` runs, without planning again.
    pub kernel: Option<(Arch, KernelConfig)>,
}

impl Prepared {
    /// Validates `args` fully and reads the device (as `plan_call`, the device's
    /// availability included), and plans under `rule`. First raises a bad packed batch
    /// that a kernel on that device found since the last call (see `check_input_errors`).
    pub fn new(args: CallArgs, rule: Rule) -> Result<(Prepared, Plan)> {
        let desc = validate(&args, true)?;
        Prepared::on_device(args, desc, rule)
    }

    /// `new` for fla's forward scan (`crate::forward`): validated in its own names, carried
    /// by its stage-4 call, planned as the forward scan.
    pub fn new_forward(a: &crate::forward::FwdArgs, rule: Rule) -> Result<(Prepared, Plan)> {
        let desc = crate::forward::validate(a, true)?;
        Prepared::on_device(a.carrier(), desc, rule)
    }

    fn on_device(args: CallArgs, desc: CallDesc, rule: Rule) -> Result<(Prepared, Plan)> {
        let ordinal = validated_ordinal(&desc)?;
        let info = device_info(ordinal)?;
        check_input_errors(ordinal)?;
        let unavailable = unavailable(ordinal)?;
        let p = on_device(plan(&desc, &info, rule), &unavailable);
        Ok((Prepared::planned(args, desc, info, unavailable, &p), p))
    }

    /// From a validated call and its device, which can run the kernels (pure: tests
    /// build it without a GPU).
    pub fn with_info(args: CallArgs, desc: CallDesc, info: DeviceInfo, rule: Rule) -> (Prepared, Plan) {
        let p = plan(&desc, &info, rule);
        (Prepared::planned(args, desc, info, None, &p), p)
    }

    fn planned(args: CallArgs, desc: CallDesc, info: DeviceInfo, unavailable: Option<String>, p: &Plan) -> Prepared {
        let kernel = match p {
            Plan::Kernel { arch, config } => Some((*arch, *config)),
            Plan::Fallback { .. } => None,
        };
        Prepared { args, desc, info, unavailable, kernel }
    }

    /// The plan of the same call under another rule (no re-validation).
    pub fn replan(&self, rule: Rule) -> Plan {
        on_device(plan(&self.desc, &self.info, rule), &self.unavailable)
    }

    /// Launches the call (as `launch`, without reading or validating the inputs again)
    /// writing `outs`, on `stream`.
    /// The kernel of the rule's plan; where that was a fallback, the Capable plan's (the
    /// caller asked for the kernel wherever it can compute the call).
    pub fn launch(&self, outs: &Outputs, stream: u64) -> Result<()> {
        launch_validated(&self.args, &self.desc, &self.info, self.kernel, outs, stream)
    }
}

fn opt_ptr(t: &Option<TensorMeta>) -> u64 {
    t.as_ref().map_or(0, |t| t.ptr)
}

/// DhuParams without the tensor maps (pure: tested without a GPU).
pub fn fill_scalars(
    args: &CallArgs,
    outs: &Outputs,
    desc: &CallDesc,
    config: &KernelConfig,
    nt: i64,
) -> Result<DhuParams> {
    let varlen = desc.varlen();
    let d = &desc.dims;
    let to_i32 = |x: i64, name: &'static str| {
        i32::try_from(x).map_err(|_| Error::value(name, format!("expected a value that fits in int32, got {x}")))
    };
    let mut p = DhuParams::zeroed();
    p.g = opt_ptr(&args.g);
    p.gk = opt_ptr(&args.gk);
    p.dht = opt_ptr(&args.dht);
    p.dh0 = opt_ptr(&outs.dh0);
    p.cu_seqlens = if varlen { opt_ptr(&args.cu_seqlens) } else { 0 };
    // The caller's table where it has fla's N + 1 entries; else the kernel sums.
    p.chunk_offsets = if varlen && desc.chunk_offsets.is_some() { opt_ptr(&args.chunk_offsets) } else { 0 };
    p.dv2 = outs.dv2.ptr;
    p.dh = outs.dh.ptr;
    p.t = d.t;
    p.nt = to_i32(nt, "dh")?;
    p.h = to_i32(d.h, "q")?;
    p.hv = to_i32(d.hv, "w")?;
    p.v = to_i32(d.v, "do")?;
    p.scale = desc.scale as f32;
    p.flags = config.flags;
    p.n = to_i32(d.n, "cu_seqlens")?;
    Ok(p)
}

/// The kernel, its DhuParams (descriptors included) and launch shape for a validated
/// call and its outputs: `kernel` where the call was planned to it, else the Capable
/// plan's (NotPlanned when that says fallback).
pub fn launch_params(
    args: &CallArgs,
    desc: &CallDesc,
    info: &DeviceInfo,
    kernel: Option<(Arch, KernelConfig)>,
    outs: &Outputs,
) -> Result<(Arch, KernelConfig, DhuParams)> {
    let (arch, config) = match kernel {
        Some(planned) => planned,
        None => match plan(desc, info, Rule::Capable) {
            Plan::Kernel { arch, config } => (arch, config),
            Plan::Fallback { reason } => return Err(Error::NotPlanned(reason)),
        },
    };
    let nt = validate_outputs(desc, outs)?;
    let mut params = fill_scalars(args, outs, desc, &config, nt)?;
    let d = &desc.dims;
    let shape = TmaShape {
        b: d.b as u64,
        t: d.t as u64,
        h: d.h as u64,
        hv: d.hv as u64,
        k: d.k as u64,
        v: d.v as u64,
        nt: nt as u64,
        dtype: config.dtype,
        svf: config.svf,
    };
    let ptrs = TmaPointers {
        q: args.q.ptr,
        k: args.k.ptr,
        w: args.w.ptr,
        do_: args.do_.ptr,
        dv: args.dv.ptr,
        dv2: outs.dv2.ptr,
        dh: outs.dh.ptr,
    };
    let maps = tensor_maps(validated_ordinal(desc)?, &shape, &ptrs)?;
    [params.tma_q, params.tma_k, params.tma_w, params.tma_do, params.tma_dv, params.tma_dv2, params.tma_dh] = maps;
    Ok((arch, config, params))
}

/// Validates the call fully (as `plan_call` under the Capable rule), then launches it
/// as `Prepared::launch` does: on `stream` (a CUstream as an integer; 0 is the legacy
/// default stream). No sync.
pub fn launch(args: &CallArgs, outs: &Outputs, stream: u64) -> Result<()> {
    let desc = validate(args, true)?;
    let info = device_info(validated_ordinal(&desc)?)?;
    launch_validated(args, &desc, &info, None, outs, stream)
}

/// The forward scan (fla's `chunk_gated_delta_rule_fwd_h`) on the params of a stage-4 call
/// that carries it (SPEC.md, "The twin"): k, w as themselves, dv = u, dht = initial_state,
/// h0 present for a final state (dh0 = final_state), outputs dh = h, dv2 = v_new; q and do
/// any tensors of their shapes (not read). Validated as stage 4's call, then planned as the
/// forward scan ("capable": `CallDesc::forward`, stage 4's warpgroup rule and split). A probe
/// for the kernel's GPU tests beside the forward op's own path (`crate::forward`). No sync.
pub fn launch_forward_probe(args: &CallArgs, outs: &Outputs, stream: u64) -> Result<()> {
    let mut desc = validate(args, true)?;
    desc.forward = true;
    let info = device_info(validated_ordinal(&desc)?)?;
    launch_validated(args, &desc, &info, None, outs, stream)
}

/// Kernel launches of this process that the driver accepted (every route: tests and
/// benchmarks count them around a call).
static LAUNCHES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Kernel launches so far (`_core.launch_count()`).
pub fn launch_count() -> u64 {
    LAUNCHES.load(std::sync::atomic::Ordering::Relaxed)
}

/// Outputs checked, DhuParams filled, descriptors from the cache, one cuLaunchKernel.
fn launch_validated(
    args: &CallArgs,
    desc: &CallDesc,
    info: &DeviceInfo,
    kernel: Option<(Arch, KernelConfig)>,
    outs: &Outputs,
    stream: u64,
) -> Result<()> {
    let (arch, config, mut params) = launch_params(args, desc, info, kernel, outs)?;
    let drv = driver()?;
    let dev = device(desc.device.expect("planned with a device"))?;
    let ctx = dev.context()?;
    let _scope = CtxScope::enter(ctx)?;
    let kernels = dev.kernels(drv, arch)?;
    let f = kernels.funcs[config.slot()].0;
    if desc.varlen() {
        params.error = dev.error_record()?.device;
    }
    let one = Launch { drv, dev, stream: stream as sys::CUstream };
    let smem = smem_bytes(arch, &config);
    let block = config.block_threads(arch);
    let mut param_ptr = [&mut params as *mut DhuParams as *mut c_void];
    let Some(sp) = config.split else {
        return one.run(config.entry_point(arch), f, config.grid, block, smem, &mut param_ptr);
    };
    launch_split(&one, kernels, desc, &config, sp, params, config.entry_point(arch), f, block, smem)
}

/// One stream's launches of a call.
struct Launch<'a> {
    drv: &'a Driver,
    dev: &'a DeviceState,
    stream: sys::CUstream,
}

impl Launch<'_> {
    /// cuLaunchKernel of `f` (`name`) with `args` (pointers to its parameters, in order).
    fn run(
        &self,
        name: &str,
        f: CUfunction,
        grid: [u32; 3],
        block: u32,
        smem: u32,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        let [gx, gy, gz] = grid;
        // SAFETY: f belongs to the current context's module; args points at the kernel's
        // live parameters, in order; the driver copies them at launch.
        let res = unsafe {
            sys::cuLaunchKernel(f, gx, gy, gz, block, 1, 1, smem, self.stream, args.as_mut_ptr(), std::ptr::null_mut())
        };
        let what = || format!("cuLaunchKernel({name}, grid ({gx}, {gy}, {gz}), block ({block}, 1, 1), smem {smem})");
        if means_unusable_image(res) {
            // A driver that loads functions lazily finds the image unusable here: the device's
            // calls go to fla from now on.
            let e = self.dev.target(self.drv.version).unavailable(
                format_args!("{} failed: {}", what(), error_name(res)),
                "an image this driver and GPU load (see kda_dhu's README: driver requirements)",
            );
            return Err(self.dev.lost.get_or_init(|| e).clone());
        }
        check(res, || format!("{} on cuda:{}", what(), self.dev.ordinal))?;
        LAUNCHES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(())
    }

    /// `bytes` of device memory ordered on the stream (cuMemAllocAsync: no synchronization).
    fn alloc(&self, bytes: u64) -> Result<sys::CUdeviceptr> {
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: ptr is a live out-parameter; the stream belongs to the current context.
        let res = unsafe { sys::cuMemAllocAsync(&mut ptr, bytes as usize, self.stream) };
        check(res, || format!("cuMemAllocAsync({bytes} bytes) on cuda:{}", self.dev.ordinal))?;
        Ok(ptr)
    }

    /// Frees `ptr` once the stream's work so far is done (cuMemFreeAsync).
    fn free(&self, ptr: sys::CUdeviceptr) -> Result<()> {
        // SAFETY: ptr came from `alloc` on this stream and is freed once.
        let res = unsafe { sys::cuMemFreeAsync(ptr, self.stream) };
        check(res, || format!("cuMemFreeAsync on cuda:{}", self.dev.ordinal))
    }
}

/// A split call's three launches on the stream (src/split.rs): the first pass into U,
/// the merge into X, the second pass (`f`, the plan's kernel) from X; U and X are freed
/// in stream order after it.
#[allow(clippy::too_many_arguments)]
fn launch_split(
    one: &Launch,
    kernels: &Kernels,
    desc: &CallDesc,
    config: &KernelConfig,
    sp: Split,
    params: DhuParams,
    name: &str,
    f: CUfunction,
    block: u32,
    smem: u32,
) -> Result<()> {
    let shape = split::shape(desc, sp);
    let u = one.alloc(shape.u_elems * 4)?;
    let x = match one.alloc(shape.x_elems * 4) {
        Ok(x) => x,
        Err(e) => {
            one.free(u)?;
            return Err(e);
        }
    };
    let result = (|| {
        let (mut p1, mut p2) = split_params(&params, sp, u, x, config.forward);
        let slot = split::summary_slot(config.k, config.dtype, config.svf, config.has_g(), config.forward);
        one.run(
            SPLIT_ENTRIES[slot],
            kernels.split[slot].0,
            shape.pass1,
            facts::threads(&facts::SM90, 1),
            split_pass1_smem(config.k),
            &mut [&mut p1 as *mut DhuParams as *mut c_void],
        )?;
        let (mut mu, mut mx) = (u, x);
        let (mut s1, mut hv, mut v, mut svf) =
            (sp.launch_segments() as i32, params.hv, params.v, i32::from(config.svf));
        let mslot = split::merge_slot(config.k, config.forward);
        one.run(
            SPLIT_ENTRIES[mslot],
            kernels.split[mslot].0,
            shape.merge,
            shape.merge_threads,
            split_slot_smem(mslot),
            &mut [
                &mut mu as *mut u64 as *mut c_void,
                &mut mx as *mut u64 as *mut c_void,
                &mut s1 as *mut i32 as *mut c_void,
                &mut hv as *mut i32 as *mut c_void,
                &mut v as *mut i32 as *mut c_void,
                &mut svf as *mut i32 as *mut c_void,
            ],
        )?;
        one.run(name, f, config.grid, block, smem, &mut [&mut p2 as *mut DhuParams as *mut c_void])
    })();
    let freed = one.free(x).and(one.free(u));
    result.and(freed)
}

/// The two passes' DhuParams from the call's (src/split.rs): pass 1 from dht into U
/// (segments 1 .., every CTA's last state; the live one from its segment to the last),
/// pass 2 from X (segments 0 .., dh0 from segment 0). The forward scan's (`forward`):
/// pass 1 over segments live - 1 .. (the live CTA from segment 0), pass 2 over segments
/// live .. (final_state, where asked, from its last).
pub fn split_params(params: &DhuParams, sp: Split, u: u64, x: u64, forward: bool) -> (DhuParams, DhuParams) {
    let live = sp.live as i32;
    let mut p1 = *params;
    p1.seg_chunks = sp.seg_chunks as i32;
    p1.seg_first = if forward { live - 1 } else { 1 };
    p1.dh0 = u;
    let mut p2 = *params;
    p2.seg_chunks = sp.seg_chunks as i32;
    p2.seg_first = if forward { live } else { 0 };
    p2.dht = x;
    p2.flags |= crate::abi::FLAG_DHT;
    (p1, p2)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::abi::{FLAG_CU_I32, FLAG_DH0, FLAG_DHT, FLAG_GK, FLAG_OFFSETS_I32, FLAG_VARLEN};
    use crate::tensor::{DType, Device};
    use crate::validate::tests::call;

    fn outs(args: &CallArgs, nt: i64) -> Outputs {
        let (b, t, hv, k, v) = (args.q.shape[0], args.q.shape[1], args.w.shape[2], args.q.shape[3], args.do_.shape[3]);
        let n = args.h0.as_ref().map_or(b, |h| h.shape[0]);
        Outputs {
            dh: TensorMeta::contiguous(0xd000_0000, &[b, nt, hv, k, v], args.q.dtype, Device::cpu()),
            dh0: args
                .h0
                .as_ref()
                .map(|_| TensorMeta::contiguous(0xe000_0000, &[n, hv, k, v], DType::F32, Device::cpu())),
            dv2: TensorMeta::contiguous(0xf000_0000, &[b, t, hv, v], args.dv.dtype, Device::cpu()),
        }
    }

    #[test]
    fn split_params_place_the_live_segments() {
        use crate::abi::FLAG_DHT;
        let params = DhuParams::zeroed();
        for (live, fwd_p1, fwd_p2) in [(1u32, 0, 1), (2, 1, 2), (3, 2, 3)] {
            let sp = Split { segments: 6, seg_chunks: 171, live };
            // The forward scan: pass 1 from segment live - 1 (its live CTA from 0), pass 2 from live.
            let (p1, p2) = split_params(&params, sp, 0x10, 0x20, true);
            assert_eq!((p1.seg_first, p2.seg_first, p1.seg_chunks, p2.seg_chunks), (fwd_p1, fwd_p2, 171, 171));
            assert_eq!((p1.dh0, p2.dht, p2.flags & FLAG_DHT), (0x10, 0x20, FLAG_DHT));
            // Stage 4: pass 1 from segment 1 (its live CTA the last launch segment, to T), pass 2 from 0.
            let (p1, p2) = split_params(&params, sp, 0x10, 0x20, false);
            assert_eq!((p1.seg_first, p2.seg_first), (1, 0));
        }
    }

    #[test]
    fn scalars_and_pointers_fill_the_params() {
        let mut a = call(2, 1000, 4, 8, 64, 128, DType::BF16);
        a.scale = Some(0.5);
        a.h0 = Some(TensorMeta::contiguous(0x9000, &[2, 8, 64, 128], DType::F32, Device::cpu()));
        a.dht = Some(TensorMeta::contiguous(0xa000, &[2, 8, 64, 128], DType::F32, Device::cpu()));
        let desc = validate(&a, false).unwrap();
        let o = outs(&a, 16);
        let nt = validate_outputs(&desc, &o).unwrap();
        assert_eq!(nt, 16);
        let config = KernelConfig {
            k: 64,
            dtype: DType::BF16,
            flags: FLAG_GK | FLAG_DHT | FLAG_DH0,
            grid: [2, 8, 2],
            nwg: 1,
            svf: false,
            split: None,
            forward: false,
        };
        let p = fill_scalars(&a, &o, &desc, &config, nt).unwrap();
        assert_eq!((p.t, p.nt, p.h, p.hv, p.v), (1000, 16, 4, 8, 128));
        assert_eq!(p.scale, 0.5);
        assert_eq!(p.flags, FLAG_GK | FLAG_DHT | FLAG_DH0);
        assert_eq!(p.gk, a.gk.as_ref().unwrap().ptr);
        assert_eq!(p.dht, 0xa000);
        assert_eq!(p.g, 0);
        assert_eq!(p.dh0, 0xe000_0000);
        assert_eq!(p.dh, 0xd000_0000);
        assert_eq!(p.dv2, 0xf000_0000);
        assert_eq!((p.cu_seqlens, p.chunk_offsets), (0, 0));
    }

    #[test]
    fn varlen_sums_chunk_offsets_in_the_kernel_without_a_table() {
        let mut a = call(1, 1000, 4, 4, 128, 64, DType::BF16);
        a.h0 = None;
        a.dht = None;
        a.cu_seqlens = Some(TensorMeta::contiguous(0x40, &[4], DType::I64, Device::cpu()));
        let desc = validate(&a, false).unwrap();
        let o = outs(&a, 17);
        let config = KernelConfig {
            k: 128,
            dtype: DType::BF16,
            flags: FLAG_GK | FLAG_VARLEN,
            grid: [1, 4, 3],
            nwg: 1,
            svf: false,
            split: None,
            forward: false,
        };
        let p = fill_scalars(&a, &o, &desc, &config, 17).unwrap();
        assert_eq!((p.cu_seqlens, p.chunk_offsets, p.nt, p.t, p.n), (0x40, 0, 17, 1000, 3));
        a.chunk_offsets = Some(TensorMeta::contiguous(0x80, &[4], DType::I64, Device::cpu()));
        let desc = validate(&a, false).unwrap();
        let p = fill_scalars(&a, &o, &desc, &config, 17).unwrap();
        assert_eq!((p.cu_seqlens, p.chunk_offsets, p.nt, p.t), (0x40, 0x80, 17, 1000));
    }

    const H200: DeviceInfo = DeviceInfo { cc_major: 9, cc_minor: 0, sm_count: 132 };

    fn on_cuda(mut a: CallArgs) -> CallArgs {
        for t in [&mut a.q, &mut a.k, &mut a.w, &mut a.do_, &mut a.dv] {
            t.device = Device::cuda(0);
        }
        for t in
            [&mut a.g, &mut a.gk, &mut a.h0, &mut a.dht, &mut a.cu_seqlens, &mut a.chunk_indices, &mut a.chunk_offsets]
                .into_iter()
                .flatten()
        {
            t.device = Device::cuda(0);
        }
        a
    }

    fn prepared(a: CallArgs, rule: Rule) -> (Prepared, Plan) {
        let desc = validate(&a, true).unwrap();
        Prepared::with_info(a, desc, H200, rule)
    }

    #[test]
    fn a_prepared_call_replans_without_revalidating() {
        // A few CTAs: B2a's floor says fallback, Extended and Capable say kernel.
        let (pc, p) = prepared(on_cuda(call(1, 256 * 64, 4, 4, 64, 64, DType::BF16)), Rule::B2a);
        assert!(!p.is_kernel());
        assert_eq!(p.describe().1, "B*HV*(V/64) = 4 < 256 CTAs", "{p}");
        assert_eq!(pc.replan(Rule::Capable).describe(), (true, "kernel-sm90a".to_string()));
        assert_eq!(pc.replan(Rule::Extended).describe(), (true, "kernel-sm90a".to_string()));
        assert_eq!(pc.replan(Rule::B2a), p);
        for rule in [Rule::B2a, Rule::Extended, Rule::Capable] {
            assert_eq!(pc.replan(rule), plan(&pc.desc, &H200, rule));
        }
    }

    #[test]
    fn a_prepared_call_keeps_its_kernel_plan_for_the_launch() {
        // The rule's kernel plan is what the launch runs (not planned again); a fallback
        // keeps none, and the launch then asks the Capable rule.
        let (pc, p) = prepared(on_cuda(call(2, 256, 32, 32, 128, 128, DType::BF16)), Rule::Extended);
        let Plan::Kernel { arch, config } = p else { panic!("{p}") };
        assert_eq!(pc.kernel, Some((arch, config)));
        let (pc, p) = prepared(on_cuda(call(1, 256 * 64, 4, 4, 64, 64, DType::BF16)), Rule::B2a);
        assert!(!p.is_kernel() && pc.kernel.is_none());
    }

    #[test]
    fn launch_params_check_the_outputs_against_the_prepared_call() {
        let a = on_cuda(call(2, 128, 4, 4, 128, 64, DType::BF16));
        let (pc, _) = prepared(a.clone(), Rule::Extended);
        let mut o = outs(&a, 2);
        for t in [&mut o.dh, &mut o.dv2] {
            t.device = Device::cuda(0);
        }
        o.dh0.as_mut().unwrap().device = Device::cuda(0);
        // Wrong NT, missing dh0, misaligned dv2, another device: named before any driver pc.
        let mut bad = o.clone();
        bad.dh.shape[1] = 3;
        let e = launch_params(&pc.args, &pc.desc, &pc.info, pc.kernel, &bad).unwrap_err();
        assert!(e.to_string().starts_with("dh: expected shape [B=2, NT=2, HV=4, K=128, V=64]"), "{e}");
        let mut bad = o.clone();
        bad.dh0 = None;
        let e = launch_params(&pc.args, &pc.desc, &pc.info, pc.kernel, &bad).unwrap_err();
        assert!(e.to_string().starts_with("dh0: expected a tensor"), "{e}");
        let mut bad = o.clone();
        bad.dv2.ptr += 8;
        let e = launch_params(&pc.args, &pc.desc, &pc.info, pc.kernel, &bad).unwrap_err();
        assert!(e.to_string().starts_with("dv2: expected a 16-byte aligned data pointer"), "{e}");
        let mut bad = o.clone();
        bad.dh.device = Device::cuda(1);
        let e = launch_params(&pc.args, &pc.desc, &pc.info, pc.kernel, &bad).unwrap_err();
        assert_eq!(e.to_string(), "dh: expected a tensor on cuda:0 like q, got a tensor on cuda:1");
        // A call the kernel cannot compute is refused whatever rule prepared it.
        let mut chunk32 = on_cuda(call(2, 128, 4, 4, 128, 64, DType::BF16));
        chunk32.chunk_size = 32;
        let (pc, p) = prepared(chunk32, Rule::Capable);
        assert!(!p.is_kernel());
        let e = launch_params(&pc.args, &pc.desc, &pc.info, pc.kernel, &o).unwrap_err();
        assert!(matches!(e, Error::NotPlanned(_)), "{e}");
    }

    #[test]
    fn packed_batches_read_their_tables_as_the_caller_made_them() {
        let mut a = call(1, 1000, 4, 4, 128, 64, DType::BF16);
        a.h0 = None;
        a.dht = None;
        a.cu_seqlens = Some(TensorMeta::contiguous(0x40, &[4], DType::I32, Device::cpu()));
        // int32 cu_seqlens and a table of fla's N + 1 int32 offsets: the kernel reads both.
        a.chunk_offsets = Some(TensorMeta::contiguous(0x60, &[4], DType::I32, Device::cpu()));
        a.chunk_indices = Some(TensorMeta::contiguous(0x80, &[17, 2], DType::I64, Device::cpu()));
        let (pc, p) = prepared(on_cuda(a.clone()), Rule::Extended);
        let Plan::Kernel { config, .. } = p else { panic!("{p}") };
        assert_eq!(
            config.flags & (FLAG_VARLEN | FLAG_CU_I32 | FLAG_OFFSETS_I32),
            FLAG_VARLEN | FLAG_CU_I32 | FLAG_OFFSETS_I32
        );
        assert_eq!(pc.desc.nt, Some(17));
        let o = outs(&a, 17);
        let pr = fill_scalars(&pc.args, &o, &pc.desc, &config, 17).unwrap();
        assert_eq!((pr.cu_seqlens, pr.chunk_offsets, pr.nt, pr.n), (0x40, 0x60, 17, 3));
        // N entries (fla's kernel reads only those): not used, the kernel sums the counts.
        a.chunk_offsets = Some(TensorMeta::contiguous(0x60, &[3], DType::I64, Device::cpu()));
        let (pc, p) = prepared(on_cuda(a.clone()), Rule::Extended);
        let Plan::Kernel { config, .. } = p else { panic!("{p}") };
        assert_eq!(config.flags & FLAG_OFFSETS_I32, 0);
        let pr = fill_scalars(&pc.args, &o, &pc.desc, &config, 17).unwrap();
        assert_eq!(pr.chunk_offsets, 0);
        // Without chunk_indices NT is unknown on the host until the caller says.
        a.chunk_indices = None;
        let (pc, _) = prepared(on_cuda(a.clone()), Rule::Extended);
        assert_eq!((pc.desc.nt, pc.desc.out_shapes()), (None, None));
        a.nt = Some(17);
        let (pc, _) = prepared(on_cuda(a), Rule::Extended);
        let shapes = pc.desc.out_shapes().unwrap();
        assert_eq!((shapes.dh, shapes.dh0, shapes.dv2), ([1, 17, 4, 128, 64], None, [1, 1000, 4, 64]));
    }

    /// Host cost of the pure steps of one call at the tiny shape (B1 T64 H1 K128 V64):
    /// `cargo test --release -- --ignored host_steps_timing --nocapture`.
    #[test]
    #[ignore]
    fn host_steps_timing() {
        use crate::tma::{lookup_or_encode, Lru, TmaCache, TmaKey};
        let a = on_cuda(call(1, 64, 1, 1, 128, 64, DType::BF16));
        let n = 200_000;
        let time = |what: &str, f: &mut dyn FnMut()| {
            let t0 = std::time::Instant::now();
            for _ in 0..n {
                f();
            }
            println!("{what:<40} {:8.1} ns", t0.elapsed().as_nanos() as f64 / n as f64);
        };
        time("validate (8 tensors)", &mut || {
            std::hint::black_box(validate(std::hint::black_box(&a), true).unwrap());
        });
        let desc = validate(&a, true).unwrap();
        time("plan (Extended)", &mut || {
            std::hint::black_box(plan(std::hint::black_box(&desc), &H200, Rule::Extended));
        });
        let (pc, _) = prepared(a.clone(), Rule::Extended);
        let mut o = outs(&a, 1);
        for t in [&mut o.dh, &mut o.dv2] {
            t.device = Device::cuda(0);
        }
        o.dh0.as_mut().unwrap().device = Device::cuda(0);
        time("plan (Capable) + outputs + params", &mut || {
            let p = pc.replan(Rule::Capable);
            let Plan::Kernel { config, .. } = p else { panic!() };
            let nt = validate_outputs(&pc.desc, &o).unwrap();
            std::hint::black_box(fill_scalars(&pc.args, &o, &pc.desc, &config, nt).unwrap());
        });
        let cache: TmaCache = std::sync::Mutex::new(Lru::new(64));
        let shape = TmaShape { b: 1, t: 64, h: 1, hv: 1, k: 128, v: 64, nt: 1, dtype: DType::BF16, svf: false };
        let mut ptrs =
            TmaPointers { q: 0x1000, k: 0x2000, w: 0x3000, do_: 0x4000, dv: 0x5000, dv2: 0x6000, dh: 0x7000 };
        for t in 1..64 {
            let mut s = shape;
            s.t = t;
            let _ = lookup_or_encode(
                &cache,
                TmaKey { ordinal: 0, shape: s },
                &ptrs,
                || Ok(unsafe { std::mem::zeroed() }),
                |_, _, _| Ok(()),
            );
        }
        let key = TmaKey { ordinal: 0, shape };
        let mut i = 0u64;
        time("descriptor cache hit, 64 entries, 2 new addresses (fake replace)", &mut || {
            i += 1;
            ptrs.dh = 0x10_0000 + 16 * (i % 2);
            ptrs.dv2 = 0x20_0000 + 16 * (i % 2);
            let m = lookup_or_encode(
                &cache,
                key,
                &ptrs,
                || Ok(unsafe { std::mem::zeroed() }),
                |m, _, a| {
                    m.opaque[0] = a;
                    Ok(())
                },
            );
            std::hint::black_box(m.unwrap());
        });
    }

    #[test]
    fn every_entry_point_asks_for_its_shared_memory_map() {
        for arch in [Arch::Sm90, Arch::Sm100] {
            for cfg in KernelConfig::all(arch) {
                let smem = smem_bytes(arch, &cfg);
                // 227 KB is the opt-in maximum per block on sm_90 and sm_100.
                assert!(smem <= facts::SMEM_OPTIN_MAX_SM90, "{}: {smem}", cfg.entry_point(arch));
                // K = 64 with one warpgroup: two CTAs fit an SM (228 KB, 1 KB reserved per CTA).
                if arch == Arch::Sm90 && cfg.k == 64 && cfg.nwg == 1 {
                    assert!(2 * (smem + 1024) <= 228 * 1024, "{}: {smem}", cfg.entry_point(arch));
                }
            }
        }
        // The ring is 3 stages deep where shared memory allows (K = 128 with one warpgroup,
        // K = 64 with two), else 2.
        let stages: Vec<_> = facts::SM90.iter().map(|l| (l.k, l.nwg, l.stages)).collect();
        assert_eq!(stages, [(64, 1, 2), (128, 1, 3), (64, 2, 3), (128, 2, 2)]);
        // The forward scan's unsplit kernels: stage 4's maps but K = 128 with one warpgroup,
        // whose ring of w, k, u is 4 stages deep (cuda/dhu_layout.h, fwd_ring), unless an
        // experiment's build.
        if !crate::kernels::experiment_built("KDA_DHU_EXP_FWD_STAGES") {
            for (fwd, bwd) in facts::SM90_FWD.iter().zip(facts::SM90.iter()) {
                assert_eq!((fwd.k, fwd.nwg, fwd.threads), (bwd.k, bwd.nwg, bwd.threads));
                if (fwd.k, fwd.nwg) == (128, 1) {
                    assert_eq!(fwd.stages, 4);
                    assert!(fwd.smem_bytes < bwd.smem_bytes, "{fwd:?}");
                } else {
                    assert_eq!(fwd, bwd);
                }
            }
        }
    }

    /// Driver answers for `load_kernels`: what cuModuleLoadData returns, which entry point
    /// cuModuleGetFunction does not find (and with what), what cuFuncSetAttribute returns.
    struct FakeModules {
        load: CUresult,
        function: Option<(&'static str, CUresult)>,
        set: CUresult,
        smem_set: std::cell::RefCell<Vec<i32>>,
    }

    impl FakeModules {
        fn ok() -> FakeModules {
            FakeModules {
                load: CUresult::CUDA_SUCCESS,
                function: None,
                set: CUresult::CUDA_SUCCESS,
                smem_set: Default::default(),
            }
        }
    }

    impl ModuleApi for FakeModules {
        fn load(&self, _image: &[u8]) -> std::result::Result<CUmodule, CUresult> {
            result(self.load, 0x1000usize as CUmodule)
        }
        fn function(&self, _module: CUmodule, name: &CStr) -> std::result::Result<CUfunction, CUresult> {
            match self.function {
                Some((missing, res)) if name.to_str() == Ok(missing) => Err(res),
                _ => Ok((0x2000 + name.to_bytes().len()) as CUfunction),
            }
        }
        fn set_max_dynamic_smem(&self, _f: CUfunction, bytes: i32) -> std::result::Result<(), CUresult> {
            self.smem_set.borrow_mut().push(bytes);
            result(self.set, ())
        }
    }

    const H200_TARGET: Target = Target { ordinal: 1, info: H200, driver_version: 12020, max_smem_optin: 232448 };

    fn cuda12_image() -> Image {
        Image {
            bytes: b"\x7fELF",
            label: "dhu_sm90 sm_90a, CUDA 12 image".into(),
            needs: "that image needs a driver for CUDA 12.0 or newer (R525+) and a GPU of compute capability 9.0"
                .into(),
        }
    }

    fn load_with(api: &FakeModules, target: &Target) -> Result<Kernels> {
        load_kernels(api, Arch::Sm90, &cuda12_image(), target)
    }

    #[test]
    fn a_module_the_driver_cannot_load_makes_the_device_unavailable() {
        for code in [
            CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION,
            CUresult::CUDA_ERROR_NO_BINARY_FOR_GPU,
            CUresult::CUDA_ERROR_INVALID_IMAGE,
            CUresult::CUDA_ERROR_INVALID_SOURCE,
            CUresult::CUDA_ERROR_SHARED_OBJECT_INIT_FAILED,
            CUresult::CUDA_ERROR_JIT_COMPILER_NOT_FOUND,
        ] {
            let api = FakeModules { load: code, ..FakeModules::ok() };
            let e = load_with(&api, &H200_TARGET).err().expect("a failed load");
            let Error::Unavailable { ordinal, .. } = &e else { panic!("{code:?}: {e:?}") };
            assert_eq!(*ordinal, 1);
            let msg = e.to_string();
            let head = format!(
                "kernel unavailable on cuda:1: sm_90 with CUDA driver 12.2: \
                 cuModuleLoadData(dhu_sm90 sm_90a, CUDA 12 image) failed: {code:?}"
            );
            assert!(msg.starts_with(&head), "{msg}");
            assert!(
                msg.ends_with(
                    "; that image needs a driver for CUDA 12.0 or newer (R525+) and a GPU of compute capability 9.0"
                ),
                "{msg}"
            );
            assert_eq!(e.py_kind(), crate::error::PyKind::Unavailable);
            assert!(api.smem_set.borrow().is_empty(), "nothing after a failed load");
        }
    }

    #[test]
    fn load_failures_that_mean_a_bug_still_raise() {
        for code in [CUresult::CUDA_ERROR_OUT_OF_MEMORY, CUresult::CUDA_ERROR_INVALID_CONTEXT] {
            let e = load_with(&FakeModules { load: code, ..FakeModules::ok() }, &H200_TARGET).err().unwrap();
            assert!(matches!(e, Error::Cuda { .. }), "{code:?}: {e:?}");
            assert!(e.to_string().starts_with("cuModuleLoadData(dhu_sm90 sm_90a, CUDA 12 image) on cuda:1 failed: "));
        }
        let api = FakeModules {
            function: Some(("kda_dhu_sm90_rs_k64_bf16", CUresult::CUDA_ERROR_INVALID_HANDLE)),
            ..FakeModules::ok()
        };
        let e = load_with(&api, &H200_TARGET).err().unwrap();
        assert!(matches!(e, Error::Cuda { .. }), "{e:?}");
        let api = FakeModules { set: CUresult::CUDA_ERROR_INVALID_VALUE, ..FakeModules::ok() };
        let e = load_with(&api, &H200_TARGET).err().unwrap();
        assert!(e.to_string().starts_with("cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES = "), "{e}");
    }

    #[test]
    fn a_missing_entry_point_or_too_little_shared_memory_makes_the_device_unavailable() {
        let api = FakeModules {
            function: Some(("kda_dhu_sm90_rs_k128_fp16_wg2_svf", CUresult::CUDA_ERROR_NOT_FOUND)),
            ..FakeModules::ok()
        };
        let e = load_with(&api, &H200_TARGET).err().unwrap();
        assert_eq!(
            e.to_string(),
            "kernel unavailable on cuda:1: sm_90 with CUDA driver 12.2: dhu_sm90 sm_90a, CUDA 12 image has no entry \
             point kda_dhu_sm90_rs_k128_fp16_wg2_svf; an image built from this release's cuda/ sources"
        );
        let small = Target { max_smem_optin: 99_000, ..H200_TARGET };
        let e = load_with(&FakeModules::ok(), &small).err().unwrap();
        let msg = e.to_string();
        assert!(matches!(e, Error::Unavailable { .. }), "{e:?}");
        let want = format!(
            "kda_dhu_sm90_rs_k64_bf16 needs {} bytes of shared memory per block, this GPU allows 99000",
            smem_bytes(Arch::Sm90, &KernelConfig::all(Arch::Sm90)[0])
        );
        assert!(msg.contains(&want), "{msg}");
    }

    #[test]
    fn a_loadable_module_fills_every_slot_with_its_shared_memory_set() {
        let api = FakeModules::ok();
        let k = load_with(&api, &H200_TARGET).unwrap();
        assert!(k.funcs.iter().all(|f| !f.0.is_null()));
        assert!(k.split.iter().all(|f| !f.0.is_null()));
        // The stage-4 and forward-scan entry points, then the split's first-pass kernels and
        // merges, in SPLIT_ENTRIES' order.
        let mut want: Vec<i32> =
            KernelConfig::all(Arch::Sm90).iter().map(|c| smem_bytes(Arch::Sm90, c) as i32).collect();
        for slot in 0..SPLIT_ENTRIES.len() {
            let k = split::slot_k(slot);
            // The merge's P [K, K + 4] fp32 (cuda/dhu_layout.h, seg_merge).
            let merge = (k * (k + 4) * 4) as i32;
            want.push(if split::is_summary_slot(slot) { split_pass1_smem(k) as i32 } else { merge });
        }
        assert_eq!(*api.smem_set.borrow(), want);
    }

    #[test]
    fn every_plan_on_an_unavailable_device_is_a_fallback_that_says_why() {
        let (mut pc, p) = prepared(on_cuda(call(2, 128, 4, 4, 128, 64, DType::BF16)), Rule::Extended);
        assert!(p.is_kernel());
        let reason = Error::Unavailable { ordinal: 0, reason: "sm_90 with CUDA driver 12.2: ...".into() }.to_string();
        pc.unavailable = Some(reason.clone());
        for rule in [Rule::B2a, Rule::Extended, Rule::Capable] {
            assert_eq!(pc.replan(rule).describe(), (false, reason.clone()));
        }
        assert_eq!(on_device(Plan::Fallback { reason: "x".into() }, &None), Plan::Fallback { reason: "x".into() });
    }

    #[test]
    fn a_file_image_is_kept_aligned() {
        let data: Vec<u8> = (0..300u32).map(|i| i as u8).collect();
        let kept = leak_aligned(&data);
        assert_eq!(kept, &data[..]);
        assert_eq!(kept.as_ptr() as usize % 128, 0);
    }

    #[test]
    fn no_driver_is_an_error_not_a_panic() {
        // On a machine without libcuda every device path answers NoDriver.
        if !crate::driver::driver_present() {
            assert_eq!(device_info(0).unwrap_err(), Error::NoDriver);
            assert_eq!(device_arch(0).unwrap_err().to_string(), "no CUDA driver (libcuda) found");
            let (ok, msg) = cuda_status();
            assert!(!ok);
            assert_eq!(msg, "no CUDA driver (libcuda) found");
            let mut a = call(1, 64, 1, 1, 64, 64, DType::BF16);
            for t in [&mut a.q, &mut a.k, &mut a.w, &mut a.do_, &mut a.dv] {
                t.device = Device::cuda(0);
            }
            a.gk = None;
            a.h0 = None;
            a.dht = None;
            let o = outs(&a, 1);
            assert_eq!(launch(&a, &o, 0).unwrap_err(), Error::NoDriver);
        }
    }
}
