//! Compiles the device code (cuda/*_sm90.cu for sm_90a, cuda/*_sm100.cu for sm_100a)
//! to SASS cubins, twice: with nvcc (CUDA 13: the images CUDA 13 drivers load) and with
//! NVRTC 12 (the images CUDA 12 drivers load: a CUDA 13 cubin needs a 580+ driver, and
//! PyPI has NVRTC 12.9 but no CUDA 12 nvcc). Checks ptxas's resource report of every
//! image (a spill fails the build) and embeds the cubins and the reports' summary in the
//! extension; src/launch.rs picks the image by the driver's version at load time.
//!
//! Generated in OUT_DIR:
//!   <stem>.<arch>.cuda<M>.cubin      one per source file and CUDA major version M
//!                                    (SASS only: no PTX, no JIT at load)
//!   ptxas_<stem>_<arch>_cuda<M>.txt  the compiler's full diagnostics (the ptxas -v report)
//!   kernels.rs                       `EMBEDDED` (stem, arch, cuda, image) table +
//!                                    `BUILD_INFO`, pulled in by src/kernels.rs
//!   kernel_facts.rs                  BT, the V tile, threads and dynamic shared memory
//!                                    of every entry point, as cuda/dhu_layout.h (their
//!                                    one owner) defines them: build/kernel_facts.cpp,
//!                                    compiled by nvcc's host compiler and run here;
//!                                    pulled in by src/facts.rs
//!
//! nvcc is found through NVCC, CUDA_HOME / CUDA_PATH, PATH, then the PyPI wheel
//! `nvidia-cuda-nvcc` (13.0) in the site-packages of the Python maturin builds for
//! (PYO3_PYTHON), an activated env, or the env maturin runs from (`python_candidates`).
//! When that nvcc is a CUDA 12 one its images are the CUDA 12 images and NVRTC is not
//! used. NVRTC 12 (libnvrtc.so.12, with the CUDA 12 runtime and CCCL headers) comes from
//! CUDA12_HOME (a CUDA 12.8+ toolkit) or the PyPI wheels `nvidia-cuda-nvrtc-cu12`,
//! `nvidia-cuda-runtime-cu12`, `nvidia-cuda-cccl-cu12` of the same Pythons. The
//! CUTLASS/CuTe headers come from CUTLASS_DIR or the `nvidia-cutlass` wheel.
//!
//! KDA_DHU_KERNEL_DEFINES (unset for every release build): space-separated `KDA_DHU_EXP_*`
//! macro names, each optionally `=VALUE`, defined for both compilers: the kernels'
//! compile-time experiments (cuda/dhu_sm90_regstate.cuh lists them), built into wheels of
//! their own and measured against the plain build (benches/build_ab.py). BUILD_INFO
//! lists them.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

// Shared with the crate's tests (src/lib.rs), which check it on real ptxas output.
#[path = "src/ptxas.rs"]
mod ptxas;
use ptxas::{parse_ptxas, FuncReport};

#[path = "build/nvrtc.rs"]
mod nvrtc;

const NVCC_HELP: &str = "install the CUDA 13.0 compiler wheels into the Python you build with \
(`pip install nvidia-cuda-nvcc==13.0.* nvidia-cuda-crt==13.0.* nvidia-nvvm==13.0.* \
nvidia-cuda-runtime==13.0.* nvidia-cuda-cccl==13.0.*`; `pip install .` does this by itself), \
or set NVCC=/path/to/nvcc or CUDA_HOME=/path/to/cuda (with bin/nvcc)";

const NVRTC_HELP: &str = "install the CUDA 12 NVRTC wheels into the Python you build with \
(`pip install nvidia-cuda-nvrtc-cu12==12.9.* nvidia-cuda-runtime-cu12==12.9.* \
nvidia-cuda-cccl-cu12==12.9.*`; `pip install .` does this by itself), or set CUDA12_HOME to a \
CUDA 12.8+ toolkit (lib64/libnvrtc.so.12, include/)";

const CUTLASS_HELP: &str = "install the CUTLASS headers wheel into the Python you build with \
(`pip install nvidia-cutlass==4.2.0.0`; `pip install .` does this by itself), or set \
CUTLASS_DIR to a CUTLASS checkout (its include/ is used)";

