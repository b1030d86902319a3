//! The sequence split (sm_90a, dense calls below one wave): one owner for when a call is
//! split, into how many segments, and how its three launches are shaped.
//!
//! Below one wave (B * HV * V / 64 CTAs well under the SM count: one long sequence, few
//! heads) the reverse scan's serial chain over NT chunks sets the time and most SMs idle.
//! The scan over a segment is affine in the state it starts from (DESIGN.md, "The state
//! scan as an affine map"): leaving segment s the state is P_s x + u_s, x the state
//! entering it. So with S segments of `seg_chunks` chunks each (the last one short):
//!
//! 1. first pass (`_sum` kernels, one launch): the newest segment S - 1 runs as usual from
//!    dht, storing its dh and dv2 and its last state; each of the segments 1 .. S - 2 runs
//!    with V widened by K columns, from [0 | I] with its do, dv (and q) read as zero in the
//!    K extra columns, and stores only its last state [u_s | P_s]: the same A_c per chunk,
//!    so the same kernel (cuda/dhu_sm90_regstate.cuh, SUMMARY). Buffer U
//!    [B, S - 1, HV, K, V + K] fp32 ([.., V + K, K] with state_v_first).
//! 2. merge (cuda/dhu_seg_merge.cuh): the boundary states in fp32, serially from the newest,
//!    x_{s-1} = P_s x_s + u_s: S - 2 products [K, K] x [K, V] per head. Buffer X
//!    [B, S - 1, HV, K, V] fp32 ([.., V, K]).
//! 3. second pass (the usual kernels): segments 0 .. S - 2 at once, each from its boundary
//!    state in X as dht; segment 0 writes dh0.
//!
//! Pass 1 and pass 2 each walk one segment's chunks, so the time is about 2 T / S of the
//! unsplit scan plus the merge, where both passes fit one wave: S >= 3 pays. Pass 1's
//! kernel numbers its launch segments from the last blockIdx.y row, so its live CTAs are
//! dispatched first (B1 T65536 H16 0.91 -> 0.81 ms on the H200: benches/NOTES.md).
//!
//! The forward scan (fla's fwd_h, `CallDesc::forward`) splits the same way in the other
//! direction: pass 1 runs segment 0 from initial_state with its outputs (h, v_new) and
//! summarizes segments 1 .. S - 2 (the FWD instance's `_sum` kernels, from [0 | I] with
//! u's K extra columns zero: [b_s | P_s] of h <- A_c h + b_c); the merge runs oldest
//! first (X[0] = the state leaving segment 0, X[j] = P_j X[j - 1] + b_j); pass 2 runs
//! segments 1 .. S - 1 from X, its last launch segment (the sequence's newest) writing
//! final_state where the call asks for one (as the one segment of an unsplit call does).
//! On by default where the rule picks segments (`DEFAULT_ON_FWD`, with its record).
//! Rounding: the boundary states are fp32 sums of pieces each rounded as the kernel
//! rounds its own state (bf16 before k . dh), the kind of rounding the unsplit kernel
//! has; the parity tests against the float64 reference decide (the exact one: a split
//! rounds its partial states where fla rounds the true state, so it does not follow the
//! reference that emulates fla's casts as closely as the unsplit kernel does).
//!
//! A long live segment (`Split::live` = L > 1; the KDA_DHU_EXP_SPLIT_LIVE experiment's
//! build only, `live_built`): the first pass's live CTA runs L segments (stage 4: the
//! newest L, from its launch segment to T; the forward scan: the oldest L, from token 0
//! to the end of its launch segment), the other CTAs summarize one each; each pass and U
//! and X then hold S - L segments per row and head (`Split::launch_segments`), the forward
//! scan's passes starting at segments L - 1 and L. Above, L = 1.

use crate::plan::{Arch, DeviceInfo};
use crate::tensor::DType;
use crate::validate::CallDesc;

use crate::facts::{BV, MERGE_COLS};
use crate::varlen::chunks;

