"""Measure, don't guess: the memory the worst steps need beyond the pools, on the real device.

After the weights are placed and before the pools are sized, `probe_transients` runs, through
small temporary pools:

    prefill   a chunk of max_extend_tokens at depth 0 and at depth D1 (two depths: the growth
              with context depth is extrapolated linearly to the deepest start the context allows,
              which is conservative for the kernels here: the paged prefill attention and the GDN
              chunk scratch do not grow with depth, split-K decode scratch grows at most linearly;
              SDPA flash's context gather grows linearly and is added analytically beyond D1, as
              the MoE layers' larger peak can hide it at D1: `worst_prefill`)
    decode    the largest batch (max_running_requests) at depth 1 and D1, extrapolated the same way
    sampling  temperature sampling with logprobs over [batch, vocab] fp32 logits

Each peak is the allocator's peak minus the memory held before the step (CUDA); on the CPU it
is the process's peak resident set (VmHWM, reset before each step). Memory outside the
allocator that a step made appear (cuBLAS workspaces, kernel modules) is logged and stays: the
plan counts it with the weights, measured after the probe. The margin is measured too: the
allocator's fragmentation at the peak and twice the run-to-run spread of a repeated step.
"""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

import torch

from moeferry.cache.manager import CacheManager
from moeferry.model.batch import ForwardBatch, SeqChunk
from moeferry.ops.attention import context_gather_bytes

log = logging.getLogger("moeferry.memory")

CPU_PROBE_TOKENS = 64  # longest chunk / depth the probe runs through the CPU references


@dataclass(frozen=True)
class Transients:
    worst: int              # bytes: the largest step, extrapolated to full depth
    decode: int             # bytes: the largest decode batch (what a CUDA graph pool holds)
    margin: int             # bytes: measured fragmentation + 2 x spread
    note: str               # how it was measured (for the plan table)
    steps: dict             # each step's measured peak


