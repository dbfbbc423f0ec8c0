"""CausalLM: embeddings, decoder layers, final norm and LM head over a ForwardBatch."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moeferry.model.batch import ForwardBatch
from moeferry.model.layers import StepContext
from moeferry.model.spec import ModelSpec
from moeferry.ops.norm import add_rms_norm
from moeferry.ops.rope import rope_cos_sin, rope_inv_freq


class CausalLM:
    def __init__(self, spec: ModelSpec, embed: torch.Tensor, layers: list, norm: torch.Tensor, lm_head):
        self.spec, self.embed, self.layers, self.norm, self.lm_head = spec, embed, layers, norm, lm_head
        self.inv_freq = rope_inv_freq(spec.rotary_dim, spec.rope_theta).to(embed.device)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def forward(self, batch: ForwardBatch, kv_pool, state_pool) -> torch.Tensor:
        """Run one step; returns fp32 logits [len(batch.logit_rows), vocab]."""
        h = F.embedding(batch.input_ids, self.embed)
        cos, sin = rope_cos_sin(batch.positions, self.inv_freq, h.dtype)
        ctx = StepContext(batch, cos, sin, kv_pool, state_pool)
        pending = None  # a layer's MLP output, added to the stream by the next layer's norm
        for layer in self.layers:
            h, pending = layer(h, pending, ctx)
        rows = batch.logit_rows
        h, _ = add_rms_norm(pending[rows], h[rows], self.norm, self.spec.rms_norm_eps, self.spec.zero_centered_norm)
        return self.lm_head(h).float()
