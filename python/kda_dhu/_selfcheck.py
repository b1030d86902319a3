"""Containment of a kernel that has never run on real hardware (the sm_100a one).

No Blackwell GPU was reachable when kda-dhu's sm_100a kernel was written. A wrong kernel
would be caught by comparing it with fla, but a kernel that hangs (an mbarrier that never
completes) or hits an illegal address (which kills the CUDA context) would take the
training job down with it. So on an sm_100 device the dispatcher never runs that kernel
in the job's process until a check, run in a separate process, has said it is right for
the call's shape signature (``Signature``):

* The first call of a signature asks for a check and returns fla's result. The check runs
  in the background (one worker thread per process, one check process at a time): a child
  process, started with the same Python, draws random inputs of that signature on the
  same device (``kda_dhu.testing.make_inputs``), runs fla, and the float64 reference on
  a sample of (sequence, head) pairs, then the kernel (the planner's rule for the entry,
  outputs poisoned with NaN), and reports measurements that this process judges against
  SPEC.md's bar (``judge``). Calls of that signature use fla until the verdict arrives,
  and the kernel from then on if it passed. A training rank never blocks on a check:
  its first steps run fla. With ``KDA_DHU_SM100=wait`` the first call waits for the
  verdict instead (then uses the kernel if it passed).
* The child has a time limit per phase (``Limits``): setup (imports, CUDA start, inputs,
  fla and its autotuning, the reference), the kernel (its launch to its synchronize),
  the comparison. Outcomes: ``pass`` (kernel used), ``fail`` (wrong or non-finite
  values, modified inputs, or the kernel raised), ``crash`` (the child died once the
  kernel had run: a signal, an exit without a report), ``timeout`` (the kernel or the
  comparison overran: the child is killed), each of which switches the kernel off for
  that signature with one warning that names the reason and the verdict file; and
  ``inconclusive`` (the check could not get as far as the kernel: out of memory, setup
  too slow, no CUDA in the child, another process holding the lock too long), which
  uses fla and is tried again after ``Limits.retry`` seconds. The child needs a CUDA
  context and about twice the call's tensors on the job's GPU; on a GPU in
  exclusive-process mode it cannot start one, and the kernel stays off.
* Verdicts are kept on disk (``kda_dhu._selfcheck_cache``: per GPU model, driver, kda_dhu
  build and signature, under ``$KDA_DHU_CACHE_DIR`` or ``$XDG_CACHE_HOME/kda_dhu`` or
  ``~/.cache/kda_dhu``), written atomically, and a lock file makes the processes of a
  node check one at a time: the eight ranks of a node starting together run one check,
  and the others read its verdict (using fla meanwhile). A lock's holder that is killed
  releases it.

``KDA_DHU_SM100`` (read at every call): ``check`` (or unset) the above; ``wait`` the
same, the first call of a signature waiting for the verdict; ``on`` trusts the kernel
without checking; ``off`` never runs it (fla's function for every such call).

What the check cannot see: it runs one draw of random inputs per signature; a kernel bug
that only other data triggers (other values, other sequence lengths of a varlen batch of
the same size and count) passes. It samples the float64 reference on a few (sequence,
head) pairs and compares every element with fla's output only to a loose tolerance.
Once a signature has passed, later calls are not compared with anything. In the default
mode a run switches from fla's results to the kernel's (equal to rounding, not bitwise)
at a call that depends on timing, on each rank separately; ``wait``, ``on`` and ``off``
make the switch reproducible.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch

from ._selfcheck_cache import VerdictStore, cache_root, gpu_identity

MODE_ENV = "KDA_DHU_SM100"
MODES = ("check", "wait", "on", "off")
OUTCOMES = ("pass", "fail", "crash", "timeout", "inconclusive")

# SPEC.md's accuracy bar: against the float64 reference, at most 1.25 x fla's own error.
BAR = 1.25
# Relative difference allowed between the kernel's and fla's outputs over every element,
# by the inputs' dtype. Each sits about 3e-3 (bf16) or 4e-4 (fp16) from the float64
# recurrence (SPEC.md); a wrong kernel is off by O(1).
TOLERANCE = {"bfloat16": 1.5e-2, "float16": 2e-3, "float32": 2e-3}
# The planner's rule each guarded entry point plans with.
RULES = {"extended": "extended", "b2a": "b2a"}
# The check process's report lines on its stdout start with this; other lines are ignored.
REPORT_PREFIX = "@kda_dhu_selfcheck "
PHASES = ("setup", "kernel", "compare")


class Signature(NamedTuple):
    """What a check covers: an entry point and the shapes, dtype and optional inputs of a
    call. ``N`` is the number of sequences of a varlen call (cu_seqlens given), else None.
    ``device`` (the CUDA device index the call ran on) tells the check where to run; it
    is not part of ``key()``: one verdict on disk serves every device of a GPU model.
    (A tuple: built and hashed on every guarded call, in well under a microsecond.)"""

    entry: str
    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    dtype: str
    g: bool = False
    gk: bool = False
    h0: bool = False
    dht: bool = False
    state_v_first: bool = False
    N: int | None = None
    device: int | None = None

    def key(self) -> str:
        """A file-name-safe name: "extended_B2_T512_H4_HV4_K128_V128_bfloat16_gk_h0_dht"."""
        parts = [self.entry, f"B{self.B}", f"T{self.T}", f"H{self.H}", f"HV{self.HV}"]
        parts += [f"K{self.K}", f"V{self.V}", self.dtype]
        parts += [name for name in ("g", "gk", "h0", "dht") if getattr(self, name)]
        if self.state_v_first:
            parts.append("svf")
        if self.N is not None:
            parts.append(f"N{self.N}")
        return "_".join(parts)

    def to_json(self) -> dict:
        """The fields of ``key()`` as a dict (no device)."""
        d = self._asdict()
        del d["device"]
        return d

    @classmethod
    def from_json(cls, d: dict, device: int | None = None) -> Signature:
        """The signature ``to_json`` gave, on ``device``."""
        return cls(**d, device=device)


_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def _dtype_name(dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    return name if name is not None else str(dtype).rsplit(".", 1)[-1]


def _device_index(x) -> int | None:
    """The CUDA device index of a tensor (torch, or any DLPack producer), or None."""
    if type(x) is torch.Tensor or isinstance(x, torch.Tensor):
        index = x.get_device()  # -1 on the CPU
        return index if index >= 0 else None
    try:
        kind, index = x.__dlpack_device__()
    except Exception:  # noqa: BLE001 - not a DLPack producer: no device to name
        return None
    return int(index) if int(kind) == 2 else None  # kDLCUDA


def signature_of(
    entry: str, q, do, *, g=None, gk=None, h0=None, dht=None, state_v_first=False, cu_seqlens=None
) -> Signature:
    """The shape signature of a call: entry ("extended" or "b2a"), B, T, H, K from q
    ([B, T, H, K]), HV, V from do ([B, T, HV, V]), q's dtype, which of g, gk, h0, dht
    are given, state_v_first, the number of sequences of cu_seqlens ([N + 1]), and
    q's device."""
    B, T, H, K = q.shape
    _, _, HV, V = do.shape
    return Signature(
        entry,
        int(B),
        int(T),
        int(H),
        int(HV),
        int(K),
        int(V),
        _dtype_name(q.dtype),
        g is not None,
        gk is not None,
        h0 is not None,
        dht is not None,
        bool(state_v_first),
        None if cu_seqlens is None else int(cu_seqlens.shape[0]) - 1,
        _device_index(q),
    )


