//! Every environment switch of kda-dhu, read here and nowhere else (Python asks through
//! `_core.switches()` / `_core.force()`). Read at each use, so that a training script or a
//! test may change them between calls. Values that mean "unset": absent, "", "0", "auto".
//!
//! | variable | values | effect |
//! |---|---|---|
//! | `KDA_DHU_FORCE` | `kernel`, `fla` | force a path (debugging), the same on every route (direct entry points, `kda_dhu_b2a`, the custom op, fla's registry: its verifier reads it once per call and hands the reading to the implementation): `kernel` runs the kernel wherever it can compute the call (the planner's "capable" rule) and raises where it cannot; `fla` always runs fla's function; another value raises, naming the switch; inputs in host memory run the CPU implementation either way |
//! | `KDA_DHU_CHECK_INPUTS` | `1` | packed batches: check cu_seqlens / chunk_offsets on the host before each call (one synchronization per call) and raise at once, instead of on the device (reported by the next call) |
//! | `KDA_DHU_SM90_NWG` | `1`, `2` | Hopper kernel: consumer warpgroups per CTA (measurements) |
//! | `KDA_DHU_SM90_SPLIT` | `on`, `off`, an integer >= 2 | Hopper kernel, dense calls: the sequence split below one wave (src/split.rs): `on` where its rule picks one, `off` never, `N` N segments wherever a split can run (tests, measurements); `live` / `N:L` a long live segment (the rule `split::rule_live` / N segments, L live: only with the KDA_DHU_EXP_SPLIT_LIVE experiment's kernels, else `on` / `N`); unset: the default (`split::DEFAULT_ON`; the forward scan's `split::DEFAULT_ON_FWD`) |
//! | `KDA_DHU_SM100` | `check`, `wait`, `on`, `off` | Blackwell kernel (python/kda_dhu/_selfcheck.py): unset or `check`, each shape signature runs fla until a check in a child process passed it (in the background); `wait`, the signature's first call waits for that verdict; `on`, the kernel runs unchecked; `off`, never |
//! | `KDA_DHU_CACHE_DIR` | a folder | where the Blackwell kernel's check keeps its verdicts (else `$XDG_CACHE_HOME/kda_dhu`, else `~/.cache/kda_dhu`): a path, so read as it is (not lower-cased) by python/kda_dhu/_selfcheck_cache.py, not here |
//! | `KDA_DHU_NO_EXCHANGE_API` | `1` | read torch tensors through DLPack capsules, not torch's C exchange API |
//! | `KDA_DHU_NO_AUTOREGISTER` | `1` | do not register kda-dhu in fla's backend registry on import |
//! | `KDA_DHU_IMAGE` | `cuda12`, `cuda13` | the embedded kernel image a device loads (default: the newest its driver loads; same-run A/B measurements); read when a device first loads its kernels |
//! | `KDA_DHU_IMAGE_FILE` | a path | a cubin loaded instead of the embedded image (development; the tests of an image a GPU cannot run); read when a device first loads its kernels |
//! | `KDA_DHU_FWD_H` | `on`, `off` | the forward scan (fla's `chunk_gated_delta_rule_fwd_h`) on kda-dhu's kernel, the same on every route (`kda_dhu.chunk_gated_delta_rule_fwd_h`, its custom op, `patch()`, fla's registry, whose verifier declines while off): `on` the kernel where it covers the call, `off` fla's own function always; unset: `FWD_H_DEFAULT`. `KDA_DHU_FORCE` wins over it |
//! | `FLA_KDA_DHU` | `0` | fla's own switch of this backend (read by fla) |

use crate::error::{Error, Result};

/// `KDA_DHU_FORCE`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Force {
    Kernel,
    Fla,
}

impl Force {
    /// "kernel" or "fla" (trimmed, lower-cased as `value` gives it); None for another value.
    pub fn parse(v: &str) -> Option<Force> {
        match v {
            "kernel" => Some(Force::Kernel),
            "fla" => Some(Force::Fla),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Force::Kernel => "kernel",
            Force::Fla => "fla",
        }
    }
}

