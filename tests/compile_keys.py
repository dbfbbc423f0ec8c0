"""The Triton compile keys a run launches, recorded under the interpreter without running a kernel.

A compiled Triton kernel is reused only for launches with the same key: every `tl.constexpr`
value, the launch options (num_warps, ...) and each other argument's type and specialisation
(an int: 1, a multiple of 16 or neither, unless `do_not_specialize`; a tensor: its dtype and
whether its address is 16-byte aligned). A launch with a new key compiles on the GPU first (a
fraction of a second to seconds). `CompileKeys` patches the interpreter's launch to record that
key and skip the kernel (outputs stay uninitialised; only launch shapes matter), and makes the
launchers choose the configs they choose on a GPU (`interpreting()` false, 132 SMs). It needs a
process where TRITON_INTERPRET=1 was set before triton was imported (interpreter_workers.py).
"""
from __future__ import annotations

import importlib
import inspect

import torch

GPU_CONFIG_MODULES = ("moe_gemm", "quant_linear", "gdn")  # modules that pick tiles by interpreting()


def _int_key(name: str, value: int, specialize: bool) -> tuple:
    width = "i32" if -2**31 <= value < 2**31 else "i64"
    if not specialize:
        return name, width
    return name, width, "1" if value == 1 else "D" if value % 16 == 0 else ""


def launch_key(fn, args: tuple, kwargs: dict) -> tuple:
    """(kernel name, per-argument key, launch options) of one launch of interpreted kernel `fn`."""
    sig = inspect.signature(fn.fn)
    names = list(sig.parameters)
    fixed = set(fn.kwargs.get("do_not_specialize") or ())
    bound = dict(zip(names, args), **kwargs)
    parts = []
    for i, name in enumerate(names):
        param = sig.parameters[name]
        value = bound.get(name, param.default)
        if "constexpr" in str(param.annotation):
            parts.append((name, "constexpr", value))
        elif isinstance(value, bool):
            parts.append((name, "i1"))
        elif isinstance(value, int):
            parts.append(_int_key(name, value, name not in fixed and i not in fixed))
        elif isinstance(value, float):
            parts.append((name, "fp32"))
        elif isinstance(value, torch.Tensor):
            parts.append((name, str(value.dtype), value.data_ptr() % 16 == 0))
        else:
            parts.append((name, repr(value)))
    options = tuple(sorted((k, v) for k, v in kwargs.items() if k not in names))
    return fn.fn.__name__, tuple(parts), options


class CompileKeys:
    """with CompileKeys() as keys: ... ; keys.seen: every key launched, in first-launch order."""

    def __enter__(self) -> "CompileKeys":
        import triton.runtime.interpreter as interpreter

        self.seen: dict[tuple, None] = {}  # an ordered set
        self._undo = []
        self._patch(interpreter.InterpretedFunction, "run",
                    lambda fn, *args, grid, warmup, **kw: self.seen.setdefault(launch_key(fn, args, kw)))
        for name in GPU_CONFIG_MODULES:
            self._patch(importlib.import_module(f"moeferry.ops.triton.{name}"), "interpreting", lambda: False)
        self._patch(importlib.import_module("moeferry.ops.triton.quant_linear"), "num_sms", lambda device: 132)  # H200
        return self

    def _patch(self, owner, name: str, value) -> None:
        self._undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def __exit__(self, *exc) -> None:
        for owner, name, old in reversed(self._undo):
            setattr(owner, name, old)

    def new_since(self, before: set) -> list[str]:
        """Keys launched since `before` (a set of keys), each with how it differs from the
        closest earlier key of the same kernel."""
        out = []
        for key in self.seen:
            if key in before:
                continue
            same = [k for k in before if k[0] == key[0]]
            if not same:
                out.append(f"{key[0]}: never launched before")
                continue
            near = min(same, key=lambda k: sum(a != b for a, b in zip(k[1], key[1])) + (k[2] != key[2]))
            diff = [(a, b) for a, b in zip(near[1], key[1]) if a != b]
            out.append(f"{key[0]}: {diff or ''}{'' if near[2] == key[2] else (near[2], key[2])}")
        return out
