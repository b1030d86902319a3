//! fla's forward scan, `chunk_gated_delta_rule_fwd_h` (fla-core 0.6; SPEC.md, "The twin"):
//! its arguments and their validation. The forward call is carried by a stage-4 call
//! (`FwdArgs::carrier`: k and w as themselves, dv = u, dht = initial_state), whose
//! validation, plan (`CallDesc::forward`: the FWD instances of the register-state kernel,
//! stage 4's warpgroup rule and split), kernel parameters and launch are stage 4's; only the names in
//! the errors are the forward call's (`rename`).

use crate::error::{Error, Result};
use crate::tensor::{DType, TensorMeta};
use crate::validate::{self, CallArgs, CallDesc};

/// fla's signature of `chunk_gated_delta_rule_fwd_h` (fla-core 0.6), in order, as (name,
/// default): None for a required argument, else the default's Python repr. The one
/// description the forward entry points are checked against (`_core.fwd_h_arguments()`,
/// tests/unit/test_op_arguments.py).
pub const ARGUMENTS: &[(&str, Option<&str>)] = &[
    ("k", None),
    ("w", None),
    ("u", None),
    ("g", Some("None")),
    ("gk", Some("None")),
    ("initial_state", Some("None")),
    ("output_final_state", Some("False")),
    ("chunk_size", Some("64")),
    ("save_new_value", Some("True")),
    ("state_v_first", Some("False")),
    ("cu_seqlens", Some("None")),
    ("cu_seqlens_cpu", Some("None")),
    ("chunk_indices", Some("None")),
    ("chunk_offsets", Some("None")),
];

/// The arguments of one forward call (cu_seqlens_cpu, a host copy of cu_seqlens, is not
/// read).
#[derive(Clone, Debug)]
pub struct FwdArgs {
    pub k: TensorMeta,
    pub w: TensorMeta,
    pub u: TensorMeta,
    pub g: Option<TensorMeta>,
    pub gk: Option<TensorMeta>,
    pub initial_state: Option<TensorMeta>,
    pub output_final_state: bool,
    pub chunk_size: i64,
    pub save_new_value: bool,
    pub state_v_first: bool,
    pub cu_seqlens: Option<TensorMeta>,
    pub chunk_indices: Option<TensorMeta>,
    pub chunk_offsets: Option<TensorMeta>,
}

impl FwdArgs {
    /// The stage-4 call whose kernel parameters are this call's (cuda/dhu_sm90_regstate.cuh,
    /// FWD): q = k and do = u (validated, never read), dv = u, dht = initial_state, no h0
    /// (the final state is `CallDesc::has_h0`, set by `validate`).
    pub fn carrier(&self) -> CallArgs {
        let mut dht = self.initial_state.clone();
        if let Some(s) = dht.as_mut().filter(|s| s.dtype.is_half16()) {
            // fla's kernel reads a 16-bit initial_state as well (cast to fp32 on load): the
            // call is validated as fla takes it, and the planner leaves it to fla
            // (`CallDesc::state_dtype`).
            s.dtype = DType::F32;
        }
        CallArgs {
            q: self.k.clone(),
            k: self.k.clone(),
            w: self.w.clone(),
            do_: self.u.clone(),
            dv: self.u.clone(),
            g: self.g.clone(),
            gk: self.gk.clone(),
            h0: None,
            dht,
            scale: None,
            state_v_first: self.state_v_first,
            cu_seqlens: self.cu_seqlens.clone(),
            chunk_size: self.chunk_size,
            chunk_indices: self.chunk_indices.clone(),
            chunk_offsets: self.chunk_offsets.clone(),
            nt: None,
        }
    }
}