pub const FORCE: &str = "KDA_DHU_FORCE";
pub const CHECK_INPUTS: &str = "KDA_DHU_CHECK_INPUTS";
pub const SM90_NWG: &str = "KDA_DHU_SM90_NWG";
pub const SM90_SPLIT: &str = "KDA_DHU_SM90_SPLIT";
pub const SM100: &str = "KDA_DHU_SM100";
pub const NO_EXCHANGE_API: &str = "KDA_DHU_NO_EXCHANGE_API";
pub const NO_AUTOREGISTER: &str = "KDA_DHU_NO_AUTOREGISTER";
pub const IMAGE: &str = "KDA_DHU_IMAGE";
pub const IMAGE_FILE: &str = "KDA_DHU_IMAGE_FILE";
pub const FWD_H: &str = "KDA_DHU_FWD_H";

/// The switches read at each call: they change what a call runs. The others are read once
/// (on import, when a device first loads its kernels) or choose how tensors are read.
pub const PER_CALL: &[&str] = &[FORCE, CHECK_INPUTS, SM90_NWG, SM90_SPLIT, SM100, FWD_H];

/// Every switch, with its meaning (the table above), for `_core.switches()` and --doctor.
pub const SWITCHES: &[(&str, &str)] = &[
    (FORCE, "kernel|fla: force a path (debugging)"),
    (CHECK_INPUTS, "1: check packed-batch tables on the host before each call (synchronizes)"),
    (SM90_NWG, "1|2: Hopper kernel's consumer warpgroups per CTA (measurements)"),
    (SM90_SPLIT, "on|off|N|live|N:L: Hopper kernel's sequence split below one wave (N: that many segments; live, N:L: a long live segment, an experiment's build only)"),
    (SM100, "check|wait|on|off: the Blackwell kernel's check in a child process (on: unchecked, off: never)"),
    (NO_EXCHANGE_API, "1: read torch tensors through DLPack capsules"),
    (NO_AUTOREGISTER, "1: do not register the backend in fla's registry on import"),
    (IMAGE, "cuda12|cuda13: the embedded kernel image (default: the newest the driver loads)"),
    (IMAGE_FILE, "path: a cubin loaded instead of the embedded image (development, tests)"),
    (FWD_H, "on|off: the forward scan (fwd_h) on kda-dhu's kernel on every route (unset: FWD_H_DEFAULT)"),
];

/// The value of `name`, trimmed and lower-cased; None when unset (absent, "", "0", "auto").
pub fn value(name: &str) -> Option<String> {
    let v = std::env::var(name).ok()?;
    let v = v.trim().to_ascii_lowercase();
    (!matches!(v.as_str(), "" | "0" | "auto")).then_some(v)
}

/// Whether a flag switch is set (any value but the unset ones).
pub fn flag(name: &str) -> bool {
    value(name).is_some()
}

/// `KDA_DHU_FORCE`: None, Kernel or Fla; another value is an error naming the switch.
pub fn force() -> Result<Option<Force>> {
    match value(FORCE) {
        None => Ok(None),
        Some(v) => Force::parse(&v)
            .map(Some)
            .ok_or_else(|| Error::value(FORCE, format!("expected 'kernel', 'fla' or unset, got {v:?}"))),
    }
}

/// Whether the forward scan runs kda-dhu's kernel while `KDA_DHU_FWD_H` is unset.
pub const FWD_H_DEFAULT: bool = true;

/// `KDA_DHU_FWD_H`: `on` / `1` true, `off` / `0` false, unset (absent, "", "auto")
/// `FWD_H_DEFAULT`; another value is an error naming the switch.
pub fn fwd_h() -> Result<bool> {
    let Ok(raw) = std::env::var(FWD_H) else { return Ok(FWD_H_DEFAULT) };
    match raw.trim().to_ascii_lowercase().as_str() {
        "" | "auto" => Ok(FWD_H_DEFAULT),
        "on" | "1" => Ok(true),
        "off" | "0" => Ok(false),
        v => Err(Error::value(FWD_H, format!("expected 'on', 'off' or unset, got {v:?}"))),
    }
}

/// `KDA_DHU_CHECK_INPUTS`.
pub fn check_inputs() -> bool {
    flag(CHECK_INPUTS)
}

