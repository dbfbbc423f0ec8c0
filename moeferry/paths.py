"""Where moeferry keeps what it makes for later runs (the demo model, built CPU kernels)."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/moeferry, or ~/.cache/moeferry."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "moeferry"
