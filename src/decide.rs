//! The one decision of a call: from the validated inputs, the plan of the entry point's
//! rule and one reading of the per-call switches, what the call runs. Pure (no Python, no
//! GPU): `cargo test` covers every branch. The Python layer carries a decision out (torch
//! copies, fla's chunk count, fla's function, the CPU path, the sm_100a guard) and asks
//! again only after a `Copy` or `CountChunks`, on the packed inputs or with the count:
//! that second decision is final.

use crate::env::{self, Force};
use crate::error::{Error, Result};
use crate::plan::{Arch, Plan};

/// The switches a call's decision reads (`KDA_DHU_FORCE`, `KDA_DHU_CHECK_INPUTS`), read
/// once per call; the planner's own switch (SM90_NWG) is read by the plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Switches {
    pub force: Option<Force>,
    pub check_inputs: bool,
}

impl Switches {
    /// The switches now; a bad `KDA_DHU_FORCE` value is an error naming it.
    pub fn now() -> Result<Switches> {
        Ok(Switches { force: env::force()?, check_inputs: env::check_inputs() })
    }
}

/// What the caller does with the call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Launch the kernel (`Decision::guarded`: through the sm_100a self-check).
    Kernel,
    /// fla's function, on the inputs as they are (packed).
    Fla,
    /// Copy `Decision::copies` into packed tensors (and count the chunks where
    /// `count_chunks`), then decide again.
    Copy,
    /// Count the chunks of the packed batch (fla's cached chunk table), then decide again.
    CountChunks,
    /// Inputs in host memory: kda-dhu's CPU implementation (validated already).
    Cpu,
    /// No chunks at all: the outputs without a launch (dh empty, dh0 = dht, dv2 zeros).
    Empty,
}

impl Action {
    pub fn name(self) -> &'static str {
        match self {
            Action::Kernel => "kernel",
            Action::Fla => "fla",
            Action::Copy => "copy",
            Action::CountChunks => "count",
            Action::Cpu => "cpu",
            Action::Empty => "empty",
        }
    }
}

/// The reason of a call in host memory.
pub const CPU_REASON: &str = "cpu: inputs in host memory (kda-dhu's entry points run them on its CPU implementation)";

/// A call's decision.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    pub action: Action,
    /// The plan under the switches: whether the kernel runs the call (once copied and
    /// counted) and why: "kernel-sm90a", or the fallback's reason.
    pub plan: Plan,
    /// The inputs to copy first (`Action::Copy`).
    pub copies: Vec<&'static str>,
    /// The chunk count is unknown on the host (a packed batch without chunk_indices).
    pub count_chunks: bool,
    /// `KDA_DHU_CHECK_INPUTS` on a packed batch: check its tables on the host first.
    pub check_tables: bool,
    /// Why the device cannot run the kernel image, where it cannot (a warning, once).
    pub unavailable: Option<String>,
    /// `KDA_DHU_FORCE=fla` made the verdict.
    pub forced_fla: bool,
}

/// What the decision reads of a validated call on a CUDA device.
#[derive(Clone, Debug)]
pub struct Facts {
    pub copies: Vec<&'static str>,
    /// dh's NT, None while unknown on the host.
    pub nt: Option<i64>,
    pub varlen: bool,
    pub unavailable: Option<String>,
}

impl Decision {
    /// A call whose inputs are in host memory (validated for the CPU path).
    pub fn cpu() -> Decision {
        Decision {
            action: Action::Cpu,
            plan: Plan::Fallback { reason: CPU_REASON.into() },
            copies: Vec::new(),
            count_chunks: false,
            check_tables: false,
            unavailable: None,
            forced_fla: false,
        }
    }

    /// A call on a CUDA device: `planned` is the plan under the entry point's rule,
    /// `capable` the plan wherever the kernel can compute the call (asked only under
    /// `KDA_DHU_FORCE=kernel`). Errs for `KDA_DHU_FORCE=kernel` on a call the kernel
    /// cannot compute.
    pub fn on_device(facts: Facts, planned: Plan, capable: impl FnOnce() -> Plan, sw: Switches) -> Result<Decision> {
        let plan = match sw.force {
            Some(Force::Fla) => Plan::Fallback { reason: format!("{}=fla", env::FORCE) },
            Some(Force::Kernel) if !planned.is_kernel() => match capable() {
                Plan::Fallback { reason } => return Err(Error::Forced(reason)),
                kernel => kernel,
            },
            _ => planned,
        };
        let count_chunks = facts.nt.is_none();
        let action = if !facts.copies.is_empty() {
            Action::Copy
        } else if count_chunks {
            Action::CountChunks
        } else if facts.nt == Some(0) {
            Action::Empty
        } else if plan.is_kernel() {
            Action::Kernel
        } else {
            Action::Fla
        };
        let last = !matches!(action, Action::Copy | Action::CountChunks);
        Ok(Decision {
            action,
            plan,
            copies: facts.copies,
            count_chunks,
            check_tables: last && sw.check_inputs && facts.varlen,
            unavailable: facts.unavailable,
            forced_fla: sw.force == Some(Force::Fla),
        })
    }

