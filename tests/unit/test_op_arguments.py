"""Every entry point with fla's signature says the op's arguments as the one description
does (``_core.op_arguments()``, src/validate.rs's ARGUMENTS): names, order and defaults,
for the Python functions, the custom op's wrapper, fla's registry binding, the compiled
functions' signatures and the ``_core.pyi`` stubs; and that description is fla's own
signature where fla is importable. CPU only."""

from __future__ import annotations

import ast
import inspect
import pathlib

import pytest
from kda_dhu import _core

# The package under test (the source tree's, or an installed wheel's): its stub beside it.
PACKAGE = pathlib.Path(_core.__file__).resolve().parent
ARGS = [tuple(a) for a in _core.op_arguments()]
NAMES = [name for name, _ in ARGS]
# The arguments the Rust core reads (use_graph is carried out in Python: fla's buffers).
CORE_NAMES = NAMES[: NAMES.index("use_graph")]


def _described(fn) -> list[tuple[str, str | None]]:
    """(name, repr of the default or None) of ``fn``'s parameters."""
    out = []
    for p in inspect.signature(fn).parameters.values():
        out.append((p.name, None if p.default is inspect.Parameter.empty else repr(p.default)))
    return out


def test_the_description_is_fla_s_signature():
    from kda_dhu._fla import fla_function

    try:
        fn = fla_function()
    except ImportError as err:
        pytest.skip(f"fla is not importable here: {err}")
    assert _described(inspect.unwrap(fn)) == ARGS


def test_the_python_entry_points_say_the_description():
    import kda_dhu
    from kda_dhu import _dispatch, fla_backend

    for fn in (kda_dhu.chunk_gated_delta_rule_bwd_dhu, kda_dhu.plan_call, _dispatch.verify):
        assert _described(fn) == ARGS, fn.__qualname__
    # fla's registry binding: the description, then any argument of a newer fla (**newer).
    assert _described(fla_backend._bound) == [*ARGS, ("newer", None)]
    assert list(fla_backend._FLA_PARAMS) == NAMES


def test_the_custom_op_wrapper_says_the_description_but_use_graph():
    ops = pytest.importorskip("kda_dhu.ops")
    assert _described(ops.chunk_gated_delta_rule_bwd_dhu_op) == ARGS[: len(CORE_NAMES)]


def test_fla_compat_passes_every_argument():
    from kda_dhu import _fla_compat

    assert [*_fla_compat.REQUIRED, *_fla_compat.NEWER] == NAMES


def _text_names(fn) -> list[str]:
    sig = fn.__text_signature__.strip("()")
    return [p.split("=")[0].strip() for p in sig.split(",") if p.strip() not in ("*", "/")]


@pytest.mark.parametrize(
    "name, before, after",
    [
        ("run", ["rule"], ["use_graph"]),
        ("decide", ["rule"], ["nt", "switches"]),
        ("validate", [], []),
        ("launch", [], ["dh", "dh0", "dv2", "stream"]),
        ("cpu_bwd_dhu", ["mode"], ["poison", "check_only"]),
    ],
)
def test_the_compiled_functions_and_their_stubs_say_the_description(name, before, after):
    want = [*before, *CORE_NAMES, *after]
    assert _text_names(getattr(_core, name)) == want, f"_core.{name}"
    tree = ast.parse((PACKAGE / "_core.pyi").read_text())
    stubs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    a = stubs[name].args
    assert [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)] == want, f"_core.pyi: {name}"


# ---- the forward scan (fla's chunk_gated_delta_rule_fwd_h): its own description
FWD_ARGS = [tuple(a) for a in _core.fwd_h_arguments()]


def test_the_forward_description_is_fla_s_signature():
    import inspect as _inspect

    try:
        from kda_dhu._forward import fla_fwd_h_function

        fn = fla_fwd_h_function()
    except ImportError as err:
        pytest.skip(f"fla is not importable here: {err}")
    assert _described(_inspect.unwrap(fn)) == FWD_ARGS


def test_the_forward_entry_points_say_the_forward_description():
    from kda_dhu import _forward

    assert _described(_forward.chunk_gated_delta_rule_fwd_h) == FWD_ARGS
    names = [n for n, _ in FWD_ARGS]
    assert _text_names(_core.fwd_h_run) == names
    tree = ast.parse((PACKAGE / "_core.pyi").read_text())
    stub = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}["fwd_h_run"]
    assert [x.arg for x in (*stub.args.posonlyargs, *stub.args.args, *stub.args.kwonlyargs)] == names
    # and the probe, a stage-4 call carrying a forward call, says stage 4's
    assert _text_names(_core._fwd_h_probe) == [*CORE_NAMES, "dh", "dh0", "dv2", "stream"]