/// Chunks per segment below which the rule does not split: the two extra launches and the
/// merge cost a few microseconds, a segment of 32 chunks about 35 us at K = V = 128.
pub const MIN_SEGMENT_CHUNKS: i64 = 32;
/// The most segments the rule picks.
pub const MAX_SEGMENTS: i64 = 16;
/// Whether the rule runs by default (else only under `KDA_DHU_SM90_SPLIT=on`). On: the
/// A/B on the H200 (same process as fla, benches/results/2026-12-03-NVIDIA_H200-variants-1af6b37.json)
/// measured B1 T65536 H16 1.142 -> 0.855 ms with every other row it ran unchanged, and the
/// kernel times of benches/split_profile.py B1 T65536 H8 1157 -> 540 us, H4 1192 -> 378 us
/// (benches/NOTES.md, "The sequence split").
pub const DEFAULT_ON: bool = true;
/// Whether the forward scan's split runs by default (else only under `KDA_DHU_SM90_SPLIT=on`
/// or `=N`). On: the A/B on the H200 without a final state (same process as fla,
/// benches/results/2026-12-04-NVIDIA_H200-fwd-split-ab-846f29a.json) measured B1 T65536 H16
/// 0.955 -> 0.690 ms (fla 1.579 ms), and B1 T65536 H32 and B1 T11264 HV32, where the rule
/// picks none, unchanged (benches/NOTES.md, "The forward scan's split"); with a final state
/// (since f42465d) on an H100, B1 T65536 H16 0.925 -> 0.771 ms (benches/NOTES.md, "The
/// split's host side and merge").
pub const DEFAULT_ON_FWD: bool = true;

/// A call's split: `segments` (>= 2) of `seg_chunks` chunks each, the last one shorter.
/// `live` (>= 1, < segments): segments the first pass's live CTA runs (the oldest `live`
/// for the forward scan, the newest for stage 4); more than one only with the kernels of
/// the KDA_DHU_EXP_SPLIT_LIVE experiment (`live_built`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Split {
    pub segments: u32,
    pub seg_chunks: u32,
    pub live: u32,
}

impl Split {
    /// Segments per batch row and value head in each pass's launch (pass 1: the live one
    /// and the summarized ones; pass 2: those after the live ones in scan order), and in
    /// U and X.
    pub fn launch_segments(&self) -> u32 {
        self.segments - self.live
    }
}

/// Whether this build's first-pass kernels run a live segment longer than one
/// (cuda/dhu_sm90_regstate.cuh, KDA_DHU_EXP_SPLIT_LIVE: an experiment's wheel).
/// A cubin loaded in place of the embedded image (`KDA_DHU_IMAGE_FILE`) may lack it: never
/// with one.
pub fn live_built() -> bool {
    crate::kernels::experiment_built("KDA_DHU_EXP_SPLIT_LIVE")
}

/// What `KDA_DHU_SM90_SPLIT` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SplitSwitch {
    /// Unset: `DEFAULT_ON` decides between `Rule` and `Off`.
    Default,
    /// `on`: the rule (`rule_segments`).
    Rule,
    /// `off`: never.
    Off,
    /// An integer >= 2: that many segments wherever a split can run (tests, measurements).
    Segments(u32),
    /// `live` (the KDA_DHU_EXP_SPLIT_LIVE experiment): the rule with a long live segment
    /// (`rule_live`); `N:L`: N segments, L of them live. Without the experiment's kernels,
    /// `Rule` and `Segments(N)`.
    LiveRule,
    SegmentsLive(u32, u32),
}

/// CTAs of the first pass and of the second (one warpgroup per CTA) with S segments.
pub fn pass_ctas(desc: &CallDesc, s: i64) -> (i64, i64) {
    let d = &desc.dims;
    let rows = d.b * d.hv;
    let tiles = d.v / BV;
    let wide = (d.v + d.k) / BV;
    (rows * (tiles + (s - 2).max(0) * wide), rows * (s - 1) * tiles)
}

/// The rule: the most segments (3 ..= MAX_SEGMENTS) whose two passes each fit one wave of
/// `dev` (one CTA per SM) with at least MIN_SEGMENT_CHUNKS chunks per segment; None where
/// none does (a grid near one wave or above gains nothing: pass 1 and pass 2 each take
/// T / S, so S = 2 is the unsplit time).
pub fn rule_segments(desc: &CallDesc, dev: &DeviceInfo) -> Option<i64> {
    let nt = chunks(desc.dims.t);
    let sms = i64::from(dev.sm_count);
    (3..=MAX_SEGMENTS).rev().find(|&s| {
        let (p1, p2) = pass_ctas(desc, s);
        nt >= s * MIN_SEGMENT_CHUNKS && p1 <= sms && p2 <= sms
    })
}

