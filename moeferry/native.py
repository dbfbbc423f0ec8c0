"""C sources of the package built once per machine and loaded with ctypes.

A source is compiled with the system C compiler (`$CC`, else `cc`) with the first of its flag
sets the compiler accepts, into the user cache directory (the temporary directory when that
cannot be written) under a name that hashes the source, the flag sets and the CPU (flags such as
`-march=native` depend on it). The write is atomic: a concurrent build never loads half a file.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from moeferry.paths import cache_dir


def build(source: Path, out: Path, flag_sets, libs=()) -> list[str]:
    """Compile `source` into `out` with the first flag set the compiler accepts; returns it.
    Raises OSError with the compiler's words when none works."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise OSError(f"no C compiler ({cc!r} not found; set CC)")
    errors = []
    for flags in flag_sets:
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            target = Path(tmp) / out.name
            r = subprocess.run([cc, *flags, "-shared", "-fPIC", "-o", str(target), str(source), *libs],
                               capture_output=True, text=True)
            if r.returncode == 0:
                os.replace(target, out)
                return flags
            errors.append(f"{' '.join(flags)}: {(r.stderr.strip().splitlines() or [r.returncode])[-1]}")
    raise OSError("the C compiler refused every flag set: " + "; ".join(errors))


def cpu_id() -> str:
    """What -march=native depends on: the machine and, on Linux, the CPU's feature flags."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = platform.processor()
    return platform.machine() + flags


def _found_or_built(source: Path, path: Path, flag_sets, libs) -> list[str]:
    """The flags of the library at `path`, built there first if missing (OSError when neither works)."""
    flags_file = path.with_suffix(".flags")
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        flags_file.write_text(" ".join(build(source, path, flag_sets, libs)))
    return flags_file.read_text().split() if flags_file.is_file() else []


def library(source: Path, flag_sets, libs, load):
    """`load(path, flags)` of `source` built (or found) in the user cache directory, else the
    temporary directory. OSError naming every place tried when none works (no compiler, or
    it refused every flag set: other places are not tried then)."""
    digest = hashlib.sha256(source.read_bytes() + repr(flag_sets).encode() + cpu_id().encode()).hexdigest()[:16]
    name = f"{source.stem}-{digest}.so"
    uid = os.getuid() if hasattr(os, "getuid") else 0
    places = (cache_dir() / "cpu_kernels", Path(tempfile.gettempdir()) / f"moeferry-cpu-kernels-{uid}")
    errors = []
    for place in places:
        try:
            flags = _found_or_built(source, place / name, flag_sets, libs)
            return load(place / name, flags)
        except OSError as e:
            errors.append(f"{place}: {e}")
            if "compiler" in str(e):
                break
    raise OSError("; ".join(errors))


def library_or_none(source: Path, flag_sets, load, log: logging.Logger, what: str):
    """`library(source, flag_sets, [], load)`, or None where it cannot be built: the log says
    once (info) that `what` runs without it, and why."""
    try:
        return library(source, flag_sets, [], load)
    except OSError as e:
        log.info("%s (%s could not be built: %s)", what, source.name, e)
        return None
