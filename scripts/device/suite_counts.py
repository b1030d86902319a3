"""The GPU suite's counts, for scripts/device/gpu_session.sh (on the GPU machine).

    python3 scripts/device/suite_counts.py DIR COLLECTED CUT_SHORT SECONDS [VAR=VALUE...]
        DIR/pytest_*.log (one per shard) -> DIR/counts.json
    python3 scripts/device/suite_counts.py --gather RES OUT COMMIT
        RES/tests/counts.json, RES/image12/counts.json -> OUT (gpu-suite-latest.json), with
        the commit, the GPU and driver, the date, torch's and fla's versions

A shard's counts are its last line ("3 failed, 40 passed, 2 skipped in 12.3s"); a shard
cut short has none and is counted in ``shards_cut_short``. ``failed_tests`` lists the
FAILED / ERROR lines of pytest's short summary (DIR/failed.txt).
"""

from __future__ import annotations

import datetime
import glob
import importlib.metadata
import json
import os
import re
import subprocess
import sys

KINDS = ("passed", "failed", "skipped", "error", "xfailed", "xpassed")
# (stage, the image its run loads)
RUNS = (("tests", "default (the newest the driver loads)"), ("image12", "cuda12 (KDA_DHU_IMAGE=cuda12)"))


def shard_counts(log_text: str) -> dict:
    """The counts of a shard's last non-empty line; zeros for a shard cut short."""
    counts = dict.fromkeys(KINDS, 0)
    lines = [ln for ln in log_text.strip().splitlines() if ln.strip()]
    for num, kind in re.findall(
        r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", lines[-1] if lines else ""
    ):
        counts["error" if kind.startswith("error") else kind] += int(num)
    return counts


def count(d: str, collected: int, cut_short: int, seconds: int, env: list) -> dict:
    total = dict.fromkeys(KINDS, 0)
    for log in sorted(glob.glob(os.path.join(d, "pytest_*.log"))):
        with open(log, errors="replace") as f:
            for kind, n in shard_counts(f.read()).items():
                total[kind] += n
    failed = []
    path = os.path.join(d, "failed.txt")
    if os.path.exists(path):
        with open(path, errors="replace") as f:
            failed = [ln.strip() for ln in f if ln.strip()]
    return {
        "env": env,
        "collected": collected,
        **total,
        "shards_cut_short": cut_short,
        "seconds": seconds,
        "failed_tests": failed,
    }


def gather(res: str, commit: str) -> dict:
    runs = []
    for stage, image in RUNS:
        path = os.path.join(res, stage, "counts.json")
        if os.path.exists(path):
            with open(path) as f:
                runs.append({"stage": stage, "image": image, **json.load(f)})
    smi = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    versions = {}
    for key, dist in (("torch", "torch"), ("fla", "fla-core")):
        try:
            versions[key] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[key] = "not installed"
    return {
        "commit": commit,
        "gpu": smi[0].strip() if smi else "unknown",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%MZ"),
        **versions,
        "runs": runs,
    }


def main(argv: list) -> int:
    if argv[:1] == ["--gather"]:
        res, out, commit = argv[1:4]
        record = gather(res, commit)
        if not record["runs"]:
            return 0
        with open(out, "w") as f:
            json.dump(record, f, indent=1)
        return 0
    d, collected, cut_short, seconds, *env = argv
    with open(os.path.join(d, "counts.json"), "w") as f:
        json.dump(count(d, int(collected), int(cut_short), int(seconds), env), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
