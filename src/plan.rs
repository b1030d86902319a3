//! The planner: one pure function that says "kernel" or "fallback, because ...",
//! called by every entry point (fla's backends call the same idea a verifier).
//!
//! Two rules:
//! - `Rule::B2a` is the seed's dispatcher `kda_dhu_b2a` exactly (SPEC.md), plus the
//!   limits of the kernel (gk path, H == HV, dense, ...).
//! - `Rule::Extended` is the full-signature entry point and the fla backend: tails,
//!   varlen, GVA, g, gk or no gate, dht/h0 None are all kernel cases on sm_90.
//!
//! The architecture narrows them: the sm_90a kernel covers everything above; the
//! sm_100a kernel (cuda/dhu_sm100.cu, the seed's Blackwell design) covers the seed's
//! envelope only (gk gate, H == HV, dense, dht given, T % 64 == 0), under every rule,
//! with no CTA floor of its own (B2a keeps its 256-CTA floor).

use crate::abi::{FLAG_CU_I32, FLAG_DH0, FLAG_DHT, FLAG_G, FLAG_GK, FLAG_OFFSETS_I32, FLAG_VARLEN};
use crate::split::{self, Split};
use crate::tensor::DType;
use crate::validate::CallDesc;
use std::fmt;

// BT (the chunk length of every kernel, fla's BT) and BV (the V tile of one consumer
// warpgroup): cuda/dhu_layout.h, through crate::facts.
use crate::facts::{self, BT, BV};
/// The seed's floor: "serial scans need a full GPU".
pub const MIN_CTAS_B2A: i64 = 256;
/// The Extended rule's CTA floor: none. At 128 CTAs the kernel beats fla (b4_t8192_h16,
/// 1.41x, v4, benches/results/2026-11-30-NVIDIA_H200-v4-c99b8b5.json), and a call of one
/// chunk per sequence is issue latency more than GPU time (the kernel's is lower), so a
/// small grid alone is no reason to fall back; measured losses would be the policy
/// clauses below.
pub const MIN_CTAS_EXTENDED: i64 = 1;
/// One measured clause of the Extended rule on Hopper: a kind of call where the kernel
/// measured slower than fla, stated in what it depends on (CTAs per wave, which is the SM
/// count, and chunks per sequence), with the GPU and the record it was measured on. On a
/// GPU of another SM count the clause is applied as measured, and `--doctor` says so.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PolicyClause {
    pub name: &'static str,
    /// When the clause sends a call to fla.
    pub when: &'static str,
    /// The GPU it was measured on, and that GPU's SM count.
    pub measured_on: &'static str,
    pub measured_sms: i32,
    /// The record of the measurement (kernel forced, same run as fla).
    pub record: &'static str,
}

/// The Extended rule's measured clauses, in the order they are checked: none. The
/// register-state kernel measured faster than fla on every row of the benchmark, the
/// grids below one wave included (b1_t65536_h32 1.24x, b1_t65536_h16 1.22x,
/// gva_b1_t11264_h16_hv32 1.19x, b8_t1096_h4_tail 1.12x; fla re-tuned for each row, same
/// run): benches/results/2026-12-02-NVIDIA_H200-variants-3e142d3.json.
pub const POLICY: [PolicyClause; 0] = [];

/// Each clause of `POLICY` with what it means on `dev`: whether it was measured on a GPU of
/// this SM count.
pub fn policy_notes(dev: &DeviceInfo) -> Vec<(PolicyClause, String)> {
    clause_notes(&POLICY, dev)
}

fn clause_notes(clauses: &[PolicyClause], dev: &DeviceInfo) -> Vec<(PolicyClause, String)> {
    clauses
        .iter()
        .map(|c| {
            let note = if c.measured_sms == dev.sm_count {
                format!("measured on {} ({} SMs), the SM count of this GPU", c.measured_on, c.measured_sms)
            } else {
                format!(
                    "not measured on a GPU of {} SMs: applied as measured on {} ({} SMs)",
                    dev.sm_count, c.measured_on, c.measured_sms
                )
            };
            (*c, note)
        })
        .collect()
}

/// CUDA grid limits on gridDim.y (HV) and gridDim.z (N).
pub const MAX_GRID_YZ: i64 = 65535;
/// Threads per CTA of the Hopper kernel (one producer warp + one consumer warpgroup).
pub const BLOCK_THREADS_SM90: u32 = facts::threads(&facts::SM90, 1);
/// Threads per CTA of the sm_90a kernel with two consumer warpgroups (`_wg2`: 128 V
/// columns of one head per CTA): 2 x 128 consumers + a producer warpgroup.
pub const BLOCK_THREADS_SM90_WG2: u32 = facts::threads(&facts::SM90, 2);
/// Threads per CTA of the Blackwell kernel (TMA warp, MMA warp, two idle warps, the
/// recurrence warpgroup: warps 4-7).
pub const BLOCK_THREADS_SM100: u32 = facts::threads(&facts::SM100, 1);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rule {
    /// The seed's dispatcher, exactly (`kda_dhu_b2a`).
    B2a,
    /// The full-signature entry point and the fla backend: `Capable`, less the shapes
    /// where the kernel measured slower than fla.
    Extended,
    /// Everything the kernel computes correctly; used by `launch` (which must accept
    /// whatever B2a or Extended sent it) and by KDA_DHU_FORCE=kernel.
    Capable,
}

impl Rule {
    pub fn parse(s: &str) -> Option<Rule> {
        match s {
            "b2a" | "B2a" | "B2A" => Some(Rule::B2a),
            "extended" | "Extended" => Some(Rule::Extended),
            "capable" | "Capable" => Some(Rule::Capable),
            _ => None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arch {
    Sm90,
    Sm100,
}

impl Arch {
    /// The arch-specific ('a') SASS runs on exactly one compute capability.
    pub fn from_cc(major: i32, minor: i32) -> Option<Arch> {
        match (major, minor) {
            (9, 0) => Some(Arch::Sm90),
            (10, 0) => Some(Arch::Sm100),
            _ => None,
        }
    }

    /// The SASS target name, as build.rs tags the embedded cubins.
    pub fn sass(self) -> &'static str {
        match self {
            Arch::Sm90 => "sm_90a",
            Arch::Sm100 => "sm_100a",
        }
    }

    /// The plan's name for it: "kernel-sm90a".
    pub fn label(self) -> &'static str {
        match self {
            Arch::Sm90 => "kernel-sm90a",
            Arch::Sm100 => "kernel-sm100a",
        }
    }

    /// The stem of the cuda/ file that holds its kernels.
    pub fn stem(self) -> &'static str {
        match self {
            Arch::Sm90 => "dhu_sm90",
            Arch::Sm100 => "dhu_sm100",
        }
    }

    /// Threads per CTA of its kernels (one consumer warpgroup on sm_90a).
    pub fn block_threads(self) -> u32 {
        match self {
            Arch::Sm90 => BLOCK_THREADS_SM90,
            Arch::Sm100 => BLOCK_THREADS_SM100,
        }
    }

    /// Threads per CTA of the kernel with `nwg` consumer warpgroups.
    pub fn block_threads_for(self, nwg: u32) -> u32 {
        match (self, nwg) {
            (Arch::Sm90, 2) => BLOCK_THREADS_SM90_WG2,
            _ => self.block_threads(),
        }
    }
}

/// What the planner knows about the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    pub cc_major: i32,
    pub cc_minor: i32,
    pub sm_count: i32,
}

impl DeviceInfo {
    pub fn sm_name(&self) -> String {
        format!("sm_{}{}", self.cc_major, self.cc_minor)
    }
}