class PeakMeter:
    """Peak memory of one step on `device`, beyond what was held before it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.fragmentation = 0
        self.outside = 0

    def measure(self, fn) -> int:
        gc.collect()
        if self.device.type == "cuda":
            return self._cuda(fn)
        return self._cpu(fn)

    def _cuda(self, fn) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(self.device)
        reserved0 = torch.cuda.memory_reserved(self.device)
        free0 = torch.cuda.mem_get_info(self.device)[0]
        torch.cuda.reset_peak_memory_stats(self.device)
        fn()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        reserved_peak = torch.cuda.max_memory_reserved(self.device) - reserved0
        grown = free0 - torch.cuda.mem_get_info(self.device)[0] - (torch.cuda.memory_reserved(self.device) - reserved0)
        self.fragmentation = max(self.fragmentation, reserved_peak - peak)
        self.outside = max(self.outside, grown)  # logged; the plan measures it after the probe
        return max(peak, 0)

    def _cpu(self, fn) -> int:
        _reset_peak_rss()
        base = _rss("VmRSS")
        fn()
        return max(_rss("VmHWM") - base, 0)


def _rss(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _reset_peak_rss() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux)
    except OSError:
        pass


def _extrapolate(at0: int, at1: int, depth1: int, depth: int) -> int:
    if depth1 <= 0 or depth <= depth1:
        return max(at0, at1)
    return max(at0, at1) + max(at1 - at0, 0) * (depth - depth1) // depth1


def worst_prefill(at0: int, at1: int, depth1: int, deepest: int, gather_per_token: int) -> int:
    """The largest prefill chunk's peak at the deepest start: the measured growth extrapolated,
    and at least the peak at depth1 plus what the flash attention's context gather adds beyond
    depth1 (`gather_per_token` bytes a token of context; the MoE layers' peak can hide that
    growth at depth1 while the attention layer's outgrows it deeper)."""
    worst = _extrapolate(at0, at1, depth1, deepest)
    if depth1 > 0 and deepest > depth1:
        worst = max(worst, at1 + gather_per_token * (deepest - depth1))
    return worst


@torch.inference_mode()
def probe_transients(model, spec, cfg, context: int, dtype: torch.dtype, device: torch.device) -> Transients:
    """Run the worst steps the configuration allows through temporary pools; measure each."""
    t0 = time.perf_counter()
    full_chunk = longest_chunk(cfg, context)
    # The CPU references are slow and not memory-efficient at depth: measure a short chunk and scale
    # linearly in its length (activations, the reference attention's scores and GDN scratch all are).
    chunk = full_chunk if device.type == "cuda" else min(full_chunk, CPU_PROBE_TOKENS)
    scale = full_chunk / chunk
    depth1 = second_depth(context, full_chunk, chunk)
    batch = cfg.max_running_requests
    tokens = max(chunk + depth1, batch * (depth1 + 2))
    cache = CacheManager.build(spec, tokens, 1, batch, False, dtype, device)
    meter = PeakMeter(device)
    vocab = spec.vocab_size
    gen = torch.Generator().manual_seed(0)

    def prefill(depth: int):
        ids = torch.randint(0, vocab, (chunk,), generator=gen).tolist()
        with cache.sequences([depth + chunk]) as (seq,):
            return meter.measure(lambda: run_step(model, cache, [SeqChunk(ids, depth, seq.pages, seq.state_slot)]))

    def decode(depth: int):
        with cache.sequences([depth + 1] * batch) as held:
            chunks = [SeqChunk([i % vocab], depth, b.pages, b.state_slot) for i, b in enumerate(held)]
            return meter.measure(lambda: run_step(model, cache, chunks))

    steps = {"prefill@0": prefill(0)}
    steps["prefill@0 again"] = prefill(0)
    if depth1:
        steps[f"prefill@{depth1}"] = prefill(depth1)
    steps["decode@1"] = decode(1)
    if depth1:
        steps[f"decode@{depth1}"] = decode(depth1)
    steps["sampling"] = meter.measure(lambda: _sample(batch, vocab, device))
    deepest = context - full_chunk
    gather = context_gather_bytes(spec.num_kv_heads, spec.head_dim, dtype, device)
    prefill_peak = int(scale * worst_prefill(steps["prefill@0"], steps.get(f"prefill@{depth1}", 0), depth1, deepest,
                                             gather))
    worst_decode = _extrapolate(steps["decode@1"], steps.get(f"decode@{depth1}", 0), depth1, context - 1)
    spread = abs(steps["prefill@0"] - steps["prefill@0 again"])
    margin = meter.fragmentation + 2 * spread  # memory outside the allocator: measured into the weights term
    cache = None  # the temporary pools go before the real ones are sized
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    worst = max(prefill_peak, worst_decode) + steps["sampling"]
    note = (f"measured: prefill {chunk} tokens at depth 0" + (f" and {depth1}" if depth1 else "")
            + (f", scaled to {full_chunk} tokens" if scale != 1 else "")
            + (f", extrapolated to depth {deepest}" if depth1 and deepest > depth1 else "")
            + (f" (attention's context gather: {gather} bytes a token)" if gather and depth1 and deepest > depth1
               else "")
            + f"; decode x{batch}; sampling+logprobs ({time.perf_counter() - t0:.1f} s)")
    log.info("probe: %s; peaks %s; fragmentation %d, outside the allocator %d, spread %d", note, steps,
             meter.fragmentation, meter.outside, spread)
    return Transients(worst, worst_decode, margin, note, steps)


def longest_chunk(cfg, context: int) -> int:
    """The longest prefill chunk a step takes (the probe's first prefill)."""
    return max(1, min(cfg.max_extend_tokens, context - 1))


def second_depth(context: int, full_chunk: int, chunk: int) -> int:
    """Where the probe's second prefill of `chunk` tokens starts: after a context of that many
    tokens, where the context leaves room for a full chunk after it (0: no second prefill)."""
    return max(0, min(context - full_chunk, chunk))


def run_step(model, cache: CacheManager, chunks: list[SeqChunk]) -> None:
    """One forward step of `chunks` through `cache`'s pools (the probe's steps, the boot's walk)."""
    batch = ForwardBatch.build(chunks, cache.page_size, cache.kv.k[0].device if cache.kv.k else model.device)
    model.forward(batch, cache.kv, cache.states)


def _sample(batch: int, vocab: int, device: torch.device) -> None:
    from moeferry.ops.sampler import SamplingBatch, logprobs_of, sample

    logits = torch.randn(batch, vocab, device=device)
    b = SamplingBatch(
        temperature=torch.full((batch,), 0.7, device=device), top_k=torch.full((batch,), 50, device=device),
        top_p=torch.full((batch,), 0.9, device=device), min_p=torch.zeros(batch, device=device),
        presence=torch.zeros(batch, device=device), frequency=torch.zeros(batch, device=device),
        repetition=torch.full((batch,), 1.1, device=device), output_counts=torch.zeros(batch, vocab, device=device),
        seen=torch.zeros(batch, vocab, dtype=torch.bool, device=device),
        banned=torch.zeros(batch, vocab, dtype=torch.bool, device=device), bias=torch.zeros(batch, vocab, device=device),
        generators=[torch.Generator(device).manual_seed(i) for i in range(batch)])
    tokens = sample(logits, b)
    logprobs_of(logits, tokens, 20)
