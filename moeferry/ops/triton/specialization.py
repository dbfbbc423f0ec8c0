"""What a Triton kernel launch specializes on, read off a model part (the boot's walk compiles
for one layer of each signature: `engine.compile_ahead.representative_layers`).

Triton compiles a kernel once per key: its constexpr values, launch options, and per argument
its type, an int's being 1 or a multiple of 16, a tensor's dtype and 16-byte alignment. Two
parts with the same classes, settings and tensor shapes, strides, dtypes and alignments launch
the same keys for the same inputs.
"""
from __future__ import annotations

import torch

# attributes that never reach a launch as a value: which layer a part is (its pools' rows are
# tensors of their own; a part reading a view of a shared table gives its own signature)
_NOT_LAUNCHED = frozenset({"layer", "kv_index", "state_index"})


def kernel_signature(part, seen: set | None = None):
    """What the Triton launches of a model part can depend on, as a hashable value: its classes,
    its settings, and its tensors' shapes, strides, dtypes and 16-byte alignment (Triton
    specializes on it); not which layer it is (`_NOT_LAUNCHED`). A part that holds more than
    its own weights (an offload executor: the backend, the next layer) gives its own
    (`kernel_signature()`)."""
    seen = set() if seen is None else seen
    if isinstance(part, torch.Tensor):
        return "tensor", tuple(part.shape), part.stride(), part.dtype, part.device.type, part.data_ptr() % 16 == 0
    if part is None or isinstance(part, (bool, int, float, str, torch.dtype, torch.device)):
        return part
    if isinstance(part, (list, tuple)):
        return tuple(kernel_signature(p, seen) for p in part)
    if isinstance(part, dict):
        return tuple((repr(k), kernel_signature(v, seen)) for k, v in part.items())
    if id(part) in seen:  # (a part shared within the layer: the same place in every layer's walk)
        return "seen", type(part).__name__
    seen.add(id(part))
    own = getattr(part, "kernel_signature", None)
    if callable(own):
        return own()
    if not (type(part).__module__.startswith("moeferry.") and hasattr(part, "__dict__")):
        return type(part).__name__
    return (type(part).__name__,) + tuple((k, kernel_signature(v, seen)) for k, v in sorted(vars(part).items())
                                          if k not in _NOT_LAUNCHED)