/// Which compiled kernel runs and with which flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelConfig {
    /// 64 or 128.
    pub k: u32,
    /// BF16 or F16: the dtype of q, k, w, do, dv, dh, dv2.
    pub dtype: DType,
    /// DhuFlags of dhu_params.h.
    pub flags: u32,
    /// (V / (64 nwg), HV, N).
    pub grid: [u32; 3],
    /// Consumer warpgroups per CTA, each owning 64 V columns: 1, or 2 (sm_90a, V % 128
    /// == 0: the two V tiles of a head share one CTA's k, q, w loads).
    pub nwg: u32,
    /// state_v_first (sm_90a): dh, dht, h0, dh0 are [.., V, K].
    pub svf: bool,
    /// A sequence split (sm_90a, dense, below one wave: src/split.rs), or None. With a
    /// split, `grid`, `nwg` and the entry point are its second pass's.
    pub split: Option<Split>,
    /// The forward scan (fla's `chunk_gated_delta_rule_fwd_h`: the FWD instances,
    /// `FWD_ENTRIES`; stage 4's warpgroup rule and split rule, src/split.rs).
    pub forward: bool,
}

/// The sm_90a image's entry points (cuda/dhu_sm90.cu; the kernel, the state held in
/// registers, is cuda/dhu_sm90_regstate.cuh) in slot order: k64/k128 x bf16/fp16, then the
/// same with two warpgroups (`_wg2`), then those eight with state_v_first (`_svf`), then
/// those sixteen for calls with the scalar gate g (`_g`; FLAG_G picks them).
const SM90_ENTRIES: [&str; 32] = [
    "kda_dhu_sm90_rs_k64_bf16",
    "kda_dhu_sm90_rs_k64_fp16",
    "kda_dhu_sm90_rs_k128_bf16",
    "kda_dhu_sm90_rs_k128_fp16",
    "kda_dhu_sm90_rs_k64_bf16_wg2",
    "kda_dhu_sm90_rs_k64_fp16_wg2",
    "kda_dhu_sm90_rs_k128_bf16_wg2",
    "kda_dhu_sm90_rs_k128_fp16_wg2",
    "kda_dhu_sm90_rs_k64_bf16_svf",
    "kda_dhu_sm90_rs_k64_fp16_svf",
    "kda_dhu_sm90_rs_k128_bf16_svf",
    "kda_dhu_sm90_rs_k128_fp16_svf",
    "kda_dhu_sm90_rs_k64_bf16_wg2_svf",
    "kda_dhu_sm90_rs_k64_fp16_wg2_svf",
    "kda_dhu_sm90_rs_k128_bf16_wg2_svf",
    "kda_dhu_sm90_rs_k128_fp16_wg2_svf",
    "kda_dhu_sm90_rs_k64_bf16_g",
    "kda_dhu_sm90_rs_k64_fp16_g",
    "kda_dhu_sm90_rs_k128_bf16_g",
    "kda_dhu_sm90_rs_k128_fp16_g",
    "kda_dhu_sm90_rs_k64_bf16_wg2_g",
    "kda_dhu_sm90_rs_k64_fp16_wg2_g",
    "kda_dhu_sm90_rs_k128_bf16_wg2_g",
    "kda_dhu_sm90_rs_k128_fp16_wg2_g",
    "kda_dhu_sm90_rs_k64_bf16_svf_g",
    "kda_dhu_sm90_rs_k64_fp16_svf_g",
    "kda_dhu_sm90_rs_k128_bf16_svf_g",
    "kda_dhu_sm90_rs_k128_fp16_svf_g",
    "kda_dhu_sm90_rs_k64_bf16_wg2_svf_g",
    "kda_dhu_sm90_rs_k64_fp16_wg2_svf_g",
    "kda_dhu_sm90_rs_k128_bf16_wg2_svf_g",
    "kda_dhu_sm90_rs_k128_fp16_wg2_svf_g",
];
/// The sm_90a image's forward-scan entry points (fla's `chunk_gated_delta_rule_fwd_h`; the
/// register-state kernel's FWD instance), in `fwd_slot` order: k64/k128 x bf16/fp16, then
/// with two warpgroups, then those eight with state_v_first, then those sixteen with the
/// scalar gate g. Planned for calls whose `CallDesc::forward` is set (`KernelConfig::forward`).
pub const FWD_ENTRIES: [&str; 32] = [
    "kda_dhu_sm90_fwd_k64_bf16",
    "kda_dhu_sm90_fwd_k64_fp16",
    "kda_dhu_sm90_fwd_k128_bf16",
    "kda_dhu_sm90_fwd_k128_fp16",
    "kda_dhu_sm90_fwd_k64_bf16_wg2",
    "kda_dhu_sm90_fwd_k64_fp16_wg2",
    "kda_dhu_sm90_fwd_k128_bf16_wg2",
    "kda_dhu_sm90_fwd_k128_fp16_wg2",
    "kda_dhu_sm90_fwd_k64_bf16_svf",
    "kda_dhu_sm90_fwd_k64_fp16_svf",
    "kda_dhu_sm90_fwd_k128_bf16_svf",
    "kda_dhu_sm90_fwd_k128_fp16_svf",
    "kda_dhu_sm90_fwd_k64_bf16_wg2_svf",
    "kda_dhu_sm90_fwd_k64_fp16_wg2_svf",
    "kda_dhu_sm90_fwd_k128_bf16_wg2_svf",
    "kda_dhu_sm90_fwd_k128_fp16_wg2_svf",
    "kda_dhu_sm90_fwd_k64_bf16_g",
    "kda_dhu_sm90_fwd_k64_fp16_g",
    "kda_dhu_sm90_fwd_k128_bf16_g",
    "kda_dhu_sm90_fwd_k128_fp16_g",
    "kda_dhu_sm90_fwd_k64_bf16_wg2_g",
    "kda_dhu_sm90_fwd_k64_fp16_wg2_g",
    "kda_dhu_sm90_fwd_k128_bf16_wg2_g",
    "kda_dhu_sm90_fwd_k128_fp16_wg2_g",
    "kda_dhu_sm90_fwd_k64_bf16_svf_g",
    "kda_dhu_sm90_fwd_k64_fp16_svf_g",
    "kda_dhu_sm90_fwd_k128_bf16_svf_g",
    "kda_dhu_sm90_fwd_k128_fp16_svf_g",
    "kda_dhu_sm90_fwd_k64_bf16_wg2_svf_g",
    "kda_dhu_sm90_fwd_k64_fp16_wg2_svf_g",
    "kda_dhu_sm90_fwd_k128_bf16_wg2_svf_g",
    "kda_dhu_sm90_fwd_k128_fp16_wg2_svf_g",
];

/// Slot in FWD_ENTRIES of the forward scan with these properties.
pub fn fwd_slot(k: u32, dtype: DType, nwg: u32, svf: bool, g: bool) -> usize {
    (if k == 64 { 0 } else { 2 })
        + usize::from(dtype != DType::BF16)
        + if nwg == 2 { 4 } else { 0 }
        + if svf { 8 } else { 0 }
        + if g { 16 } else { 0 }
}

/// The sm_100a image's (one kernel shape, [K, V] states).
const SM100_ENTRIES: [&str; 4] =
    ["kda_dhu_sm100_k64_bf16", "kda_dhu_sm100_k64_fp16", "kda_dhu_sm100_k128_bf16", "kda_dhu_sm100_k128_fp16"];
/// Slots of the largest image (the launch table's size): stage 4's, then the forward scan's.
pub const MAX_SLOTS: usize = SM90_ENTRIES.len() + FWD_ENTRIES.len();

