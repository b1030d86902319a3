//! The cubins build.rs compiled and embedded (SASS only), its build summary, and which
//! image a driver loads.
//!
//! Every source is embedded twice: built by nvcc 13 (a CUDA 13 image: drivers >= 13.0,
//! R580+) and by NVRTC 12 (a CUDA 12 image: drivers >= 12.0, R525+, for sm_90a; >= 12.8,
//! R570+, for sm_100a, the first that drive Blackwell). A driver loads images of its own
//! CUDA major version or older; by default the newest one it can load is used, and
//! `KDA_DHU_IMAGE=cuda12|cuda13` picks one (same-run A/B measurements).

/// Keeps an embedded image 128-byte aligned (cuModuleLoadData parses it in place).
#[repr(C, align(128))]
pub struct Aligned<B: ?Sized>(pub B);

pub struct EmbeddedCubin {
    /// The cuda/ file it came from, without ".cu" (e.g. "dhu_sm90").
    pub stem: &'static str,
    /// The SASS target (e.g. "sm_90a").
    pub arch: &'static str,
    /// The CUDA major version of the compiler that built it: 13 (nvcc) or 12 (NVRTC).
    pub cuda: u32,
    pub image: &'static Aligned<[u8]>,
}

impl std::fmt::Debug for EmbeddedCubin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} cuda{} ({} bytes)", self.stem, self.arch, self.cuda, self.image.0.len())
    }
}

include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

/// The cubin of `stem` compiled for `arch` by CUDA major version `cuda`.
pub fn find(stem: &str, arch: &str, cuda: u32) -> Option<&'static EmbeddedCubin> {
    EMBEDDED.iter().find(|c| c.stem == stem && c.arch == arch && c.cuda == cuda)
}

/// The oldest driver that loads the image of CUDA major `cuda` for `arch`: its version as
/// cuDriverGetVersion reports it (1000 major + 10 minor) and its branch. CUDA 12 images
/// run on every 12.x driver (NVIDIA's minor version compatibility: SASS only, no PTX to
/// JIT), from the first that knows the architecture; CUDA 13 images need a 13.x driver.
pub fn min_driver(cuda: u32, arch: &str) -> (i32, &'static str) {
    match (cuda, arch) {
        (12, "sm_100a") => (12080, "R570"),
        (12, _) => (12000, "R525"),
        _ => (13000, "R580"),
    }
}

/// "12.4" for 12040.
pub fn driver_version_name(version: i32) -> String {
    format!("{}.{}", version / 1000, (version % 1000) / 10)
}

/// What `KDA_DHU_IMAGE` (`env::image`) asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ImageRequest {
    /// The newest image the driver loads (unset, empty, "auto").
    Newest,
    /// The image of this CUDA major version ("cuda12", "cuda13").
    Cuda(u32),
}

impl ImageRequest {
    /// Reads the variable's value; Err names what it accepts.
    pub fn parse(raw: Option<&str>) -> Result<ImageRequest, String> {
        let value = raw.map(|v| v.trim().to_ascii_lowercase()).unwrap_or_default();
        match value.as_str() {
            "" | "auto" => Ok(ImageRequest::Newest),
            v => v
                .strip_prefix("cuda")
                .and_then(|n| n.parse().ok())
                .filter(|n: &u32| EMBEDDED.iter().any(|c| c.cuda == *n))
                .map(ImageRequest::Cuda)
                .ok_or_else(|| format!("expected {}, 'auto' or unset, got {v:?}", image_names(EMBEDDED).join(", "))),
        }
    }
}

/// "cuda12", "cuda13": the CUDA versions of `table`'s images, oldest first.
fn image_names(table: &[EmbeddedCubin]) -> Vec<String> {
    let mut versions: Vec<u32> = table.iter().map(|c| c.cuda).collect();
    versions.sort_unstable();
    versions.dedup();
    versions.iter().map(|v| format!("'cuda{v}'")).collect()
}

