"""A pytest plugin for running a peer's test suite (fla's tests/ops) with kda-dhu on: prints
kda-dhu's kernel launches (``kda_dhu._core.launch_count()``, both scans) per test module
and in all at the end, so that a run whose calls all went to fla's own kernels shows it.

    cd FLA_TESTS && KDA_DHU_FWD_H=on PYTHONPATH=SITE:REPO/scripts/device \\
        python3 -m pytest -p kda_launch_count ops/test_kda.py -k test_chunk
"""

from __future__ import annotations

_counts: dict[str, int] = {}


def _launches() -> int:
    from kda_dhu import _core

    return _core.launch_count()


def pytest_configure(config):
    import kda_dhu

    kda_dhu.register_backend()  # whatever KDA_DHU_NO_AUTOREGISTER says: this run is about it


_before = [0]


def pytest_runtest_setup(item):
    _before[0] = _launches()


def pytest_runtest_teardown(item):
    module = item.nodeid.split("::")[0]
    _counts[module] = _counts.get(module, 0) + _launches() - _before[0]


def pytest_terminal_summary(terminalreporter):
    total = 0
    for module, n in _counts.items():
        terminalreporter.write_line(f"kda_dhu launches: {module}: {n}")
        total += n
    terminalreporter.write_line(f"kda_dhu launches: total {total}")
