"""Where the sm_100a self-check keeps its verdicts: one JSON file per signature, on disk.

Layout: ``<cache>/selfcheck/<label>/<gpu>__<driver>__kda_dhu-<build>/<signature key>.json``
where ``<cache>`` is ``$KDA_DHU_CACHE_DIR``, else ``$XDG_CACHE_HOME/kda_dhu``, else
``~/.cache/kda_dhu``; ``<gpu>`` the device name and compute capability, ``<driver>`` the
NVIDIA driver's version, ``<build>`` kda_dhu's version and a hash of its compiled
extension (which holds the kernel images). A new driver, a new GPU model or a rebuilt
kda_dhu starts from no verdicts. Files are written atomically (a temporary file in the
same folder, then ``os.replace``): a reader sees the old file, the new one or none, never
a partial one. One lock file per folder (``.lock``, an fcntl record lock that the
operating system releases when its holder exits, however it exits) makes the processes
of a node check one at a time, so that eight ranks starting together run one check.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import tempfile
import threading
import time

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None

CACHE_ENV = "KDA_DHU_CACHE_DIR"
FORMAT = 1  # the record's layout; a record of another format is ignored (checked again)


def cache_root() -> str:
    """kda_dhu's cache folder: $KDA_DHU_CACHE_DIR, else $XDG_CACHE_HOME/kda_dhu, else
    ~/.cache/kda_dhu (the XDG base directory rule; read at every call)."""
    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return os.path.abspath(os.path.expanduser(explicit))
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = xdg if xdg and os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kda_dhu")


def _slug(text: str) -> str:
    """A file-name-safe spelling of text (letters, digits, '.', '-', '_')."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", str(text)).strip("-") or "unknown"


def driver_version() -> str:
    """The NVIDIA kernel driver's version ("580.65.06"), from /proc; else the CUDA driver
    API's version ("cuda-13000"); else "unknown"."""
    try:
        with open("/proc/driver/nvidia/version") as f:
            m = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]*)", f.read())
            if m:
                return m.group(1)
    except OSError:
        pass
    try:
        import ctypes

        lib = ctypes.CDLL("libcuda.so.1" if os.name != "nt" else "nvcuda.dll")
        v = ctypes.c_int()
        if lib.cuDriverGetVersion(ctypes.byref(v)) == 0:
            return f"cuda-{v.value}"
    except (OSError, AttributeError):
        pass
    return "unknown"


_build = None


def build_id() -> str:
    """kda_dhu's version and the first 12 hex digits of the SHA-256 of its compiled
    extension (the kernel images live in it): "0.1.0+3f2a...". "+nocore" without one."""
    global _build
    if _build is None:
        from . import __version__

        try:
            from . import _core

            path = _core.__file__
        except ImportError:
            path = None
        digest = "nocore"
        if path:
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            digest = h.hexdigest()[:12]
        _build = f"{__version__}+{digest}"
    return _build


def gpu_identity(device: int | None) -> dict:
    """{"gpu", "driver", "build"} of CUDA device ``device`` (an index; None: current)."""
    import torch

    if device is None:
        device = torch.cuda.current_device()
    name = torch.cuda.get_device_name(device)
    major, minor = torch.cuda.get_device_capability(device)
    return {"gpu": f"{name} sm_{major}{minor}", "driver": driver_version(), "build": build_id()}


class VerdictStore:
    """The verdicts of one (label, GPU, driver, build), in one folder.

    ``read`` / ``write`` take a signature's key (a file-name-safe string); records are
    dicts with at least ``outcome`` and ``checked_at`` (seconds since the epoch).
    """

    def __init__(self, root: str, label: str, identity: dict):
        self.identity = dict(identity)
        folder = "__".join(
            (
                _slug(identity["gpu"]),
                "driver-" + _slug(identity["driver"]),
                "kda_dhu-" + _slug(identity["build"]),
            )
        )
        self.dir = os.path.join(root, "selfcheck", _slug(label), folder)

    def path(self, key: str) -> str:
        return os.path.join(self.dir, key + ".json")

    def log_path(self, key: str) -> str:
        """Where the check process's stderr goes (kept beside the verdict)."""
        return os.path.join(self.dir, key + ".log")

    def ensure(self) -> None:
        """Creates the folder; raises OSError where it cannot."""
        os.makedirs(self.dir, exist_ok=True)

    def read(self, key: str, signature: dict) -> dict | None:
        """The record for key, or None: no file, an unreadable or foreign one (another
        format or signature), which the next check overwrites."""
        try:
            with open(self.path(key)) as f:
                record = json.load(f)
        except (OSError, ValueError):
            return None
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            return None
        if record.get("signature") != signature or not isinstance(record.get("outcome"), str):
            return None
        if not isinstance(record.get("checked_at"), (int, float)):
            return None
        return record

    def write(self, key: str, record: dict) -> str:
        """Writes the record atomically (temporary file, fsync, os.replace); returns the
        path. Raises OSError (the temporary file is removed)."""
        self.ensure()
        record = dict(record, format=FORMAT)
        fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=f".{key}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(record, f, indent=1, sort_keys=True)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path(key))
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return self.path(key)

    @contextlib.contextmanager
    def locked(self, timeout: float):
        """Holds the folder's lock (one check at a time among all processes and threads);
        raises TimeoutError after ``timeout`` seconds of waiting.

        An fcntl record lock (``lockf``) on ``.lock``: the operating system releases it
        when its holder exits, killed or not, so a crashed holder never blocks the
        others; and a forked process (a data loader's worker) does not inherit it. Such
        locks do not exclude the threads of one process from each other, so a
        per-process lock does that. Without fcntl (not POSIX) only the latter applies.
        """
        self.ensure()
        path = os.path.join(self.dir, ".lock")
        start = time.monotonic()
        deadline = start + timeout

        def timed_out():
            return TimeoutError(f"another process held {path} for {time.monotonic() - start:.0f} s")

        in_process = _thread_lock(path)
        if not in_process.acquire(timeout=max(0.0, timeout)):
            raise timed_out()
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                while fcntl is not None:
                    try:
                        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except OSError as e:
                        if e.errno not in (errno.EACCES, errno.EAGAIN):
                            raise
                    if time.monotonic() >= deadline:
                        raise timed_out()
                    time.sleep(0.05)
                yield
            finally:
                os.close(fd)  # releases the record lock
        finally:
            in_process.release()


_thread_locks: dict[str, threading.Lock] = {}
_thread_locks_guard = threading.Lock()


def _thread_lock(path: str) -> threading.Lock:
    with _thread_locks_guard:
        return _thread_locks.setdefault(path, threading.Lock())


def _fresh_thread_locks() -> None:
    """After a fork: the parent's threads (which may have held these) are not here."""
    global _thread_locks_guard
    _thread_locks.clear()
    _thread_locks_guard = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_fresh_thread_locks)
