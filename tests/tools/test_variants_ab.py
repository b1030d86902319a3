"""benches/variants.py without a GPU: the variants' settings (what the A/B stage of
scripts/device/gpu_session.sh passes as AB_VARIANTS), --plan, and the table."""

from __future__ import annotations

import importlib.util
import os

import pytest
from helpers import REPO_ROOT

SCRIPT = os.path.join(REPO_ROOT, "benches", "variants.py")


@pytest.fixture(scope="module")
def ab():
    spec = importlib.util.spec_from_file_location("variants", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_bare_value_sets_the_switch_and_default_unsets_it(ab):
    v = ab.parse_variants("default regstate", "KDA_DHU_SM90_VARIANT")
    assert v == [
        ("default", {"KDA_DHU_SM90_VARIANT": None}),
        ("regstate", {"KDA_DHU_SM90_VARIANT": "regstate"}),
    ]
    # commas or spaces; explicit settings joined by '+'; every variant names every switch
    v = ab.parse_variants("v4, KDA_DHU_SM90_NWG=2+KDA_DHU_SM90_VARIANT=regstate", "KDA_DHU_SM90_VARIANT")
    assert v == [
        ("v4", {"KDA_DHU_SM90_NWG": None, "KDA_DHU_SM90_VARIANT": "v4"}),
        (
            "KDA_DHU_SM90_NWG=2+KDA_DHU_SM90_VARIANT=regstate",
            {"KDA_DHU_SM90_NWG": "2", "KDA_DHU_SM90_VARIANT": "regstate"},
        ),
    ]


@pytest.mark.parametrize(
    "text,switch,match",
    [
        ("", "KDA_DHU_SM90_VARIANT", "at least one"),
        ("a b a", "KDA_DHU_SM90_VARIANT", "given twice"),
        ("KDA_DHU_SM90_NWG=", "KDA_DHU_SM90_VARIANT", "not NAME=VALUE"),
        ("lower=1", "KDA_DHU_SM90_VARIANT", "not NAME=VALUE"),
        ("x", "not a name", "--switch"),
    ],
)
def test_bad_variants_are_named(ab, text, switch, match):
    with pytest.raises(ValueError, match=match):
        ab.parse_variants(text, switch)


def test_apply_sets_and_unsets(ab, monkeypatch):
    monkeypatch.setenv("KDA_DHU_SM90_VARIANT", "regstate")
    monkeypatch.delenv("KDA_DHU_SM90_NWG", raising=False)
    ab.apply({"KDA_DHU_SM90_VARIANT": None, "KDA_DHU_SM90_NWG": "2"})
    assert "KDA_DHU_SM90_VARIANT" not in os.environ and os.environ["KDA_DHU_SM90_NWG"] == "2"


def test_plan_lists_variants_and_shapes(ab, capsys):
    assert ab.main(["--variants", "default,2", "--shapes", "b8_t4096_h32", "--plan"]) == 0
    out = capsys.readouterr().out
    # the default switch: the warpgroups per CTA
    assert "variant default: KDA_DHU_SM90_NWG=(unset)" in out
    assert "variant 2: KDA_DHU_SM90_NWG=2" in out
    assert "shapes: b8_t4096_h32" in out
    with pytest.raises(SystemExit):
        ab.main(["--variants", "a", "--shapes", "no_such_shape", "--plan"])


def test_table(ab):
    record = {
        "gpu": "G", "torch": "t", "fla_version": "f", "commit": "c", "date": "d",
        "settings": {"rounds": 5, "reps": 10},
        "variants": [{"label": "default"}, {"label": "regstate"}],
        "rows": [
            {"shape": "b8", "fla_ms": None, "ms": {"default": 0.5, "regstate": 0.4},
             "err_vs_fla": {"default": 1e-3, "regstate": 2e-3}},
            {"shape": "b4", "error": "RuntimeError: boom"},
        ],
    }  # fmt: skip
    table = ab.markdown_table(record)
    assert "| b8 | - | 0.500 | 1.0e-03 | 0.400 | 2.0e-03 | regstate |" in table
    assert "| b4 | raised: RuntimeError: boom |" in table