/// nvcc's flags shared by every architecture (the arch-specific -gencode is added per job).
const NVCC_FLAGS: &[&str] =
    &["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-Xptxas", "-v", "-lineinfo", "-DNDEBUG"];

/// NVRTC's, the same build: NVRTC optimizes at -O3 by default and has no
/// --expt-relaxed-constexpr; -default-device compiles the functions CuTe leaves
/// unannotated (constexpr helpers and their lambdas) for the device, as that flag lets
/// nvcc call them there. The architecture (--gpu-architecture=sm_90a) is added per job.
const NVRTC_FLAGS: &[&str] = &["-std=c++17", "-default-device", "-lineinfo", "-DNDEBUG", "--ptxas-options=-v"];

/// Headers that stand in for the C library's under NVRTC (which has none), in
/// cuda/nvrtc/: `cuda.h` (the CUtensorMap type only) and `stdint.h` (CCCL's).
const NVRTC_SHIM_DIR: &str = "nvrtc";

/// The oldest NVRTC 12 that compiles sm_100a.
const NVRTC12_MIN_MINOR: i32 = 8;

/// The experiment macros of KDA_DHU_KERNEL_DEFINES as `-DNAME[=VALUE]` flags. Panics on an
/// item that is not a `KDA_DHU_EXP_` macro name (with an optional integer value).
fn experiment_defines() -> Vec<String> {
    let raw = env::var("KDA_DHU_KERNEL_DEFINES").unwrap_or_default();
    raw.split_whitespace()
        .map(|item| {
            let (name, value) = item.split_once('=').unwrap_or((item, ""));
            let name_ok = name.starts_with("KDA_DHU_EXP_")
                && name.chars().all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_');
            let value_ok = value.is_empty() || value.parse::<i64>().is_ok();
            if !(name_ok && value_ok) {
                panic!("KDA_DHU_KERNEL_DEFINES: {item:?} is not KDA_DHU_EXP_<NAME>[=<integer>]");
            }
            format!("-D{item}")
        })
        .collect()
}

/// One compiler, building the images of one CUDA major version.
enum Compiler {
    Nvcc(PathBuf),
    Nvrtc { nvrtc: nvrtc::Nvrtc, include: Vec<PathBuf> },
}

struct Toolchain {
    /// The CUDA major version of the compiler: names the image ("cuda13") and the
    /// driver it needs.
    cuda: u32,
    /// For BUILD_INFO, e.g. "nvcc: /path/nvcc (release 13.0, V13.0.88)".
    describe: String,
    flags: String,
    compiler: Compiler,
}

/// One source file of cuda/ and the SASS target it is compiled for.
struct Source {
    path: PathBuf,
    stem: String,
    /// SASS target, e.g. "sm_90a".
    arch: &'static str,
    /// nvcc -gencode value.
    gencode: &'static str,
}

/// One source compiled by one toolchain.
struct Job {
    source: usize,
    toolchain: usize,
}

