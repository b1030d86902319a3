//! Compiles the device code (cuda/*_sm90.cu for sm_90a, cuda/*_sm100.cu for sm_100a)
//! to SASS cubins with nvcc, checks ptxas's resource report (a spill fails the build)
//! and embeds the cubins and the report's summary in the extension.
//!
//! Generated in OUT_DIR:
//!   <stem>.<arch>.cubin        one per source file (SASS only: no PTX, no JIT at load)
//!   ptxas_<stem>_<arch>.txt    nvcc's full stderr (the `-Xptxas -v` report)
//!   kernels.rs                 `EMBEDDED` (stem, arch, image) table + `BUILD_INFO`,
//!                              pulled in by src/kernels.rs
//!
//! nvcc is found through NVCC, CUDA_HOME / CUDA_PATH, PATH, then the PyPI wheel
//! `nvidia-cuda-nvcc` (13.0) of the Python maturin builds for (PYO3_PYTHON), an
//! activated env, or the env maturin runs from (`python_candidates`). The CUTLASS/CuTe
//! headers come from CUTLASS_DIR or the `nvidia-cutlass` wheel of the same Pythons.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

// Shared with the crate's tests (src/lib.rs), which check it on real ptxas output.
#[path = "src/ptxas.rs"]
mod ptxas;
use ptxas::{parse_ptxas, FuncReport};

const NVCC_HELP: &str = "install the CUDA 13.0 compiler wheels into the Python you build with \
(`pip install nvidia-cuda-nvcc==13.0.* nvidia-cuda-crt==13.0.* nvidia-nvvm==13.0.* \
nvidia-cuda-runtime==13.0.* nvidia-cuda-cccl==13.0.*`; `pip install .` does this by itself), \
or set NVCC=/path/to/nvcc or CUDA_HOME=/path/to/cuda (with bin/nvcc)";

const CUTLASS_HELP: &str = "install the CUTLASS headers wheel into the Python you build with \
(`pip install nvidia-cutlass==4.2.0.0`; `pip install .` does this by itself), or set \
CUTLASS_DIR to a CUTLASS checkout (its include/ is used)";

/// Flags shared by every architecture (the arch-specific -gencode is added per job).
const NVCC_FLAGS: &[&str] =
    &["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-Xptxas", "-v", "-lineinfo", "-DNDEBUG"];

/// One source file to compile for one architecture.
struct Job {
    src: PathBuf,
    stem: String,
    /// SASS target, e.g. "sm_90a".
    arch: &'static str,
    /// nvcc -gencode value.
    gencode: &'static str,
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
    // A directory: cargo rescans everything under it (new, edited, removed files).
    println!("cargo:rerun-if-changed={}", cuda_dir.display());
    for var in ["NVCC", "CUDA_HOME", "CUDA_PATH", "CUTLASS_DIR", "PYO3_PYTHON", "VIRTUAL_ENV", "CONDA_PREFIX"] {
        println!("cargo:rerun-if-env-changed={var}");
    }

    let jobs = collect_jobs(&cuda_dir);
    let nvcc = find_nvcc();
    let cutlass_include = find_cutlass_include();
    let nvcc_version = nvcc_version(&nvcc);

    let compiled = compile_all(&jobs, &nvcc, &cuda_dir, &cutlass_include, &out_dir);

    // Spills fail the build; the summary goes to cargo:warning and into BUILD_INFO.
    let mut info = String::new();
    let _ = writeln!(info, "nvcc: {} ({})", nvcc.display(), nvcc_version);
    let _ = writeln!(info, "cutlass include: {}", cutlass_include.display());
    let _ = writeln!(info, "flags: {}", NVCC_FLAGS.join(" "));
    let mut spills = Vec::new();
    for c in &compiled {
        let job = &jobs[c.job_index];
        for f in &c.funcs {
            if f.spill_stores != 0 || f.spill_loads != 0 {
                spills.push(format!(
                    "{} ({}.cu, {}): {} bytes spill stores, {} bytes spill loads",
                    f.name, job.stem, job.arch, f.spill_stores, f.spill_loads
                ));
            }
            if f.entry {
                let line = format!(
                    "{} {} {}: {} registers, {} bytes static smem, {} bytes stack frame",
                    job.stem,
                    job.arch,
                    f.name,
                    opt(f.registers),
                    f.smem.unwrap_or(0),
                    opt(f.stack)
                );
                println!("cargo:warning={line}");
                let _ = writeln!(info, "{line}");
            }
        }
    }
    if !spills.is_empty() {
        panic!(
            "ptxas reports register spills (the kernels must not spill):\n  {}\n(full reports: {}/ptxas_*.txt)",
            spills.join("\n  "),
            out_dir.display()
        );
    }

    write_embed_file(&jobs, &compiled, &info, &out_dir);
}

fn opt(v: Option<u64>) -> String {
    v.map_or_else(|| "?".to_string(), |n| n.to_string())
}

