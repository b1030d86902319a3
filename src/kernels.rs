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