/// The rule with a long live segment (the KDA_DHU_EXP_SPLIT_LIVE experiment): (S, L), S
/// segments of which the first pass's live CTA runs L while the other CTAs summarize one
/// each (on the SMs the live CTAs leave, in as many rounds as they need), pass 2 one
/// segment per CTA in one wave. Time in segments: max(L, rounds) + 1 of S (the unsplit
/// scan: S); the (S, L) of least time below S, fewer segments on a tie; None where none
/// gains. B1 T65536 H16 K = V = 128 on 132 SMs: (6, 2), 3 of 6 (the rule above: 3, 2 of 3).
pub fn rule_live(desc: &CallDesc, dev: &DeviceInfo) -> Option<(i64, i64)> {
    let d = &desc.dims;
    let nt = chunks(d.t);
    let sms = i64::from(dev.sm_count);
    let rows = d.b * d.hv;
    let (tiles, wide) = (d.v / BV, (d.v + d.k) / BV);
    let live_ctas = rows * tiles;
    let mut best: Option<(i64, i64, i64)> = None; // (time, S, L)
    for s in 3..=MAX_SEGMENTS {
        if nt < s * MIN_SEGMENT_CHUNKS || sms <= live_ctas {
            continue;
        }
        for l in 1..s {
            if rows * (s - l) * tiles > sms {
                continue;
            }
            let summaries = rows * (s - l - 1) * wide;
            let rounds = (summaries + (sms - live_ctas) - 1) / (sms - live_ctas);
            let time = l.max(rounds) + 1;
            // time / s against best.0 / best.1, in integers
            if time < s && best.is_none_or(|(bt, bs, _)| time * bs < bt * s) {
                best = Some((time, s, l));
            }
        }
    }
    best.map(|(_, s, l)| (s, l))
}

/// The split of a call that the planner sends to the sm_90a kernel, or None.
pub fn split(desc: &CallDesc, dev: &DeviceInfo, arch: Arch, switch: SplitSwitch) -> Option<Split> {
    if arch != Arch::Sm90 || desc.varlen() {
        return None;
    }
    let default_on = if desc.forward { DEFAULT_ON_FWD } else { DEFAULT_ON };
    let (wanted, live) = match switch {
        SplitSwitch::Off => return None,
        SplitSwitch::Default if !default_on => return None,
        SplitSwitch::LiveRule if live_built() => rule_live(desc, dev)?,
        SplitSwitch::Default | SplitSwitch::Rule | SplitSwitch::LiveRule => (rule_segments(desc, dev)?, 1),
        SplitSwitch::Segments(n) => (i64::from(n), 1),
        SplitSwitch::SegmentsLive(n, l) => (i64::from(n), if live_built() { i64::from(l) } else { 1 }),
    };
    let nt = chunks(desc.dims.t);
    if wanted < 2 || nt < 2 {
        return None;
    }
    let seg_chunks = (nt + wanted - 1) / wanted;
    let segments = (nt + seg_chunks - 1) / seg_chunks;
    let live = live.clamp(1, (segments - 1).max(1));
    // gridDim.y = HV * (S - live) (plan.rs checks HV against the same limit).
    if segments < 2 || desc.dims.hv * (segments - live) > crate::plan::MAX_GRID_YZ {
        return None;
    }
    Some(Split { segments: segments as u32, seg_chunks: seg_chunks as u32, live: live as u32 })
}

