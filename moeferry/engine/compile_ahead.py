"""Compile the boot's Triton kernels in parallel before the probe and the warm-up launch them
(`--compile-workers N`, default 8; 0 turns it off).

A kernel compiles at its first launch, one after another: on a machine's first boot that is 69
kernels and ~28 s of the memory probe and the warm-up (H100 host, full-depth `mixed_nvfp4`, offload).
Triton releases the GIL while it compiles (a 2-core box: four sm_90 compiles 0.89 s in turn, 0.50 s
on four threads), so they can run side by side, once they are known. They are found by walking the
probe's and the warm-up's steps once, through one layer of each kernel signature
(`representative_layers`: the other layers launch the same kernels; the walk through all 40
layers took 9 s of the H100 host's boot, and its Python per op grows with the layers walked),
with nothing computed (`ShapeOnly`: every torch op on the
device gets zero-filled outputs of the shapes it would give, views stay views, writes are
dropped, so no value can steer a kernel or an index out of range; ops on small integer tensors
alone (lengths, positions, page rows) compute, so a size read from them is the real one) and
every Triton launch turned into a compile request (`JITFunction.run(..., warmup=True)` under
Triton's `AsyncCompileMode` on a thread pool). Leaving the mode waits for the compiles and files each kernel in its JIT's cache, so
the real steps launch them at once. Best effort: a kernel whose specialization depends on values
(zeros here) compiles again at its real launch; whatever the walk raises ends it (logged), and what
it did not reach compiles when first launched, as without it. The walk writes nothing: the
temporary pools it uses are dropped, and the expert cache it may touch is rebuilt after the probe.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

from moeferry.ops.triton.specialization import kernel_signature

aten = torch.ops.aten
# allocations: run, then zeroed (their bytes are whatever the allocator held; a value read from
# them must not steer the walk)
_ALLOCATIONS = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
                aten.new_empty.default, aten.new_empty_strided.default}
# ops whose output size depends on values (no meta function): run on the walk's zeros (or real
# inputs) instead; none of them can fault on the device (no index they could take out of range)
_BY_VALUE = {aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default, aten.nonzero.default,
             aten.masked_select.default, aten.where.default, aten.index.Tensor, aten.repeat_interleave.Tensor,
             aten.bincount.default}
_SCALAR_READS = {aten._local_scalar_dense.default, aten.item.default}
_METADATA_NUMEL = 1 << 16  # integer tensors up to this size are metadata (positions, lengths, page rows)


class WalkAborted(RuntimeError):
    """An op the walk cannot run without computing (no shape function)."""


class ShapeOnly(TorchDispatchMode):
    """Torch ops touching `device_type` tensors compute nothing: outputs are zero-filled tensors
    of the shapes, dtypes and strides the op's meta function gives, on the device its inputs
    were on (or its `device` argument); views are taken (no data moves); writes in place or into
    `out=` are dropped; a scalar read reads what it is given; ops whose output size depends on
    values (`_BY_VALUE`) and ops reading only small integer tensors (`_metadata`) run on what they
    are given. Ops on host tensors only run as they are."""

    def __init__(self, device_type: str = "cuda"):
        super().__init__()
        self.device_type = device_type

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ALLOCATIONS:
            return func(*args, **kwargs).zero_()
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        device = self._target(tensors, kwargs)
        if device is None or func.is_view or func in _SCALAR_READS:
            return func(*args, **kwargs)
        written = [(i, a) for i, a in enumerate(func._schema.arguments) if a.alias_info and a.alias_info.is_write]
        if written:
            return _written(func, args, kwargs, written)
        if func in _BY_VALUE or _metadata(tensors):
            return func(*args, **kwargs)
        try:
            meta_kwargs = tree_map(_meta, kwargs) | ({"device": torch.device("meta")} if "device" in kwargs else {})
            shapes = func(*tree_map(_meta, args), **meta_kwargs)
        except Exception as e:  # no meta function (e.g. an output whose size depends on values)
            raise WalkAborted(f"{func} has no shape function: {type(e).__name__}: {e}") from e
        return tree_map(lambda m: _zeros_like_meta(m, device), shapes)

    def _target(self, tensors: list[torch.Tensor], kwargs: dict) -> torch.device | None:
        """Where the outputs of an op reading `device_type` tensors go (None: it reads none, so it
        runs: host work, an allocation, a copy of host data to the device)."""
        on = [t.device for t in tensors if t.device.type == self.device_type]
        if not on:
            return None
        wanted = kwargs.get("device")
        return torch.device(wanted) if wanted is not None else on[0]


def _metadata(tensors: list[torch.Tensor]) -> bool:
    """Small integer tensors only: sequence lengths, positions, page rows, expert ids, computed for
    real so that a size a kernel is specialized for (a longest chunk read with `.item()`) is the
    real one; reading nothing but such tensors, the op cannot be the work the walk skips."""
    return all(not (t.is_floating_point() or t.is_complex()) and t.numel() <= _METADATA_NUMEL for t in tensors)


def _written(func, args, kwargs, written):
    """What an op that writes its arguments returns, without writing them."""
    if not func._schema.returns:
        return None
    values = [args[i] if i < len(args) else kwargs[a.name] for i, a in written]
    return values[0] if len(func._schema.returns) == 1 else tuple(values)


def _meta(x):
    return x.to("meta") if isinstance(x, torch.Tensor) else x


def _zeros_like_meta(m, device: torch.device):
    if not isinstance(m, torch.Tensor):
        return m
    return torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=device).zero_()


def representative_layers(layers: list) -> list:
    """The first layer of each kernel signature, in model order (the first layer among them: it
    alone normalizes without a previous layer's output). A 40-layer Qwen3.5 model has two (a
    linear-attention layer and a full-attention one), three with an offload backend (its last
    MoE layer prefetches for none)."""
    kinds: dict = {}
    for layer in layers:
        kinds.setdefault(kernel_signature(layer), layer)
    return list(kinds.values())


@contextmanager
def walking_layers(model, layers: list):
    """`model` steps through `layers` only (its own list restored after)."""
    every = model.layers
    model.layers = layers
    try:
        yield
    finally:
        model.layers = every


@contextmanager
def launches_compile():
    """Every Triton launch compiles its kernel (or finds it compiled) and launches nothing (under
    the interpreter, where nothing compiles, launches are skipped)."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    run, interpreted = JITFunction.run, InterpretedFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    JITFunction.run = compile_only
    InterpretedFunction.run = lambda self, *args, **kwargs: None
    try:
        yield
    finally:
        JITFunction.run, InterpretedFunction.run = run, interpreted


def compile_ahead(walk: Callable[[], None], workers: int, device_type: str = "cuda") -> str:
    """Run `walk` (the steps to come) under `ShapeOnly` with Triton launches as compile requests
    on `workers` threads; returns what happened, for the boot log. Never raises for the walk."""
    from triton.runtime._async_compile import AsyncCompileMode
    t0 = time.perf_counter()
    ended = "walked every step"
    with ThreadPoolExecutor(workers, thread_name_prefix="compile") as pool:
        mode = AsyncCompileMode(pool, ignore_errors=True)  # a kernel that fails here fails at its launch too
        with mode:
            try:
                with launches_compile(), ShapeOnly(device_type):
                    walk()
            except Exception as e:  # noqa: BLE001 - best effort: the real steps compile what is left
                ended = f"walk ended early ({type(e).__name__}: {str(e)[:200]})"
            requested = len(mode.future_kernels)
    return (f"compiled ahead on {workers} threads: {requested} kernels requested in "
            f"{time.perf_counter() - t0:.1f} s; {ended}")
