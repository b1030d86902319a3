//! Parser of ptxas's `-v` resource report. Used by build.rs (which includes this file
//! by path) to fail the build on spills and print a per-kernel summary; compiled into
//! the crate only for its tests.

/// One kernel's line in ptxas's report.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct FuncReport {
    pub name: String,
    pub entry: bool,
    pub registers: Option<u64>,
    pub smem: Option<u64>,
    pub stack: Option<u64>,
    pub spill_stores: u64,
    pub spill_loads: u64,
}

/// Reads ptxas's `-v` report:
///   ptxas info    : Compiling entry function 'NAME' for 'sm_90a'
///   ptxas info    : Function properties for NAME
///       0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
///   ptxas info    : Used 168 registers, used 1 barriers, 1024 bytes smem, ...
/// "Function properties" also appears for non-inlined device functions: their
/// spills count too.
pub fn parse_ptxas(report: &str) -> Vec<FuncReport> {
    let mut funcs: Vec<FuncReport> = Vec::new();
    let mut current: Option<usize> = None;
    let mut current_entry: Option<usize> = None;
    let index_of = |funcs: &mut Vec<FuncReport>, name: &str| -> usize {
        if let Some(i) = funcs.iter().position(|f| f.name == name) {
            i
        } else {
            funcs.push(FuncReport { name: name.to_string(), ..Default::default() });
            funcs.len() - 1
        }
    };
    for line in report.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or("");
            let i = index_of(&mut funcs, name);
            funcs[i].entry = true;
            current_entry = Some(i);
        } else if let Some(rest) = line.split("Function properties for ").nth(1) {
            let i = index_of(&mut funcs, rest.trim());
            current = Some(i);
        } else if line.contains("bytes stack frame") {
            if let Some(i) = current {
                let f = &mut funcs[i];
                f.stack = number_before(line, " bytes stack frame");
                f.spill_stores = number_before(line, " bytes spill stores").unwrap_or(0);
                f.spill_loads = number_before(line, " bytes spill loads").unwrap_or(0);
            }
        } else if line.contains("Used ") && line.contains(" registers") {
            if let Some(i) = current_entry {
                let f = &mut funcs[i];
                f.registers =
                    line.split("Used ").nth(1).and_then(|r| r.split_whitespace().next()).and_then(|n| n.parse().ok());
                f.smem = number_before(line, " bytes smem");
            }
        }
    }
    funcs
}

/// The integer just before `suffix` in `line` ("..., 24 bytes spill stores" → 24).
pub fn number_before(line: &str, suffix: &str) -> Option<u64> {
    let end = line.find(suffix)?;
    let head = &line[..end];
    let start = head.rfind(|c: char| !c.is_ascii_digit()).map_or(0, |i| i + 1);
    head[start..].parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// nvcc 13.0 -Xptxas -v on a kernel forced to spill (-maxrregcount=24) calling a
    /// non-inlined device function that spills too.
    const SPILLING: &str = "\
ptxas info    : Overriding maximum register limit 256 for 'spiller' with  24 of maxrregcount option
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'spiller' for 'sm_90a'
ptxas info    : Function properties for spiller
    600 bytes stack frame, 656 bytes spill stores, 816 bytes spill loads
ptxas info    : Used 24 registers, used 1 barriers, 600 bytes cumulative stack size, 1024 bytes smem
ptxas info    : Compile time = 31.999 ms
ptxas info    : Function properties for _Z6helperPfi
    0 bytes stack frame, 640 bytes spill stores, 700 bytes spill loads
";

    /// The placeholder-style clean kernel (CUDA 13 prints no smem when there is none).
    const CLEAN: &str = "\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'kda_dhu_sm90_k64_bf16' for 'sm_90a'
ptxas info    : Function properties for kda_dhu_sm90_k64_bf16
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 218 registers, used 1 barriers
";

    #[test]
    fn spills_are_found_in_entries_and_device_functions() {
        let f = parse_ptxas(SPILLING);
        assert_eq!(f.len(), 2);
        assert_eq!(
            f[0],
            FuncReport {
                name: "spiller".into(),
                entry: true,
                registers: Some(24),
                smem: Some(1024),
                stack: Some(600),
                spill_stores: 656,
                spill_loads: 816
            }
        );
        assert_eq!(f[1].name, "_Z6helperPfi");
        assert!(!f[1].entry);
        assert_eq!((f[1].spill_stores, f[1].spill_loads), (640, 700));
    }

    #[test]
    fn a_clean_kernel_reports_no_spills() {
        let f = parse_ptxas(CLEAN);
        assert_eq!(f.len(), 1);
        assert_eq!((f[0].registers, f[0].smem, f[0].stack), (Some(218), None, Some(0)));
        assert_eq!((f[0].spill_stores, f[0].spill_loads), (0, 0));
        assert_eq!(number_before("x, 24 bytes spill stores", " bytes spill stores"), Some(24));
        assert_eq!(number_before("no number bytes smem", " bytes smem"), None);
    }
}
