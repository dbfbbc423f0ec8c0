"""Engine: the loaded model, its expert backend and its cache manager; runs one step over a batch.

`Engine.build(cfg)` goes through explicit phases, each one place in this file:

    1. resolve    the checkpoint's ModelSpec
    2. place      dense weights to the device; each MoE layer's experts, read once on the
                  host, to the configured expert backend (`moeferry.moe`)
    3. plan       pool sizes: the given sizes (`derive_sizes`), or the measured memory plan
                  when the configuration asks for one (`moeferry.memory`)
    4. allocate   KV pages, GDN state slots, prefix cache (`CacheManager`), the expert
                  backend's device cache
    5. warm up    one prefill and the decode CUDA graphs, so the first request is not the slow one
    6. report     `Engine.sizes` (pages, state slots, context limit, expert slots), sent in `Ready`
"""
from __future__ import annotations

import logging
import time
from typing import Callable

import torch

from moeferry.cache.manager import CacheManager
from moeferry.checkpoint.reader import CheckpointReader
from moeferry.engine.config import EngineConfig, EngineSizes, derive_sizes
from moeferry.engine.cuda_graph import DecodeGraphs
from moeferry.model.batch import ForwardBatch, SeqChunk
from moeferry.model.loader import load_model
from moeferry.model.registry import resolve_spec
from moeferry.moe import make_backend

log = logging.getLogger("moeferry.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

Progress = Callable[[str, float], None]


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype '{name}'; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


class Engine:
    def __init__(self, cfg: EngineConfig, spec, model, experts, cache: CacheManager, sizes: EngineSizes,
                 graphs: DecodeGraphs | None):
        self.cfg, self.spec, self.model, self.experts, self.cache = cfg, spec, model, experts, cache
        self.sizes, self.graphs = sizes, graphs
        self.device = model.device

    @classmethod
    def build(cls, cfg: EngineConfig, reader: CheckpointReader | None = None,
              progress: Progress | None = None) -> "Engine":
        """Build an engine from `cfg` (`reader`: an already opened checkpoint, e.g. in memory)."""
        report = progress or (lambda phase, fraction: None)
        t0 = time.perf_counter()
        reader = reader or CheckpointReader(cfg.model_dir)
        spec = resolve_spec(reader)                                              # 1. resolve
        device, dtype = torch.device(cfg.device), resolve_dtype(cfg.dtype, cfg.device)
        report("loading weights", 0.05)
        experts = make_backend(cfg, spec, device, dtype)                         # 2. place
        model = load_model(reader, spec, dtype, device, experts, progress=cfg.progress)
        report("planning memory", 0.85)
        sizes = derive_sizes(cfg, spec.max_position_embeddings)                  # 3. plan
        report("allocating pools", 0.9)
        experts.finish(experts.requested_slots())                                # 4. allocate
        cache = CacheManager.build(spec, sizes.num_pages, sizes.page_size, sizes.num_state_slots, cfg.prefix_cache,
                                   dtype, device)
        sizes = EngineSizes(sizes.num_pages, sizes.page_size, sizes.num_state_slots, sizes.max_seq_len,
                            experts.expert_slots)
        graphs = None
        if cfg.cuda_graphs and device.type == "cuda":
            max_pages = min(sizes.num_pages, -(-sizes.max_seq_len // sizes.page_size))
            graphs = DecodeGraphs(model, cache.kv, cache.states, sizes.num_state_slots, max_pages, sizes.page_size,
                                  device)
        engine = cls(cfg, spec, model, experts, cache, sizes, graphs)
        report("warming up", 0.95)
        engine.warm_up()                                                         # 5. warm up
        log.info("engine built in %.1f s: %s", time.perf_counter() - t0, engine.describe())
        return engine                                                            # 6. report: engine.sizes

    # -- steps ------------------------------------------------------------------------------
    @property
    def page_size(self) -> int:
        return self.sizes.page_size

    @torch.inference_mode()
    def forward(self, chunks: list[SeqChunk]) -> torch.Tensor:
        """fp32 logits: one row per chunk (its last token), or one per token for all_logits chunks."""
        if self.graphs is not None:
            logits = self.graphs.run(chunks)  # None: not an all-decode batch the graphs can serve
            if logits is not None:
                return logits
        batch = ForwardBatch.build(chunks, self.page_size, self.device)
        return self.model.forward(batch, self.cache.kv, self.cache.states)

    def warm_up(self) -> None:
        """Run a short prefill and a decode step through the real pools (compiling kernels on
        CUDA and capturing the decode graphs), then give everything back."""
        if self.device.type != "cuda":
            return
        t0 = time.perf_counter()
        n = min(16, self.sizes.max_seq_len - 1)
        with self.cache.sequences([n + 1]) as (blocks,):
            self.forward([SeqChunk([0] * n, 0, blocks.pages, blocks.state_slot)])
            self.forward([SeqChunk([0], n, blocks.pages, blocks.state_slot)])
            if self.graphs is not None:
                self.graphs.capture_all()
            torch.cuda.synchronize()
        log.info("warm-up took %.1f s%s", time.perf_counter() - t0,
                 "" if self.graphs is None or self.graphs.disabled is None
                 else f" (CUDA graphs off: {self.graphs.disabled})")

    # -- reporting --------------------------------------------------------------------------
    def stats(self) -> dict:
        return {"experts": self.experts.stats()}

    def describe(self) -> str:
        s = self.sizes
        return (f"{s.kv_tokens} KV tokens ({s.num_pages} pages x {s.page_size}), {s.num_state_slots} state slots, "
                f"context {s.max_seq_len}, {s.expert_slots} expert slots ({self.cfg.moe_backend})")