/// cuda/*_sm90.cu → sm_90a, cuda/*_sm100.cu → sm_100a, in name order.
fn collect_jobs(cuda_dir: &Path) -> Vec<Job> {
    let mut names: Vec<String> = fs::read_dir(cuda_dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", cuda_dir.display()))
        .filter_map(|e| e.ok())
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    names.sort();
    let mut jobs = Vec::new();
    for name in names {
        let Some(stem) = name.strip_suffix(".cu") else { continue };
        let (arch, gencode) = if stem.ends_with("_sm90") {
            ("sm_90a", "arch=compute_90a,code=sm_90a")
        } else if stem.ends_with("_sm100") {
            ("sm_100a", "arch=compute_100a,code=sm_100a")
        } else {
            continue;
        };
        jobs.push(Job { src: cuda_dir.join(&name), stem: stem.to_string(), arch, gencode });
    }
    jobs
}

fn env_path(var: &str) -> Option<PathBuf> {
    env::var_os(var).filter(|v| !v.is_empty()).map(PathBuf::from)
}

/// Pythons whose site-packages may hold the nvcc / CUTLASS wheels, in order: the one
/// maturin builds for (PYO3_PYTHON; pip's isolated build env under `pip install .`),
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

/// Runs `python -c code` and returns its stdout's lines, or None if it fails.
fn python_lines(python: &Path, code: &str) -> Option<Vec<String>> {
    let out = Command::new(python).arg("-c").arg(code).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).ok()?;
    Some(text.lines().map(|l| l.trim().to_string()).filter(|l| !l.is_empty()).collect())
}

/// The first `<line>/<rel>` that `pick` accepts, over every candidate Python's output.
fn from_python_wheels(code: &str, rel: &[&str], pick: impl Fn(&Path) -> bool) -> Option<PathBuf> {
    for py in python_candidates() {
        for line in python_lines(&py, code).unwrap_or_default() {
            let mut p = PathBuf::from(line);
            for part in rel {
                p.push(part);
            }
            if pick(&p) {
                return Some(p);
            }
        }
    }
    None
}

fn pythons_tried() -> String {
    python_candidates().iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
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
    // nvcc.profile points at the wheel's own include/ and nvvm/). `__path__` also
    // covers a namespace package, which has no __file__.
    let code = "import nvidia.cu13 as m\nfor p in m.__path__: print(p)";
    if let Some(p) = from_python_wheels(code, &["bin", "nvcc"], |p| p.is_file()) {
        return p;
    }
    panic!(
        "no nvcc found (looked at NVCC, CUDA_HOME, CUDA_PATH, PATH, and the nvidia.cu13 wheel of: {}); {NVCC_HELP}",
        pythons_tried()
    );
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
    let code = "import cutlass_library, os\nprint(os.path.dirname(cutlass_library.__file__))";
    if let Some(inc) = from_python_wheels(code, &["source", "include"], looks_right) {
        return inc;
    }
    panic!(
        "no CUTLASS/CuTe headers found (looked at CUTLASS_DIR and the cutlass_library wheel of: {}); {CUTLASS_HELP}",
        pythons_tried()
    );
}

fn nvcc_version(nvcc: &Path) -> String {
    match Command::new(nvcc).arg("--version").output() {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout)
            .lines()
            .rfind(|l| !l.trim().is_empty())
            .unwrap_or("unknown version")
            .trim()
            .to_string(),
        Ok(out) => panic!("{} --version failed: {}; {NVCC_HELP}", nvcc.display(), String::from_utf8_lossy(&out.stderr)),
        Err(e) => panic!("cannot run {}: {e}; {NVCC_HELP}", nvcc.display()),
    }
}

/// Compiles every job, `available_parallelism` at a time (CuTe-heavy files take minutes).
fn compile_all(jobs: &[Job], nvcc: &Path, cuda_dir: &Path, cutlass_include: &Path, out_dir: &Path) -> Vec<Compiled> {
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
                let r = compile_one(i, &jobs[i], nvcc, cuda_dir, cutlass_include, out_dir);
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
    job: &Job,
    nvcc: &Path,
    cuda_dir: &Path,
    cutlass_include: &Path,
    out_dir: &Path,
) -> Result<Compiled, String> {
    let cubin = out_dir.join(format!("{}.{}.cubin", job.stem, job.arch));
    let report_path = out_dir.join(format!("ptxas_{}_{}.txt", job.stem, job.arch));
    let mut cmd = Command::new(nvcc);
    cmd.arg("-cubin").arg("-gencode").arg(job.gencode);
    cmd.args(NVCC_FLAGS);
    cmd.arg("-I").arg(cuda_dir).arg("-I").arg(cutlass_include);
    cmd.arg("-o").arg(&cubin).arg(&job.src);
    let out = cmd.output().map_err(|e| format!("cannot run {}: {e}; {NVCC_HELP}", nvcc.display()))?;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let _ = fs::write(&report_path, format!("{cmd:?}\n\n{stdout}{stderr}"));
    if !out.status.success() {
        return Err(format!(
            "nvcc failed on {} for {} ({}):\n{cmd:?}\n{stdout}{stderr}",
            job.src.display(),
            job.arch,
            out.status
        ));
    }
    Ok(Compiled { job_index: index, cubin, funcs: parse_ptxas(&stderr) })
}

fn write_embed_file(jobs: &[Job], compiled: &[Compiled], info: &str, out_dir: &Path) {
    let mut src = String::from("// Generated by build.rs: the embedded cubins and the build summary.\n");
    src.push_str("pub static EMBEDDED: &[EmbeddedCubin] = &[\n");
    for c in compiled {
        let job = &jobs[c.job_index];
        let _ = writeln!(
            src,
            "    EmbeddedCubin {{ stem: {:?}, arch: {:?}, image: &Aligned(*include_bytes!({:?})) }},",
            job.stem,
            job.arch,
            c.cubin.display().to_string()
        );
    }
    src.push_str("];\n");
    let _ = writeln!(src, "pub const BUILD_INFO: &str = {info:?};");
    let path = out_dir.join("kernels.rs");
    fs::write(&path, src).unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
}