struct Compiled {
    job_index: usize,
    cubin: PathBuf,
    funcs: Vec<FuncReport>,
}

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var("OUT_DIR").expect("OUT_DIR"));
    let cuda_dir = manifest.join("cuda");

    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=build");
    // A directory: cargo rescans everything under it (new, edited, removed files).
    println!("cargo:rerun-if-changed={}", cuda_dir.display());
    for var in [
        "NVCC",
        "CUDA_HOME",
        "CUDA_PATH",
        "CUDA12_HOME",
        "CUTLASS_DIR",
        "PYO3_PYTHON",
        "VIRTUAL_ENV",
        "CONDA_PREFIX",
        "KDA_DHU_KERNEL_DEFINES",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }

    let sources = collect_sources(&cuda_dir);
    let cutlass_include = find_cutlass_include();
    let toolchains = find_toolchains();
    let Compiler::Nvcc(nvcc) = &toolchains[0].compiler else { unreachable!("the first toolchain is nvcc") };
    write_kernel_facts(nvcc, &manifest, &cuda_dir, &out_dir);
    // The larger sm_90a file first, so that the longest jobs start together.
    let mut jobs = Vec::new();
    for source in (0..sources.len()).rev() {
        for toolchain in 0..toolchains.len() {
            jobs.push(Job { source, toolchain });
        }
    }

    let compiled = compile_all(&jobs, &sources, &toolchains, &cuda_dir, &cutlass_include, &out_dir);

    // Spills fail the build; the summary goes to cargo:warning and into BUILD_INFO.
    let mut info = String::new();
    for tc in &toolchains {
        let _ = writeln!(info, "cuda{}: {}", tc.cuda, tc.describe);
        let _ = writeln!(info, "cuda{} flags: {}", tc.cuda, tc.flags);
    }
    let _ = writeln!(info, "cutlass include: {}", cutlass_include.display());
    let mut spills = Vec::new();
    for c in &compiled {
        let job = &jobs[c.job_index];
        let (src, cuda) = (&sources[job.source], toolchains[job.toolchain].cuda);
        for f in &c.funcs {
            if f.spill_stores != 0 || f.spill_loads != 0 {
                spills.push(format!(
                    "{} ({}.cu, {}, cuda{cuda}): {} bytes spill stores, {} bytes spill loads",
                    f.name, src.stem, src.arch, f.spill_stores, f.spill_loads
                ));
            }
            if f.entry {
                let line = format!(
                    "{} {} cuda{cuda} {}: {} registers, {} bytes static smem, {} bytes stack frame",
                    src.stem,
                    src.arch,
                    f.name,
                    opt(f.registers),
                    f.smem.unwrap_or(0),
                    opt(f.stack)
                );
                println!("cargo:warning={line}");
                let _ = writeln!(info, "{line}");
            }
        }
        if !c.funcs.iter().any(|f| f.entry) {
            panic!(
                "no ptxas report for {}.cu ({}, cuda{cuda}): the build checks every image for spills (see {}/ptxas_*.txt)",
                src.stem,
                src.arch,
                out_dir.display()
            );
        }
    }
    if !spills.is_empty() {
        panic!(
            "ptxas reports register spills (the kernels must not spill):\n  {}\n(full reports: {}/ptxas_*.txt)",
            spills.join("\n  "),
            out_dir.display()
        );
    }

    write_embed_file(&jobs, &sources, &toolchains, &compiled, &info, &out_dir);
}