impl KernelConfig {
    /// The kernel's extern "C" name, e.g. `kda_dhu_sm90_rs_k128_bf16`.
    pub fn entry_point(&self, arch: Arch) -> &'static str {
        match arch {
            Arch::Sm90 if self.forward => FWD_ENTRIES[self.slot() - SM90_ENTRIES.len()],
            Arch::Sm90 => SM90_ENTRIES[self.slot()],
            // one kernel shape: the planner never sends nwg 2 or state_v_first there
            Arch::Sm100 => SM100_ENTRIES[self.slot() % SM100_ENTRIES.len()],
        }
    }

    /// Every kernel `arch`'s image holds, in slot order (the table launch.rs loads): stage
    /// 4's, then (sm_90a) the forward scan's.
    pub fn all(arch: Arch) -> Vec<KernelConfig> {
        let sm90 = arch == Arch::Sm90;
        let shapes: &[(bool, u32)] = if sm90 { &[(false, 1), (false, 2), (true, 1), (true, 2)] } else { &[(false, 1)] };
        let gates: &[u32] = if sm90 { &[0, FLAG_G] } else { &[0] };
        let scans: &[bool] = if sm90 { &[false, true] } else { &[false] };
        let mut configs = Vec::new();
        for &forward in scans {
            for &flags in gates {
                for &(svf, nwg) in shapes {
                    for (k, dtype) in [(64, DType::BF16), (64, DType::F16), (128, DType::BF16), (128, DType::F16)] {
                        let grid = [1, 1, 1];
                        configs.push(KernelConfig { k, dtype, flags, grid, nwg, svf, split: None, forward });
                    }
                }
            }
        }
        configs
    }

    /// Whether the call has the scalar gate g (sm_90a: the `_g` instances).
    pub fn has_g(&self) -> bool {
        self.flags & FLAG_G != 0
    }

    /// Index into a per-arch table of the entry points (k64/k128 × bf16/fp16, then the
    /// same four with two warpgroups, then those eight with state_v_first, then those
    /// sixteen with g).
    pub fn slot(&self) -> usize {
        if self.forward {
            return SM90_ENTRIES.len() + fwd_slot(self.k, self.dtype, self.nwg, self.svf, self.has_g());
        }
        (if self.k == 64 { 0 } else { 2 })
            + usize::from(self.dtype != DType::BF16)
            + if self.nwg == 2 { 4 } else { 0 }
            + if self.svf { 8 } else { 0 }
            + if self.has_g() { 16 } else { 0 }
    }

    /// Threads per CTA.
    pub fn block_threads(&self, arch: Arch) -> u32 {
        arch.block_threads_for(self.nwg)
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Plan {
    Kernel { arch: Arch, config: KernelConfig },
    Fallback { reason: String },
}

impl Plan {
    pub fn is_kernel(&self) -> bool {
        matches!(self, Plan::Kernel { .. })
    }

    /// Whether `_core.run` launches this plan itself: the verified sm_90a kernel only
    /// (a fallback runs fla, and the unverified sm_100a kernel runs under the Python
    /// layer's self-check).
    pub fn runs_in_one_crossing(&self) -> bool {
        matches!(self, Plan::Kernel { arch: Arch::Sm90, .. })
    }

    /// ("kernel-sm90a", true) or (the fallback reason, false).
    pub fn describe(&self) -> (bool, String) {
        match self {
            Plan::Kernel { arch, .. } => (true, arch.label().to_string()),
            Plan::Fallback { reason } => (false, reason.clone()),
        }
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe().1)
    }
}

/// The first failing clause's reason, in rule order.
fn first_failure(desc: &CallDesc, dev: &DeviceInfo, rule: Rule) -> Option<String> {
    let d = &desc.dims;
    let dtype = desc.qk_dtype;
    let chunk_clause = || (desc.chunk_size != BT).then(|| format!("chunk_size != 64 (chunk_size={})", desc.chunk_size));
    let k_clause = || (d.k != 64 && d.k != 128).then(|| format!("K not in {{64, 128}} (K={})", d.k));
    let v_clause = || (d.v % BV != 0).then(|| format!("V % 64 != 0 (V={})", d.v));
    // The forward call's own names (src/forward.rs carries it by a stage-4 call: q = k, dv = u).
    let (first, firsts, seconds) = if desc.forward { ("k", "k, w", "u is") } else { ("q", "q, k, w", "do, dv are") };
    let dtype_clause =
        || (!dtype.is_half16()).then(|| format!("dtype not in {{bfloat16, float16}} ({first} is {dtype})"));
    let same_dtype_clause = || {
        (desc.dv_dtype != dtype).then(|| format!("dtypes differ ({firsts} are {dtype}; {seconds} {})", desc.dv_dtype))
    };
    let svf_clause =
        || desc.state_v_first.then(|| "state_v_first=True (the seed's kernel stores [K, V] states)".to_string());
    let grid_clause = || {
        if d.hv > MAX_GRID_YZ {
            Some(format!("HV = {} > {MAX_GRID_YZ} (grid y limit)", d.hv))
        } else if d.n > MAX_GRID_YZ {
            Some(format!("N = {} sequences > {MAX_GRID_YZ} (grid z limit)", d.n))
        } else if d.t > i32::MAX as i64 {
            Some(format!("T = {} > 2^31 - 1 (TMA coordinates are int32)", d.t))
        } else {
            None
        }
    };

    if desc.state_dtype != DType::F32 {
        // Only the forward scan's initial_state gets here (stage 4 validates dht as float32).
        return Some(format!("initial_state is {} (the kernel reads float32 states)", desc.state_dtype));
    }
    let arch = Arch::from_cc(dev.cc_major, dev.cc_minor);
    let clauses: Vec<Option<String>> = match rule {
        Rule::B2a => {
            let ctas = d.b * d.hv * (d.v / BV);
            vec![
                // The seed's dispatcher, in its order.
                chunk_clause(),
                (d.t % BT != 0).then(|| format!("T % 64 != 0 (T={})", d.t)),
                k_clause(),
                v_clause(),
                dtype_clause(),
                (!desc.has_dht).then(|| "dht is None".to_string()),
                (ctas < MIN_CTAS_B2A).then(|| format!("B*HV*(V/64) = {ctas} < {MIN_CTAS_B2A} CTAs")),
                // The limits of the seed's kernel (KDA: gk path, H == HV, dense).
                (!desc.has_gk).then(|| "gk is None (the B2a kernel is the gk path)".to_string()),
                desc.has_g.then(|| "g is given (the B2a kernel is the gk path)".to_string()),
                (d.h != d.hv).then(|| format!("H != HV (H={}, HV={})", d.h, d.hv)),
                desc.varlen().then(|| "cu_seqlens is given".to_string()),
                svf_clause(),
                same_dtype_clause(),
                grid_clause(),
            ]
        }
        Rule::Extended | Rule::Capable => {
            let ctas = d.n * d.hv * (d.v / BV);
            let mut clauses = vec![
                chunk_clause(),
                k_clause(),
                v_clause(),
                dtype_clause(),
                same_dtype_clause(),
                (desc.has_g && desc.has_gk).then(|| "both g and gk are given".to_string()),
                grid_clause(),
            ];
            if rule == Rule::Extended && arch != Some(Arch::Sm100) {
                // Policy: the CTA floor and the measured clauses of `POLICY` (none today;
                // the sm_100 kernel takes its whole envelope: nothing was measured there).
                clauses.push(
                    (ctas < MIN_CTAS_EXTENDED).then(|| format!("N*HV*(V/64) = {ctas} < {MIN_CTAS_EXTENDED} CTAs")),
                );
            }
            clauses
        }
    };
    if let Some(reason) = clauses.into_iter().flatten().next() {
        return Some(reason);
    }
    // Layouts are not clauses: an input that is not packed is copied before either the
    // kernel or fla's function reads it (`CallDesc::copies`), and the plan is the packed
    // call's.
    match arch {
        Some(Arch::Sm90) => None,
        Some(Arch::Sm100) if desc.forward => Some("sm_100 kernel: no forward scan (fwd_h) kernel".to_string()),
        Some(Arch::Sm100) => sm100_envelope(desc),
        None => Some(format!("no kernel for {}", dev.sm_name())),
    }
}

