"""Run-time guard for a kernel that has never run on real hardware (the sm_100a one).

No Blackwell GPU was reachable when kda-dhu's sm_100a kernel was written, so on such a
device the dispatcher trusts it only after checking it: the first call of each shape
signature runs both the kernel and fla's function and compares every output. A
mismatch, or a driver error (RuntimeError) from that first kernel call, logs one warning,
switches the kernel off for the rest of the process, and returns fla's result; a match
lets later calls of that signature run the kernel alone.
``KDA_DHU_SM100_TRUSTED=1`` skips the check (for users who have validated the kernel).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Hashable, Sequence

import torch

TRUST_ENV = "KDA_DHU_SM100_TRUSTED"

# Relative difference allowed between kernel and fla, per output. Each of the two sits
# about 3e-3 (bf16) or 4e-4 (fp16) from the float64 recurrence (SPEC.md); a wrong kernel
# is off by O(1).
TOLERANCE = {torch.bfloat16: 1.5e-2, torch.float16: 2e-3, torch.float32: 2e-3}


def compare_outputs(
    ours: Sequence[torch.Tensor | None], theirs: Sequence[torch.Tensor | None], names=("dh", "dh0", "dv2")
) -> tuple[bool, str]:
    """(match, detail): every output finite and within TOLERANCE of fla's, relative L2."""
    details = []
    ok = True
    for name, a, b in zip(names, ours, theirs):
        if a is None or b is None:
            if (a is None) != (b is None):
                return False, f"{name}: one side is None"
            continue
        if a.shape != b.shape:
            return False, f"{name}: shape {tuple(a.shape)} != fla's {tuple(b.shape)}"
        num2, den2, finite = 0.0, 0.0, True
        af, bf = a.reshape(-1), b.reshape(-1)
        step = 1 << 24  # float64 slices: bounded extra memory on outputs of 2^32 elements
        for i in range(0, af.numel(), step):
            x, y = af[i : i + step].double(), bf[i : i + step].double()
            finite = finite and bool(torch.isfinite(x).all())
            num2 += float(((x - y) ** 2).sum())
            den2 += float((y**2).sum())
        if not finite:
            return False, f"{name}: non-finite values"
        den = den2**0.5
        err = num2**0.5 / (den if den > 0 else 1.0)
        tol = TOLERANCE.get(b.dtype, 2e-3)
        details.append(f"{name} {err:.2e} (tol {tol:.0e})")
        ok = ok and err <= tol
    return ok, ", ".join(details)


class SelfCheck:
    """Per-process state of the guard for one kernel (one architecture)."""

    def __init__(self, label: str, trust_env: str = TRUST_ENV):
        self.label = label
        self.trust_env = trust_env
        self.checked: set = set()
        self.disabled_reason: str | None = None
        self._lock = threading.Lock()

    def trusted(self) -> bool:
        return os.environ.get(self.trust_env, "0") not in ("", "0")

    def run(self, signature: Hashable, kernel_fn: Callable[[], tuple], fla_fn: Callable[[], tuple]):
        """The kernel's result, fla's result, or (first call of a signature) both compared."""
        if self.trusted():
            return kernel_fn()
        if self.disabled_reason is not None:
            return fla_fn()
        if signature in self.checked:
            return kernel_fn()
        try:
            ours = kernel_fn()
        except torch.cuda.OutOfMemoryError:
            raise  # the caller's memory, not the kernel: fla would need the same outputs
        except RuntimeError as e:
            # A driver error on the kernel's first call of this signature (its image not
            # loading, a launch configuration the device refuses): fla runs instead. An
            # error that leaves the CUDA context unusable fails fla's call too, and shows.
            self._disable(signature, f"raised {type(e).__name__}: {e}", "failed on")
            return fla_fn()
        theirs = fla_fn()
        ok, detail = compare_outputs(ours, theirs)
        if ok:
            with self._lock:
                self.checked.add(signature)
            return ours
        self._disable(signature, detail, "disagreed with fla on")
        return theirs

    def _disable(self, signature: Hashable, detail: str, what: str) -> None:
        """Switches the kernel off for the process; warns once (the first reason)."""
        with self._lock:
            if self.disabled_reason is not None:
                return
            self.disabled_reason = f"{signature}: {detail}"
        warnings.warn(
            f"kda_dhu: the {self.label} kernel {what} its first call of {signature} ({detail}); "
            f"it is switched off for this process and fla's results are used. Please report "
            f"this. ({self.trust_env}=1 skips this check.)",
            RuntimeWarning,
            stacklevel=4,
        )


def signature_of(*tensors, **flags) -> tuple:
    """A hashable shape signature: shapes and dtypes of the tensors, plus flags."""
    sig = []
    for t in tensors:
        sig.append(None if t is None else (tuple(t.shape), str(t.dtype)))
    sig.extend(sorted(flags.items()))
    return tuple(sig)
