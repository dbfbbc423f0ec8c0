"""Fault injection for the reliability tests: off unless MOEFERRY_FAULT_INJECT is set when the worker starts.

The variable lists `kind@token_id` pairs, e.g. `oom@4000,error@4001`. A step whose batch holds the
first chunk of a prompt (position 0) with that token id then raises inside the engine's forward
pass, the way a real failure of the step would (generated tokens never trigger it): `oom` raises
torch.OutOfMemoryError, `error` a RuntimeError. The variable is read once, at worker start; the
server never reads it otherwise.
"""
from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("moeferry.worker")

ENV = "MOEFERRY_FAULT_INJECT"
KINDS = {
    "oom": lambda t: torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate 2.00 GiB (injected at token {t})"),
    "error": lambda t: RuntimeError(f"injected failure at token {t}"),
}


def parse(spec: str) -> dict[int, str]:
    """'oom@4000,error@4001' -> {4000: 'oom', 4001: 'error'}."""
    out = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        kind, _, token = item.partition("@")
        if kind not in KINDS or not token.isdigit():
            raise ValueError(f"{ENV}: '{item}' is not kind@token_id with kind in {sorted(KINDS)}")
        out[int(token)] = kind
    return out


def install_from_env(scheduler) -> None:
    """Wrap scheduler.engine.forward when MOEFERRY_FAULT_INJECT is set (tests only)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    triggers = parse(spec)
    engine = scheduler.engine
    forward = engine.forward

    def faulty_forward(chunks, *args, **kwargs):
        for chunk in chunks:
            hit = next((t for t in chunk.tokens if t in triggers), None) if chunk.start == 0 else None
            if hit is not None:
                raise KINDS[triggers[hit]](hit)
        return forward(chunks, *args, **kwargs)

    engine.forward = faulty_forward
    log.warning("fault injection is on (%s=%s): steps holding these tokens fail", ENV, spec)