@dataclass(frozen=True)
class Limits:
    """Seconds. ``setup``, ``kernel``, ``compare``: each phase of the check process (a
    phase that overruns gets the process killed); ``lock``: how long a process waits for
    another process's checks before giving up (inconclusive); ``retry``: an inconclusive
    verdict is checked again after this long."""

    setup: float = 600.0
    kernel: float = 120.0
    compare: float = 300.0
    lock: float = 1800.0
    retry: float = 3600.0

    @property
    def longest_wait(self) -> float:
        """The longest a check can take, waiting for the lock included."""
        return self.lock + self.setup + self.kernel + self.compare + 60.0


@dataclass(frozen=True)
class Verdict:
    """A check's outcome (one of OUTCOMES), why, the verdict file (None where it was not
    saved) and when it was reached (seconds since the epoch)."""

    outcome: str
    detail: str
    path: str | None = None
    checked_at: float = 0.0

    @property
    def passed(self) -> bool:
        """Whether the kernel may run for this signature."""
        return self.outcome == "pass"


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int, int]:
    """(‖a − b‖ / ‖b‖ over the elements finite in both, a's non-finite count, b's), in
    float64 slices of 2^24 elements (bounded extra memory on outputs of 2^32)."""
    af, bf = a.reshape(-1), b.reshape(-1)
    num2 = den2 = 0.0
    bad_a = bad_b = 0
    step = 1 << 24
    for i in range(0, af.numel(), step):
        x, y = af[i : i + step].double(), bf[i : i + step].double()
        fx, fy = torch.isfinite(x), torch.isfinite(y)
        bad_a += int((~fx).sum())
        bad_b += int((~fy).sum())
        both = fx & fy
        x, y = torch.where(both, x, 0.0), torch.where(both, y, 0.0)
        num2 += float(((x - y) ** 2).sum())
        den2 += float((y**2).sum())
    den = den2**0.5
    return num2**0.5 / (den if den > 0 else 1.0), bad_a, bad_b


