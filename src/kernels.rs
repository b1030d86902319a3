//! The cubins build.rs compiled and embedded (SASS only), and its build summary.

/// Keeps an embedded image 128-byte aligned (cuModuleLoadData parses it in place).
#[repr(C, align(128))]
pub struct Aligned<B: ?Sized>(pub B);

pub struct EmbeddedCubin {
    /// The cuda/ file it came from, without ".cu" (e.g. "dhu_sm90").
    pub stem: &'static str,
    /// The SASS target (e.g. "sm_90a").
    pub arch: &'static str,
    pub image: &'static Aligned<[u8]>,
}

include!(concat!(env!("OUT_DIR"), "/kernels.rs"));

/// The cubin of `stem` compiled for `arch`.
pub fn find(stem: &str, arch: &str) -> Option<&'static EmbeddedCubin> {
    EMBEDDED.iter().find(|c| c.stem == stem && c.arch == arch)
}

#[cfg(test)]
mod tests {
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

    /// The image launch.rs loads for `arch` holds SASS for that exact target and a
    /// kernel function for each of the four entry points the planner can name.
    fn check_image(arch: Arch, sm: u32, min_text: usize) {
        let c =
            find(arch.stem(), arch.sass()).unwrap_or_else(|| panic!("{} {} not embedded", arch.stem(), arch.sass()));
        let elf = Elf::parse(&c.image.0);
        assert_eq!(elf.machine(), EM_CUDA, "{}: a CUDA ELF", arch.stem());
        assert_eq!(elf.sm(), sm, "{}: e_flags names SM {sm}", arch.stem());
        // The arch-specific ('a') target is not in e_flags; ptxas records its command
        // line ("-arch sm_100a") in the .note.nv.tkinfo note.
        let tk = elf.section(".note.nv.tkinfo").expect("a .note.nv.tkinfo note");
        assert_eq!(tk.kind, SHT_NOTE);
        let text = String::from_utf8_lossy(elf.bytes(tk)).into_owned();
        assert!(
            text.contains(&format!("-arch {}", arch.sass())),
            "{}: ptxas ran for {}: {text:?}",
            arch.stem(),
            arch.sass()
        );
        let syms = elf.symbols();
        for name in entry_points(arch) {
            let (_, kind, shndx, size) = syms
                .iter()
                .find(|s| s.0 == name)
                .unwrap_or_else(|| panic!("{name} is not in the symbol table of {}", arch.stem()));
            assert_eq!(*kind, STT_FUNC, "{name} is a function");
            let sec = &elf.sections[*shndx as usize];
            assert_eq!(sec.name, format!(".text.{name}"), "{name}'s code section");
            assert!(*size as usize >= min_text && sec.size >= min_text, "{name}: {size} bytes of SASS");
            assert!(elf.section(&format!(".nv.info.{name}")).is_some(), "{name} has its kernel attributes");
        }
    }

    #[test]
    fn sm90_image_holds_the_four_sm90a_kernels() {
        check_image(Arch::Sm90, 90, 4096);
    }

    #[test]
    fn sm100_image_holds_the_four_sm100a_kernels() {
        // 4 KB of SASS per entry point: the real kernel (~31 KB each), not the
        // trap-only stub it replaced (a few hundred bytes).
        check_image(Arch::Sm100, 100, 4096);
        assert!(BUILD_INFO.contains("dhu_sm100 sm_100a kda_dhu_sm100_k128_bf16"), "{BUILD_INFO}");
        for name in entry_points(Arch::Sm100) {
            let line = BUILD_INFO
                .lines()
                .find(|l| l.contains(&format!("{name}:")))
                .unwrap_or_else(|| panic!("{name} in BUILD_INFO"));
            assert!(line.ends_with(", 0 bytes stack frame"), "{line}");
        }
    }

    #[test]
    fn both_architectures_are_embedded_as_elf() {
        for (stem, arch) in [("dhu_sm90", "sm_90a"), ("dhu_sm100", "sm_100a")] {
            let c = find(stem, arch).unwrap_or_else(|| panic!("{stem} {arch} not embedded"));
            assert_eq!(&c.image.0[..4], b"\x7fELF", "{stem} is a cubin");
            assert_eq!(c.image.0.as_ptr() as usize % 128, 0);
        }
        assert!(BUILD_INFO.contains("kda_dhu_sm90_k128_bf16"), "{BUILD_INFO}");
    }
}
