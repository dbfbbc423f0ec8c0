"""Engine: the loaded model, its expert backend and its cache manager; runs one step over a batch.

`Engine.build(cfg)` goes through explicit phases, each one place in this file:

    1. resolve    the checkpoint's ModelSpec
    2. place      dense weights to the device; each MoE layer's experts, read once on the
                  host, to the configured expert backend (`moeferry.moe`)
    3. plan       on CUDA (and when a flag asks for it on the CPU): probe the worst steps, then
                  the memory plan (`moeferry.memory`, `engine/planning.py`); else the given sizes
    4. allocate   KV pages, GDN state slots, prefix cache (`CacheManager`), the expert
                  backend's device cache and staging area
    5. warm up    one prefill and the decode CUDA graphs, so the first request is not the slow one;
                  with a plan, what the graphs and kernels hold beyond it comes out of the expert
                  cache (CUDA), then the boot self-test runs the worst step through the real pools
    6. report     `Engine.sizes` (pages, state slots, context limit, expert slots) and the plan,
                  sent in `Ready`

Every step runs under the OOM guard (`moeferry.memory.guard`): an out-of-memory error shrinks
the expert cache and retries the step.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Callable

import torch

from moeferry.cache.manager import CacheManager
from moeferry.checkpoint.reader import CheckpointReader
from moeferry.engine.compile_ahead import compile_ahead, representative_layers, walking_layers
from moeferry.engine.config import EngineConfig, EngineSizes, context_limit, derive_sizes
from moeferry.engine.cuda_graph import DecodeGraphs, default_sizes
from moeferry.engine.planning import (choose_backend, describe_plan, free_memory, make_engine_plan, needs_plan,
                                      self_test, settle_after_warm_up)
from moeferry.memory import collector
from moeferry.memory.allocator import configure_allocator
from moeferry.memory.numa import prefer_gpu_node
from moeferry.memory.guard import OomGuard
from moeferry.memory.plan import MemoryPlan
from moeferry.memory.probe import longest_chunk, run_step, second_depth
from moeferry.model.batch import ForwardBatch, SeqChunk
from moeferry.model.loader import load_model
from moeferry.model.registry import resolve_spec
from moeferry.ops.triton.compile_watch import CompileWatch
from moeferry.moe import make_backend

log = logging.getLogger("moeferry.engine")

# warm-up shapes: one prefill chunk (tokens) in each bucket of a launch's compile-time choices
# (conv.py's block of 4 / 8 / 16 tokens; quant_linear's GEMV rows <= 4, split-K <= 16, tiles of
# 32 / 64 / 128 rows; moe_gemm's configs <= 4, 32, 512, 4096 tokens; moe_prep's one program up to
# 1024 pairs), and one eager decode batch per bucket where graphs are off. Token and row counts
# are not specialized on (`do_not_specialize`), so one length per bucket compiles what every
# length in it uses (tests/test_triton_kernels.py::case_warm_up_covers_prefill_shapes).
WARM_PREFILL = (2, 5, 9, 17, 33, 65, 129, 513, 4097)
WARM_BATCHES = (2, 5, 33)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

Progress = Callable[[str, float], None]


def resolve_device(name: str) -> torch.device:
    """The device, with its index where it has several ("cuda" is the current CUDA device)."""
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype '{name}'; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def _plan(cfg: EngineConfig, spec, model, experts, device, dtype, free_at_start: int
          ) -> tuple[MemoryPlan | None, EngineSizes, int]:
    """(plan, sizes, guard bytes): the measured plan where one is needed, else the given sizes."""
    if not needs_plan(cfg, device, experts.requested_slots()):
        return None, derive_sizes(cfg, spec.max_position_embeddings), 0
    experts.finish(experts.probe_slots())  # offload: a small cache to probe with
    if cfg.compile_workers and device.type == "cuda":  # the probe's and warm-up's kernels, compiled side by side
        log.info("%s", compile_ahead(boot_walk(cfg, spec, model, experts, dtype, device), cfg.compile_workers))
        experts.finish(experts.probe_slots())  # the walk moved the cache's books, not its slots' bytes
    plan, transients = make_engine_plan(cfg, spec, model, experts, device, dtype, free_at_start)
    log.info(describe_plan(plan))
    sizes = EngineSizes(plan.kv_pages, plan.page_size, plan.state_slots, plan.context_limit, plan.expert_slots)
    return plan, sizes, transients.worst


GRAPH_MODES = {
    "whole": "captured whole",
    "device": "captured whole, the expert cache managed on the device (lookup, eviction and fetches "
              "of each MoE layer in the graph)",
    "piecewise": "piecewise (cut at each MoE layer: the host reads its experts, fetches the misses and "
                 "computes the CPU lane's)",
}


def prefill_then_decode(cache: CacheManager, step: Callable[[list[SeqChunk]], object], lengths) -> None:
    """For each of `lengths`: a sequence's prefill chunk of that many tokens, then one decode
    step after it, each through `step` (the warm-up's shapes, one sequence at a time)."""
    for n in lengths:
        with cache.sequences([n + 1]) as (seq,):
            step([SeqChunk([0] * n, 0, seq.pages, seq.state_slot)])
            step([SeqChunk([0], n, seq.pages, seq.state_slot)])


def boot_walk(cfg: EngineConfig, spec, model, experts, dtype: torch.dtype, device: torch.device
              ) -> Callable[[], None]:
    """The steps the probe and the warm-up will run, through temporary pools, as one walk for
    `compile_ahead`: a prefill chunk of each warm-up length and of the longest chunk, each with
    a decode step after it; the probe's longest chunk after a context and its decode of the
    largest batch, shallow and deep; a decode step of each captured batch size; the MoE path
    choice's calls. The steps go through one layer of each kernel signature
    (`representative_layers`: the others launch the same kernels), not through all of them."""
    context = context_limit(cfg, spec.max_position_embeddings)
    longest = longest_chunk(cfg, context)
    depth = second_depth(context, longest, longest)  # the probe's, on a GPU (its chunks are whole there)
    lengths = sorted({min(n, longest) for n in WARM_PREFILL + (longest,)})
    batch = cfg.max_running_requests
    cache = CacheManager.build(spec, max(longest + depth, batch * (depth + 2)), 1, batch, False, dtype, device)

    def step(chunks: list[SeqChunk]) -> None:
        run_step(model, cache, chunks)

    def decode(rows: int, at: int) -> None:
        with cache.sequences([at + 1] * rows) as held:
            step([SeqChunk([0], at, b.pages, b.state_slot) for b in held])

    @torch.inference_mode()
    def walk() -> None:
        layers = representative_layers(model.layers)
        log.info("compile-ahead walk: through %d of %d layers (one of each kernel signature)",
                 len(layers), len(model.layers))
        with walking_layers(model, layers):
            prefill_then_decode(cache, step, lengths)
            with cache.sequences([depth + longest]) as (seq,):
                step([SeqChunk([0] * longest, depth, seq.pages, seq.state_slot)])
            decode(batch, depth)
            for rows in default_sizes(batch):
                decode(rows, 1)
        targets = experts.decode_targets()
        if targets:
            from moeferry.moe.path_choice import call_paths
            call_paths(targets, spec.top_k, batch, model.dtype)
    return walk


def graph_max_batch(cfg: EngineConfig, sizes: EngineSizes) -> int:
    """The largest decode batch captured: the scheduler's largest (running requests, state
    slots), at most --cuda-graph-max-bs; a larger batch runs eagerly."""
    largest = min(cfg.max_running_requests, sizes.num_state_slots)
    return largest if cfg.cuda_graph_max_bs is None else min(largest, cfg.cuda_graph_max_bs)


def _decode_graphs(cfg: EngineConfig, model, cache: CacheManager, sizes: EngineSizes, device,
                   experts, plan: MemoryPlan | None) -> DecodeGraphs | None:
    """CUDA graphs of the decode step: whole with resident experts or an offload cache holding
    every expert; whole with a partial offload cache managed on the device during decode, else
    piecewise (cut at each layer's host part, which is where cpu and hybrid run their CPU
    lane); none where the plan reserved no graph pool (`experts.graph_mode`)."""
    planned = not cfg.offloads_experts or plan is None or plan.graphs.bytes > 0
    max_batch = graph_max_batch(cfg, sizes)
    mode = experts.graph_mode(max_batch)
    if not (cfg.cuda_graphs and device.type == "cuda" and mode and planned):
        return None
    max_pages = min(sizes.num_pages, -(-sizes.max_seq_len // sizes.page_size))
    log.info("decode CUDA graphs: %s", GRAPH_MODES[mode])
    return DecodeGraphs(model, cache.kv, cache.states, max_batch, max_pages, sizes.page_size, device, experts=experts)


class Engine:
    def __init__(self, cfg: EngineConfig, spec, model, experts, cache: CacheManager, sizes: EngineSizes,
                 graphs: DecodeGraphs | None, plan: MemoryPlan | None = None, guard_bytes: int = 0):
        self.cfg, self.spec, self.model, self.experts, self.cache = cfg, spec, model, experts, cache
        self.sizes, self.graphs, self.plan = sizes, graphs, plan
        self.device = model.device
        self.guard = OomGuard(self, guard_bytes)

    @classmethod
    def build(cls, cfg: EngineConfig, reader: CheckpointReader | None = None,
              progress: Progress | None = None) -> "Engine":
        """Build an engine from `cfg` (`reader`: an already opened checkpoint, e.g. in memory)."""
        with collector.paused():  # (full collections mid-build: ~0.4-0.6 s of a 40-layer build)
            return cls._build(cfg, reader, progress)

    @classmethod
    def _build(cls, cfg: EngineConfig, reader: CheckpointReader | None, progress: Progress | None) -> "Engine":
        report = progress or (lambda phase, fraction: None)
        t0 = time.perf_counter()
        device, dtype = resolve_device(cfg.device), resolve_dtype(cfg.dtype, cfg.device)
        configure_allocator(device)
        prefer_gpu_node(device)  # before any bank: their pages near the GPU on a multi-node host
        free_at_start = free_memory(device)
        reader = reader or CheckpointReader(cfg.model_dir)
        spec = resolve_spec(reader)                                              # 1. resolve
        cfg = choose_backend(cfg, reader, device, free_at_start)
        watch = CompileWatch()
        with watch.watching():  # the boot log says how much of the build went to compiling kernels
            engine = cls._assemble(cfg, reader, spec, device, dtype, free_at_start, report)
        log.info("engine built in %.1f s (%s): %s", time.perf_counter() - t0, watch.describe(), engine.describe())
        return engine                                                            # 6. report: engine.sizes

    @classmethod
    def _assemble(cls, cfg: EngineConfig, reader: CheckpointReader, spec, device: torch.device, dtype: torch.dtype,
                  free_at_start: int, report: Progress) -> "Engine":
        """`build`'s steps 2-5: place the weights, plan, allocate, warm up (and self-test)."""
        report("loading weights", 0.05)
        experts = make_backend(cfg, spec, device, dtype)                         # 2. place
        model = load_model(reader, spec, dtype, device, experts, progress=cfg.progress)
        report("planning memory", 0.8)
        plan, sizes, guard_bytes = _plan(cfg, spec, model, experts, device, dtype, free_at_start)  # 3. plan
        report("allocating pools", 0.9)
        experts.finish(plan.expert_slots if plan is not None and cfg.offloads_experts   # 4. allocate
                       else experts.requested_slots())
        if device.type == "cuda" and cfg.gpu_memory_limit is not None:  # a big GPU behaves like a small one
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cfg.gpu_memory_limit / total), device)
        cache = CacheManager.build(spec, sizes.num_pages, sizes.page_size, sizes.num_state_slots, cfg.prefix_cache,
                                   dtype, device)
        sizes = replace(sizes, expert_slots=experts.expert_slots)
        graphs = _decode_graphs(cfg, model, cache, sizes, device, experts, plan)
        engine = cls(cfg, spec, model, experts, cache, sizes, graphs, plan, guard_bytes)
        report("warming up", 0.95)
        engine.warm_up()                                                         # 5. warm up
        if plan is not None:
            settle_after_warm_up(engine, free_at_start)
            report("boot self-test", 0.97)
            self_test(engine)
        return engine

    # -- steps ------------------------------------------------------------------------------
    @property
    def page_size(self) -> int:
        return self.sizes.page_size

    @torch.inference_mode()
    def forward(self, chunks: list[SeqChunk], feed: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits: one row per chunk (its last token), or one per token for all_logits chunks.
        `feed`: the tokens the previous step sampled, still on the device, for the chunks whose
        last token is one of them (`SeqChunk.fed`: the overlapped scheduler's decode inputs).
        An out-of-memory error shrinks the expert cache and retries (`moeferry.memory.guard`)."""
        return self.guard.run(lambda: self.run_batch(chunks, feed))

    @torch.inference_mode()
    def run_batch(self, chunks: list[SeqChunk], feed: torch.Tensor | None = None) -> torch.Tensor:
        """One step, unguarded."""
        if self.graphs is not None:
            logits = self.graphs.run(chunks, feed)  # None: not an all-decode batch the graphs can serve
            if logits is not None:
                return logits
        batch = ForwardBatch.build(chunks, self.page_size, self.device, feed)
        return self.model.forward(batch, self.cache.kv, self.cache.states)

    def warm_up(self) -> None:
        """Before the first request: choose the MoE kernel path of each decode size by timing
        (`choose_moe_paths`), then compile the kernels the server will use: a prefill chunk in
        each bucket of WARM_PREFILL (then a decode step on it), and every decode batch size
        (captured CUDA graphs; eager batches in each bucket where graphs are off, e.g. offload),
        all through the real pools, given back after."""
        if self.device.type != "cuda":
            return
        t0 = time.perf_counter()
        self.choose_moe_paths()
        self.run_warm_steps()
        torch.cuda.synchronize()
        log.info("warm-up took %.1f s%s", time.perf_counter() - t0,
                 "" if self.graphs is None or self.graphs.disabled is None
                 else f" (CUDA graphs off: {self.graphs.disabled})")

    def choose_moe_paths(self, timer=None) -> None:
        """Before any decode graph is captured: which MoE kernel path serves each decode batch
        size, timed on this device for each slot layout (`moeferry.moe.path_choice`; `timer`:
        seconds per call of a function, default the replay of a CUDA graph of calls)."""
        targets = self.experts.decode_targets()
        if not targets:
            return
        from moeferry.moe.path_choice import choose_decode_paths, graph_seconds
        t0 = time.perf_counter()
        max_batch = min(self.cfg.max_running_requests, self.sizes.num_state_slots)
        choose_decode_paths(targets, self.spec.top_k, max_batch, self.model.dtype, timer or graph_seconds)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the timing graphs' pools go back before the plan is settled
        log.info("MoE path choice took %.1f s", time.perf_counter() - t0)

    def run_warm_steps(self) -> None:
        """The warm-up's steps (on any device; tests run them on the CPU)."""
        longest = min(self.cfg.max_extend_tokens, self.sizes.max_seq_len - 1, self.sizes.kv_tokens - 1)
        prefill_then_decode(self.cache, self.forward, sorted({min(n, longest) for n in WARM_PREFILL}))
        if self.graphs is not None:
            self.graphs.capture_all()
        else:
            top = min(self.cfg.max_running_requests, self.sizes.num_state_slots, self.sizes.kv_tokens // 3)
            for batch in sorted({min(b, top) for b in WARM_BATCHES} - {1}):
                with self.cache.sequences([3] * batch) as held:  # two tokens each, then a decode step
                    self.forward([SeqChunk([0, 0], 0, b.pages, b.state_slot) for b in held])
                    self.forward([SeqChunk([0], 2, b.pages, b.state_slot) for b in held])

    # -- reporting --------------------------------------------------------------------------
    def shrink_expert_cache(self, slots: int, plan: MemoryPlan | None = None) -> int:
        """Shrink the expert cache to `slots` (old slots released, survivors refilled from the
        banks, no restart), then the plan, the reported sizes and the decode graphs follow
        (`on_expert_cache_resized`); `plan`: the plan that already says why (else the current
        one, shrunk by the out-of-memory guard). Returns the bytes freed."""
        freed = self.experts.shrink(slots)
        if plan is not None:
            self.plan = plan
        self.on_expert_cache_resized(slots)
        return freed

    def on_expert_cache_resized(self, slots: int) -> None:
        """After the guard shrank the expert cache: the plan and the reported sizes follow, and
        CUDA graphs (which hold pointers) are recaptured now, before the failed step is retried,
        so that the retry runs in the memory layout that decode will have."""
        if self.plan is not None and self.plan.expert_slots > slots >= self.plan.min_expert_slots:
            self.plan = self.plan.shrink_experts(slots, "out-of-memory guard")
        self.sizes = replace(self.sizes, expert_slots=slots)
        if self.graphs is not None:
            self.graphs.invalidate()
            if not self.experts.graph_mode(self.graphs.max_batch):  # a step's working set no longer fits
                self.graphs.disable("the shrunk expert cache holds less than a decode step's experts")
            self.graphs.capture_missing()

    def stats(self) -> dict:
        return {"experts": self.experts.stats(), "memory": self.guard.stats()}

    def describe(self) -> str:
        s = self.sizes
        return (f"{s.kv_tokens} KV tokens ({s.num_pages} pages x {s.page_size}), {s.num_state_slots} state slots, "
                f"context {s.max_seq_len}, {s.expert_slots} expert slots ({self.cfg.moe_backend})")
