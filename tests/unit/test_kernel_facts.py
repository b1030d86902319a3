"""The kernels' numbers have one owner, cuda/dhu_layout.h: the Rust core reads them from
it at build time (src/facts.rs) and Python asks the core (``_core.BT``,
``_core.kernel_facts()``). CPU only."""

from __future__ import annotations

import inspect
import pathlib
import re

import pytest
from helpers import REPO_ROOT
from kda_dhu import _core

ROOT = pathlib.Path(REPO_ROOT)
# The package under test (the source tree's, or an installed wheel's).
PACKAGE = pathlib.Path(_core.__file__).resolve().parent


def test_the_core_exports_the_header_s_numbers():
    facts = _core.kernel_facts()
    header = (ROOT / "cuda" / "dhu_layout.h").read_text()
    for name in ("BT", "BV", "WG_THREADS"):
        m = re.search(rf"constexpr int {name} = (\d+);", header)
        assert m is not None, f"{name} not in cuda/dhu_layout.h"
        assert facts[name] == int(m.group(1)), name
    assert _core.BT == facts["BT"] and _core.BV == facts["BV"]


def test_every_kernel_shape_fits():
    facts = _core.kernel_facts()
    assert set(facts) >= {"sm90", "sm90_fwd", "sm100"} and "sm90_regstate" not in facts
    for family in ("sm90", "sm90_fwd", "sm100"):
        rows = facts[family]
        assert rows, family
        for r in rows:
            assert 0 < r["smem_bytes"] <= facts["SMEM_OPTIN_MAX_SM90"], (family, r)
            assert r["threads"] % 32 == 0 and r["stages"] >= 2, (family, r)
    key = lambda r: (r["k"], r["nwg"])  # noqa: E731
    assert sorted(key(r) for r in facts["sm90"]) == [(64, 1), (64, 2), (128, 1), (128, 2)]
    assert sorted(map(key, facts["sm90_fwd"])) == sorted(map(key, facts["sm90"]))
    assert {r["nwg"]: r["threads"] for r in facts["sm90"]} == {1: 160, 2: 384}


def test_the_chunk_length_is_fla_s_default_chunk_size():
    fla_function = pytest.importorskip("kda_dhu._fla").fla_function
    try:
        fn = fla_function()
    except ImportError as err:
        pytest.skip(f"fla is not importable here: {err}")
    assert inspect.signature(fn).parameters["chunk_size"].default == _core.BT


def test_no_python_module_writes_the_chunk_length_itself():
    """A constant BT = <number> in the package would be a second owner."""
    hits = []
    paths = sorted(PACKAGE.rglob("*.py"))
    assert any(p.name == "_dispatch.py" for p in paths), PACKAGE
    for path in paths:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.match(r"\s*BT\s*=\s*\d", line):
                hits.append(f"{path.name}:{i}: {line.strip()}")
    assert not hits, "\n".join(hits)
