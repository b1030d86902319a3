"""kda-dhu against the fla versions it supports: fla-core 0.5.2 (no ``fla.backends``: the
patch path) and 0.6.0 (fla's backend registry), and a clear error for an older stage 4.

Each version is pip-installed (``--no-deps``) into a throwaway folder and exercised in a
child Python that sees only that fla, the installed kda-dhu, and torch and the rest of
what they need (scripts/build/site_view.py links them from this environment): fla-core extends
its package path over every ``fla`` folder on sys.path, so the environment's own fla must
not be visible. On CPU: registration, the patch (and its undoing), and a call through
each patched module reaching fla's own function with that version's signature (fla's
function is swapped for a stand-in with its exact signature: its Triton kernel needs a
GPU), and so is the planner's verdict (it needs CUDA tensors). Skips, saying why, where
PyPI cannot be reached. About 30 s (two downloads).

    python -m pytest tests/unit/test_fla_versions.py -q -p no:cacheprovider
"""

from __future__ import annotations

import importlib.metadata
import inspect
import json
import os
import subprocess
import sys
import textwrap

import pytest
from helpers import REPO_ROOT
from kda_dhu import _fla_compat

ROOT = REPO_ROOT
TESTS = os.path.join(ROOT, "tests")
VERSIONS = ("0.5.2", "0.6.0")


def _pip_target(version: str, dest: str) -> str | None:
    """Installs fla-core==version into dest; None, or why it could not."""
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-compile",
            "--target",
            dest,
            f"fla-core=={version}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
    )
    if r.returncode != 0:
        return (r.stderr.strip().splitlines() or ["pip failed"])[-1]
    return None


@pytest.fixture(scope="module")
def view(tmp_path_factory) -> str:
    """torch, numpy, einops, packaging (what fla imports) and the installed kda-dhu, with
    what they require, linked."""
    try:
        importlib.metadata.distribution("kda-dhu")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("kda-dhu is not installed as a package (pip install .): nothing to link into the child")
    dest = str(tmp_path_factory.mktemp("site_view"))
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "build", "site_view.py"),
            dest,
            "torch",
            "numpy",
            "einops",
            "packaging",
            "kda-dhu",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if r.returncode != 0:
        pytest.skip(f"cannot link this environment's packages: {r.stderr.strip()}")
    assert not os.path.exists(os.path.join(dest, "fla")), (
        "the environment's own fla must stay out of the view"
    )
    return dest


@pytest.fixture(scope="module", params=VERSIONS)
def fla_dir(request, tmp_path_factory) -> tuple[str, str]:
    version = request.param
    dest = str(tmp_path_factory.mktemp(f"fla_{version}"))
    why = _pip_target(version, dest)
    if why is not None:
        pytest.skip(f"cannot install fla-core=={version} from PyPI (offline?): {why}")
    return version, dest