/// The sm_100a kernel's limits (the seed's Blackwell kernel: KDA's gk path, H == HV,
/// dense, dht given, full chunks), checked after the rule's own clauses. Under B2a they
/// never fire (the seed's clauses are the same), under Capable and Extended they are
/// the envelope.
fn sm100_envelope(desc: &CallDesc) -> Option<String> {
    let d = &desc.dims;
    let clauses = [
        desc.has_g.then(|| "sm_100 kernel: g gate not supported".to_string()),
        (!desc.has_gk).then(|| "sm_100 kernel: gk is None (only the gk gate is supported)".to_string()),
        (d.h != d.hv).then(|| format!("sm_100 kernel: GVA not supported (H={}, HV={})", d.h, d.hv)),
        desc.varlen().then(|| "sm_100 kernel: cu_seqlens not supported".to_string()),
        (!desc.has_dht).then(|| "sm_100 kernel: dht is None (not supported)".to_string()),
        (d.t % BT != 0).then(|| format!("sm_100 kernel: T % 64 != 0 not supported (T={})", d.t)),
        desc.state_v_first.then(|| "sm_100 kernel: state_v_first not supported".to_string()),
    ];
    clauses.into_iter().flatten().next()
}

/// Kernel or fallback for a validated call on a device.
pub fn plan(desc: &CallDesc, dev: &DeviceInfo, rule: Rule) -> Plan {
    if let Some(reason) = first_failure(desc, dev, rule) {
        return Plan::Fallback { reason };
    }
    let d = &desc.dims;
    let mut flags = 0;
    if desc.has_g {
        flags |= FLAG_G;
    }
    if desc.has_gk {
        flags |= FLAG_GK;
    }
    if desc.has_dht {
        flags |= FLAG_DHT;
    }
    if desc.has_h0 {
        flags |= FLAG_DH0;
    }
    if desc.varlen() {
        flags |= FLAG_VARLEN;
    }
    if desc.cu_seqlens == Some(DType::I32) {
        flags |= FLAG_CU_I32;
    }
    if desc.chunk_offsets == Some(DType::I32) {
        flags |= FLAG_OFFSETS_I32;
    }
    let arch = Arch::from_cc(dev.cc_major, dev.cc_minor).expect("first_failure rejects devices without a kernel");
    let split = split::split(desc, dev, arch, crate::env::sm90_split());
    // With a split, the second pass's grid: HV x (S - live) segments per batch row.
    let rows = split.map_or(d.hv, |sp| d.hv * i64::from(sp.launch_segments()));
    let nwg = warpgroups_for(d.n * rows, desc, dev, arch, sm90_nwg_override());
    Plan::Kernel {
        arch,
        config: KernelConfig {
            k: d.k as u32,
            dtype: desc.qk_dtype,
            flags,
            grid: [(d.v / (BV * i64::from(nwg))) as u32, rows as u32, d.n as u32],
            nwg,
            svf: desc.state_v_first,
            split,
            forward: desc.forward,
        },
    }
}

/// Consumer warpgroups per CTA on sm_90a. Two (one CTA per 128 V columns of a head: k, q,
/// w loaded once for both V tiles, two chains per SM) whenever that grid still fills the
/// device (N * HV * V/128 >= SMs); below that, one per CTA, for the most CTAs. The same
/// rule for both scans (the forward scan's A/B: benches/NOTES.md, "The forward scan's
/// kernel"). `KDA_DHU_SM90_NWG` = 1 or 2 overrides the choice where V allows (measurements).
pub fn warpgroups(desc: &CallDesc, dev: &DeviceInfo, arch: Arch, override_nwg: Option<u32>) -> u32 {
    warpgroups_for(desc.dims.n * desc.dims.hv, desc, dev, arch, override_nwg)
}

/// `warpgroups` for a grid of `rows` = gridDim.y x gridDim.z (N * HV, or a split's second
/// pass's N * HV * (S - live)).
fn warpgroups_for(rows: i64, desc: &CallDesc, dev: &DeviceInfo, arch: Arch, override_nwg: Option<u32>) -> u32 {
    let d = &desc.dims;
    if arch != Arch::Sm90 || d.v % (2 * BV) != 0 {
        return 1;
    }
    if let Some(n) = override_nwg {
        return n;
    }
    if rows * (d.v / (2 * BV)) >= i64::from(dev.sm_count) {
        2
    } else {
        1
    }
}

