"""`--moe-cpu-layers`: which MoE layers keep no device slots and run their experts on the CPU.

Spelled as FreeToken 0.1.2 spells it: an explicit list of MoE-layer ids ("3,7,11"; indices into
the MoE layers, from 0), a count ("8": that many layers spread evenly over the depth) or a
fraction of the MoE layers ("0.5"). `check` validates what it can before the checkpoint is read;
`resolve` picks the layers once their number is known.
"""
from __future__ import annotations


def _parts(spec: str) -> tuple[str, object]:
    """("ids", [int]), ("fraction", float) or ("count", int); ValueError on anything else."""
    s = spec.strip()
    try:
        if "," in s:
            return "ids", [int(x) for x in s.split(",") if x.strip()]
        if "." in s:
            return "fraction", float(s)
        return "count", int(s)
    except ValueError:
        raise ValueError(f"--moe-cpu-layers {spec!r}: give MoE-layer ids ('3,7,11'), a count ('8') "
                         "or a fraction ('0.5')") from None


def check(spec: int | str | None) -> str | None:
    """The spec as a string (None or "" when no layer is chosen); ValueError when malformed."""
    if spec is None or str(spec).strip() in ("", "0"):
        return None
    spec = str(spec)
    kind, value = _parts(spec)
    if kind == "ids" and any(i < 0 for i in value):
        raise ValueError(f"--moe-cpu-layers {spec!r}: layer ids start at 0")
    if kind == "fraction" and not 0.0 <= value <= 1.0:
        raise ValueError(f"--moe-cpu-layers {spec!r}: a fraction must be in [0, 1]")
    if kind == "count" and value < 0:
        raise ValueError(f"--moe-cpu-layers {spec!r}: a count must be at least 0")
    return spec


def resolve(spec: str | None, num_moe_layers: int) -> list[int]:
    """The chosen MoE-layer indices (sorted); ValueError when they do not fit the model."""
    if not spec:
        return []
    kind, value = _parts(spec)
    if kind == "ids":
        bad = [i for i in value if not 0 <= i < num_moe_layers]
        if bad:
            raise ValueError(f"--moe-cpu-layers: ids {bad} out of range: the model has {num_moe_layers} MoE layers "
                             f"(0-{num_moe_layers - 1})")
        return sorted(set(value))
    count = round(value * num_moe_layers) if kind == "fraction" else value
    if count > num_moe_layers:
        raise ValueError(f"--moe-cpu-layers {spec}: the model has {num_moe_layers} MoE layers")
    return sorted({i * num_moe_layers // count for i in range(count)})