_CHILD = """
    import inspect, json, sys
    import torch
    import fla
    try:  # that fla's own kernels, before kda-dhu is imported
        import fla.ops
    except Exception as err:
        import triton
        print(f"UNIMPORTABLE fla-core {fla.__version__} under triton {triton.__version__}: {err!r}"[:500])
        sys.exit(0)
    import kda_dhu
    from kda_dhu import _dispatch, fla_backend
    kpatch = sys.modules["kda_dhu.patch"]
    from helpers import make_inputs

    out = {"fla": fla.__version__, "fla_paths": list(fla.__path__)}
    out["registered"] = kda_dhu.register_backend()
    out["is_registered"] = fla_backend.is_registered()
    if out["registered"]:
        from fla.backends import _get_operation_registry
        backends = _get_operation_registry("common")._backends
        out["backend"] = [type(backends["kda_dhu"]).__name__, backends["kda_dhu"].priority]
        out["unregistered"] = kda_dhu.unregister_backend()

    import fla.ops.common.chunk_delta_h as cdh
    decorated = cdh.chunk_gated_delta_rule_bwd_dhu
    real = inspect.unwrap(decorated)
    out["real_params"] = list(inspect.signature(real).parameters)
    adapted = _dispatch.fla_function()
    out["fallback_is_real"] = adapted is real
    out["fallback_wraps_real"] = inspect.unwrap(adapted) is real

    before = {m.__name__: m.__dict__.get("chunk_gated_delta_rule_bwd_dhu") for m in kpatch._fla_modules()}
    fwd_held = {m.__name__: m.__dict__.get("chunk_gated_delta_rule_fwd_h") for m in kpatch._fla_modules()}
    out["patched"] = kda_dhu.patch()
    out["patched_modules"] = sorted(kpatch.patched_modules())
    out["patched_fwd_h"] = sorted(kpatch.patched_modules("chunk_gated_delta_rule_fwd_h"))
    ours = _dispatch.chunk_gated_delta_rule_bwd_dhu
    out["all_ours"] = all(sys.modules[n].chunk_gated_delta_rule_bwd_dhu is ours for n in out["patched_modules"])

    # fla's function as a stand-in with its exact signature (its Triton kernel needs a GPU)
    calls = []
    def stand_in(*args, **kwargs):
        calls.append(sorted(inspect.signature(real).bind(*args, **kwargs).arguments))
        return "fla's result"
    stand_in.__signature__ = inspect.signature(real)
    sys.modules["kda_dhu._fla"]._fla_fn = kda_dhu._fla_compat.adapt(stand_in)

    # every patched module's name routes to kda-dhu's dispatcher, which falls back to fla's
    # function with what that fla takes (the decision is a stand-in: the real one needs CUDA
    # tensors)
    import types
    stand_in_call = types.SimpleNamespace(
        action="fla", nt=2, copies=[], count_chunks=False, check_tables=False, unavailable=None, guarded=False,
        verdict=(False, "stand-in verdict"), reason="stand-in verdict", switches=None,
    )
    real_core = _dispatch._core

    class StandInCore:  # CPU tensors stand in for CUDA ones: the decision is a stand-in
        def __getattr__(self, name):
            return getattr(real_core, name)

        def run(self, *a, **k):
            return None

        def decide(self, *a, **k):
            return stand_in_call

    _dispatch._core = StandInCore()
    a = make_inputs(1, 100, 2, 2, 64, 64, torch.bfloat16, "gk")
    results = [sys.modules[n].chunk_gated_delta_rule_bwd_dhu(**a) for n in out["patched_modules"]]
    out["results"] = sorted(set(results))
    out["b2a"] = kda_dhu.kda_dhu_b2a(a["q"], a["k"], a["w"], a["gk"], a["h0"], a["dht"], a["do"], a["dv"], 0.125, 64)
    out["calls"] = list(calls)
    try:
        kda_dhu.chunk_gated_delta_rule_bwd_dhu(**dict(a, use_graph=True, cu_seqlens=torch.tensor([0, 100])))
        out["use_graph"] = "accepted"
    except ValueError as err:
        out["use_graph"] = str(err)

    out["unpatched"] = kda_dhu.unpatch()
    # every fla module holds fla's (decorated) function again, those imported by patch() too
    held = {m.__name__: m.__dict__.get("chunk_gated_delta_rule_bwd_dhu") for m in kpatch._fla_modules()}
    fwd_now = {m.__name__: m.__dict__.get("chunk_gated_delta_rule_fwd_h") for m in kpatch._fla_modules()}
    out["fwd_h_restored"] = all(fwd_now.get(n) is f for n, f in fwd_held.items())
    out["restored"] = all(f is decorated for f in held.values() if f is not None) and all(
        held[n] is f for n, f in before.items()
    )
    print("REPORT " + json.dumps(out))
"""