/// Compiles build/kernel_facts.cpp against cuda/dhu_layout.h with nvcc's host compiler
/// (no CUDA runtime) and the kernels' experiment macros (a map an experiment changes is
/// the one its launches ask for), runs it on the build host, and writes its output, the
/// Rust table of the kernels' numbers, to OUT_DIR/kernel_facts.rs.
fn write_kernel_facts(nvcc: &Path, manifest: &Path, cuda_dir: &Path, out_dir: &Path) {
    let src = manifest.join("build").join("kernel_facts.cpp");
    let exe = out_dir.join("kernel_facts");
    let mut cmd = Command::new(nvcc);
    cmd.args(["-x", "c++", "-std=c++17", "--cudart", "none"]).args(experiment_defines());
    cmd.arg("-I").arg(cuda_dir).arg("-o").arg(&exe).arg(&src);
    let out = cmd.output().unwrap_or_else(|e| panic!("cannot run {}: {e}; {NVCC_HELP}", nvcc.display()));
    if !out.status.success() {
        panic!(
            "compiling {} failed ({}):\n{cmd:?}\n{}{}",
            src.display(),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let run = Command::new(&exe).output().unwrap_or_else(|e| panic!("cannot run {}: {e}", exe.display()));
    if !run.status.success() {
        panic!("{} failed ({})", exe.display(), run.status);
    }
    fs::write(out_dir.join("kernel_facts.rs"), &run.stdout).expect("write kernel_facts.rs");
}

fn opt(v: Option<u64>) -> String {
    v.map_or_else(|| "?".to_string(), |n| n.to_string())
}

/// cuda/*_sm90.cu → sm_90a, cuda/*_sm100.cu → sm_100a, in name order.
fn collect_sources(cuda_dir: &Path) -> Vec<Source> {
    let mut names: Vec<String> = fs::read_dir(cuda_dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", cuda_dir.display()))
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    names.sort();
    let mut sources = Vec::new();
    for name in names {
        let Some(stem) = name.strip_suffix(".cu") else { continue };
        let (arch, gencode) = if stem.ends_with("_sm90") {
            ("sm_90a", "arch=compute_90a,code=sm_90a")
        } else if stem.ends_with("_sm100") {
            ("sm_100a", "arch=compute_100a,code=sm_100a")
        } else {
            continue;
        };
        sources.push(Source { path: cuda_dir.join(&name), stem: stem.to_string(), arch, gencode });
    }
    sources
}

fn env_path(var: &str) -> Option<PathBuf> {
    env::var_os(var).filter(|v| !v.is_empty()).map(PathBuf::from)
}

/// Pythons whose site-packages may hold the compiler / CUTLASS wheels, in order: the
/// one maturin builds for (PYO3_PYTHON; pip's isolated build env under `pip install .`),
/// an activated venv / conda env, the environment maturin itself runs from (a plain
/// `/path/to/venv/bin/maturin build` picks the first python3 on PATH, not that venv),
/// then python3.
fn python_candidates() -> Vec<PathBuf> {
    let mut c: Vec<PathBuf> = Vec::new();
    if let Some(p) = env_path("PYO3_PYTHON") {
        c.push(p);
    }
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(prefix) = env_path(var) {
            c.push(prefix.join("bin").join("python"));
        }
    }
    c.extend(ancestor_env_pythons());
    c.push(PathBuf::from("python3"));
    let mut seen = Vec::new();
    c.retain(|p| {
        let keep = !seen.contains(p);
        seen.push(p.clone());
        keep
    });
    c
}

/// `<dir>/python` for every ancestor process whose executable sits in a directory
/// that has one (maturin installed in a venv: /venv/bin/maturin -> /venv/bin/python).
/// Linux /proc only; elsewhere nothing. The path is not canonicalized: a venv's
/// bin/python is a symlink whose own path selects the venv.
#[cfg(target_os = "linux")]
fn ancestor_env_pythons() -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut pid = std::os::unix::process::parent_id();
    for _ in 0..8 {
        if pid <= 1 {
            break;
        }
        if let Ok(exe) = fs::read_link(format!("/proc/{pid}/exe")) {
            if let Some(dir) = exe.parent() {
                for name in ["python", "python3"] {
                    let p = dir.join(name);
                    if p.is_file() && !dir.starts_with("/usr") && !dir.starts_with("/bin") {
                        out.push(p);
                        break;
                    }
                }
            }
        }
        // /proc/<pid>/stat: "pid (comm) state ppid ..."; comm may contain spaces.
        let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else { break };
        let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else { break };
        match rest.split_whitespace().nth(1).and_then(|p| p.parse().ok()) {
            Some(ppid) => pid = ppid,
            None => break,
        }
    }
    out
}

#[cfg(not(target_os = "linux"))]
fn ancestor_env_pythons() -> Vec<PathBuf> {
    Vec::new()
}

/// Every candidate Python's sys.path entries, in candidate order (asked once). The
/// wheels are found by path under these: a package's import name can be shadowed (the
/// CUDA 12 wheels ship an `nvidia/__init__.py` that hides the CUDA 13 wheels' `nvidia`
/// namespace in another site-packages of the same sys.path).
fn site_dirs() -> &'static [PathBuf] {
    static DIRS: OnceLock<Vec<PathBuf>> = OnceLock::new();
    DIRS.get_or_init(|| {
        let mut dirs: Vec<PathBuf> = Vec::new();
        for py in python_candidates() {
            let Ok(out) = Command::new(&py).arg("-c").arg("import sys\nfor p in sys.path: print(p)").output() else {
                continue;
            };
            if !out.status.success() {
                continue;
            }
            for line in String::from_utf8_lossy(&out.stdout).lines().map(str::trim).filter(|l| !l.is_empty()) {
                let p = PathBuf::from(line);
                if p.is_dir() && !dirs.contains(&p) {
                    dirs.push(p);
                }
            }
        }
        dirs
    })
}

