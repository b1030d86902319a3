//! Packed batches (`cu_seqlens`): the one checker of the sequence offsets and their chunk
//! tables, and the one place their error messages are written.
//!
//! The kernels check the same conditions on the device, where they read the values (so
//! that no call synchronizes the host with the GPU): a CTA of sequence n checks sequence
//! n's entries, and on a failure writes NaN to its outputs, stores nothing else and
//! reports a [`DeviceError`] through a host-mapped word, which the next call turns into
//! the same message as [`check_tables`] (`decode_device_error`). The host check runs
//! where the values are on the host anyway (the CPU path, tests) or where the caller asks
//! for it (`KDA_DHU_CHECK_INPUTS=1`).
//!
//! Conditions, per sequence n of N (`len = cu_seqlens[n+1] - cu_seqlens[n]`,
//! `chunks(n) = ceil(len / 64)`), in the order they are checked:
//! 1. `cu_seqlens[0] == 0` (n = 0 only);
//! 2. `0 <= cu_seqlens[n] <= cu_seqlens[n+1]` (non-decreasing);
//! 3. `cu_seqlens[n+1] <= T`;
//! 4. with chunk_offsets: `chunk_offsets[0] == 0` (n = 0) and
//!    `chunk_offsets[n+1] - chunk_offsets[n] == chunks(n)`;
//! 5. the sequence's chunks lie in dh: `chunk_offsets[n] + chunks(n) <= NT` (NT = dh's
//!    chunk count: `len(chunk_indices)`, or the chunks of cu_seqlens).
//!
//! Each is local to one sequence, and together they are exactly fla's contract: the
//! offsets are the prefix sums of the chunk counts and every sequence lies in [0, T).

use crate::error::{Error, Result};
use crate::facts::BT;

/// Chunks of a sequence of `len` tokens (fla's `ceil(len / BT)`).
pub fn chunks(len: i64) -> i64 {
    (len + BT - 1).div_euclid(BT)
}

/// What went wrong with one sequence, as the kernel reports it (`DhuError` of
/// cuda/dhu_params.h: `code`, `seq`, `a`, `b`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// cu_seqlens[0] = a != 0.
    FirstOffset { got: i64 },
    /// cu_seqlens[seq] = a > cu_seqlens[seq + 1] = b, or a < 0.
    Decreasing { seq: i64, at: i64, next: i64 },
    /// cu_seqlens[seq + 1] = a > T.
    PastT { seq: i64, end: i64 },
    /// chunk_offsets[seq] .. chunk_offsets[seq + 1] (a, b) does not hold sequence seq's chunks.
    Offsets { seq: i64, at: i64, next: i64 },
    /// sequence seq's chunks [a, a + b) leave dh's NT rows.
    PastNt { seq: i64, first: i64, count: i64 },
}

/// Device error codes (`DHU_ERR_*` in cuda/dhu_params.h).
pub const ERR_FIRST_OFFSET: u32 = 1;
pub const ERR_DECREASING: u32 = 2;
pub const ERR_PAST_T: u32 = 3;
pub const ERR_OFFSETS: u32 = 4;
pub const ERR_PAST_NT: u32 = 5;

impl Fault {
    /// The Python-facing error, naming the argument (the same words for the host check
    /// and a device report).
    pub fn to_error(self, t: i64, nt: i64) -> Error {
        match self {
            Fault::FirstOffset { got } => Error::value("cu_seqlens", format!("expected cu_seqlens[0] == 0, got {got}")),
            Fault::Decreasing { seq, at, next } => Error::value(
                "cu_seqlens",
                format!(
                    "expected non-negative, non-decreasing offsets, got cu_seqlens[{seq}] = {at} > cu_seqlens[{}] = {next}",
                    seq + 1
                ),
            ),
            Fault::PastT { seq, end } => {
                Error::value("cu_seqlens", format!("expected cu_seqlens[{}] <= T = {t}, got {end}", seq + 1))
            }
            Fault::Offsets { seq, at, next } => Error::value(
                "chunk_offsets",
                format!(
                    "expected the chunk offsets of cu_seqlens (chunk_offsets[0] == 0 and chunk_offsets[n + 1] - \
                     chunk_offsets[n] == ceil(len_n / 64)), got chunk_offsets[{seq}] = {at}, chunk_offsets[{}] = {next}",
                    seq + 1
                ),
            ),
            Fault::PastNt { seq, first, count } => Error::value(
                "chunk_indices",
                format!(
                    "expected at least as many rows as cu_seqlens has chunks: sequence {seq}'s chunks [{first}, {}) \
                     pass NT = {nt}",
                    first + count
                ),
            ),
        }
    }