def test_registration_and_patch_work_with_this_fla(view, fla_dir):
    version, dest = fla_dir
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KDA_DHU_", "FLA_"))}
    env.update(
        PYTHONPATH=os.pathsep.join([dest, view, TESTS]),
        KDA_DHU_NO_AUTOREGISTER="1",
        KDA_DHU_FORCE="fla",
        PYTHONNOUSERSITE="1",
    )
    # -S: no site-packages of this environment (whose fla would join fla's package path)
    r = subprocess.run(
        [sys.executable, "-S", "-c", textwrap.dedent(_CHILD)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    unusable = [ln for ln in r.stdout.splitlines() if ln.startswith("UNIMPORTABLE ")]
    if r.returncode == 0 and unusable:
        pytest.skip(
            f"fla itself fails to import here, without kda-dhu: {unusable[0][len('UNIMPORTABLE ') :]}"
        )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("REPORT ")]
    assert r.returncode == 0 and lines, f"rc={r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    rep = json.loads(lines[0][len("REPORT ") :])
    detail = json.dumps(rep, indent=1)
    assert rep["fla"] == version and rep["fla_paths"] == [os.path.join(dest, "fla")], detail
    newer = version >= "0.6"
    # fla.backends (fla-core 0.6): registered with fla's registry; without it, the patch path
    assert rep["registered"] is newer and rep["is_registered"] is newer, detail
    if newer:
        assert rep["backend"] == ["KdaDhuBackend", 1] and rep["unregistered"] is True, detail
    has_newer = {"chunk_offsets", "use_graph"} <= set(rep["real_params"])
    assert has_newer is newer, detail
    assert rep["fallback_is_real"] is newer and rep["fallback_wraps_real"] is True, detail
    # the modules of fla's chunked delta-rule family hold kda-dhu's dispatcher, then fla's again
    for module in ("fla.ops.common.chunk_delta_h", "fla.ops.kda.chunk_bwd", "fla.ops.gated_delta_rule.chunk"):
        assert module in rep["patched_modules"], detail
    # the forward scan where fla's takes kda-dhu's parameters (fla-core 0.6's)
    if newer:
        for module in ("fla.ops.common.chunk_delta_h", "fla.ops.kda.chunk_fwd", "fla.ops.kda.chunk_bwd"):
            assert module in rep["patched_fwd_h"], detail
    assert rep["patched"] == len(rep["patched_modules"]) + len(rep["patched_fwd_h"]) and rep["all_ours"], (
        detail
    )
    assert rep["unpatched"] == rep["patched"] and rep["restored"] and rep["fwd_h_restored"], detail
    # each call reached fla's function with exactly the parameters that version takes
    n = len(rep["patched_modules"])
    assert rep["results"] == ["fla's result"] and rep["b2a"] == "fla's result", detail
    assert len(rep["calls"]) == n + 1, detail
    assert all(set(c) <= set(rep["real_params"]) for c in rep["calls"]), detail
    assert set(rep["calls"][0]) == set(_fla_compat.REQUIRED) | (
        {"chunk_offsets", "use_graph"} if newer else set()
    )
    if newer:
        assert rep["use_graph"] == "accepted", detail
    else:
        assert rep["use_graph"].startswith(
            "use_graph: fla-core 0.5.2's chunk_gated_delta_rule_bwd_dhu has no"
        ), detail


# ---------------------------------------------------------- the version check itself (CPU)


def _fla_052(
    q,
    k,
    w,
    do,
    dv,
    g=None,
    gk=None,
    h0=None,
    dht=None,
    scale=None,
    state_v_first=False,
    cu_seqlens=None,
    chunk_size=64,
    chunk_indices=None,
):
    return ("0.5.2", q, chunk_indices)


def _too_old(q, k, w, do, dv, g=None, gk=None, h0=None, dht=None, scale=None, cu_seqlens=None, chunk_size=64):
    return "old"


def test_a_current_stage4_is_called_as_it_is():
    def current(
        q,
        k,
        w,
        do,
        dv,
        g=None,
        gk=None,
        h0=None,
        dht=None,
        scale=None,
        state_v_first=False,
        cu_seqlens=None,
        chunk_size=64,
        chunk_indices=None,
        chunk_offsets=None,
        use_graph=False,
    ):
        return "0.6"

    assert _fla_compat.adapt(current) is current


def test_an_fla_05_stage4_gets_only_what_it_takes():
    fn = _fla_compat.adapt(_fla_052)
    assert fn is not _fla_052 and inspect.unwrap(fn) is _fla_052
    kw = {name: None for name in _fla_compat.REQUIRED} | {"q": "q", "chunk_indices": "ci"}
    assert fn(**kw, chunk_offsets="dropped: fla derives them", use_graph=False) == ("0.5.2", "q", "ci")
    assert fn(**kw) == ("0.5.2", "q", "ci")
    assert fn("q", *[None] * 12, "ci") == ("0.5.2", "q", "ci")
    with pytest.raises(ValueError, match="^use_graph: .* has no CUDA-graph buffers"):
        fn(**kw, use_graph=True)
    with pytest.raises(TypeError):
        fn("q", q="q again")


def test_an_older_stage4_is_refused_naming_what_it_lacks(monkeypatch):
    with pytest.raises(_fla_compat.FlaVersionError) as err:
        _fla_compat.adapt(_too_old)
    msg = str(err.value)
    assert "is too old for kda-dhu: its chunk_gated_delta_rule_bwd_dhu (fla.ops.common.chunk_delta_h) " in msg
    assert "takes no state_v_first, chunk_indices, which kda-dhu passes" in msg
    assert msg.endswith("tested with fla-core 0.5.2 and 0.6.0: pip install -U 'fla-core>=0.5.2'")
    assert issubclass(_fla_compat.FlaVersionError, ImportError)

    # patch() and register_backend() say so before touching anything
    from kda_dhu import _dispatch, fla_backend

    kpatch = sys.modules["kda_dhu.patch"]  # kda_dhu.patch is also the function

    def too_old_fla():
        return _fla_compat.adapt(_too_old)

    monkeypatch.setattr(_dispatch, "fla_function", too_old_fla)
    before = list(kpatch._records)
    with pytest.raises(_fla_compat.FlaVersionError, match="too old for kda-dhu"):
        kpatch.patch()
    assert kpatch._records == before
    backends, registry = fla_backend._registry()
    if backends is not None and not getattr(backends, "_DISPATCH_DISABLED", False):
        was = fla_backend.is_registered()
        if was:
            fla_backend.unregister_backend()
        try:
            with pytest.raises(_fla_compat.FlaVersionError, match="too old for kda-dhu"):
                fla_backend.register_backend()
            assert not fla_backend.is_registered()
        finally:
            monkeypatch.undo()
            if was:
                fla_backend.register_backend()
