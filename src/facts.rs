//! The kernels' numbers, read from their one owner: `cuda/dhu_layout.h`, which the kernels
//! include. build.rs compiles `build/kernel_facts.cpp` against that header on the build
//! host and runs it; its output (OUT_DIR/kernel_facts.rs, included here) defines:
//!
//! - `BT` (tokens per chunk, fla's BT), `LOG2_BT`, `BV` (V columns per consumer
//!   warpgroup on sm_90a, per CTA on sm_100a), `WG_THREADS`, `SEQ_EXTENT_BYTES`,
//!   `SMEM_OPTIN_MAX_SM90` (the 227 KB opt-in maximum of dynamic shared memory);
//! - `SM90`, `SM100`: one [`Layout`] per head dim K and consumer
//!   warpgroup count of each kernel family (TMA ring stages, threads per CTA, the dynamic
//!   shared memory its launch asks for: the map's bytes plus the alignment slack);
//! - `SM90_FWD`: the same for the forward scan's unsplit sm_90a kernels (stage 4's rows
//!   but K = 128 with one warpgroup, whose ring of w, k, u is its own: `fwd_ring`; every
//!   row its own in the KDA_DHU_EXP_FWD_STAGES experiment's build);
//! - `MERGE_COLS`, `MERGE`: the sequence split's merge kernel (V columns per CTA; per K its
//!   threads and dynamic shared memory, `nwg` and `stages` 0).
//!
//! Python reads `SM90`, `SM90_FWD` and `SM100` through `kda_dhu._core.kernel_facts()` (the
//! merge's numbers are the host's alone).

/// One compiled kernel shape: head dim `k`, `nwg` consumer warpgroups.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub k: u32,
    pub nwg: u32,
    /// Stages of the TMA ring.
    pub stages: u32,
    /// Threads per CTA (`__launch_bounds__` of its entry points).
    pub threads: u32,
    /// Dynamic shared memory of a launch, in bytes.
    pub smem_bytes: u32,
}

include!(concat!(env!("OUT_DIR"), "/kernel_facts.rs"));

/// Threads per CTA of `table`'s kernels with `nwg` consumer warpgroups (every K has the
/// same); panics at compile time for a count no entry point has.
pub const fn threads(table: &[Layout], nwg: u32) -> u32 {
    let mut i = 0;
    while i < table.len() {
        if table[i].nwg == nwg {
            return table[i].threads;
        }
        i += 1;
    }
    panic!("no kernel with that many consumer warpgroups")
}

/// The layout of head dim `k` with `nwg` warpgroups in `table`; None for a shape that no
/// entry point has.
pub fn layout(table: &[Layout], k: u32, nwg: u32) -> Option<&Layout> {
    table.iter().find(|l| l.k == k && l.nwg == nwg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_shape_has_one_layout_within_the_opt_in_maximum() {
        for table in [&SM90[..], &SM100[..]] {
            for l in table {
                assert_eq!(layout(table, l.k, l.nwg), Some(l));
                assert!(l.smem_bytes <= SMEM_OPTIN_MAX_SM90, "{l:?}");
                assert_eq!(l.threads % 32, 0, "{l:?}");
            }
        }
        assert_eq!(BT, 1 << LOG2_BT);
        assert_eq!(BV, 64, "the TMA boxes and the planner's clauses assume 64-column V tiles");
    }
}