/// `KDA_DHU_SM90_NWG` (1 or 2); other values are ignored.
pub fn sm90_nwg() -> Option<u32> {
    match value(SM90_NWG).as_deref() {
        Some("1") => Some(1),
        Some("2") => Some(2),
        _ => None,
    }
}

/// `KDA_DHU_SM90_SPLIT`: `on`, `off`, an integer >= 2, `live`, `N:L` (2 <= N, 1 <= L < N);
/// unset (or another value) is the default.
pub fn sm90_split() -> crate::split::SplitSwitch {
    split_switch(value(SM90_SPLIT).as_deref())
}

/// The reading of a `KDA_DHU_SM90_SPLIT` value (trimmed, lower-cased; None: unset).
fn split_switch(v: Option<&str>) -> crate::split::SplitSwitch {
    use crate::split::SplitSwitch;
    match v {
        None => SplitSwitch::Default,
        Some("on") => SplitSwitch::Rule,
        Some("off") => SplitSwitch::Off,
        Some("live") => SplitSwitch::LiveRule,
        Some(v) => match v.parse::<u32>() {
            Ok(n) if n >= 2 => SplitSwitch::Segments(n),
            Ok(1) => SplitSwitch::Off,
            _ => match v.split_once(':').map(|(n, l)| (n.parse::<u32>(), l.parse::<u32>())) {
                Some((Ok(n), Ok(l))) if n >= 2 && l >= 1 && l < n => SplitSwitch::SegmentsLive(n, l),
                _ => SplitSwitch::Default,
            },
        },
    }
}

/// `KDA_DHU_IMAGE`, trimmed and lower-cased (None when unset); `kernels::ImageRequest`
/// reads it.
pub fn image() -> Option<String> {
    value(IMAGE)
}

/// `KDA_DHU_IMAGE_FILE`, as given (a path: not lower-cased); None when unset or empty.
pub fn image_file() -> Option<std::path::PathBuf> {
    std::env::var_os(IMAGE_FILE).filter(|v| !v.is_empty()).map(std::path::PathBuf::from)
}

/// `KDA_DHU_NO_EXCHANGE_API`.
pub fn no_exchange_api() -> bool {
    flag(NO_EXCHANGE_API)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_forward_scan_s_switch() {
        // SAFETY (edition 2021: set_var is safe): no other Rust test reads it.
        std::env::remove_var(FWD_H);
        assert_eq!(fwd_h().unwrap(), FWD_H_DEFAULT);
        for (v, want) in [("on", true), (" ON ", true), ("1", true), ("off", false), ("0", false)] {
            std::env::set_var(FWD_H, v);
            assert_eq!(fwd_h().unwrap(), want, "{v:?}");
        }
        for v in ["", "auto"] {
            std::env::set_var(FWD_H, v);
            assert_eq!(fwd_h().unwrap(), FWD_H_DEFAULT, "{v:?}");
        }
        std::env::set_var(FWD_H, "yes");
        assert_eq!(fwd_h().unwrap_err().to_string(), "KDA_DHU_FWD_H: expected 'on', 'off' or unset, got \"yes\"");
        std::env::remove_var(FWD_H);
    }

    #[test]
    fn the_split_switch_values() {
        use crate::split::SplitSwitch::*;
        for (v, want) in [
            (None, Default),
            (Some("on"), Rule),
            (Some("off"), Off),
            (Some("1"), Off),
            (Some("3"), Segments(3)),
            (Some("live"), LiveRule),
            (Some("6:2"), SegmentsLive(6, 2)),
            (Some("6:6"), Default),
            (Some("6:0"), Default),
            (Some("x"), Default),
        ] {
            assert_eq!(split_switch(v), want, "{v:?}");
        }
    }

    #[test]
    fn unset_values() {
        // SAFETY (edition 2021: set_var is safe): a name no other test reads.
        let name = "KDA_DHU_TEST_SWITCH_UNSET_VALUES";
        for v in ["", "0", "auto", " AUTO "] {
            std::env::set_var(name, v);
            assert_eq!(value(name), None, "{v:?}");
        }
        std::env::set_var(name, " Kernel ");
        assert_eq!(value(name).as_deref(), Some("kernel"));
        std::env::remove_var(name);
        assert!(!flag(name));
    }
}
