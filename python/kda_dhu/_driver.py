"""One warning per device whose driver or GPU cannot run kda-dhu's kernel image.

The Rust core finds such a device out once, when a call first meets it (that loads the
image: an image too new for the driver, no kernel for the GPU, a missing entry point or
driver function), and from then on plans every call there as a fallback whose reason
starts with ``_core.UNAVAILABLE_PREFIX``::

    kernel unavailable on cuda:0: sm_90 with CUDA driver 12.2: cuModuleLoadData(...)
    failed: CUDA_ERROR_...; that image needs a driver for CUDA 12.0 or newer (R525+) ...

A launch that finds it out instead raises ``_core.KernelUnavailableError`` with such a
message. The entry points hand either to :func:`note_unavailable`, which warns once per
device (``KernelUnavailableWarning``), and run fla's function: nothing is raised into
the training step. Errors that mean a bug are not of this kind and still raise.
"""

from __future__ import annotations

import threading
import warnings

try:
    from ._core import UNAVAILABLE_PREFIX
except ImportError:  # a source checkout without the compiled extension: no such verdicts
    UNAVAILABLE_PREFIX = None

__all__ = ["KernelUnavailableWarning", "note_unavailable", "unavailable_ordinal"]


class KernelUnavailableWarning(RuntimeWarning):
    """A device cannot run kda-dhu's kernel image; its stage-4 calls run fla's kernel."""


_lock = threading.Lock()
_warned: set[int] = set()


def unavailable_ordinal(reason: object) -> int | None:
    """The CUDA ordinal a planner reason or ``KernelUnavailableError`` names, or None when
    it is not about a device that cannot run the kernel image."""
    text = str(reason)
    if UNAVAILABLE_PREFIX is None or not text.startswith(UNAVAILABLE_PREFIX):
        return None
    digits = text[len(UNAVAILABLE_PREFIX) :].split(":", 1)[0]
    return int(digits) if digits.isdigit() else None


def note_unavailable(reason: object, stacklevel: int = 3) -> bool:
    """Warn once per device if ``reason`` (a fallback reason from ``_core.decide`` /
    ``plan`` / ``replan``, or a ``KernelUnavailableError``) says the device cannot run the
    kernel image; return whether it says so.

    The warning (``KernelUnavailableWarning``, a RuntimeWarning) quotes the core's reason,
    which names the GPU, the driver and what is needed. Any other reason: no warning,
    False. Thread-safe; cheap for other reasons (one prefix test).
    """
    ordinal = unavailable_ordinal(reason)
    if ordinal is None:
        return False
    with _lock:
        first = ordinal not in _warned
        _warned.add(ordinal)
    if first:
        warnings.warn(
            f"kda_dhu: {reason}. Stage 4 on cuda:{ordinal} runs fla's kernel for the rest of this process.",
            KernelUnavailableWarning,
            stacklevel=stacklevel,
        )
    return True