/// The image of `stem` for `arch` that a driver of `driver` (cuDriverGetVersion) loads
/// under `request`, from `table` (EMBEDDED; tests pass their own). Err: why none can
/// run, naming the driver and what is needed.
pub fn select<'a>(
    table: &'a [EmbeddedCubin],
    stem: &str,
    arch: &str,
    driver: i32,
    request: ImageRequest,
) -> Result<&'a EmbeddedCubin, String> {
    let mut images: Vec<&EmbeddedCubin> = table.iter().filter(|c| c.stem == stem && c.arch == arch).collect();
    images.sort_by_key(|c| std::cmp::Reverse(c.cuda));
    let needs = |c: &EmbeddedCubin| {
        let (v, branch) = min_driver(c.cuda, arch);
        format!("the CUDA {} image needs a driver for CUDA {} or newer ({branch}+)", c.cuda, driver_version_name(v))
    };
    let have = driver_version_name(driver);
    match request {
        ImageRequest::Newest => {
            if let Some(c) = images.iter().find(|c| driver >= min_driver(c.cuda, arch).0) {
                return Ok(c);
            }
            let oldest = images.last().ok_or_else(|| format!("no {stem} image for {arch} is embedded"))?;
            Err(format!("CUDA driver {have} is too old: {}", needs(oldest)))
        }
        ImageRequest::Cuda(v) => {
            let c = images.iter().find(|c| c.cuda == v).ok_or_else(|| {
                format!("{}=cuda{v}: no CUDA {v} image of {stem} for {arch} is embedded", crate::env::IMAGE)
            })?;
            if driver < min_driver(v, arch).0 {
                return Err(format!("{}=cuda{v} with CUDA driver {have}: {}", crate::env::IMAGE, needs(c)));
            }
            Ok(c)
        }
    }
}

/// Whether `build_info` (`BUILD_INFO`) holds the compiler flag `-D<name>` or `-D<name>=V`
/// with V a nonzero integer: a compile-time experiment of cuda/dhu_sm90_regstate.cuh
/// (build.rs, KDA_DHU_KERNEL_DEFINES).
pub fn experiment_defined(build_info: &str, name: &str) -> bool {
    build_info.split_whitespace().any(|flag| match flag.strip_prefix("-D").and_then(|f| f.strip_prefix(name)) {
        Some("") => true,
        Some(v) => v.strip_prefix('=').and_then(|v| v.parse::<i64>().ok()).is_some_and(|v| v != 0),
        None => false,
    })
}