/// A stage-4 argument's name as the forward call says it.
pub fn rename(arg: &'static str) -> &'static str {
    match arg {
        "q" => "k",
        "do" | "dv" => "u",
        "dht" => "initial_state",
        other => other,
    }
}

/// A stage-4 message's mentions of the other arguments, as the forward call says them.
fn reword(msg: String) -> String {
    msg.replace("like q and k", "like k")
        .replace("like q", "like k")
        .replace("(q's heads)", "(k's heads)")
        .replace("like do", "like u")
        .replace("like dht", "like initial_state")
}

/// A stage-4 validation error in the forward call's words.
pub fn rename_error(e: Error) -> Error {
    match e {
        Error::NotTensor { arg, got } => Error::NotTensor { arg: rename(arg), got },
        Error::Dtype { arg, msg } => Error::Dtype { arg: rename(arg), msg: reword(msg) },
        Error::Type { arg, msg } => Error::Type { arg: rename(arg), msg: reword(msg) },
        Error::Shape { arg, msg } => Error::Shape { arg: rename(arg), msg: reword(msg) },
        Error::Layout { arg, msg } => Error::Layout { arg: rename(arg), msg: reword(msg) },
        Error::Value { arg, msg } => Error::Value { arg: rename(arg), msg: reword(msg) },
        Error::Device { arg, msg } => Error::Device { arg: rename(arg), msg: reword(msg) },
        other => other,
    }
}

/// Validates a forward call as fla takes it (shapes, dtypes, strides, the packed batch's
/// tables, and with `check_device` one CUDA device), naming its arguments; the description
/// of the call the planner reads (`forward` set, `has_h0` = output_final_state).
pub fn validate(a: &FwdArgs, check_device: bool) -> Result<CallDesc> {
    let mut desc = validate::validate(&a.carrier(), check_device).map_err(rename_error)?;
    desc.forward = true;
    desc.has_h0 = a.output_final_state;
    desc.state_dtype = a.initial_state.as_ref().map_or(DType::F32, |s| s.dtype);
    Ok(desc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Device;

    /// A packed tensor on cuda:0 at a 256-byte aligned address of its own.
    fn t(shape: &[i64], dtype: DType) -> TensorMeta {
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(1 << 20);
        TensorMeta::contiguous(NEXT.fetch_add(1 << 30, Ordering::Relaxed), shape, dtype, Device::cuda(0))
    }

    fn call() -> FwdArgs {
        FwdArgs {
            k: t(&[2, 128, 2, 128], DType::BF16),
            w: t(&[2, 128, 4, 128], DType::BF16),
            u: t(&[2, 128, 4, 64], DType::BF16),
            g: None,
            gk: Some(t(&[2, 128, 4, 128], DType::F32)),
            initial_state: Some(t(&[2, 4, 128, 64], DType::F32)),
            output_final_state: true,
            chunk_size: 64,
            save_new_value: true,
            state_v_first: false,
            cu_seqlens: None,
            chunk_indices: None,
            chunk_offsets: None,
        }
    }

    #[test]
    fn a_good_call_is_the_forward_scan_with_its_final_state() {
        let d = validate(&call(), true).unwrap();
        assert!(d.forward && d.has_h0 && d.has_dht && d.has_gk);
        assert_eq!((d.dims.h, d.dims.hv, d.dims.k, d.dims.v, d.nt), (2, 4, 128, 64, Some(2)));
        let mut a = call();
        a.output_final_state = false;
        a.initial_state = None;
        let d = validate(&a, true).unwrap();
        assert!(!d.has_h0 && !d.has_dht);
    }

    #[test]
    fn errors_name_the_forward_call_s_arguments() {
        let mut a = call();
        a.u = t(&[2, 128, 3, 64], DType::BF16);
        let e = validate(&a, true).unwrap_err().to_string();
        assert!(e.starts_with("u: expected shape [B=2, T=128, HV=4, V=64]"), "{e}");
        let mut a = call();
        a.w = t(&[2, 128, 4, 128], DType::F16);
        let e = validate(&a, true).unwrap_err().to_string();
        assert_eq!(e, "w: expected dtype bfloat16 like k, got float16");
        let mut a = call();
        a.k = t(&[2, 128, 3, 128], DType::BF16);
        a.w = t(&[2, 128, 4, 128], DType::BF16);
        let e = validate(&a, true).unwrap_err().to_string();
        assert!(e.starts_with("w: expected HV (dim 2) to be a positive multiple of H=3 (k's heads)"), "{e}");
        let mut a = call();
        a.initial_state = Some(t(&[2, 4, 64, 128], DType::F32));
        let e = validate(&a, true).unwrap_err().to_string();
        assert!(e.starts_with("initial_state: expected shape [N=2, HV=4, K=128, V=64]"), "{e}");
        let mut a = call();
        a.k = t(&[2, 128, 2], DType::BF16);
        let e = validate(&a, true).unwrap_err().to_string();
        assert!(e.starts_with("k: expected a 4-D tensor [B, T, H, K]"), "{e}");
        let mut a = call();
        a.u.device = Device::cuda(1);
        let e = validate(&a, true).unwrap_err().to_string();
        assert!(e.starts_with("u: expected a tensor on cuda:0 like k"), "{e}");
    }

    #[test]
    fn a_16_bit_initial_state_is_fla_s_call() {
        let mut a = call();
        assert_eq!(validate(&a, true).unwrap().state_dtype, DType::F32);
        a.initial_state = Some(t(&[2, 4, 128, 64], DType::BF16));
        let d = validate(&a, true).unwrap();
        assert_eq!(d.state_dtype, DType::BF16);
        let h200 = crate::plan::DeviceInfo { cc_major: 9, cc_minor: 0, sm_count: 132 };
        for rule in [crate::plan::Rule::Extended, crate::plan::Rule::Capable] {
            let crate::plan::Plan::Fallback { reason } = crate::plan::plan(&d, &h200, rule) else { panic!() };
            assert_eq!(reason, "initial_state is bfloat16 (the kernel reads float32 states)");
        }
        a.initial_state = Some(t(&[2, 4, 128, 64], DType::I32));
        let e = validate(&a, true).unwrap_err().to_string();
        assert!(e.starts_with("initial_state: expected dtype float32"), "{e}");
    }

    #[test]
    fn the_description_is_fla_s_order() {
        let names: Vec<&str> = ARGUMENTS.iter().map(|(n, _)| *n).collect();
        assert_eq!(&names[..3], ["k", "w", "u"]);
        assert_eq!(ARGUMENTS.len(), 14);
    }
}
