"""Which MoE kernel path serves a few tokens, chosen at warm-up by timing both on the device.

The grouped-GEMM path (routing prep, gate_up, down, pair reduction: 4-5 launches) and the
decode path (`moe_decode.py`: two GEMV launches, no prep) compute the same thing; which is
faster at T tokens depends on the slot form, the GPU and T. Before the decode graphs are
captured, one buffer of each slot layout runs both at T = 1, 2, 4, 8, 16 (up to the largest
decode batch), on experts its table holds, each timed as the replay of a CUDA graph of a few
calls (device time, as the decode graphs see it) and their outputs compared. Every buffer of
that layout then takes the decode path up to the largest T at which it won at every size
measured (`SlotBuffer.decode_tokens`); a decode output outside bf16 tolerance of the grouped
one, or an error, keeps the grouped path.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, NamedTuple

import torch

from moeferry.moe.slots import SlotBuffer
from moeferry.ops.triton.moe_gemm import choose_config, decode_config

log = logging.getLogger("moeferry.moe")

SIZES = (1, 2, 4, 8, 16)
AGREE = 2e-2  # relative difference of the two paths' outputs (bf16 rounding of each)


class DecodeTarget(NamedTuple):
    """A slot buffer the decode path could serve: the table row it reads (an experts' layer)
    and its shared-expert slot (-1: none)."""
    buffer: SlotBuffer
    table_row: torch.Tensor
    shared_slot: int = -1


class PathTiming(NamedTuple):
    tokens: int
    grouped_s: float
    decode_s: float
    rel_diff: float


def graph_seconds(fn: Callable[[], object], calls: int = 8, replays: int = 5) -> float:
    """Device seconds per call of `fn`: the median replay of one CUDA graph of `calls` calls."""
    fn()  # compiles; the graph's pool takes what a call allocates
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    del graph
    return sorted(times)[len(times) // 2]


def host_seconds(fn: Callable[[], object], calls: int = 2) -> float:
    """Host seconds per call (CPU runs and tests: no graphs there)."""
    fn()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t) / calls


def _inputs(target: DecodeTarget, tokens: int, top_k: int, dtype: torch.dtype, seed: int):
    """x [T, H], routing ids over experts the row holds, weights, shared gate logits (or None)."""
    buf, row = target.buffer, target.table_row
    gen = torch.Generator().manual_seed(seed)
    held = torch.nonzero(row.cpu() >= 0).flatten()
    pick = torch.stack([held[torch.randperm(len(held), generator=gen)[:top_k]] for _ in range(tokens)])
    device = buf.gate_up.w.device
    x = torch.randn(tokens, buf.hidden, generator=gen).to(device, dtype)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), -1).to(device, dtype)
    gate = torch.randn(tokens, generator=gen).to(device, dtype) if target.shared_slot >= 0 else None
    return x, pick.to(device), weights, gate


def time_paths(target: DecodeTarget, tokens: int, top_k: int, dtype: torch.dtype,
               timer: Callable = graph_seconds) -> PathTiming:
    buf = target.buffer
    x, ids, weights, gate = _inputs(target, tokens, top_k, dtype, seed=tokens)
    paths = (choose_config(tokens, buf.gate_up, buf.down), decode_config(buf.gate_up))

    def call(config):
        return buf.run(x, ids, weights, target.table_row, target.shared_slot, gate, config=config)

    grouped, decode = (call(c).float() for c in paths)
    rel = ((decode - grouped).norm() / grouped.norm().clamp_min(1e-30)).item()
    return PathTiming(tokens, timer(lambda: call(paths[0])), timer(lambda: call(paths[1])), rel)


def choose_decode_tokens(target: DecodeTarget, top_k: int, max_tokens: int, dtype: torch.dtype,
                         timer: Callable = graph_seconds) -> tuple[int, list[PathTiming], str]:
    """(the largest T up to which the decode path won at every size measured, the timings,
    why it stopped)."""
    untimed = _untimeable(target, top_k)
    if untimed:
        return 0, [], untimed
    chosen, timings = 0, []
    for tokens in (t for t in SIZES if t <= max_tokens):
        timing = time_paths(target, tokens, top_k, dtype, timer)
        timings.append(timing)
        if not timing.rel_diff <= AGREE:
            return 0, timings, f"its output differs from the grouped GEMM's by {timing.rel_diff:.2g} at T={tokens}"
        if timing.decode_s >= timing.grouped_s:
            return chosen, timings, f"slower at T={tokens}"
        chosen = tokens
    return chosen, timings, "faster at every size measured"


def _untimeable(target: DecodeTarget, top_k: int) -> str | None:
    """Why the decode path cannot be timed on `target` (None: it can)."""
    if decode_config(target.buffer.gate_up) is None:
        return "its kernels do not handle this slot form"
    if int((target.table_row >= 0).sum()) < top_k:
        return f"fewer than {top_k} experts held to time it on"
    return None


def _layout(target: DecodeTarget) -> tuple:
    buf = target.buffer
    return buf.kernel.name, buf.gate_up.group, buf.hidden, buf.inter, target.shared_slot >= 0


def _by_layout(targets: list[DecodeTarget]) -> dict[tuple, list[DecodeTarget]]:
    groups: dict[tuple, list[DecodeTarget]] = {}
    for t in targets:
        groups.setdefault(_layout(t), []).append(t)
    return groups


def call_paths(targets: list[DecodeTarget], top_k: int, max_tokens: int, dtype: torch.dtype) -> None:
    """What `choose_decode_paths` will launch, called once and untimed: both paths of one target
    per slot layout at each size (`moeferry.engine.compile_ahead` walks it to compile their kernels)."""
    for members in _by_layout(targets).values():
        if _untimeable(members[0], top_k) is None:
            for tokens in (t for t in SIZES if t <= max_tokens):
                time_paths(members[0], tokens, top_k, dtype, timer=lambda fn: 0.0)


def choose_decode_paths(targets: list[DecodeTarget], top_k: int, max_tokens: int, dtype: torch.dtype,
                        timer: Callable = graph_seconds) -> dict[tuple, int]:
    """Time one target per slot layout, set `decode_tokens` on every buffer of that layout and
    log the timings; returns layout -> decode_tokens."""
    groups = _by_layout(targets)
    chosen = {}
    for layout, members in groups.items():
        try:
            tokens, timings, why = choose_decode_tokens(members[0], top_k, max_tokens, dtype, timer)
        except Exception as exc:  # noqa: BLE001 - a path that cannot run here is not taken
            tokens, timings, why = 0, [], f"{type(exc).__name__}: {str(exc)[:200]}"
        for t in members:
            t.buffer.decode_tokens = tokens
        chosen[layout] = tokens
        times = "; ".join(f"T={p.tokens} grouped {p.grouped_s * 1e6:.1f} us, decode {p.decode_s * 1e6:.1f} us"
                          for p in timings)
        log.info("MoE path for %s slots (%d buffers): decode path %s (%s)%s", layout[0], len(members),
                 f"up to {tokens} tokens" if tokens else "off", why, f": {times}" if times else "")
    return chosen
