"""Random-weight Qwen3.5/3.6-MoE models built in device memory and shared by transformers and
moeferry (the same tensors, no copy), for the GPU parity test and the benchmark.

Writing a 35B checkpoint to disk and reading it back would cost minutes of a lent GPU; here
transformers' Qwen3_5MoeForCausalLM is built on the device, its parameters are drawn in place,
and moeferry's loader reads them through a `StateDictReader` (a CheckpointReader over a dict
of tensors). The loader's `.to(device, dtype)` is then a no-op, so both engines see one copy.

Weights (unit-gain: each projection keeps activations near unit scale, so the layers matter):
linears N(0, 1/in), embeddings N(0, 1), norms 1 + N(0, 0.1) (plain) or N(0, 0.1)
(zero-centred), router N(0, (3/sqrt(H))^2) (peaked routing, so the bf16 noise of one engine
against the other rarely flips an expert of noticeable weight), A_log, dt_bias as the
checkpoints have them. With `planted=True` the LM head is the embedding matrix of a random
permutation (row pi(t) = embedding of t, scaled): greedy decoding then follows t -> pi(t)
with a wide margin, so two bf16 engines agree on tokens while their logits still carry every
layer's output (the rest of the vocabulary scores through the same head).
"""
from __future__ import annotations

from pathlib import Path

import torch

from moeferry.checkpoint.reader import CheckpointError, CheckpointReader, TensorInfo


class StateDictReader(CheckpointReader):
    """A CheckpointReader over in-memory tensors (names as in a checkpoint)."""

    def __init__(self, config: dict, tensors: dict[str, torch.Tensor]):
        self.dir = Path("<in-memory>")
        self.config, self.generation_config, self.hf_quant_config = config, {}, {}
        self._data = dict(tensors)
        self.tensors = {n: TensorInfo(self.dir, n, tuple(t.shape), str(t.dtype)) for n, t in self._data.items()}
        self._handles = {}

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if name not in self._data:
            raise CheckpointError(f"missing tensor '{name}' in {self.dir}")
        t = self._data[name]
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"tensor '{name}' has shape {list(t.shape)}, expected {list(shape)}")
        return t

    def view(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        return self.get(name, shape)


def qwen36_config(num_layers: int | None = None, **overrides) -> dict:
    """config.json of Qwen3.6-35B-A3B's text model (synthetic preset), optionally fewer layers."""
    from moeferry.checkpoint.synthetic import model_config
    cfg = model_config("qwen3_5_moe", "qwen3.6-35b-a3b", num_layers=num_layers, dtype="bfloat16")
    cfg.update(overrides)
    return cfg


@torch.no_grad()
def init_random_(model, seed: int, planted: bool) -> None:
    """Draw every parameter of a transformers Qwen3.5-MoE model in place (see module doc)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    hidden = model.config.hidden_size
    for name, p in model.named_parameters():
        def normal(std, mean=0.0):
            p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32) * std + mean)
        if name.endswith("A_log"):
            p.copy_(torch.log(torch.rand(p.shape, generator=gen, device=p.device) * 15.99 + 0.01))
        elif name.endswith("dt_bias"):
            normal(0.5, 1.0)
        elif "norm" in name:  # zero-centred decoder/q/k norms and the gated norm (plain, 1 + w)
            normal(0.1, 1.0 if "linear_attn.norm" in name else 0.0)
        elif name.endswith("embed_tokens.weight"):
            normal(1.0)
        elif name.endswith("mlp.gate.weight"):
            normal(3.0 / hidden ** 0.5)
        elif "experts.gate_up_proj" in name or "experts.down_proj" in name:
            normal(1.0 / p.shape[-1] ** 0.5)
        elif name.endswith("conv1d.weight"):
            normal(0.5)
        elif name == "lm_head.weight":
            if planted:
                embed = model.get_input_embeddings().weight
                perm = torch.randperm(embed.shape[0], generator=gen, device=embed.device)
                p[perm] = embed  # row perm[t] = embedding of t, so t is followed by perm[t]
                p.mul_(hidden ** -0.5)
            else:
                normal(hidden ** -0.5)
        elif p.dim() == 2:
            normal(1.0 / p.shape[1] ** 0.5)
        else:
            normal(0.1)


def build_hf(config: dict, device: str, dtype: torch.dtype, seed: int = 0, planted: bool = False):
    """transformers' Qwen3_5MoeForCausalLM with random weights, built directly on `device`."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig
    keep = {k: v for k, v in config.items() if k not in ("architectures", "transformers_version", "dtype")}
    hf_cfg = Qwen3_5MoeTextConfig(**keep)
    hf_cfg._attn_implementation = "sdpa"
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3_5MoeForCausalLM(hf_cfg)
    finally:
        torch.set_default_dtype(prev)
    model = model.to(dtype).eval()
    init_random_(model, seed, planted)
    return model


def moeferry_engine(config: dict, hf_model, device: str, dtype: torch.dtype, num_tokens: int, max_seqs: int,
                    page_size: int = 16, cuda_graphs: bool = True):
    """moeferry's Engine over the very tensors of `hf_model` (dense weights not copied)."""
    from moeferry.engine.config import EngineConfig
    from moeferry.engine.engine import Engine
    reader = StateDictReader(config, dict(hf_model.state_dict()))
    cfg = EngineConfig("(in memory)", device, str(dtype).removeprefix("torch."), num_tokens=num_tokens,
                       page_size=page_size, num_state_slots=max_seqs, max_running_requests=max_seqs,
                       cuda_graphs=cuda_graphs)
    return Engine.build(cfg, reader=reader)


def moe_path(engine) -> str:
    """Name of the expert executor the engine's MoE layers use."""
    names = {type(layer.mlp.experts).__name__ for layer in engine.model.layers if hasattr(layer.mlp, "experts")}
    return ",".join(sorted(names))
