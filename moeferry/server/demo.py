"""The built-in demo model: a tiny random-weight Qwen3.5-MoE checkpoint made on first use.

It lives in the user cache directory ($XDG_CACHE_HOME/moeferry or ~/.cache/moeferry), under a
name that carries the generator's settings, so a change of them makes a fresh one. It is built
in a temporary directory and renamed into place, so an interrupted build is never served.
"""
from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

from moeferry.paths import cache_dir

log = logging.getLogger("moeferry.demo")

DEMO = dict(arch="qwen3_5_moe", size="tiny", seed=0, dtype="float32")
DEMO_DIR_NAME = "demo-{arch}-{size}-seed{seed}-{dtype}-v1".format(**DEMO)


def ensure_demo_model() -> str:
    """Path of the demo checkpoint, made now if it is not there yet."""
    target = cache_dir() / DEMO_DIR_NAME
    if (target / "config.json").is_file():
        return str(target)
    from moeferry.checkpoint.synthetic import make_model

    log.info("making the random-weight demo model in %s (first use only)", target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=target.parent))
    try:
        make_model(tmp, **DEMO)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)