/// The split's kernels in the sm_90a image (cuda/dhu_sm90.cu), in slot order: stage 4's
/// first pass (k64/k128 x bf16/fp16, then those with state_v_first, then those eight with
/// the scalar gate g), the merge (K 64, 128), then the forward scan's first pass (the same
/// sixteen shapes) and its merge (K 64, 128).
pub const SPLIT_ENTRIES: [&str; 36] = [
    "kda_dhu_sm90_rs_k64_bf16_sum",
    "kda_dhu_sm90_rs_k64_fp16_sum",
    "kda_dhu_sm90_rs_k128_bf16_sum",
    "kda_dhu_sm90_rs_k128_fp16_sum",
    "kda_dhu_sm90_rs_k64_bf16_sum_svf",
    "kda_dhu_sm90_rs_k64_fp16_sum_svf",
    "kda_dhu_sm90_rs_k128_bf16_sum_svf",
    "kda_dhu_sm90_rs_k128_fp16_sum_svf",
    "kda_dhu_sm90_rs_k64_bf16_sum_g",
    "kda_dhu_sm90_rs_k64_fp16_sum_g",
    "kda_dhu_sm90_rs_k128_bf16_sum_g",
    "kda_dhu_sm90_rs_k128_fp16_sum_g",
    "kda_dhu_sm90_rs_k64_bf16_sum_svf_g",
    "kda_dhu_sm90_rs_k64_fp16_sum_svf_g",
    "kda_dhu_sm90_rs_k128_bf16_sum_svf_g",
    "kda_dhu_sm90_rs_k128_fp16_sum_svf_g",
    "kda_dhu_sm90_seg_merge_k64",
    "kda_dhu_sm90_seg_merge_k128",
    "kda_dhu_sm90_fwd_k64_bf16_sum",
    "kda_dhu_sm90_fwd_k64_fp16_sum",
    "kda_dhu_sm90_fwd_k128_bf16_sum",
    "kda_dhu_sm90_fwd_k128_fp16_sum",
    "kda_dhu_sm90_fwd_k64_bf16_sum_svf",
    "kda_dhu_sm90_fwd_k64_fp16_sum_svf",
    "kda_dhu_sm90_fwd_k128_bf16_sum_svf",
    "kda_dhu_sm90_fwd_k128_fp16_sum_svf",
    "kda_dhu_sm90_fwd_k64_bf16_sum_g",
    "kda_dhu_sm90_fwd_k64_fp16_sum_g",
    "kda_dhu_sm90_fwd_k128_bf16_sum_g",
    "kda_dhu_sm90_fwd_k128_fp16_sum_g",
    "kda_dhu_sm90_fwd_k64_bf16_sum_svf_g",
    "kda_dhu_sm90_fwd_k64_fp16_sum_svf_g",
    "kda_dhu_sm90_fwd_k128_bf16_sum_svf_g",
    "kda_dhu_sm90_fwd_k128_fp16_sum_svf_g",
    "kda_dhu_sm90_fwd_seg_merge_k64",
    "kda_dhu_sm90_fwd_seg_merge_k128",
];

/// The first slot of the forward scan's first-pass kernels in SPLIT_ENTRIES, and of its
/// merge kernels.
const FWD_SUMMARY_FIRST: usize = 18;
const FWD_MERGE_FIRST: usize = 34;

/// Slot in SPLIT_ENTRIES of the first pass's kernel (`g`: the call has the scalar gate;
/// `forward`: the forward scan's).
pub fn summary_slot(k: u32, dtype: DType, svf: bool, g: bool, forward: bool) -> usize {
    (if forward { FWD_SUMMARY_FIRST } else { 0 })
        + (if k == 64 { 0 } else { 2 })
        + usize::from(dtype != DType::BF16)
        + if svf { 4 } else { 0 }
        + if g { 8 } else { 0 }
}

/// The merge kernel's threads and dynamic shared memory at head dim `k` (64 or 128;
/// cuda/dhu_layout.h, seg_merge).
pub fn merge_layout(k: u32) -> &'static crate::facts::Layout {
    crate::facts::MERGE.iter().find(|l| l.k == k).expect("merge kernels at K = 64 and 128")
}

/// Slot in SPLIT_ENTRIES of the merge kernel (`forward`: the forward scan's, oldest first).
pub fn merge_slot(k: u32, forward: bool) -> usize {
    (if forward { FWD_MERGE_FIRST } else { 16 }) + usize::from(k != 64)
}

/// Whether SPLIT_ENTRIES[slot] is a first-pass kernel (dynamic shared memory: the
/// one-warpgroup map) rather than the merge (static shared memory only).
pub fn is_summary_slot(slot: usize) -> bool {
    slot < 16 || (FWD_SUMMARY_FIRST..FWD_MERGE_FIRST).contains(&slot)
}

/// The K of SPLIT_ENTRIES[slot] (its name says it: `_k64` or `_k128`).
pub fn slot_k(slot: usize) -> u32 {
    if SPLIT_ENTRIES[slot].contains("_k64") {
        64
    } else {
        128
    }
}

/// The three launches' grids and the merge's block (threads).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitShape {
    pub pass1: [u32; 3],
    pub merge: [u32; 3],
    pub merge_threads: u32,
    /// fp32 elements of U and X.
    pub u_elems: u64,
    pub x_elems: u64,
}