/// The first `<site dir>/<rel>` that `pick` accepts.
fn from_python_wheels(rel: &[&str], pick: impl Fn(&Path) -> bool) -> Option<PathBuf> {
    site_dirs().iter().map(|d| rel.iter().fold(d.clone(), |p, part| p.join(part))).find(|p| pick(p))
}

fn pythons_tried() -> String {
    python_candidates().iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
}

/// nvcc, and NVRTC 12 unless that nvcc is a CUDA 12 one.
fn find_toolchains() -> Vec<Toolchain> {
    let nvcc = find_nvcc();
    let (version, cuda) = nvcc_version(&nvcc);
    let mut toolchains = vec![Toolchain {
        cuda,
        describe: format!("nvcc {} ({version})", nvcc.display()),
        flags: NVCC_FLAGS.iter().map(|f| f.to_string()).chain(experiment_defines()).collect::<Vec<_>>().join(" "),
        compiler: Compiler::Nvcc(nvcc),
    }];
    if cuda != 12 {
        toolchains.push(find_nvrtc12());
    }
    toolchains
}

fn find_nvcc() -> PathBuf {
    if let Some(p) = env_path("NVCC") {
        if p.is_file() {
            return p;
        }
        panic!("NVCC={} is not a file; {NVCC_HELP}", p.display());
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = env_path(var) {
            let p = home.join("bin").join("nvcc");
            if p.is_file() {
                return p;
            }
            println!("cargo:warning={var}={} has no bin/nvcc; looking further", home.display());
        }
    }
    if let Some(path) = env::var_os("PATH") {
        for dir in env::split_paths(&path) {
            let p = dir.join("nvcc");
            if p.is_file() {
                return p;
            }
        }
    }
    // The PyPI wheel (nvidia-cuda-nvcc 13.x installs nvidia/cu13/bin/nvcc; its
    // nvcc.profile points at the wheel's own include/ and nvvm/).
    if let Some(p) = from_python_wheels(&["nvidia", "cu13", "bin", "nvcc"], |p| p.is_file()) {
        return p;
    }
    panic!(
        "no nvcc found (looked at NVCC, CUDA_HOME, CUDA_PATH, PATH, and the nvidia-cuda-nvcc wheel of: {}); {NVCC_HELP}",
        pythons_tried()
    );
}

/// NVRTC 12.8+ and the CUDA 12 headers it compiles against (runtime: cuda_fp16.h,
/// cuda_bf16.h, ...; CCCL: cuda/std/...).
fn find_nvrtc12() -> Toolchain {
    let has_runtime = |p: &Path| p.join("cuda_fp16.h").is_file();
    let has_cccl = |p: &Path| p.join("cuda").join("std").join("cstdint").is_file();
    let (lib, include) = if let Some(home) = env_path("CUDA12_HOME") {
        let lib = ["lib64", "lib"].iter().map(|d| home.join(d).join("libnvrtc.so.12")).find(|p| p.is_file());
        let inc = home.join("include");
        match lib {
            Some(lib) if has_runtime(&inc) && has_cccl(&inc) => (lib, vec![inc]),
            _ => panic!(
                "CUDA12_HOME={} has no lib64/libnvrtc.so.12 or include/ with the CUDA 12 headers; {NVRTC_HELP}",
                home.display()
            ),
        }
    } else {
        let lib = from_python_wheels(&["nvidia", "cuda_nvrtc", "lib", "libnvrtc.so.12"], |p| p.is_file());
        let runtime = from_python_wheels(&["nvidia", "cuda_runtime", "include"], has_runtime);
        let cccl = from_python_wheels(&["nvidia", "cuda_cccl", "include"], has_cccl);
        match (lib, runtime, cccl) {
            (Some(lib), Some(runtime), Some(cccl)) => (lib, vec![runtime, cccl]),
            (lib, runtime, cccl) => {
                let missing: Vec<&str> = [
                    (lib.is_none(), "libnvrtc.so.12"),
                    (runtime.is_none(), "the CUDA 12 runtime headers"),
                    (cccl.is_none(), "the CUDA 12 CCCL headers"),
                ]
                .iter()
                .filter(|(m, _)| *m)
                .map(|(_, what)| *what)
                .collect();
                panic!(
                    "the CUDA 12 images need NVRTC 12: {} not found (looked at CUDA12_HOME and the site-packages of: {}); {NVRTC_HELP}",
                    missing.join(", "),
                    pythons_tried()
                );
            }
        }
    };
    let nvrtc = nvrtc::Nvrtc::load(&lib).unwrap_or_else(|e| panic!("{e}; {NVRTC_HELP}"));
    let (major, minor) = nvrtc.version().unwrap_or_else(|e| panic!("{}: {e}", lib.display()));
    if major != 12 || minor < NVRTC12_MIN_MINOR {
        panic!("{} is NVRTC {major}.{minor}; the CUDA 12 images need NVRTC 12.{NVRTC12_MIN_MINOR} or newer 12.x; {NVRTC_HELP}", lib.display());
    }
    let mut describe = format!("NVRTC {major}.{minor} {}, headers", lib.display());
    for inc in &include {
        let _ = write!(describe, " {}", inc.display());
    }
    let flags = NVRTC_FLAGS.iter().map(|f| f.to_string()).chain(experiment_defines()).collect::<Vec<_>>().join(" ");
    Toolchain { cuda: 12, describe, flags, compiler: Compiler::Nvrtc { nvrtc, include } }
}