    /// (the kernel runs the call, why): the plan's verdict.
    pub fn verdict(&self) -> (bool, String) {
        self.plan.describe()
    }

    /// The verdict's reason, saying which inputs are copied first (not under
    /// `KDA_DHU_FORCE=fla`: the switch is the reason).
    pub fn reason(&self) -> String {
        let reason = self.plan.describe().1;
        if self.copies.is_empty() || self.forced_fla {
            return reason;
        }
        format!("{reason} after copying {} (fla's function reads inputs as contiguous)", self.copies.join(", "))
    }

    /// The kernel under the sm_100a self-check (the Blackwell kernel has not run on hardware).
    pub fn guarded(&self) -> bool {
        matches!(self.plan, Plan::Kernel { arch: Arch::Sm100, .. })
    }

    /// Launching is all that is left: the kernel, unguarded, no host check of the tables.
    pub fn launch_only(&self) -> bool {
        self.action == Action::Kernel && !self.guarded() && !self.check_tables
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::KernelConfig;
    use crate::tensor::DType;

    fn kernel(arch: Arch) -> Plan {
        let config = KernelConfig {
            k: 128,
            dtype: DType::BF16,
            flags: 0,
            grid: [2, 32, 8],
            nwg: 1,
            svf: false,
            split: None,
            forward: false,
        };
        Plan::Kernel { arch, config }
    }

    fn fallback(r: &str) -> Plan {
        Plan::Fallback { reason: r.into() }
    }

    fn facts(copies: &[&'static str], nt: Option<i64>, varlen: bool) -> Facts {
        Facts { copies: copies.to_vec(), nt, varlen, unavailable: None }
    }

    const NONE: Switches = Switches { force: None, check_inputs: false };

    fn never() -> Plan {
        panic!("the capable plan is asked only under KDA_DHU_FORCE=kernel")
    }

    #[test]
    fn each_action_from_the_facts_and_the_plan() {
        let d = |f, p| Decision::on_device(f, p, never, NONE).unwrap();
        assert_eq!(d(facts(&[], Some(4), false), kernel(Arch::Sm90)).action, Action::Kernel);
        assert_eq!(d(facts(&[], Some(4), false), fallback("T % 64 != 0")).action, Action::Fla);
        let c = d(facts(&["q", "dv"], None, true), kernel(Arch::Sm90));
        assert_eq!((c.action, c.count_chunks), (Action::Copy, true));
        assert_eq!(c.reason(), "kernel-sm90a after copying q, dv (fla's function reads inputs as contiguous)");
        assert_eq!(d(facts(&[], None, true), kernel(Arch::Sm90)).action, Action::CountChunks);
        assert_eq!(d(facts(&[], Some(0), true), fallback("x")).action, Action::Empty);
        assert_eq!(Decision::cpu().verdict(), (false, CPU_REASON.to_string()));
    }

    #[test]
    fn the_switches_decide_once() {
        let fla = Switches { force: Some(Force::Fla), check_inputs: false };
        let d = Decision::on_device(facts(&["k"], Some(4), false), kernel(Arch::Sm90), never, fla).unwrap();
        assert_eq!((d.action, d.reason()), (Action::Copy, "KDA_DHU_FORCE=fla".to_string()));
        let d = Decision::on_device(facts(&[], Some(4), false), kernel(Arch::Sm90), never, fla).unwrap();
        assert_eq!((d.action, d.verdict().0), (Action::Fla, false));

        let forced = Switches { force: Some(Force::Kernel), check_inputs: false };
        let d = Decision::on_device(
            facts(&[], Some(4), false),
            fallback("B*HV*(V/64) < 256"),
            || kernel(Arch::Sm90),
            forced,
        )
        .unwrap();
        assert_eq!(d.action, Action::Kernel);
        let err =
            Decision::on_device(facts(&[], Some(4), false), fallback("a"), || fallback("chunk_size != 64"), forced)
                .unwrap_err();
        assert_eq!(err.to_string(), "KDA_DHU_FORCE=kernel, but the kernel cannot run this call: chunk_size != 64");

        let check = Switches { force: None, check_inputs: true };
        let on = |f| Decision::on_device(f, kernel(Arch::Sm90), never, check).unwrap();
        assert!(on(facts(&[], Some(4), true)).check_tables);
        assert!(!on(facts(&[], Some(4), true)).launch_only());
        assert!(!on(facts(&[], Some(4), false)).check_tables, "dense: no tables");
        assert!(!on(facts(&[], None, true)).check_tables, "after the count, on the final decision");
    }

    #[test]
    fn the_blackwell_kernel_is_guarded() {
        let d = Decision::on_device(facts(&[], Some(4), false), kernel(Arch::Sm100), never, NONE).unwrap();
        assert!(d.guarded() && !d.launch_only());
        let d = Decision::on_device(facts(&[], Some(4), false), kernel(Arch::Sm90), never, NONE).unwrap();
        assert!(!d.guarded() && d.launch_only());
    }
}