/// Whether the embedded image was built with the experiment `name` (`experiment_defined`
/// on `BUILD_INFO`). A cubin loaded in place of it (`KDA_DHU_IMAGE_FILE`) may lack it: never
/// with one.
pub fn experiment_built(name: &str) -> bool {
    experiment_defined(BUILD_INFO, name) && crate::env::image_file().is_none()
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_experiment_flag_is_read_exactly() {
        use super::experiment_defined;
        let name = "KDA_DHU_EXP_SPLIT_LIVE";
        assert!(experiment_defined("nvcc flags: -O3 -DKDA_DHU_EXP_SPLIT_LIVE=1 -I x", name));
        assert!(experiment_defined("-DKDA_DHU_EXP_SPLIT_LIVE", name));
        assert!(experiment_defined("-DKDA_DHU_EXP_ABLATE=2", "KDA_DHU_EXP_ABLATE"));
        for info in [
            "",
            "-DKDA_DHU_EXP_SPLIT_LIVE=0",
            "-DKDA_DHU_EXP_SPLIT_LIVE=00",
            "-DKDA_DHU_EXP_SPLIT_LIVE_X=1",
            "KDA_DHU_EXP_SPLIT_LIVE=1",
            "-DKDA_DHU_EXP_ABLATE=2",
        ] {
            assert!(!experiment_defined(info, name), "{info}");
        }
    }

    use super::*;
    use crate::plan::{Arch, KernelConfig};

    /// The few ELF64 facts the image tests read (little-endian, as every cubin is).
    struct Elf<'a> {
        data: &'a [u8],
        sections: Vec<Section>,
    }

    struct Section {
        name: String,
        kind: u32,
        offset: usize,
        size: usize,
        link: u32,
        entsize: usize,
    }

    /// One symbol: (name, type from st_info, section index, size).
    type Symbol = (String, u8, u16, u64);

    fn u16_at(d: &[u8], o: usize) -> u16 {
        u16::from_le_bytes(d[o..o + 2].try_into().unwrap())
    }
    fn u32_at(d: &[u8], o: usize) -> u32 {
        u32::from_le_bytes(d[o..o + 4].try_into().unwrap())
    }
    fn u64_at(d: &[u8], o: usize) -> u64 {
        u64::from_le_bytes(d[o..o + 8].try_into().unwrap())
    }
    fn c_str(d: &[u8], o: usize) -> String {
        let end = d[o..].iter().position(|&b| b == 0).map_or(d.len(), |n| o + n);
        String::from_utf8_lossy(&d[o..end]).into_owned()
    }

    const EM_CUDA: u16 = 190;
    const SHT_SYMTAB: u32 = 2;
    const SHT_NOTE: u32 = 7;
    const STT_FUNC: u8 = 2;

    impl<'a> Elf<'a> {
        fn parse(data: &'a [u8]) -> Elf<'a> {
            assert_eq!(&data[..4], b"\x7fELF");
            assert_eq!(data[4], 2, "ELF64");
            assert_eq!(data[5], 1, "little-endian");
            let shoff = u64_at(data, 0x28) as usize;
            let shentsize = u16_at(data, 0x3a) as usize;
            let shnum = u16_at(data, 0x3c) as usize;
            let shstrndx = u16_at(data, 0x3e) as usize;
            let raw: Vec<(u32, u32, usize, usize, u32, usize)> = (0..shnum)
                .map(|i| {
                    let h = shoff + i * shentsize;
                    (
                        u32_at(data, h),
                        u32_at(data, h + 4),
                        u64_at(data, h + 0x18) as usize,
                        u64_at(data, h + 0x20) as usize,
                        u32_at(data, h + 0x28),
                        u64_at(data, h + 0x38) as usize,
                    )
                })
                .collect();
            let names_at = raw[shstrndx].2;
            let sections = raw
                .iter()
                .map(|&(name, kind, offset, size, link, entsize)| Section {
                    name: c_str(data, names_at + name as usize),
                    kind,
                    offset,
                    size,
                    link,
                    entsize,
                })
                .collect();
            Elf { data, sections }
        }

        fn machine(&self) -> u16 {
            u16_at(self.data, 0x12)
        }

        /// The SM number of e_flags: bits 8..16 from ELF ABI version 8 (CUDA >= 12.8),
        /// bits 0..8 before.
        fn sm(&self) -> u32 {
            let flags = u32_at(self.data, 0x30);
            if self.data[8] >= 8 {
                (flags >> 8) & 0xff
            } else {
                flags & 0xff
            }
        }

        fn section(&self, name: &str) -> Option<&Section> {
            self.sections.iter().find(|s| s.name == name)
        }

        fn bytes(&self, s: &Section) -> &'a [u8] {
            &self.data[s.offset..s.offset + s.size]
        }

        fn symbols(&self) -> Vec<Symbol> {
            let tab = self.sections.iter().find(|s| s.kind == SHT_SYMTAB).expect("a .symtab");
            let strtab = &self.sections[tab.link as usize];
            (0..tab.size / tab.entsize)
                .map(|i| {
                    let e = tab.offset + i * tab.entsize;
                    (
                        c_str(self.data, strtab.offset + u32_at(self.data, e) as usize),
                        self.data[e + 4] & 0xf,
                        u16_at(self.data, e + 6),
                        u64_at(self.data, e + 16),
                    )
                })
                .collect()
        }
    }

    fn entry_points(arch: Arch) -> Vec<&'static str> {
        KernelConfig::all(arch).iter().map(|c| c.entry_point(arch)).collect()
    }

    /// Pre-v8 ELF ABI (CUDA 12's sm_90a): e_flags bit 11 marks an arch-specific ('a')
    /// target (set for sm_90a, clear for sm_90: compared on NVRTC 12.9's output).
    const EF_CUDA_ARCH_SPECIFIC_V7: u32 = 0x800;

    /// The images launch.rs loads for `arch` (one per CUDA version) hold SASS for that
    /// exact target and a kernel function for each entry point the planner can name.
    fn check_image(arch: Arch, sm: u32, min_text: usize) {
        for cuda in [12, 13] {
            let c = find(arch.stem(), arch.sass(), cuda)
                .unwrap_or_else(|| panic!("{} {} cuda{cuda} not embedded", arch.stem(), arch.sass()));
            let what = format!("{} cuda{cuda}", arch.stem());
            let elf = Elf::parse(&c.image.0);
            assert_eq!(elf.machine(), EM_CUDA, "{what}: a CUDA ELF");
            assert_eq!(elf.sm(), sm, "{what}: e_flags names SM {sm}");
            if elf.data[8] >= 8 {
                // The arch-specific ('a') target is not in e_flags; ptxas records its
                // command line ("-arch sm_100a") in the .note.nv.tkinfo note.
                let tk = elf.section(".note.nv.tkinfo").expect("a .note.nv.tkinfo note");
                assert_eq!(tk.kind, SHT_NOTE);
                let text = String::from_utf8_lossy(elf.bytes(tk)).into_owned();
                assert!(
                    text.contains(&format!("-arch {}", arch.sass())),
                    "{what}: ptxas ran for {}: {text:?}",
                    arch.sass()
                );
            } else {
                let flags = u32_at(elf.data, 0x30);
                assert_ne!(flags & EF_CUDA_ARCH_SPECIFIC_V7, 0, "{what}: an arch-specific target ({flags:#x})");
            }
            let syms = elf.symbols();
            for name in entry_points(arch) {
                let (_, kind, shndx, size) = syms
                    .iter()
                    .find(|s| s.0 == name)
                    .unwrap_or_else(|| panic!("{name} is not in the symbol table of {what}"));
                assert_eq!(*kind, STT_FUNC, "{name} is a function");
                let sec = &elf.sections[*shndx as usize];
                assert_eq!(sec.name, format!(".text.{name}"), "{name}'s code section");
                assert!(*size as usize >= min_text && sec.size >= min_text, "{what} {name}: {size} bytes of SASS");
                assert!(elf.section(&format!(".nv.info.{name}")).is_some(), "{name} has its kernel attributes");
            }
        }
    }

    #[test]
    fn sm90_images_hold_the_sm90a_kernels() {
        check_image(Arch::Sm90, 90, 4096);
    }

    #[test]
    fn sm100_images_hold_the_four_sm100a_kernels() {
        // 4 KB of SASS per entry point: the real kernel (~31 KB each), not the
        // trap-only stub it replaced (a few hundred bytes).
        check_image(Arch::Sm100, 100, 4096);
        for cuda in [12, 13] {
            for name in entry_points(Arch::Sm100) {
                let line = BUILD_INFO
                    .lines()
                    .find(|l| l.starts_with(&format!("dhu_sm100 sm_100a cuda{cuda} {name}:")))
                    .unwrap_or_else(|| panic!("{name} (cuda{cuda}) in BUILD_INFO:\n{BUILD_INFO}"));
                assert!(line.ends_with(", 0 bytes stack frame"), "{line}");
            }
        }
    }

    #[test]
    fn every_image_is_embedded_as_aligned_elf_with_its_ptxas_report() {
        for (stem, arch) in [("dhu_sm90", "sm_90a"), ("dhu_sm100", "sm_100a")] {
            for cuda in [12, 13] {
                let c = find(stem, arch, cuda).unwrap_or_else(|| panic!("{stem} {arch} cuda{cuda} not embedded"));
                assert_eq!(&c.image.0[..4], b"\x7fELF", "{stem} is a cubin");
                assert_eq!(c.image.0.as_ptr() as usize % 128, 0);
                // build.rs checked this image's ptxas report for spills: its entry points
                // are in the summary.
                let prefix = format!("{stem} {arch} cuda{cuda} ");
                assert!(BUILD_INFO.lines().any(|l| l.starts_with(&prefix)), "{prefix} in BUILD_INFO:\n{BUILD_INFO}");
            }
        }
        assert_eq!(EMBEDDED.len(), 4, "two sources, two CUDA versions");
        assert!(BUILD_INFO.contains("cuda12: NVRTC 12."), "{BUILD_INFO}");
    }

    static FAKE: Aligned<[u8; 4]> = Aligned(*b"\x7fELF");

    fn fake_table() -> Vec<EmbeddedCubin> {
        let mut t = Vec::new();
        for (stem, arch) in [("dhu_sm90", "sm_90a"), ("dhu_sm100", "sm_100a")] {
            for cuda in [12, 13] {
                t.push(EmbeddedCubin { stem, arch, cuda, image: &FAKE });
            }
        }
        t
    }

    #[test]
    fn the_newest_image_the_driver_loads_is_selected() {
        let t = fake_table();
        let pick =
            |arch, driver, req| select(&t, if arch == "sm_90a" { "dhu_sm90" } else { "dhu_sm100" }, arch, driver, req);
        let cuda = |arch, driver, req| pick(arch, driver, req).map(|c| c.cuda);
        use ImageRequest::*;
        assert_eq!(cuda("sm_90a", 12000, Newest), Ok(12));
        assert_eq!(cuda("sm_90a", 12040, Newest), Ok(12));
        assert_eq!(cuda("sm_90a", 12090, Newest), Ok(12));
        assert_eq!(cuda("sm_90a", 13000, Newest), Ok(13));
        assert_eq!(cuda("sm_90a", 13040, Newest), Ok(13));
        assert_eq!(cuda("sm_100a", 12080, Newest), Ok(12));
        assert_eq!(cuda("sm_100a", 13000, Newest), Ok(13));
        // Asked for: a newer driver loads the older image too.
        assert_eq!(cuda("sm_90a", 13000, Cuda(12)), Ok(12));
        assert_eq!(cuda("sm_100a", 13000, Cuda(13)), Ok(13));
        assert_eq!(pick("sm_90a", 13000, Newest).unwrap().stem, "dhu_sm90");
    }

    #[test]
    fn a_driver_too_old_for_every_image_is_named_with_what_it_needs() {
        let t = fake_table();
        use ImageRequest::*;
        let e = select(&t, "dhu_sm90", "sm_90a", 11080, Newest).unwrap_err();
        assert_eq!(e, "CUDA driver 11.8 is too old: the CUDA 12 image needs a driver for CUDA 12.0 or newer (R525+)");
        let e = select(&t, "dhu_sm100", "sm_100a", 12040, Newest).unwrap_err();
        assert_eq!(e, "CUDA driver 12.4 is too old: the CUDA 12 image needs a driver for CUDA 12.8 or newer (R570+)");
        let e = select(&t, "dhu_sm90", "sm_90a", 12040, Cuda(13)).unwrap_err();
        assert_eq!(
            e,
            "KDA_DHU_IMAGE=cuda13 with CUDA driver 12.4: the CUDA 13 image needs a driver for CUDA 13.0 or newer (R580+)"
        );
        let only12: Vec<EmbeddedCubin> = fake_table().into_iter().filter(|c| c.cuda == 12).collect();
        let e = select(&only12, "dhu_sm90", "sm_90a", 13000, Cuda(13)).unwrap_err();
        assert_eq!(e, "KDA_DHU_IMAGE=cuda13: no CUDA 13 image of dhu_sm90 for sm_90a is embedded");
        assert_eq!(select(&only12, "dhu_sm90", "sm_90a", 13000, Newest).map(|c| c.cuda), Ok(12));
        let e = select(&t, "dhu_sm89", "sm_89", 13000, Newest).unwrap_err();
        assert_eq!(e, "no dhu_sm89 image for sm_89 is embedded");
    }

    #[test]
    fn the_image_variable_reads_the_embedded_versions() {
        use ImageRequest::*;
        assert_eq!(ImageRequest::parse(None), Ok(Newest));
        assert_eq!(ImageRequest::parse(Some("")), Ok(Newest));
        assert_eq!(ImageRequest::parse(Some(" Auto ")), Ok(Newest));
        assert_eq!(ImageRequest::parse(Some("cuda12")), Ok(Cuda(12)));
        assert_eq!(ImageRequest::parse(Some(" CUDA13\n")), Ok(Cuda(13)));
        for bad in ["cuda11", "cuda", "12", "newest"] {
            let e = ImageRequest::parse(Some(bad)).unwrap_err();
            assert!(e.starts_with("expected 'cuda12', 'cuda13', 'auto' or unset, got "), "{e}");
        }
        assert_eq!(min_driver(13, "sm_90a"), (13000, "R580"));
        assert_eq!(driver_version_name(12080), "12.8");
    }
}