    /// The device's (code, seq, a, b) report as a fault; None for an unknown code.
    pub fn from_device(code: u32, seq: i64, a: i64, b: i64) -> Option<Fault> {
        Some(match code {
            ERR_FIRST_OFFSET => Fault::FirstOffset { got: a },
            ERR_DECREASING => Fault::Decreasing { seq, at: a, next: b },
            ERR_PAST_T => Fault::PastT { seq, end: a },
            ERR_OFFSETS => Fault::Offsets { seq, at: a, next: b },
            ERR_PAST_NT => Fault::PastNt { seq, first: a, count: b },
            _ => return None,
        })
    }
}

/// The checks of one sequence, exactly as the kernel runs them (see the module docs).
/// `offsets`: chunk_offsets[n], chunk_offsets[n + 1] when the caller gave them, else the
/// running prefix (first chunk of n, None for the next). Returns the first chunk of n.
pub fn check_sequence(
    n: i64,
    cu: (i64, i64),
    offsets: (i64, Option<i64>),
    t: i64,
    nt: i64,
) -> std::result::Result<i64, Fault> {
    let (bos, eos) = cu;
    if n == 0 && bos != 0 {
        return Err(Fault::FirstOffset { got: bos });
    }
    if bos < 0 || eos < bos {
        return Err(Fault::Decreasing { seq: n, at: bos, next: eos });
    }
    if eos > t {
        return Err(Fault::PastT { seq: n, end: eos });
    }
    let nc = chunks(eos - bos);
    let (first, next) = offsets;
    if let Some(next) = next {
        if (n == 0 && first != 0) || first < 0 || next.checked_sub(first) != Some(nc) {
            return Err(Fault::Offsets { seq: n, at: first, next });
        }
    }
    if first < 0 || first.checked_add(nc).is_none_or(|end| end > nt) {
        return Err(Fault::PastNt { seq: n, first, count: nc });
    }
    Ok(first)
}

