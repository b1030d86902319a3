"""README.md for a user: its set-up commands are the ones CI and users run, and its "Use"
snippet runs as it stands (on a GPU; on the CPU, it parses and its make_inputs call fits
kda_dhu.testing.make_inputs)."""

from __future__ import annotations

import ast
import inspect
import os
import re

import pytest
from helpers import REPO_ROOT

README = os.path.join(REPO_ROOT, "README.md")


def _readme() -> str:
    with open(README) as f:
        return f.read()


def _use_snippet() -> str:
    """The first python block of README's "## Use" section."""
    section = _readme().split("\n## Use\n", 1)[1].split("\n## ", 1)[0]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m, "no python block in README's Use section"
    return m.group(1)


def test_set_up_is_two_commands():
    text = _readme()
    assert 'pip install ".[test]" && python -m kda_dhu' in text
    assert "\npython -m pytest tests -q " in text  # CI's test command (.ci/run)


def test_use_snippet_parses_and_makes_its_inputs_with_testing_make_inputs():
    tree = ast.parse(_use_snippet())
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "make_inputs"
    ]
    assert len(calls) == 1, "the snippet draws its inputs with one make_inputs call"
    imports = {(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert ("kda_dhu.testing", "make_inputs") in imports
    from kda_dhu.testing import make_inputs

    call = calls[0]
    args = [ast.literal_eval(a) for a in call.args]
    kwargs = {k.arg: k.value for k in call.keywords}
    inspect.signature(make_inputs).bind(*args, **kwargs)  # raises TypeError if it does not fit
    assert ast.literal_eval(kwargs["device"]) == "cuda"


@pytest.mark.gpu
def test_use_snippet_runs_as_it_stands(no_switches, capsys):
    """The snippet, unchanged, on this GPU: the kernel runs on an sm_90 GPU, and its result
    matches fla's to bf16 rounding."""
    pytest.importorskip("fla")
    import kda_dhu
    import torch
    from kda_dhu.reference import rel_err

    ns: dict = {}
    exec(compile(_use_snippet(), "README.md (Use)", "exec"), ns)
    assert not kda_dhu.is_patched()
    ok, reason = kda_dhu.plan_call(**ns["a"])
    if torch.cuda.get_device_capability() == (9, 0):
        assert ok and reason == "kernel-sm90a", reason
    for out, ref in zip((ns["dh"], ns["dh0"], ns["dv2"]), ns["ref"]):
        assert rel_err(out, ref) < 2e-2
    assert "kernel-sm90a" in capsys.readouterr().out or not ok
