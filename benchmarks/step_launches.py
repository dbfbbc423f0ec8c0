"""Kernel launches in one decode step on the GPU path, counted on the CPU.

    python benchmarks/step_launches.py [--arch qwen3_5_moe] [--quant mixed_nvfp4 bf16 ...] [--batch 1]

A decode step at batch 1 is latency bound: each launch inside the CUDA graph costs a few
microseconds however little it moves, so the number of launches is a floor on the step's time
that the weight bytes do not show. This script runs the GPU path's code on the CPU (Triton
kernels under the interpreter, the fused MoE kernels forced on) for a tiny checkpoint of the
Qwen3.6 layer pattern at 4 and 8 layers, counts the Triton launches and the PyTorch ops that
would be CUDA kernels (views, allocations and no-op casts excluded) of one decode step, and
extrapolates linearly to the full depth (`--full-layers`, 40). Run it with `PYTHONPATH=<another
checkout>` for that tree's count (the baseline); `--ops` lists the ops per name.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from pathlib import Path

os.environ["MOEFERRY_TRITON_INTERPRET"] = "1"  # before triton is imported
os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton.runtime.interpreter as interpreter  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import moeferry.moe.offload as offload  # noqa: E402
import moeferry.moe.resident as resident  # noqa: E402
from moeferry.checkpoint.synthetic import make_model  # noqa: E402
from moeferry.llm import LLM  # noqa: E402
from moeferry.model.batch import SeqChunk  # noqa: E402

# aten ops that launch nothing on the GPU (views, metadata, allocation)
NO_KERNEL = {"view", "_unsafe_view", "as_strided", "reshape", "slice", "select", "unsqueeze", "squeeze", "t",
             "transpose", "permute", "expand", "empty", "empty_strided", "empty_like", "alias", "detach", "detach_",
             "split", "split_with_sizes", "unbind", "narrow", "_reshape_alias", "lift_fresh", "view_as", "chunk",
             "new_empty", "new_empty_strided", "result_type", "unflatten", "flatten", "movedim", "sym_size",
             "sym_stride", "size", "stride", "is_nonzero", "_local_scalar_dense", "item"}


class LaunchCounter(TorchDispatchMode):
    """Counts Triton launches (by kernel) and kernel-launching aten ops (by name) while active;
    the ops the interpreter runs inside a Triton kernel are not counted."""

    def __init__(self):
        super().__init__()
        self.triton, self.aten, self._inside = collections.Counter(), collections.Counter(), 0
        self._run = interpreter.GridExecutor.__call__

    def __enter__(self):
        run, counter = self._run, self

        def counted(grid_executor, *args, **kwargs):
            counter.triton[grid_executor.fn.__name__] += 1
            counter._inside += 1
            try:
                return run(grid_executor, *args, **kwargs)
            finally:
                counter._inside -= 1

        interpreter.GridExecutor.__call__ = counted
        return super().__enter__()

    def __exit__(self, *exc):
        interpreter.GridExecutor.__call__ = self._run
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        no_op_cast = name in ("to", "_to_copy") and args and out is args[0]
        if not self._inside and name not in NO_KERNEL and not no_op_cast:
            self.aten[name] += 1
        return out

    @property
    def total(self) -> int:
        return sum(self.triton.values()) + sum(self.aten.values())


def count_step(path: Path, batch: int) -> LaunchCounter:
    """Launches of the decode step after an 8-token prefill of each of `batch` sequences."""
    forced = resident.use_kernels
    resident.use_kernels = offload.use_kernels = lambda device: True
    try:
        engine = LLM(str(path), device="cpu", dtype="bfloat16").engine
        with engine.cache.sequences([9] * batch) as held:
            engine.forward([SeqChunk(list(range(1, 9)), 0, s.pages, s.state_slot) for s in held])
            with LaunchCounter() as counter:
                engine.forward([SeqChunk([5], 8, s.pages, s.state_slot) for s in held])
        return counter
    finally:
        resident.use_kernels = offload.use_kernels = forced


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="qwen3_5_moe")
    p.add_argument("--quant", nargs="+", default=["mixed_nvfp4", "bf16"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--full-layers", type=int, default=40)
    p.add_argument("--ops", action="store_true", help="list the launches of the 4-layer step per kernel / op")
    args = p.parse_args()
    print(f"| quant | launches, 4 layers | 8 layers | per layer | {args.full_layers} layers (extrapolated) |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for quant in args.quant:
            counts = {}
            for layers in (4, 8):
                path = make_model(Path(tmp) / f"{quant}-{layers}", args.arch, "tiny", num_layers=layers,
                                  quant=None if quant == "bf16" else quant)
                counts[layers] = count_step(path, args.batch)
            per_layer = (counts[8].total - counts[4].total) / 4
            full = counts[4].total + per_layer * (args.full_layers - 4)
            print(f"| {quant} | {counts[4].total} | {counts[8].total} | {per_layer:.2f} | {full:.0f} |")
            if args.ops:
                for name, n in (counts[4].triton + counts[4].aten).most_common():
                    print(f"|   {name} | {n} | | | |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
