"""A site-packages folder that holds exactly some installed distributions and everything
they require, as symlinks to this Python's installed files: nothing is downloaded or
copied, and nothing else of this environment is visible through it.

    python scripts/build/site_view.py DEST torch fla-core pytest numpy

scripts/build/build_wheel.sh gives its test venv the torch, fla-core, pytest and numpy this
environment already has (a few GB that would otherwise be downloaded again) through a
.pth file naming DEST, without the compilers (nvcc, NVRTC 12, Rust) or the kda-dhu that
this environment may also hold. Requirement markers are evaluated for this Python, with
the extras each requirement asks for. Prints the distributions linked, one per line.
Exits 1 naming any required distribution that is not installed.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def closure(names: list[str]) -> tuple[dict[str, md.Distribution], list[str]]:
    """The installed distributions `names` need, transitively (by canonical name), and
    the names of required ones that are not installed."""
    found: dict[str, md.Distribution] = {}
    extras_seen: dict[str, set[str]] = {}
    missing: list[str] = []
    todo: list[tuple[str, frozenset[str]]] = [(n, frozenset()) for n in names]
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if key in extras_seen and extras <= extras_seen[key]:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            missing.append(name)
            continue
        extras_seen.setdefault(key, set()).update(extras)
        found[key] = dist
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in ("", *extras)):
                continue
            todo.append((req.name, frozenset(req.extras)))
    return found, sorted(set(missing))


def link(dist: md.Distribution, dest: str) -> int:
    """Symlinks every file of `dist` that lies under its site-packages into `dest`, at the
    same relative path. Returns the number of files linked."""
    count = 0
    for f in dist.files or []:
        rel = os.path.normpath(str(f))
        if rel.startswith("..") or os.path.isabs(rel):  # scripts and data outside site-packages
            continue
        src = os.path.realpath(dist.locate_file(f))
        if not os.path.exists(src):
            continue
        target = os.path.join(dest, rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not os.path.lexists(target):
            os.symlink(src, target)
            count += 1
    return count


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    dest, names = argv[1], argv[2:]
    found, missing = closure(names)
    if missing:
        print(f"not installed in {sys.prefix}: {', '.join(missing)}", file=sys.stderr)
        return 1
    os.makedirs(dest, exist_ok=True)
    for key in sorted(found):
        dist = found[key]
        n = link(dist, dest)
        print(f"{dist.metadata['Name']}=={dist.version} ({n} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
