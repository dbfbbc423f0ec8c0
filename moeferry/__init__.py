"""moeferry: serve large Mixture-of-Experts language models from one consumer GPU.

The offline API (`LLM`, `GenerationOutput`, `SamplingParams`) is imported on first use, so that
`moeferry serve` starts its engine worker before this process has imported torch.
"""
from __future__ import annotations

import importlib

__all__ = ["LLM", "GenerationOutput", "SamplingParams"]
__version__ = "0.1.0"

_LAZY = {"LLM": "moeferry.llm", "GenerationOutput": "moeferry.llm", "SamplingParams": "moeferry.scheduler.sampling"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'moeferry' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