def judge(result, signature: Signature) -> tuple[str, str]:
    """(outcome, detail) of a check process's measurements (its "result" report).

    Per output (dh, dh0 where h0 is given, dv2): every element of the kernel's output
    finite (an unwritten, NaN-poisoned element is not); its error against the float64
    reference on the sampled pairs at most BAR x fla's (SPEC.md's bar, + 1e-6); every
    element within TOLERANCE of fla's output (relative L2). And the kernel left its
    inputs as they were. fla's own output not finite: inconclusive. A report without
    these numbers: crash (nothing usable came back).
    """
    if not isinstance(result, dict) or not isinstance(result.get("outputs"), dict):
        return "crash", "the check process's report is unreadable"
    outputs = result["outputs"]
    tol = TOLERANCE.get(signature.dtype, 2e-3)
    names = ["dh"] + (["dh0"] if signature.h0 else []) + ["dv2"]
    parts, bad = [], []
    for name in names:
        o = outputs.get(name)
        try:
            ke, fe, kf = float(o["kernel_err"]), float(o["fla_err"]), float(o["kernel_vs_fla"])
            nk, nf = int(o["kernel_nonfinite"]), int(o["fla_nonfinite"])
        except (TypeError, KeyError, ValueError):
            return "crash", f"the check process's report lacks {name}'s measurements"
        if nf or not math.isfinite(fe):
            return "inconclusive", f"{name}: fla's own output is not finite on the check's inputs"
        if nk:
            bad.append(f"{name}: {nk} non-finite or unwritten elements")
        elif not ke <= BAR * fe + 1e-6:
            bad.append(f"{name}: error {ke:.2e} against the float64 reference, over {BAR} x fla's {fe:.2e}")
        elif not kf <= tol:
            bad.append(f"{name}: {kf:.2e} from fla's output (tolerance {tol:.0e})")
        parts.append(f"{name} {ke:.2e} (fla {fe:.2e})")
    modified = result.get("inputs_modified") or []
    if modified:
        bad.append(f"the kernel modified its inputs ({', '.join(map(str, modified))})")
    plan = result.get("plan", "?")
    if bad:
        return "fail", "; ".join(bad) + f" [{plan}]"
    return "pass", f"errors against the float64 reference: {', '.join(parts)} [{plan}]"


# ------------------------------------------------------------------------- the check process


def default_child_command(request: dict) -> list[str]:
    """The check process: kda_dhu._selfcheck_child under the same Python."""
    return [sys.executable, "-m", "kda_dhu._selfcheck_child"]


def child_env(mode_env: str = MODE_ENV) -> dict:
    """The check process's environment: this one, with this package importable first, no
    KDA_DHU_FORCE, the guard off (the child calls the kernel directly) and no fla
    backend registration."""
    from ._core import FORCE_ENV

    env = dict(os.environ)
    env.pop(FORCE_ENV, None)
    env[mode_env] = "off"
    env["KDA_DHU_NO_AUTOREGISTER"] = "1"
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([here] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def _pump(stream, lines: queue.SimpleQueue) -> None:
    """Copies a process's stdout, line by line, into a queue; None at end of file."""
    try:
        for line in stream:
            lines.put(line)
    except (OSError, ValueError):
        pass
    lines.put(None)


def _parse(line: bytes) -> dict | None:
    text = line.decode("utf-8", "replace").strip()
    if not text.startswith(REPORT_PREFIX):
        return None
    try:
        msg = json.loads(text[len(REPORT_PREFIX) :])
    except ValueError:
        return None
    return msg if isinstance(msg, dict) else None


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL to the process's group (its own session: anything it started goes too)."""
    try:
        if os.name == "posix":
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except (ProcessLookupError, PermissionError):
        pass


def _tail(f, n: int = 4000) -> str:
    try:
        f.flush()
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - n))
        return f.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return ""