fn find_cutlass_include() -> PathBuf {
    let looks_right = |p: &Path| p.join("cute").join("tensor.hpp").is_file();
    if let Some(dir) = env_path("CUTLASS_DIR") {
        let inc = dir.join("include");
        if looks_right(&inc) {
            return inc;
        }
        panic!("CUTLASS_DIR={} has no include/cute/tensor.hpp; {CUTLASS_HELP}", dir.display());
    }
    if let Some(inc) = from_python_wheels(&["cutlass_library", "source", "include"], looks_right) {
        return inc;
    }
    panic!(
        "no CUTLASS/CuTe headers found (looked at CUTLASS_DIR and the nvidia-cutlass wheel of: {}); {CUTLASS_HELP}",
        pythons_tried()
    );
}

/// nvcc's "release 13.0, V13.0.88" and its CUDA major version.
fn nvcc_version(nvcc: &Path) -> (String, u32) {
    let text = match Command::new(nvcc).arg("--version").output() {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout).into_owned(),
        Ok(out) => panic!("{} --version failed: {}; {NVCC_HELP}", nvcc.display(), String::from_utf8_lossy(&out.stderr)),
        Err(e) => panic!("cannot run {}: {e}; {NVCC_HELP}", nvcc.display()),
    };
    let release = text.split("release ").nth(1).map(|r| r.lines().next().unwrap_or("").trim().to_string());
    let major = release.as_deref().and_then(|r| r.split('.').next()).and_then(|m| m.trim().parse().ok());
    match (release, major) {
        (Some(release), Some(major)) => (format!("release {release}"), major),
        _ => panic!("cannot read the CUDA version from `{} --version`:\n{text}", nvcc.display()),
    }
}

/// Compiles every job, `available_parallelism` at a time (CuTe-heavy files take minutes).
fn compile_all(
    jobs: &[Job],
    sources: &[Source],
    toolchains: &[Toolchain],
    cuda_dir: &Path,
    cutlass_include: &Path,
    out_dir: &Path,
) -> Vec<Compiled> {
    let workers = std::thread::available_parallelism().map_or(2, |n| n.get()).min(jobs.len().max(1));
    let next = Mutex::new(0usize);
    let results: Mutex<Vec<Result<Compiled, String>>> = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| loop {
                let i = {
                    let mut n = next.lock().unwrap();
                    let i = *n;
                    *n += 1;
                    i
                };
                if i >= jobs.len() {
                    break;
                }
                let job = &jobs[i];
                let r = compile_one(
                    i,
                    &sources[job.source],
                    &toolchains[job.toolchain],
                    cuda_dir,
                    cutlass_include,
                    out_dir,
                );
                results.lock().unwrap().push(r);
            });
        }
    });
    let mut ok = Vec::new();
    let mut errors = Vec::new();
    for r in results.into_inner().unwrap() {
        match r {
            Ok(c) => ok.push(c),
            Err(e) => errors.push(e),
        }
    }
    if !errors.is_empty() {
        panic!("{}", errors.join("\n\n"));
    }
    ok.sort_by_key(|c| c.job_index);
    ok
}