/// The shape of `sp`'s launches for a call of dims `desc.dims`; pass 2's grid is the
/// plan's (`KernelConfig::grid`).
pub fn shape(desc: &CallDesc, sp: Split) -> SplitShape {
    let d = &desc.dims;
    let s1 = i64::from(sp.launch_segments());
    SplitShape {
        pass1: [((d.v + d.k) / BV) as u32, (d.hv * s1) as u32, d.b as u32],
        merge: [(d.v / MERGE_COLS) as u32, d.hv as u32, d.b as u32],
        merge_threads: merge_layout(d.k as u32).threads,
        u_elems: (d.b * s1 * d.hv * d.k * (d.v + d.k)) as u64,
        x_elems: (d.b * s1 * d.hv * d.k * d.v) as u64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::tests::long_desc as long;

    const H200: DeviceInfo = DeviceInfo { cc_major: 9, cc_minor: 0, sm_count: 132 };

    #[test]
    fn the_long_live_rule_and_its_launches() {
        // B1 H16: 32 live CTAs, 100 SMs for the summaries; (6, 2): pass 1 runs two segments'
        // time (the live CTAs; 192 summary CTAs in two rounds), pass 2 one: 3 of 6.
        assert_eq!(rule_live(&long(1, 16, 65536), &H200), Some((6, 2)));
        // B1 H32 (and B1 HV32 GVA): 64 live CTAs, 68 SMs left: (4, 2), 3 of 4.
        assert_eq!(rule_live(&long(1, 32, 65536), &H200), Some((4, 2)));
        let mut gva = long(1, 32, 11264);
        gva.dims.h = 16;
        assert_eq!(rule_live(&gva, &H200), Some((4, 2)));
        // Dense (512 CTAs) and short: none.
        assert_eq!(rule_live(&long(8, 32, 4096), &H200), None);
        assert_eq!(rule_live(&long(1, 16, 64 * 95), &H200), None);
        // Through split(): only with the experiment's kernels; else stage 4's rule, one live.
        let d = long(1, 16, 65536);
        let plain = split(&d, &H200, Arch::Sm90, SplitSwitch::Rule);
        let got = split(&d, &H200, Arch::Sm90, SplitSwitch::LiveRule);
        let forced = split(&d, &H200, Arch::Sm90, SplitSwitch::SegmentsLive(4, 2));
        if live_built() {
            assert_eq!(got, Some(Split { segments: 6, seg_chunks: 171, live: 2 }));
            assert_eq!(forced, Some(Split { segments: 4, seg_chunks: 256, live: 2 }));
        } else {
            assert_eq!(got, plain);
            assert_eq!(forced, Some(Split { segments: 4, seg_chunks: 256, live: 1 }));
        }
        // The launches: S - live segments per row and head in each pass, U and X.
        let sp = Split { segments: 6, seg_chunks: 171, live: 2 };
        assert_eq!(sp.launch_segments(), 4);
        let sh = shape(&d, sp);
        assert_eq!(sh.pass1, [4, 16 * 4, 1]);
        assert_eq!(sh.x_elems, 4 * 16 * 128 * 128);
        assert_eq!(sh.u_elems, 4 * 16 * 128 * 256);
    }

    #[test]
    fn the_rule_splits_only_below_one_wave() {
        // B1 H16 K = V = 128: 32 CTAs; three segments: pass 1 32 + 64, pass 2 64.
        assert_eq!(rule_segments(&long(1, 16, 65536), &H200), Some(3));
        assert_eq!(pass_ctas(&long(1, 16, 65536), 3), (96, 64));
        // B1 H32: 64 CTAs, three segments need 192 in pass 1.
        assert_eq!(rule_segments(&long(1, 32, 65536), &H200), None);
        // B1 H8: five segments (16 + 3 * 32 = 112, 4 * 16 = 64).
        assert_eq!(rule_segments(&long(1, 8, 65536), &H200), Some(5));
        // Too short: fewer than 3 x 32 chunks.
        assert_eq!(rule_segments(&long(1, 16, 64 * 95), &H200), None);
        assert_eq!(rule_segments(&long(1, 16, 64 * 96), &H200), Some(3));
        // The forward scan: the same rule (on by default: DEFAULT_ON_FWD), with or without a
        // final state (output_final_state: has_h0 of the carrier; pass 2's last segment
        // writes it).
        let mut f = long(1, 16, 65536);
        f.forward = true;
        f.has_h0 = true;
        assert_eq!(split(&f, &H200, Arch::Sm90, SplitSwitch::Segments(3)).map(|s| s.segments), Some(3));
        assert_eq!(split(&f, &H200, Arch::Sm90, SplitSwitch::Rule).map(|s| s.segments), Some(3));
        f.has_h0 = false;
        assert_eq!(rule_segments(&f, &H200), Some(3));
        let asked = split(&f, &H200, Arch::Sm90, SplitSwitch::Rule);
        assert_eq!(asked, Some(Split { segments: 3, seg_chunks: 342, live: 1 }));
        assert_eq!(split(&f, &H200, Arch::Sm90, SplitSwitch::Default), if DEFAULT_ON_FWD { asked } else { None });
        assert_eq!(split(&f, &H200, Arch::Sm90, SplitSwitch::Segments(4)).map(|s| s.segments), Some(4));
        // varlen never, sm_100 never.
        let mut v = long(1, 16, 65536);
        v.cu_seqlens = Some(DType::I64);
        assert_eq!(split(&v, &H200, Arch::Sm90, SplitSwitch::Rule), None);
        assert_eq!(split(&long(1, 16, 65536), &H200, Arch::Sm100, SplitSwitch::Rule), None);
    }

    #[test]
    fn the_switch_and_the_segment_arithmetic() {
        let d = long(1, 16, 65536);
        let on = split(&d, &H200, Arch::Sm90, SplitSwitch::Rule);
        assert_eq!(on, Some(Split { segments: 3, seg_chunks: 342, live: 1 }));
        assert_eq!(split(&d, &H200, Arch::Sm90, SplitSwitch::Off), None);
        assert_eq!(split(&d, &H200, Arch::Sm90, SplitSwitch::Default), if DEFAULT_ON { on } else { None });
        // Forced counts: every segment non-empty, the last one short.
        for (t, n, want) in [
            (64 * 10, 3, Some((3, 4))),
            (64 * 10 - 5, 4, Some((4, 3))),
            (64 * 9, 4, Some((3, 3))),
            (64 * 2, 5, Some((2, 1))),
            (64, 2, None),
            (64 * 10, 1, None),
        ] {
            let got = split(&long(2, 2, t), &H200, Arch::Sm90, SplitSwitch::Segments(n));
            assert_eq!(got.map(|s| (s.segments, s.seg_chunks)), want, "T={t} n={n}");
            if let Some(s) = got {
                let nt = chunks(t);
                let (sc, sn) = (i64::from(s.seg_chunks), i64::from(s.segments));
                assert!((sn - 1) * sc < nt && nt <= sn * sc, "T={t}: the last segment is non-empty");
            }
        }
    }

    #[test]
    fn slots_and_shapes() {
        for (i, name) in SPLIT_ENTRIES.iter().enumerate() {
            assert_eq!(slot_k(i), if name.contains("_k64") { 64 } else { 128 }, "{name}");
            assert_eq!(is_summary_slot(i), name.contains("_sum"), "{name}");
        }
        for k in [64u32, 128] {
            for dt in [DType::BF16, DType::F16] {
                for (svf, g) in [(false, false), (true, false), (false, true), (true, true)] {
                    for (forward, op) in [(false, "rs"), (true, "fwd")] {
                        let name = SPLIT_ENTRIES[summary_slot(k, dt, svf, g, forward)];
                        let want = format!(
                            "kda_dhu_sm90_{op}_k{k}_{}_sum{}{}",
                            if dt == DType::BF16 { "bf16" } else { "fp16" },
                            if svf { "_svf" } else { "" },
                            if g { "_g" } else { "" }
                        );
                        assert_eq!(name, want);
                    }
                }
            }
            assert_eq!(SPLIT_ENTRIES[merge_slot(k, false)], format!("kda_dhu_sm90_seg_merge_k{k}"));
            assert_eq!(SPLIT_ENTRIES[merge_slot(k, true)], format!("kda_dhu_sm90_fwd_seg_merge_k{k}"));
        }
        let d = long(1, 16, 65536);
        let sh = shape(&d, Split { segments: 3, seg_chunks: 342, live: 1 });
        assert_eq!(sh.pass1, [4, 32, 1]);
        assert_eq!(sh.merge, [8, 16, 1]);
        assert_eq!(sh.merge_threads, 256);
        assert_eq!(sh.u_elems, 2 * 16 * 128 * 256);
        assert_eq!(sh.x_elems, 2 * 16 * 128 * 128);
    }
}