/// Checks cu_seqlens [N + 1] of a packed batch of T tokens (and chunk_offsets [N + 1] when
/// given) and returns the chunk offsets [N + 1] (the last is the total chunk count).
/// `nt`: dh's chunk count when it is fixed by the caller (`len(chunk_indices)`), else
/// None (then it is the total). Raises the first failing condition's error, naming the
/// argument (ValueError).
pub fn check_tables(cu: &[i64], t: i64, chunk_offsets: Option<&[i64]>, nt: Option<i64>) -> Result<Vec<i64>> {
    let n_seq = cu.len().saturating_sub(1);
    if let Some(co) = chunk_offsets {
        if co.len() != cu.len() {
            return Err(Error::shape(
                "chunk_offsets",
                format!("expected {} entries like cu_seqlens, got {}", cu.len(), co.len()),
            ));
        }
    }
    let nt_bound = nt.unwrap_or(i64::MAX);
    let mut offsets = Vec::with_capacity(cu.len());
    let mut first = 0i64;
    for n in 0..n_seq {
        let given = chunk_offsets.map(|co| (co[n], co[n + 1]));
        let offs = match given {
            Some((a, b)) => (a, Some(b)),
            None => (first, None),
        };
        let f = check_sequence(n as i64, (cu[n], cu[n + 1]), offs, t, nt_bound)
            .map_err(|f| f.to_error(t, nt.unwrap_or(-1)))?;
        offsets.push(f);
        first = f + chunks(cu[n + 1] - cu[n]);
    }
    offsets.push(first);
    Ok(offsets)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(r: Result<Vec<i64>>) -> String {
        r.unwrap_err().to_string()
    }

    #[test]
    fn offsets_are_prefix_sums_of_chunk_counts() {
        let cu = [0, 1, 64, 65, 65, 200];
        assert_eq!(check_tables(&cu, 200, None, None).unwrap(), vec![0, 1, 2, 3, 3, 6]);
        // a padded packed batch: cu[-1] < T
        assert_eq!(check_tables(&[0, 10], 300, None, None).unwrap(), vec![0, 1]);
        // fla's graph mode: zero-length padding sequences and a larger fixed NT
        assert_eq!(check_tables(&[0, 130, 130, 130], 130, None, Some(8)).unwrap(), vec![0, 3, 3, 3]);
        // no sequences at all
        assert_eq!(check_tables(&[0], 5, None, None).unwrap(), vec![0]);
    }

    #[test]
    fn given_offsets_must_match() {
        let cu = [0, 1, 64, 65];
        assert!(check_tables(&cu, 65, Some(&[0, 1, 2, 3]), None).is_ok());
        assert_eq!(
            msg(check_tables(&cu, 65, Some(&[0, 1, 3, 5]), None)),
            "chunk_offsets: expected the chunk offsets of cu_seqlens (chunk_offsets[0] == 0 and \
             chunk_offsets[n + 1] - chunk_offsets[n] == ceil(len_n / 64)), got chunk_offsets[1] = 1, \
             chunk_offsets[2] = 3"
        );
        assert!(msg(check_tables(&cu, 65, Some(&[1, 2, 3, 5]), None)).contains("chunk_offsets[0] = 1"));
        assert!(msg(check_tables(&cu, 65, Some(&[0, 1]), None)).starts_with("chunk_offsets: expected 4 entries"));
    }

    #[test]
    fn each_condition_names_cu_seqlens() {
        assert_eq!(msg(check_tables(&[3, 10], 20, None, None)), "cu_seqlens: expected cu_seqlens[0] == 0, got 3");
        assert_eq!(
            msg(check_tables(&[0, 10, 5], 20, None, None)),
            "cu_seqlens: expected non-negative, non-decreasing offsets, got cu_seqlens[1] = 10 > cu_seqlens[2] = 5"
        );
        assert_eq!(
            msg(check_tables(&[0, 10, 30], 20, None, None)),
            "cu_seqlens: expected cu_seqlens[2] <= T = 20, got 30"
        );
        assert!(msg(check_tables(&[0, -5, 10], 20, None, None)).contains("cu_seqlens[1] = -5"));
        assert!(msg(check_tables(&[0, 200], 200, None, Some(3))).starts_with("chunk_indices: expected at least"));
        // overflow-sized values are errors, not panics
        assert!(check_tables(&[0, i64::MAX], i64::MAX, None, None).is_ok());
        assert!(check_tables(&[0, 5], 5, Some(&[0, i64::MAX]), None).is_err());
        assert!(check_tables(&[0, 5], 5, Some(&[i64::MIN, 0]), None).is_err());
    }

    #[test]
    fn device_reports_decode_to_the_host_messages() {
        let cases = [
            (vec![3, 10], None, None),
            (vec![0, 10, 5], None, None),
            (vec![0, 10, 30], None, None),
            (vec![0, 1, 64, 65], Some(vec![0, 1, 3, 5]), None),
            (vec![0, 200], None, Some(3)),
        ];
        let codes = [ERR_FIRST_OFFSET, ERR_DECREASING, ERR_PAST_T, ERR_OFFSETS, ERR_PAST_NT];
        let reports = [(0, 3, 0), (1, 10, 5), (1, 30, 0), (1, 1, 3), (0, 0, 4)];
        for ((cu, co, nt), (code, (seq, a, b))) in cases.into_iter().zip(codes.into_iter().zip(reports)) {
            let t = 20.max(*cu.last().unwrap()).min(if code == ERR_PAST_T { 20 } else { i64::MAX });
            let host = msg(check_tables(&cu, t, co.as_deref(), nt));
            let dev = Fault::from_device(code, seq, a, b).unwrap().to_error(t, nt.unwrap_or(-1)).to_string();
            assert_eq!(host, dev, "code {code}");
        }
        assert_eq!(Fault::from_device(99, 0, 0, 0), None);
    }
}