fn compile_one(
    index: usize,
    src: &Source,
    tc: &Toolchain,
    cuda_dir: &Path,
    cutlass_include: &Path,
    out_dir: &Path,
) -> Result<Compiled, String> {
    let cubin = out_dir.join(format!("{}.{}.cuda{}.cubin", src.stem, src.arch, tc.cuda));
    let report_path = out_dir.join(format!("ptxas_{}_{}_cuda{}.txt", src.stem, src.arch, tc.cuda));
    let report = match &tc.compiler {
        Compiler::Nvcc(nvcc) => {
            let mut cmd = Command::new(nvcc);
            cmd.arg("-cubin").arg("-gencode").arg(src.gencode);
            cmd.args(NVCC_FLAGS);
            cmd.args(experiment_defines());
            cmd.arg("-I").arg(cuda_dir).arg("-I").arg(cutlass_include);
            cmd.arg("-o").arg(&cubin).arg(&src.path);
            let out = cmd.output().map_err(|e| format!("cannot run {}: {e}; {NVCC_HELP}", nvcc.display()))?;
            let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
            let stdout = String::from_utf8_lossy(&out.stdout);
            let _ = fs::write(&report_path, format!("{cmd:?}\n\n{stdout}{stderr}"));
            if !out.status.success() {
                return Err(format!(
                    "nvcc failed on {} for {} ({}):\n{cmd:?}\n{stdout}{stderr}",
                    src.path.display(),
                    src.arch,
                    out.status
                ));
            }
            stderr
        }
        Compiler::Nvrtc { nvrtc, include } => {
            let source =
                fs::read_to_string(&src.path).map_err(|e| format!("cannot read {}: {e}", src.path.display()))?;
            let mut options: Vec<String> =
                NVRTC_FLAGS.iter().map(|f| f.to_string()).chain(experiment_defines()).collect();
            options.push(format!("--gpu-architecture={}", src.arch));
            // The shims first: they stand in for headers the real include paths also have.
            for dir in [&cuda_dir.join(NVRTC_SHIM_DIR), &cuda_dir.to_path_buf(), &cutlass_include.to_path_buf()]
                .into_iter()
                .chain(include)
            {
                options.push(format!("-I{}", dir.display()));
            }
            let name = src.path.file_name().map_or("source.cu".into(), |n| n.to_string_lossy().into_owned());
            let out = nvrtc.compile(&source, &name, &options).map_err(|e| format!("{}: {e}", src.path.display()))?;
            let _ = fs::write(&report_path, format!("NVRTC {}\n\n{}", options.join(" "), out.log));
            let Some(image) = out.cubin else {
                return Err(format!(
                    "NVRTC failed on {} for {}:\n{}\n{}",
                    src.path.display(),
                    src.arch,
                    options.join(" "),
                    out.log
                ));
            };
            fs::write(&cubin, image).map_err(|e| format!("cannot write {}: {e}", cubin.display()))?;
            out.log
        }
    };
    Ok(Compiled { job_index: index, cubin, funcs: parse_ptxas(&report) })
}

fn write_embed_file(
    jobs: &[Job],
    sources: &[Source],
    toolchains: &[Toolchain],
    compiled: &[Compiled],
    info: &str,
    out_dir: &Path,
) {
    let mut src = String::from("// Generated by build.rs: the embedded cubins and the build summary.\n");
    src.push_str("pub static EMBEDDED: &[EmbeddedCubin] = &[\n");
    for c in compiled {
        let job = &jobs[c.job_index];
        let s = &sources[job.source];
        let _ = writeln!(
            src,
            "    EmbeddedCubin {{ stem: {:?}, arch: {:?}, cuda: {}, image: &Aligned(*include_bytes!({:?})) }},",
            s.stem,
            s.arch,
            toolchains[job.toolchain].cuda,
            c.cubin.display().to_string()
        );
    }
    src.push_str("];\n");
    let _ = writeln!(src, "pub const BUILD_INFO: &str = {info:?};");
    let path = out_dir.join("kernels.rs");
    fs::write(&path, src).unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
}