/// `KDA_DHU_SM90_NWG` (1 or 2), read at every plan: a measurement switch.
fn sm90_nwg_override() -> Option<u32> {
    crate::env::sm90_nwg()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::validate::{Dims, TensorLayout};

    /// For the other modules' tests: `base()` with B sequences of T tokens and HV = H heads.
    pub(crate) fn long_desc(b: i64, hv: i64, t: i64) -> CallDesc {
        let mut d = base();
        d.dims.b = b;
        d.dims.n = b;
        d.dims.h = hv;
        d.dims.hv = hv;
        d.dims.t = t;
        d
    }

    const H200: DeviceInfo = DeviceInfo { cc_major: 9, cc_minor: 0, sm_count: 132 };
    const B200: DeviceInfo = DeviceInfo { cc_major: 10, cc_minor: 0, sm_count: 148 };

    /// B=4, T=256, H=HV=32, K=V=128, bf16, gk, dht, h0: 4*32*2 = 256 CTAs, a B2a kernel case.
    fn base() -> CallDesc {
        let names = ["q", "k", "w", "do", "dv", "gk", "h0", "dht"];
        CallDesc {
            dims: Dims { b: 4, t: 256, h: 32, hv: 32, k: 128, v: 128, n: 4 },
            qk_dtype: DType::BF16,
            dv_dtype: DType::BF16,
            has_g: false,
            has_gk: true,
            has_h0: true,
            has_dht: true,
            cu_seqlens: None,
            chunk_offsets: None,
            nt: Some(4),
            state_v_first: false,
            scale: 128f64.powf(-0.5),
            chunk_size: 64,
            layouts: names
                .iter()
                .map(|&name| TensorLayout {
                    name,
                    contiguous: true,
                    aligned16: true,
                    needs_align16: !matches!(name, "h0"),
                })
                .collect(),
            device: Some(0),
            forward: false,
            state_dtype: DType::F32,
        }
    }

    fn reason(p: Plan) -> String {
        match p {
            Plan::Fallback { reason } => reason,
            Plan::Kernel { .. } => panic!("expected a fallback"),
        }
    }

    fn set_layout(d: &mut CallDesc, name: &str, contiguous: bool, aligned16: bool) {
        let l = d.layouts.iter_mut().find(|l| l.name == name).unwrap();
        l.contiguous = contiguous;
        l.aligned16 = aligned16;
    }

    /// Packed sequences at B = 1, with HV = 128 so that B*HV*(V/64) still reaches 256
    /// (the B2a reason is then the varlen clause itself).
    fn varlen(d: &mut CallDesc, n: i64) {
        d.dims.n = n;
        d.dims.b = 1;
        d.dims.h = 128;
        d.dims.hv = 128;
        d.cu_seqlens = Some(DType::I64);
        d.chunk_offsets = Some(DType::I64);
        for name in ["cu_seqlens", "chunk_offsets"] {
            d.layouts.push(TensorLayout { name, contiguous: true, aligned16: true, needs_align16: false });
        }
    }

    type Mutation = fn(&mut CallDesc);

    /// Each clause on its failing side: (what, mutation, B2a's reason, Extended's
    /// reason or None when Extended takes the kernel).
    fn clauses() -> Vec<(&'static str, Mutation, &'static str, Option<&'static str>)> {
        vec![
            (
                "chunk_size",
                |d| d.chunk_size = 32,
                "chunk_size != 64 (chunk_size=32)",
                Some("chunk_size != 64 (chunk_size=32)"),
            ),
            ("tail", |d| d.dims.t = 1000, "T % 64 != 0 (T=1000)", None),
            ("K=256", |d| d.dims.k = 256, "K not in {64, 128} (K=256)", Some("K not in {64, 128} (K=256)")),
            ("K=96", |d| d.dims.k = 96, "K not in {64, 128} (K=96)", Some("K not in {64, 128} (K=96)")),
            ("V=96", |d| d.dims.v = 96, "V % 64 != 0 (V=96)", Some("V % 64 != 0 (V=96)")),
            (
                "fp32",
                |d| {
                    d.qk_dtype = DType::F32;
                    d.dv_dtype = DType::F32
                },
                "dtype not in {bfloat16, float16} (q is float32)",
                Some("dtype not in {bfloat16, float16} (q is float32)"),
            ),
            ("no dht", |d| d.has_dht = false, "dht is None", None),
            (
                "few CTAs",
                |d| {
                    d.dims.b = 1;
                    d.dims.n = 1
                },
                "B*HV*(V/64) = 64 < 256 CTAs",
                None,
            ),
            ("no gate", |d| d.has_gk = false, "gk is None (the B2a kernel is the gk path)", None),
            (
                "g instead of gk",
                |d| {
                    d.has_gk = false;
                    d.has_g = true
                },
                "gk is None (the B2a kernel is the gk path)",
                None,
            ),
            (
                "g and gk",
                |d| d.has_g = true,
                "g is given (the B2a kernel is the gk path)",
                Some("both g and gk are given"),
            ),
            (
                "GVA",
                |d| {
                    d.dims.h = 16;
                },
                "H != HV (H=16, HV=32)",
                None,
            ),
            ("varlen", |d| varlen(d, 8), "cu_seqlens is given", None),
            (
                "varlen int32",
                |d| {
                    varlen(d, 8);
                    d.cu_seqlens = Some(DType::I32)
                },
                "cu_seqlens is given",
                None,
            ),
            (
                "chunk_offsets int32",
                |d| {
                    varlen(d, 8);
                    d.chunk_offsets = Some(DType::I32)
                },
                "cu_seqlens is given",
                None,
            ),
            (
                "state_v_first",
                |d| d.state_v_first = true,
                "state_v_first=True (the seed's kernel stores [K, V] states)",
                None,
            ),
            (
                "do fp16",
                |d| d.dv_dtype = DType::F16,
                "dtypes differ (q, k, w are bfloat16; do, dv are float16)",
                Some("dtypes differ (q, k, w are bfloat16; do, dv are float16)"),
            ),
            (
                "do fp32",
                |d| d.dv_dtype = DType::F32,
                "dtypes differ (q, k, w are bfloat16; do, dv are float32)",
                Some("dtypes differ (q, k, w are bfloat16; do, dv are float32)"),
            ),
            // Layouts are not clauses: the plan is the packed call's (the inputs are copied).
            ("w strided", |d| set_layout(d, "w", false, true), "", None),
            ("dv misaligned", |d| set_layout(d, "dv", true, false), "", None),
            (
                "HV too large",
                |d| {
                    d.dims.hv = 65536 * 2;
                    d.dims.h = d.dims.hv
                },
                "HV = 131072 > 65535 (grid y limit)",
                Some("HV = 131072 > 65535 (grid y limit)"),
            ),
            (
                "N too large",
                |d| varlen(d, 70000),
                "cu_seqlens is given",
                Some("N = 70000 sequences > 65535 (grid z limit)"),
            ),
            (
                "T too large",
                |d| d.dims.t = 1 << 31,
                "T = 2147483648 > 2^31 - 1 (TMA coordinates are int32)",
                Some("T = 2147483648 > 2^31 - 1 (TMA coordinates are int32)"),
            ),
        ]
    }

    #[test]
    fn base_case_is_a_kernel_under_both_rules() {
        for rule in [Rule::B2a, Rule::Extended] {
            let p = plan(&base(), &H200, rule);
            assert_eq!(p.describe(), (true, "kernel-sm90a".to_string()), "{rule:?}");
            let Plan::Kernel { arch, config } = p else { unreachable!() };
            assert_eq!(arch, Arch::Sm90);
            assert_eq!(config.grid, [2, 32, 4]);
            assert_eq!(config.k, 128);
            assert_eq!(config.flags, FLAG_GK | FLAG_DHT | FLAG_DH0);
            assert_eq!(config.entry_point(arch), "kda_dhu_sm90_rs_k128_bf16");
        }
    }

    #[test]
    fn every_clause_both_sides_both_rules() {
        for (what, mutate, b2a, extended) in clauses() {
            let mut d = base();
            mutate(&mut d);
            let p = plan(&d, &H200, Rule::B2a);
            if b2a.is_empty() {
                assert!(p.is_kernel(), "B2a {what}: {p}");
            } else {
                assert_eq!(reason(p), b2a, "B2a {what}");
            }
            let p = plan(&d, &H200, Rule::Extended);
            match extended {
                None => assert!(p.is_kernel(), "Extended {what}: {p}"),
                Some(r) => assert_eq!(reason(p), r, "Extended {what}"),
            }
        }
    }

    #[test]
    fn kernel_side_of_each_b2a_clause() {
        // Passing values of the seed's clauses besides the base ones.
        let cases: Vec<(&str, Mutation)> = vec![
            ("K=64", |d| d.dims.k = 64),
            ("V=64, B=8", |d| {
                d.dims.v = 64;
                d.dims.b = 8;
                d.dims.n = 8
            }),
            ("V=256, B=2", |d| {
                d.dims.v = 256;
                d.dims.b = 2;
                d.dims.n = 2
            }),
            ("fp16", |d| {
                d.qk_dtype = DType::F16;
                d.dv_dtype = DType::F16
            }),
            ("T=64", |d| d.dims.t = 64),
            ("no h0", |d| d.has_h0 = false),
            ("exactly 256 CTAs", |d| {
                d.dims.hv = 64;
                d.dims.h = 64;
                d.dims.b = 2;
                d.dims.n = 2
            }),
        ];
        for (what, mutate) in cases {
            let mut d = base();
            mutate(&mut d);
            for rule in [Rule::B2a, Rule::Capable] {
                assert!(plan(&d, &H200, rule).is_kernel(), "{rule:?} {what}");
            }
            // Extended: the measured policy sends none of these to fla.
            assert!(plan(&d, &H200, Rule::Extended).is_kernel(), "Extended {what}");
        }
        let mut d = base();
        d.dims.hv = 63;
        d.dims.h = 63;
        d.dims.b = 2;
        d.dims.n = 2;
        assert_eq!(reason(plan(&d, &H200, Rule::B2a)), "B*HV*(V/64) = 252 < 256 CTAs");
    }

    #[test]
    fn plan_runs_in_one_crossing_only_on_sm90() {
        for rule in [Rule::B2a, Rule::Extended, Rule::Capable] {
            assert!(plan(&base(), &H200, rule).runs_in_one_crossing());
            let p = plan(&base(), &B200, rule);
            assert!(p.is_kernel() && !p.runs_in_one_crossing(), "sm_100a runs under the self-check");
        }
        let mut d = base();
        d.dims.k = 256;
        assert!(!plan(&d, &H200, Rule::Extended).runs_in_one_crossing());
    }

    #[test]
    fn every_kernel_plan_names_an_entry_point_of_its_image() {
        let image = KernelConfig::all(Arch::Sm90);
        let mut kernels = 0;
        for (what, mutate, _, _) in clauses() {
            for dev in [H200, B200] {
                for rule in [Rule::B2a, Rule::Extended, Rule::Capable] {
                    for nwg in [None, Some(1), Some(2)] {
                        let mut d = base();
                        mutate(&mut d);
                        let Plan::Kernel { arch, config } = plan(&d, &dev, rule) else { continue };
                        if arch == Arch::Sm100 {
                            assert!(config.entry_point(arch).starts_with("kda_dhu_sm100_"), "{what}");
                            continue;
                        }
                        // The same call on each warpgroup count: an entry point of the image
                        // (same flags), its threads those of its warpgroups.
                        let n = warpgroups(&d, &dev, arch, nwg);
                        let cfg = KernelConfig {
                            nwg: n,
                            grid: [(d.dims.v / (BV * i64::from(n))) as u32, config.grid[1], config.grid[2]],
                            ..config
                        };
                        kernels += 1;
                        let name = cfg.entry_point(arch);
                        assert!(name.starts_with("kda_dhu_sm90_rs_"), "{what}: {name}");
                        assert_eq!(image[cfg.slot()].entry_point(arch), name);
                        assert_eq!(cfg.block_threads(arch), arch.block_threads_for(n));
                    }
                }
            }
        }
        assert!(kernels > 50, "{kernels} sm_90a kernel plans checked");
    }

    #[test]
    fn two_warpgroups_where_the_grid_still_fills_the_device() {
        // base(): B4 HV32 V128 on 132 SMs: 4 * 32 * 1 = 128 CTAs of two warpgroups < 132,
        // so one warpgroup per CTA (256 CTAs).
        let d = base();
        assert_eq!(warpgroups(&d, &H200, Arch::Sm90, None), 1);
        let Plan::Kernel { arch, config } = plan(&d, &H200, Rule::Extended) else { panic!() };
        assert_eq!((config.grid, config.nwg, config.block_threads(arch)), ([2, 32, 4], 1, BLOCK_THREADS_SM90));
        assert_eq!(config.entry_point(arch), "kda_dhu_sm90_rs_k128_bf16");
        // B8: 256 CTAs of two warpgroups fill the device.
        let mut d = base();
        d.dims.b = 8;
        d.dims.n = 8;
        let Plan::Kernel { arch, config } = plan(&d, &H200, Rule::Extended) else { panic!() };
        assert_eq!((config.grid, config.nwg, config.block_threads(arch)), ([1, 32, 8], 2, BLOCK_THREADS_SM90_WG2));
        assert_eq!(config.entry_point(arch), "kda_dhu_sm90_rs_k128_bf16_wg2");
        assert_eq!(config.slot(), 6);
        // V = 64 (or any V not a multiple of 128) keeps one; the override applies where V allows.
        let mut d = base();
        d.dims.b = 64;
        d.dims.n = 64;
        d.dims.v = 192;
        assert_eq!(warpgroups(&d, &H200, Arch::Sm90, None), 1);
        assert_eq!(warpgroups(&d, &H200, Arch::Sm90, Some(2)), 1);
        d.dims.v = 256;
        assert_eq!(warpgroups(&d, &H200, Arch::Sm90, None), 2);
        assert_eq!(warpgroups(&d, &H200, Arch::Sm90, Some(1)), 1);
        assert_eq!(warpgroups(&base(), &H200, Arch::Sm90, Some(2)), 2);
        // sm_100 has one kernel shape.
        assert_eq!(warpgroups(&d, &H200, Arch::Sm100, None), 1);
    }

    #[test]
    fn extended_covers_the_training_cases() {
        // Qwen3-Next style GVA, varlen, tail, scalar gate, no dht/h0: one call.
        let mut d = base();
        varlen(&mut d, 64);
        d.dims.t = 65536 + 17;
        d.dims.h = 16;
        d.has_gk = false;
        d.has_g = true;
        d.has_dht = false;
        d.has_h0 = false;
        let Plan::Kernel { config, .. } = plan(&d, &H200, Rule::Extended) else { panic!() };
        assert_eq!(config.flags, FLAG_G | FLAG_VARLEN);
        // 64 sequences x 128 heads: two warpgroups per CTA, one CTA per head.
        assert_eq!((config.grid, config.nwg), ([1, 128, 64], 2));
        assert_eq!(config.entry_point(Arch::Sm90), "kda_dhu_sm90_rs_k128_bf16_wg2_g");
        // No gate at all (delta rule).
        let mut d = base();
        d.has_gk = false;
        let Plan::Kernel { config, .. } = plan(&d, &H200, Rule::Extended) else { panic!() };
        assert_eq!(config.flags, FLAG_DHT | FLAG_DH0);
        // A single CTA is still a kernel (MIN_CTAS_EXTENDED = 1).
        let mut d = base();
        d.dims = Dims { b: 1, t: 64, h: 1, hv: 1, k: 128, v: 64, n: 1 };
        assert!(plan(&d, &H200, Rule::Extended).is_kernel());
    }

    #[test]
    fn extended_policy_follows_the_measurement() {
        // No measured clause: every shape the kernel computes is the kernel's under
        // Extended, the rows that the shared-memory-state kernel lost to fla included
        // (the register-state kernel measured faster than fla on each).
        assert!(POLICY.is_empty());
        let mut d = base();
        d.dims.k = 64;
        assert!(plan(&d, &H200, Rule::Extended).is_kernel(), "K = 64");
        for (dims, what) in [
            (Dims { b: 1, t: 65536, h: 32, hv: 32, k: 128, v: 128, n: 1 }, "b1_t65536_h32: 64 CTAs, 1024 chunks"),
            (Dims { b: 1, t: 65536, h: 16, hv: 16, k: 128, v: 128, n: 1 }, "b1_t65536_h16: 32 CTAs"),
            (Dims { b: 8, t: 1096, h: 4, hv: 4, k: 128, v: 128, n: 8 }, "b8_t1096_h4_tail: 64 CTAs, 18 chunks"),
            (Dims { b: 1, t: 11264, h: 16, hv: 32, k: 128, v: 128, n: 1 }, "gva_b1_t11264_h16_hv32: GVA below a wave"),
            (Dims { b: 1, t: 64, h: 1, hv: 1, k: 128, v: 64, n: 1 }, "one chunk, one CTA"),
            (Dims { b: 1, t: 15 * 64 + 1, h: 1, hv: 1, k: 64, v: 64, n: 1 }, "16 chunks, one CTA"),
        ] {
            let mut d = base();
            d.dims = dims;
            for rule in [Rule::Extended, Rule::Capable] {
                assert!(plan(&d, &H200, rule).is_kernel(), "{what} {rule:?}");
            }
            // B2a keeps the seed's floor (and its T % 64 and H == HV clauses).
            assert!(!plan(&d, &H200, Rule::B2a).is_kernel(), "{what}");
        }
    }

    #[test]
    fn only_hopper_and_blackwell_have_kernels() {
        for (cc, sm) in [((8, 0), "sm_80"), ((8, 9), "sm_89"), ((12, 0), "sm_120"), ((10, 3), "sm_103")] {
            let dev = DeviceInfo { cc_major: cc.0, cc_minor: cc.1, sm_count: 100 };
            for rule in [Rule::B2a, Rule::Extended, Rule::Capable] {
                assert_eq!(reason(plan(&base(), &dev, rule)), format!("no kernel for {sm}"));
            }
        }
        assert_eq!(Arch::from_cc(10, 0), Some(Arch::Sm100));
        assert_eq!(Arch::from_cc(9, 0), Some(Arch::Sm90));
        assert_eq!(Arch::from_cc(8, 6), None);
        assert_eq!(Arch::from_cc(10, 3), None, "sm_100a SASS does not run on sm_103");
    }

    #[test]
    fn base_case_is_an_sm100_kernel_under_every_rule() {
        for rule in [Rule::B2a, Rule::Extended, Rule::Capable] {
            let p = plan(&base(), &B200, rule);
            assert_eq!(p.describe(), (true, "kernel-sm100a".to_string()), "{rule:?}");
            let Plan::Kernel { arch, config } = p else { unreachable!() };
            assert_eq!(arch, Arch::Sm100);
            assert_eq!(arch.sass(), "sm_100a");
            assert_eq!(arch.stem(), "dhu_sm100");
            assert_eq!(arch.block_threads(), BLOCK_THREADS_SM100);
            assert_eq!(config.grid, [2, 32, 4]);
            assert_eq!(config.k, 128);
            assert_eq!(config.flags, FLAG_GK | FLAG_DHT | FLAG_DH0);
            assert_eq!(config.entry_point(arch), "kda_dhu_sm100_k128_bf16");
        }
        assert_eq!(Arch::Sm90.block_threads(), BLOCK_THREADS_SM90);
    }

    /// The rows of `clauses()` where the sm_100 kernel answers differently from the
    /// sm_90 one under Extended (and Capable): its envelope is the seed's. Rows not
    /// listed answer exactly as on the H200 (generic clauses, layouts, or a kernel).
    fn sm100_differences() -> Vec<(&'static str, &'static str)> {
        vec![
            ("tail", "sm_100 kernel: T % 64 != 0 not supported (T=1000)"),
            ("no dht", "sm_100 kernel: dht is None (not supported)"),
            ("no gate", "sm_100 kernel: gk is None (only the gk gate is supported)"),
            ("g instead of gk", "sm_100 kernel: g gate not supported"),
            ("GVA", "sm_100 kernel: GVA not supported (H=16, HV=32)"),
            ("varlen", "sm_100 kernel: cu_seqlens not supported"),
            ("varlen int32", "sm_100 kernel: cu_seqlens not supported"),
            ("chunk_offsets int32", "sm_100 kernel: cu_seqlens not supported"),
            ("state_v_first", "sm_100 kernel: state_v_first not supported"),
        ]
    }

    #[test]
    fn every_clause_on_sm100_every_rule() {
        let diffs = sm100_differences();
        let rows = clauses();
        for (what, _) in &diffs {
            assert!(rows.iter().any(|r| r.0 == *what), "{what} is not a row of clauses()");
        }
        for (what, mutate, b2a, extended) in rows {
            let mut d = base();
            mutate(&mut d);
            // B2a: the seed's clauses already are the sm_100 envelope (and its 256-CTA floor).
            let p = plan(&d, &B200, Rule::B2a);
            if b2a.is_empty() {
                assert_eq!(p.describe(), (true, "kernel-sm100a".to_string()), "B2a {what}");
            } else {
                assert_eq!(reason(p), b2a, "B2a {what}");
            }
            let want = diffs.iter().find(|x| x.0 == what).map(|x| x.1).or(extended);
            for rule in [Rule::Extended, Rule::Capable] {
                let p = plan(&d, &B200, rule);
                match want {
                    None => assert_eq!(p.describe(), (true, "kernel-sm100a".to_string()), "{rule:?} {what}"),
                    Some(r) => assert_eq!(reason(p), r, "{rule:?} {what}"),
                }
            }
        }
    }

    #[test]
    fn policy_notes_say_where_a_clause_was_measured() {
        assert_eq!(policy_notes(&H200).len(), POLICY.len());
        let clause = PolicyClause {
            name: "example",
            when: "a kind of call",
            measured_on: "NVIDIA H200",
            measured_sms: 132,
            record: "benches/results/2026-12-02-NVIDIA_H200-variants-3e142d3.json",
        };
        let notes = clause_notes(&[clause], &H200);
        assert_eq!(notes, vec![(clause, "measured on NVIDIA H200 (132 SMs), the SM count of this GPU".to_string())]);
        let h100_pcie = DeviceInfo { cc_major: 9, cc_minor: 0, sm_count: 114 };
        assert_eq!(
            clause_notes(&[clause], &h100_pcie)[0].1,
            "not measured on a GPU of 114 SMs: applied as measured on NVIDIA H200 (132 SMs)"
        );
        for c in POLICY.iter().chain([&clause]) {
            assert!(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(c.record).is_file(), "{}", c.record);
        }
    }

    #[test]
    fn sm100_envelope_edges() {
        // No CTA floor outside B2a: one CTA is a kernel; B2a keeps the seed's 256.
        let mut d = base();
        d.dims = Dims { b: 1, t: 64, h: 1, hv: 1, k: 64, v: 64, n: 1 };
        for rule in [Rule::Extended, Rule::Capable] {
            let Plan::Kernel { arch, config } = plan(&d, &B200, rule) else { panic!("{rule:?}") };
            assert_eq!(config.entry_point(arch), "kda_dhu_sm100_k64_bf16");
            assert_eq!(config.grid, [1, 1, 1]);
        }
        assert_eq!(reason(plan(&d, &B200, Rule::B2a)), "B*HV*(V/64) = 1 < 256 CTAs");
        // K = 64 and fp16.
        let mut d = base();
        d.dims.k = 64;
        d.qk_dtype = DType::F16;
        d.dv_dtype = DType::F16;
        let Plan::Kernel { arch, config } = plan(&d, &B200, Rule::Extended) else { panic!() };
        assert_eq!(config.entry_point(arch), "kda_dhu_sm100_k64_fp16");
        // h0 absent: still the envelope (dh0 is just not written).
        let mut d = base();
        d.has_h0 = false;
        let Plan::Kernel { config, .. } = plan(&d, &B200, Rule::Extended) else { panic!() };
        assert_eq!(config.flags, FLAG_GK | FLAG_DHT);
        // Sub-wave GVA: the GVA clause of the envelope, not the Hopper policy.
        let mut d = base();
        d.dims = Dims { b: 1, t: 11264, h: 16, hv: 32, k: 128, v: 128, n: 1 };
        assert_eq!(reason(plan(&d, &B200, Rule::Extended)), "sm_100 kernel: GVA not supported (H=16, HV=32)");
        // The first failing envelope clause is named: g before the missing gk.
        let mut d = base();
        d.has_gk = false;
        d.has_g = true;
        d.has_dht = false;
        assert_eq!(reason(plan(&d, &B200, Rule::Capable)), "sm_100 kernel: g gate not supported");
        // Generic clauses still come first (a tail with fp32 names the dtype).
        let mut d = base();
        d.dims.t = 1000;
        d.qk_dtype = DType::F32;
        d.dv_dtype = DType::F32;
        assert_eq!(reason(plan(&d, &B200, Rule::Extended)), "dtype not in {bfloat16, float16} (q is float32)");
    }

    #[test]
    fn seed_clauses_are_reported_before_kernel_limits() {
        // T % 64 and no gk both fail: the seed's clause is named first.
        let mut d = base();
        d.dims.t = 100;
        d.has_gk = false;
        assert_eq!(reason(plan(&d, &H200, Rule::B2a)), "T % 64 != 0 (T=100)");
        // Device is the last clause.
        let dev = DeviceInfo { cc_major: 8, cc_minor: 0, sm_count: 108 };
        assert_eq!(reason(plan(&d, &dev, Rule::B2a)), "T % 64 != 0 (T=100)");
    }

    #[test]
    fn the_forward_scan_plans_stage_4s_warpgroups_and_split_on_sm90_only() {
        // B8 H32 K = V = 128: two warpgroups (256 CTAs of 128 V columns fill the H200), as for
        // stage 4; B1 H16 T 65536: one (32 CTAs), split in three segments as stage 4's call
        // (split::DEFAULT_ON_FWD), with a final state or without.
        let three = Some(crate::split::Split { segments: 3, seg_chunks: 342, live: 1 });
        for (b, hv, t, nwg, split) in [(8, 32, 4096, 2u32, None), (1, 16, 65536, 1, three)] {
            let mut d = long_desc(b, hv, t);
            d.forward = true;
            d.has_h0 = false;
            let Plan::Kernel { config: no_final, .. } = plan(&d, &H200, Rule::Extended) else { panic!() };
            assert_eq!((no_final.nwg, no_final.split), (nwg, split));
            d.has_h0 = true;
            let Plan::Kernel { arch, config } = plan(&d, &H200, Rule::Extended) else { panic!() };
            assert_eq!((arch, config.nwg, config.split, config.forward), (Arch::Sm90, nwg, split, true));
            let segs = split.map_or(1, |s| s.launch_segments());
            assert_eq!(config.grid, [2 / nwg, hv as u32 * segs, b as u32]);
            let wg = if nwg == 2 { "_wg2" } else { "" };
            assert_eq!(config.entry_point(arch), format!("kda_dhu_sm90_fwd_k128_bf16{wg}"));
            assert_eq!(KernelConfig::all(Arch::Sm90)[config.slot()].entry_point(arch), config.entry_point(arch));
            // KDA_DHU_SM90_NWG overrides it where V allows
            for n in [1u32, 2] {
                assert_eq!(warpgroups(&d, &H200, Arch::Sm90, Some(n)), n);
            }
            let wg1 = KernelConfig { nwg: 1, grid: [2, hv as u32, b as u32], ..config };
            assert_eq!(wg1.entry_point(arch), "kda_dhu_sm90_fwd_k128_bf16");
            let wg2 = KernelConfig { nwg: 2, grid: [1, hv as u32, b as u32], ..config };
            assert_eq!(wg2.entry_point(arch), "kda_dhu_sm90_fwd_k128_bf16_wg2");
            assert_eq!(KernelConfig::all(Arch::Sm90)[wg2.slot()].entry_point(arch), wg2.entry_point(arch));
            d.has_gk = false;
            d.has_g = true;
            let Plan::Kernel { arch, config } = plan(&d, &H200, Rule::Extended) else { panic!() };
            assert_eq!(config.entry_point(arch), format!("kda_dhu_sm90_fwd_k128_bf16{wg}_g"));
            assert_eq!(KernelConfig::all(Arch::Sm90)[config.slot()].entry_point(arch), config.entry_point(arch));
            assert_eq!(reason(plan(&d, &B200, Rule::Extended)), "sm_100 kernel: no forward scan (fwd_h) kernel");
        }
        // Reasons name the forward call's arguments (k, w, u), not the stage-4 call's that carries it.
        let mut d = long_desc(1, 16, 4096);
        d.forward = true;
        d.qk_dtype = DType::F32;
        assert_eq!(reason(plan(&d, &H200, Rule::Extended)), "dtype not in {bfloat16, float16} (k is float32)");
        d.qk_dtype = DType::BF16;
        d.dv_dtype = DType::F16;
        assert_eq!(reason(plan(&d, &H200, Rule::Extended)), "dtypes differ (k, w are bfloat16; u is float16)");
    }

    #[test]
    fn forward_entry_points_and_slots() {
        for k in [64u32, 128] {
            for dt in [DType::BF16, DType::F16] {
                for (svf, g) in [(false, false), (true, false), (false, true), (true, true)] {
                    for nwg in [1u32, 2] {
                        let want = format!(
                            "kda_dhu_sm90_fwd_k{k}_{}{}{}{}",
                            if dt == DType::BF16 { "bf16" } else { "fp16" },
                            if nwg == 2 { "_wg2" } else { "" },
                            if svf { "_svf" } else { "" },
                            if g { "_g" } else { "" }
                        );
                        assert_eq!(FWD_ENTRIES[fwd_slot(k, dt, nwg, svf, g)], want);
                    }
                }
            }
        }
    }

    #[test]
    fn entry_points_and_slots() {
        let mut c = KernelConfig {
            k: 64,
            dtype: DType::BF16,
            flags: 0,
            grid: [1, 1, 1],
            nwg: 1,
            svf: false,
            split: None,
            forward: false,
        };
        let mut seen = Vec::new();
        for k in [64, 128] {
            for dt in [DType::BF16, DType::F16] {
                c.k = k;
                c.dtype = dt;
                seen.push((c.slot(), c.entry_point(Arch::Sm90)));
            }
        }
        assert_eq!(
            seen,
            vec![
                (0, "kda_dhu_sm90_rs_k64_bf16"),
                (1, "kda_dhu_sm90_rs_k64_fp16"),
                (2, "kda_dhu_sm90_rs_k128_bf16"),
                (3, "kda_dhu_sm90_rs_k128_fp16")
            ]
        );
        c.nwg = 2;
        let wg2: Vec<_> = [(64, DType::BF16), (64, DType::F16), (128, DType::BF16), (128, DType::F16)]
            .into_iter()
            .map(|(k, dt)| {
                c.k = k;
                c.dtype = dt;
                (c.slot(), c.entry_point(Arch::Sm90))
            })
            .collect();
        assert_eq!(
            wg2,
            vec![
                (4, "kda_dhu_sm90_rs_k64_bf16_wg2"),
                (5, "kda_dhu_sm90_rs_k64_fp16_wg2"),
                (6, "kda_dhu_sm90_rs_k128_bf16_wg2"),
                (7, "kda_dhu_sm90_rs_k128_fp16_wg2")
            ]
        );
        c.svf = true;
        for (nwg, first, suffix) in [(1u32, 8usize, "_svf"), (2, 12, "_wg2_svf")] {
            c.nwg = nwg;
            for (i, (k, dt)) in
                [(64, DType::BF16), (64, DType::F16), (128, DType::BF16), (128, DType::F16)].into_iter().enumerate()
            {
                c.k = k;
                c.dtype = dt;
                let name = format!("kda_dhu_sm90_rs_k{k}_{}{suffix}", if dt == DType::BF16 { "bf16" } else { "fp16" });
                assert_eq!((c.slot(), c.entry_point(Arch::Sm90)), (first + i, name.as_str()));
            }
        }
        // With the scalar gate: the same sixteen, `_g`.
        for (i, base) in SM90_ENTRIES[..16].iter().enumerate() {
            let mut g = KernelConfig::all(Arch::Sm90)[i];
            assert_eq!(g.entry_point(Arch::Sm90), *base);
            g.flags |= FLAG_G;
            assert_eq!((g.slot(), g.entry_point(Arch::Sm90)), (16 + i, format!("{base}_g").as_str()));
        }
        let all = KernelConfig::all(Arch::Sm90);
        assert_eq!(all.len(), MAX_SLOTS);
        assert!(all.iter().enumerate().all(|(i, c)| c.slot() == i));
        c.svf = false;
        c.nwg = 1;
        let mut seen = Vec::new();
        for k in [64, 128] {
            for dt in [DType::BF16, DType::F16] {
                c.k = k;
                c.dtype = dt;
                seen.push((c.slot(), c.entry_point(Arch::Sm100)));
            }
        }
        assert_eq!(
            seen,
            vec![
                (0, "kda_dhu_sm100_k64_bf16"),
                (1, "kda_dhu_sm100_k64_fp16"),
                (2, "kda_dhu_sm100_k128_bf16"),
                (3, "kda_dhu_sm100_k128_fp16")
            ]
        );
        assert_eq!(Rule::parse("b2a"), Some(Rule::B2a));
        assert_eq!(Rule::parse("extended"), Some(Rule::Extended));
        assert_eq!(Rule::parse("x"), None);
    }
}
