"""Engine: the loaded model plus its KV and GDN state pools; runs one step over a batch."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moeferry.cache.kv_pool import KVPool
from moeferry.cache.state_pool import StatePool
from moeferry.checkpoint.reader import CheckpointReader
from moeferry.engine.batch import ForwardBatch, SeqChunk
from moeferry.engine.cuda_graph import DecodeGraphs
from moeferry.model.loader import load_model
from moeferry.model.registry import resolve_spec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class PoolSizes:
    num_pages: int
    page_size: int = 1
    num_state_slots: int = 8


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype '{name}'; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


class Engine:
    def __init__(self, model_dir: str, device: str, dtype: torch.dtype, pools: PoolSizes, progress: bool = True,
                 cuda_graphs: bool = True):
        # a model directory, or a reader already made (e.g. over in-memory tensors)
        self.reader = model_dir if isinstance(model_dir, CheckpointReader) else CheckpointReader(model_dir)
        self.spec = resolve_spec(self.reader)
        self.device = torch.device(device)
        self.model = load_model(self.reader, self.spec, dtype, self.device, progress=progress)
        s = self.spec
        self.kv_pool = KVPool(len(s.attention_layers), pools.num_pages, pools.page_size, s.num_kv_heads,
                              s.head_dim, dtype, self.device)
        self.state_pool = StatePool(len(s.linear_layers), pools.num_state_slots, max(s.conv_dim, 1),
                                    max(s.conv_kernel, 2), max(s.linear_num_v_heads, 1), max(s.linear_k_head_dim, 1),
                                    max(s.linear_v_head_dim, 1), dtype, self.device)
        self.graphs = None  # decode CUDA graphs, batch sizes up to the number of sequence slots
        if cuda_graphs and self.device.type == "cuda":
            max_pages = min(pools.num_pages, -(-s.max_position_embeddings // pools.page_size))
            self.graphs = DecodeGraphs(self.model, self.kv_pool, self.state_pool, pools.num_state_slots, max_pages,
                                       pools.page_size, self.device)

    @property
    def page_size(self) -> int:
        return self.kv_pool.page_size

    @torch.inference_mode()
    def forward(self, chunks: list[SeqChunk]) -> torch.Tensor:
        """fp32 logits: one row per chunk (its last token), or one per token for all_logits chunks."""
        if self.graphs is not None:
            logits = self.graphs.run(chunks)  # None: not an all-decode batch the graphs can serve
            if logits is not None:
                return logits
        batch = ForwardBatch.build(chunks, self.page_size, self.device)
        return self.model.forward(batch, self.kv_pool, self.state_pool)