# Held while a check process is being started, and by os.fork (register_at_fork): a process
# forked meanwhile (a data loader's worker) would inherit the write end of the pipe through
# which subprocess learns that the exec succeeded, and Popen would wait for that process
# to exit (for the whole training run, with persistent workers), holding the cache's lock.
_spawn_lock = threading.RLock()


def supervise(argv: list[str], request: dict, limits: Limits, *, log_path=None, env=None) -> dict:
    """Runs one check process and watches it; returns what happened.

    The process reads ``request`` (one JSON line) from its stdin, which stays open as its
    lifeline (end of file: this process is gone), and reports on stdout in lines that
    start with REPORT_PREFIX: ``{"phase": p}`` as each of PHASES starts, then
    ``{"result": ...}`` or ``{"error": {"phase", "type", "message"}}``. Each phase has its
    limit in ``limits`` (counted from its start; before the first report, setup's): past
    it the process and everything it started are killed. Its stderr goes to ``log_path``
    (or a temporary file).

    Returns {"phase": the last phase reported (None if none), "final": the last report
    or None, "timed_out", "returncode" (negative: the signal), "elapsed" (s), "log_tail",
    "spawn_error" (str, where the process could not start)}.
    """
    start = time.monotonic()
    report = {"phase": None, "final": None, "timed_out": False, "returncode": None, "spawn_error": None}
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(open(log_path, "w+b") if log_path else tempfile.TemporaryFile())
        try:
            with _spawn_lock:
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=log,
                    env=env,
                    start_new_session=(os.name == "posix"),
                )
        except OSError as e:
            report.update(spawn_error=f"{type(e).__name__}: {e}", elapsed=0.0, log_tail="")
            return report
        lines: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
        try:
            proc.stdin.write((json.dumps(request) + "\n").encode())
            proc.stdin.flush()
        except OSError:
            pass  # gone already: its exit status tells
        deadline = start + limits.setup
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                report["timed_out"] = True
                _kill(proc)
                break
            if line is None:
                break
            msg = _parse(line)
            if msg is None:
                continue
            if msg.get("phase") in PHASES:
                report["phase"] = msg["phase"]
                deadline = time.monotonic() + getattr(limits, msg["phase"])
            elif "result" in msg or "error" in msg:
                report["final"] = msg
                break
        with contextlib.suppress(OSError):
            proc.stdin.close()  # the lifeline: a process still there ends
        try:
            report["returncode"] = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _kill(proc)
            with contextlib.suppress(subprocess.TimeoutExpired):
                report["returncode"] = proc.wait(timeout=60)
        with contextlib.suppress(OSError):
            proc.stdout.close()
        report["elapsed"] = time.monotonic() - start
        report["log_tail"] = _tail(log)
    return report


def _exit_text(returncode) -> str:
    if returncode is None:
        return "no exit status"
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


def classify(report: dict, limits: Limits, signature: Signature) -> tuple[str, str]:
    """(outcome, detail) of a ``supervise`` report.

    Whatever stops the check before the kernel ran (a process that cannot start, dies,
    raises or overruns during setup; out of memory anywhere) is inconclusive: not the
    kernel's doing. Once the kernel has started, a death is a crash, an overrun a
    timeout, an exception a fail, and the measurements go to ``judge``.
    """
    phase, final = report.get("phase"), report.get("final")
    if report.get("spawn_error"):
        return "inconclusive", f"the check process could not start ({report['spawn_error']})"
    if report.get("timed_out"):
        if phase == "kernel":
            return (
                "timeout",
                f"the kernel did not finish within {limits.kernel:g} s; the check process was killed",
            )
        if phase == "compare":
            return "timeout", (
                f"the comparison after the kernel did not finish within {limits.compare:g} s; "
                "the check process was killed"
            )
        return "inconclusive", f"the check did not reach the kernel within {limits.setup:g} s"
    if final is None:
        how = _exit_text(report.get("returncode"))
        if phase == "kernel":
            return "crash", f"the check process died ({how}) while running the kernel"
        if phase == "compare":
            return "crash", f"the check process died ({how}) after running the kernel"
        return "inconclusive", f"the check process exited ({how}) before running the kernel"
    if "error" in final:
        err = final["error"] if isinstance(final["error"], dict) else {}
        where = err.get("phase", phase)
        text = f"{err.get('type', 'Error')}: {err.get('message', '')}"
        if where not in ("kernel", "compare") or err.get("type") == "OutOfMemoryError":
            return "inconclusive", f"the check could not run ({text})"
        if where == "kernel":
            return "fail", f"the kernel raised {text}"
        return "fail", f"comparing the kernel's outputs raised {text}"
    return judge(final.get("result"), signature)


# ------------------------------------------------------------------------- the guard

_instances: weakref.WeakSet = weakref.WeakSet()


def _before_fork() -> None:
    _spawn_lock.acquire()


def _after_fork_in_parent() -> None:
    _spawn_lock.release()


def _after_fork_in_child() -> None:
    global _spawn_lock
    _spawn_lock = threading.RLock()
    for chk in list(_instances):
        chk._reset_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
    )


_switch = None


def _read_switch(name: str) -> str | None:
    """``_core.switch(name)``: the switch's value, trimmed and lower-cased, or None where
    unset (the core reads every switch: src/env.rs)."""
    global _switch
    if _switch is None:
        from ._core import switch

        _switch = switch
    return _switch(name)


class SelfCheck:
    """The guard of one kernel (one architecture): per signature, run it only once a check
    process has passed it (see the module docstring).

    Args:
        label: the kernel's name in messages and in the cache's folder ("sm_100a").
        mode_env: the environment variable of the switch (check, wait, on, off): one of
            the core's switches (src/env.rs), which reads it.
        child_command: ``request -> argv`` of the check process (tests substitute
            synthetic children); default ``python -m kda_dhu._selfcheck_child``.
        cache_dir: the cache folder; None: ``cache_root()`` at each check.
        identity: ``device index -> {"gpu", "driver", "build"}``, the verdicts' folder
            key; default the CUDA device's (``gpu_identity``).
        limits: the check's time limits.
    """

    def __init__(
        self,
        label: str,
        *,
        mode_env: str = MODE_ENV,
        child_command: Callable[[dict], list[str]] | None = None,
        cache_dir: str | None = None,
        identity: Callable[[int | None], dict] | None = None,
        limits: Limits | None = None,
    ):
        self.label = label
        self.mode_env = mode_env
        self.child_command = child_command or default_child_command
        self.cache_dir = cache_dir
        self.identity = identity or gpu_identity
        self.limits = limits or Limits()
        self.children_started = 0  # check processes this process started
        self._verdicts: dict[Signature, Verdict] = {}
        self._warned: set = set()
        self._reset_after_fork()
        _instances.add(self)

    def _reset_after_fork(self) -> None:
        """Fresh worker state (a forked process has no worker thread: pending checks are
        asked for again)."""
        self._lock = threading.Lock()
        self._pending: dict[Signature, threading.Event] = {}
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._worker: threading.Thread | None = None

    def mode(self) -> str:
        """The switch: check (unset: absent, "", "0" or "auto"), wait, on or off, read by
        the core like every switch (src/env.rs). Raises ValueError on another value."""
        value = _read_switch(self.mode_env)
        if value is None:
            return "check"
        if value not in MODES:
            raise ValueError(f"{self.mode_env}: expected one of {', '.join(MODES)} or unset, got {value!r}")
        return value

    def run(self, signature: Signature, kernel_fn: Callable[[], tuple], fla_fn: Callable[[], tuple]):
        """The kernel's result where the signature's check passed (or the switch is on),
        else fla's, asking for the check on a signature's first call."""
        mode = self.mode()
        if mode == "on":
            return kernel_fn()
        if mode == "off":
            return fla_fn()
        v = self._verdicts.get(signature)
        if v is not None and v.passed:
            return kernel_fn()
        if v is None or self._expired(v):
            v = self._request(signature, wait=mode == "wait")
            if v is not None and v.passed:
                return kernel_fn()
        if v is not None:
            self._warn_once(signature, v)
        return fla_fn()

    def verdict(self, signature: Signature) -> Verdict | None:
        """This process's verdict for the signature, None while there is none."""
        return self._verdicts.get(signature)

    def wait(self, signature: Signature, timeout: float | None = None) -> Verdict | None:
        """Asks for the signature's check if needed and waits for its verdict (at most
        ``timeout`` s; None: Limits.longest_wait). None if it did not come in time."""
        return self._request(signature, wait=True, timeout=timeout)

    def _expired(self, v: Verdict) -> bool:
        return v.outcome == "inconclusive" and time.time() - v.checked_at > self.limits.retry

    def _request(self, signature: Signature, wait: bool, timeout: float | None = None) -> Verdict | None:
        with self._lock:
            v = self._verdicts.get(signature)
            if v is not None and not self._expired(v):
                return v
            event = self._pending.get(signature)
            if event is None:
                self._verdicts.pop(signature, None)
                event = self._pending[signature] = threading.Event()
                self._queue.put(signature)
                if self._worker is None or not self._worker.is_alive():
                    self._worker = threading.Thread(
                        target=self._work, name=f"kda_dhu {self.label} check", daemon=True
                    )
                    self._worker.start()
        if not wait:
            return None
        event.wait(self.limits.longest_wait if timeout is None else timeout)
        return self._verdicts.get(signature)

    def _work(self) -> None:
        while True:
            signature = self._queue.get()
            try:
                v = self.check_now(signature)
            except Exception as e:  # noqa: BLE001 - the worker must outlive any one check
                v = Verdict("inconclusive", f"the check raised {type(e).__name__}: {e}", None, time.time())
            with self._lock:
                self._verdicts[signature] = v
                event = self._pending.pop(signature, None)
            if event is not None:
                event.set()

    def check_now(self, signature: Signature) -> Verdict:
        """The signature's verdict, checking it here and now where the cache has none:
        the saved verdict if there is one, else, holding the cache's lock (waiting for
        another process's checks), a check process and its verdict saved. Blocks."""
        try:
            store = VerdictStore(self.cache_dir or cache_root(), self.label, self.identity(signature.device))
        except Exception as e:  # noqa: BLE001 - no identity or cache: check, unsaved
            return self._check(signature, None, f"no verdict folder: {type(e).__name__}: {e}")
        found = self._load(store, signature)
        if found is not None:
            return found
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(store.locked(self.limits.lock))
            except TimeoutError as e:
                return Verdict("inconclusive", str(e), None, time.time())
            except OSError as e:
                return self._check(signature, None, f"the verdict folder is not usable: {e}")
            found = self._load(store, signature)  # another process may have just checked it
            if found is not None:
                return found
            return self._check(signature, store, None)

    def _load(self, store: VerdictStore, signature: Signature) -> Verdict | None:
        record = store.read(signature.key(), signature.to_json())
        if record is None or record["outcome"] not in OUTCOMES:
            return None
        v = Verdict(
            record["outcome"],
            str(record.get("detail", "")),
            store.path(signature.key()),
            record["checked_at"],
        )
        return None if self._expired(v) else v

    def _check(self, signature: Signature, store: VerdictStore | None, unsaved: str | None) -> Verdict:
        key = signature.key()
        request = {
            "signature": signature.to_json(),
            "key": key,
            "device": signature.device,
            "limits": asdict(self.limits),
        }
        log_path = None
        if store is not None:
            with contextlib.suppress(OSError):
                store.ensure()
                log_path = store.log_path(key)
        self.children_started += 1
        report = supervise(
            self.child_command(request), request, self.limits, log_path=log_path, env=child_env(self.mode_env)
        )
        outcome, detail = classify(report, self.limits, signature)
        record = {
            "signature": signature.to_json(),
            "outcome": outcome,
            "detail": detail,
            "checked_at": time.time(),
            "elapsed_s": round(report.get("elapsed", 0.0), 3),
            "final_report": report.get("final"),
            "returncode": report.get("returncode"),
            "log": log_path,
            "log_tail": None if outcome == "pass" else report.get("log_tail"),
        }
        path = None
        if store is not None:
            record.update(store.identity)
            try:
                path = store.write(key, record)
            except OSError as e:
                detail += f" (not saved: {e})"
        elif unsaved:
            detail += f" (not saved: {unsaved})"
        return Verdict(outcome, detail, path, record["checked_at"])

    def _warn_once(self, signature: Signature, v: Verdict) -> None:
        with self._lock:
            if signature in self._warned:
                return
            self._warned.add(signature)
        where = f"verdict file: {v.path}" if v.path else "the verdict is not saved"
        if v.outcome == "inconclusive":
            msg = (
                f"kda_dhu: the {self.label} kernel's check of {signature.key()} could not run "
                f"({v.detail}); fla's function runs for this signature, and the check is tried "
                f"again after {self.limits.retry:g} s ({where})."
            )
        else:
            msg = (
                f"kda_dhu: the {self.label} kernel failed its check of {signature.key()} "
                f"({v.outcome}: {v.detail}); it is off for this signature and fla's function "
                f"runs instead. Please report this ({where}; delete it to check again). "
                f"{self.mode_env}=off never runs the kernel; {self.mode_env}=on runs it unchecked."
            )
        warnings.warn(msg, RuntimeWarning, stacklevel=5)
