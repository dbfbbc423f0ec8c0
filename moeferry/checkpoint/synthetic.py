"""Synthetic Hugging Face checkpoints (`make-model`): random weights, real layouts.

`make_model` writes a directory that `transformers` 5.24 loads with no missing and no
unexpected keys (config.json, generation_config.json, safetensors shards + index, and the
demo tokenizer from `moeferry.text.demo_tokenizer`). Two architectures:

- ``qwen3_moe``: `Qwen3MoeForCausalLM` (model_type ``qwen3_moe``).
- ``qwen3_5_moe``: `Qwen3_5MoeForCausalLM` with a flat config (model_type
  ``qwen3_5_moe_text``, tensors ``model.*``), or with ``multimodal=True`` the released
  Qwen3.5/3.6 layout: `Qwen3_5MoeForConditionalGeneration` (model_type ``qwen3_5_moe``,
  ``text_config`` nested, text tensors under ``model.language_model.``, a small
  ``model.visual.*`` tower and ``mtp.*`` tensors that a text server skips).

Experts are stored per expert (``mlp.experts.{e}.{gate,up,down}_proj.weight``) or fused
(``mlp.experts.gate_up_proj`` [E, 2I, H] = cat(gate, up) per expert, ``mlp.experts.down_proj``
[E, H, I]).

Values. Every tensor is drawn from a generator seeded by (seed, canonical name), where
the canonical name drops the ``language_model.`` part and names experts per expert. So a
checkpoint's values do not depend on the layout or the shard size: the per-expert, fused
and multimodal checkpoints of one seed are the same text model (tests compare their logits).

Streaming. Tensors are generated one at a time and handed to a `ShardWriter` that writes a
shard whenever the next tensor would overflow `max_shard_bytes`; at most one shard plus one
tensor are held in memory (5-7 GB peak RSS measured for the 35B preset in bf16).

Router skew. Random routers send tokens almost uniformly over the experts, which trained
models do not. ``router_skew=S > 0`` gives every router a Zipf-like expert popularity: in
each MoE layer a seeded random permutation assigns the experts popularity ranks r = 0..E-1,
and row e of ``mlp.gate.weight`` is multiplied by ``(r_e + 1) ** -S`` (a per-expert bias of
``-S * log(r + 1)`` on the log-scale of its logits). The routers have no bias tensor (the
Qwen MoE gates are bias-free, and the loaders reject extra keys), and hidden states are
sign-symmetric, so popularity has to come from the spread of the logits: an expert whose
logits spread wider wins the top-k more often (over isotropic hidden states, top-8 of 256:
the top 10% of experts get ~11% of the picks at S=0, ~40% at S=0.25, ~65% at S=0.5). The
gate is unquantized in every preset, so the skew is stored exactly. S=0 draws nothing
extra: the checkpoint is bit for bit what it was without the option.

Planted head. ``planted_head=True`` (untied heads only) writes ``lm_head.weight`` as the
embedding matrix under a seeded random permutation of its rows, scaled by 1/sqrt(hidden): row
pi(t) is the embedding of t, so a hidden state that still carries its token's embedding scores
pi(t) far above every other token, and greedy decoding follows t -> pi(t) with a wide margin
(two engines on different numerics then agree on tokens, while the logits still carry every
layer's output). Random heads leave near-ties that bf16 noise flips.

Quantization hook. Every tensor passes through `Emitter.emit(name, fp32_tensor)`, and
`Emitter.end_group(group)` is called after each group (``embed``, ``layers.{i}``, ``final``,
``visual``, ``mtp``); `Emitter.config_patch()` is merged into the model config and
`Emitter.extra_files()` are written next to it. The plain emitter casts to the checkpoint
dtype.

Quantized checkpoints (``quant=`` one of `moeferry.checkpoint.formats.PRESETS`). The
`QuantEmitter` runs every 2-D ``*.weight`` through `quantize_module(preset, module, w)` (the
real quantizers' math on the checkpoint-dtype weight) and writes the resulting tensors
(e.g. ``weight`` + ``weight_scale`` + ``weight_scale_2``) under the same module prefix;
modules a preset leaves unquantized are stored plainly. Experts must be per expert (every
public quantized release stores them so). At the end it writes config.json
``quantization_config`` and, for the ModelOpt presets, ``hf_quant_config.json``; the
MIXED_PRECISION ``quantized_layers`` map lists the modules it saw (experts as one
``...mlp.experts`` entry). Quantization is streamed with the drawing (one tensor at a time
per worker); ``MOEFERRY_QUANT_DEVICE=cuda`` runs the fp8/nvfp4 quantizer math on a GPU
(the 35B geometry in seconds; int4 and fp8_block fall back to the CPU).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from moeferry.text.demo_tokenizer import special_token_ids, train_demo_tokenizer

__all__ = [
    "ARCHS",
    "SIZES",
    "PRESETS",
    "Preset",
    "TensorSpec",
    "Emitter",
    "QuantEmitter",
    "ShardWriter",
    "make_model",
    "router_gains",
    "model_config",
    "iter_tensor_groups",
]

ARCHS = ("qwen3_moe", "qwen3_5_moe")
SIZES = ("tiny", "small", "qwen3.6-35b-a3b", "qwen3-30b-a3b")
EXPERT_LAYOUTS = ("per-expert", "fused")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOKENIZER_VOCAB = 4096
TRANSFORMERS_VERSION = "5.24.0"
DEFAULT_MAX_SHARD_BYTES = 2_000_000_000


@dataclass(frozen=True)
class Preset:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate: int
    rope_theta: float
    max_position: int
    vocab_size: int | None = None  # None: the tokenizer's vocabulary rounded up to 64
    rms_eps: float = 1e-6
    # qwen3_moe only: size of a dense MLP (mlp_only_layers; unused when every layer is MoE)
    intermediate: int = 0
    # qwen3_5_moe only
    shared_intermediate: int = 0
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_dim: int = 0
    linear_v_dim: int = 0
    conv_kernel: int = 4
    partial_rotary: float = 0.25
    full_attention_interval: int = 4


PRESETS: dict[tuple[str, str], Preset] = {
    ("qwen3_moe", "tiny"): Preset(
        hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
        num_experts=8, top_k=2, moe_intermediate=32, intermediate=128,
        rope_theta=10_000.0, max_position=4096,
    ),
    ("qwen3_5_moe", "tiny"): Preset(
        hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
        num_experts=8, top_k=2, moe_intermediate=32, shared_intermediate=32,
        linear_k_heads=2, linear_v_heads=4, linear_k_dim=16, linear_v_dim=16,
        rope_theta=10_000.0, max_position=4096,
    ),
    ("qwen3_moe", "small"): Preset(
        hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=2, head_dim=128,
        num_experts=64, top_k=8, moe_intermediate=128, intermediate=3072,
        rope_theta=1_000_000.0, max_position=32768,
    ),
    ("qwen3_5_moe", "small"): Preset(
        hidden_size=1024, num_layers=8, num_heads=8, num_kv_heads=2, head_dim=256,
        num_experts=64, top_k=8, moe_intermediate=128, shared_intermediate=128,
        linear_k_heads=8, linear_v_heads=16, linear_k_dim=128, linear_v_dim=128,
        rope_theta=10_000_000.0, max_position=32768,
    ),
    ("qwen3_5_moe", "qwen3.6-35b-a3b"): Preset(
        hidden_size=2048, num_layers=40, num_heads=16, num_kv_heads=2, head_dim=256,
        num_experts=256, top_k=8, moe_intermediate=512, shared_intermediate=512,
        linear_k_heads=16, linear_v_heads=32, linear_k_dim=128, linear_v_dim=128,
        rope_theta=10_000_000.0, max_position=262144, vocab_size=248320,
    ),
    ("qwen3_moe", "qwen3-30b-a3b"): Preset(
        hidden_size=2048, num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128,
        num_experts=128, top_k=8, moe_intermediate=768, intermediate=6144,
        rope_theta=1_000_000.0, max_position=40960, vocab_size=151936,
    ),
}


def _preset(arch: str, size: str) -> Preset:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {ARCHS}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose from {SIZES}")
    if (arch, size) not in PRESETS:
        valid = ", ".join(f"{a}/{s}" for a, s in PRESETS)
        raise ValueError(f"size {size!r} does not exist for {arch!r}; valid: {valid}")
    return PRESETS[(arch, size)]


# ---------------------------------------------------------------------------------------
# config.json


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _mrope_section(head_dim: int, partial_rotary: float) -> list[int]:
    half = int(head_dim * partial_rotary) // 2
    base, rem = divmod(half, 3)
    return [base + (1 if i < rem else 0) for i in range(3)]


def model_config(
    arch: str,
    size: str,
    *,
    multimodal: bool = False,
    num_layers: int | None = None,
    dtype: str = "float32",
    tokenizer_vocab: int = TOKENIZER_VOCAB,
) -> dict:
    """The config.json dict of a preset (as transformers 5.24 reads and writes it)."""
    p = _preset(arch, size)
    if multimodal and arch != "qwen3_5_moe":
        raise ValueError("multimodal=True exists only for qwen3_5_moe")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}")
    layers = p.num_layers if num_layers is None else int(num_layers)
    if layers < 1:
        raise ValueError("num_layers must be >= 1")
    vocab = p.vocab_size if p.vocab_size is not None else _round_up(tokenizer_vocab, 64)
    if vocab < tokenizer_vocab:
        raise ValueError(f"model vocab {vocab} smaller than tokenizer vocab {tokenizer_vocab}")
    ids = special_token_ids(tokenizer_vocab)
    eot, im_end = ids["<|endoftext|>"], ids["<|im_end|>"]

    common = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": eot,
        "eos_token_id": im_end,
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "hidden_size": p.hidden_size,
        "initializer_range": 0.02,
        "max_position_embeddings": p.max_position,
        "moe_intermediate_size": p.moe_intermediate,
        "num_attention_heads": p.num_heads,
        "num_experts": p.num_experts,
        "num_experts_per_tok": p.top_k,
        "num_hidden_layers": layers,
        "num_key_value_heads": p.num_kv_heads,
        "output_router_logits": False,
        "rms_norm_eps": p.rms_eps,
        "router_aux_loss_coef": 0.001,
        "tie_word_embeddings": False,
        "use_cache": True,
        "vocab_size": vocab,
    }
    if arch == "qwen3_moe":
        cfg = {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            **common,
            "decoder_sparse_step": 1,
            "intermediate_size": p.intermediate,
            "max_window_layers": layers,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            "rope_parameters": {"rope_theta": p.rope_theta, "rope_type": "default"},
            "sliding_window": None,
            "use_sliding_window": False,
        }
        return dict(sorted(cfg.items()), dtype=dtype, transformers_version=TRANSFORMERS_VERSION)

    rotary = int(p.head_dim * p.partial_rotary)
    if rotary < 2 or rotary % 2:
        raise ValueError(f"rotary dim {rotary} must be even and >= 2")
    layer_types = [
        "full_attention" if (i + 1) % p.full_attention_interval == 0 else "linear_attention"
        for i in range(layers)
    ]
    text = {
        "model_type": "qwen3_5_moe_text",
        **common,
        "attn_output_gate": True,
        "full_attention_interval": p.full_attention_interval,
        "layer_types": layer_types,
        "linear_conv_kernel_dim": p.conv_kernel,
        "linear_key_head_dim": p.linear_k_dim,
        "linear_num_key_heads": p.linear_k_heads,
        "linear_num_value_heads": p.linear_v_heads,
        "linear_value_head_dim": p.linear_v_dim,
        "mtp_num_hidden_layers": 1 if multimodal else 0,
        "mtp_use_dedicated_embeddings": False,
        "rope_parameters": {
            "mrope_interleaved": True,
            "mrope_section": _mrope_section(p.head_dim, p.partial_rotary),
            "partial_rotary_factor": p.partial_rotary,
            "rope_theta": p.rope_theta,
            "rope_type": "default",
        },
        "shared_expert_intermediate_size": p.shared_intermediate,
    }
    text = dict(sorted(text.items()), dtype=dtype)
    if not multimodal:
        return {"architectures": ["Qwen3_5MoeForCausalLM"], **text, "transformers_version": TRANSFORMERS_VERSION}
    vision = {
        "deepstack_visual_indexes": [],
        "depth": 1,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 32,
        "in_channels": 3,
        "initializer_range": 0.02,
        "intermediate_size": 64,
        "model_type": "qwen3_5_moe_vision",
        "num_heads": 2,
        "num_position_embeddings": 64,
        "out_hidden_size": p.hidden_size,
        "patch_size": 8,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "dtype": dtype,
        "image_token_id": ids["<|image_pad|>"],
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "tie_word_embeddings": False,
        "transformers_version": TRANSFORMERS_VERSION,
        "video_token_id": ids["<|video_pad|>"],
        "vision_config": vision,
        "vision_end_token_id": ids["<|vision_end|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
    }


def generation_config(tokenizer_vocab: int = TOKENIZER_VOCAB) -> dict:
    ids = special_token_ids(tokenizer_vocab)
    eot, im_end = ids["<|endoftext|>"], ids["<|im_end|>"]
    return {
        "bos_token_id": eot,
        "do_sample": True,
        "eos_token_id": [im_end, eot],
        "pad_token_id": eot,
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.8,
        "transformers_version": TRANSFORMERS_VERSION,
    }


# ---------------------------------------------------------------------------------------
# Tensor specs: name, shape and how to draw the values


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    init: Callable[[], torch.Tensor]  # -> fp32 tensor of `shape`

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


# Tensors above this many elements are drawn in fixed blocks of rows (each block its own
# generator), in parallel; smaller ones from one generator. Both depend only on the seed
# and the name, never on the thread count.
_BLOCK = 1 << 22


def _seed_of(seed: int, canonical: str) -> int:
    digest = hashlib.sha256(f"{seed}/{canonical}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _gen(seed: int, canonical: str) -> torch.Generator:
    return torch.Generator().manual_seed(_seed_of(seed, canonical))


def _canonical(name: str) -> str:
    return name.replace("model.language_model.", "model.", 1)


class _Draw:
    """Value recipes; each draws from generators seeded by (seed, canonical name).

    `pool` parallelises the drawing of tensors larger than `_BLOCK` elements (only those,
    so work already running on the pool never waits on it)."""

    def __init__(self, seed: int, pool: ThreadPoolExecutor | None = None):
        self.seed = seed
        self.pool = pool

    def map(self, fn, items, numel: int) -> None:
        if self.pool is not None and numel > _BLOCK:
            list(self.pool.map(fn, items))
        else:
            for it in items:
                fn(it)

    def fill_normal(self, out: torch.Tensor, name: str, mean: float, std: float) -> torch.Tensor:
        canon = _canonical(name)
        if out.numel() <= _BLOCK:
            return out.normal_(mean, std, generator=_gen(self.seed, canon))
        flat = out.view(out.shape[0], -1)
        rows = max(1, _BLOCK // flat.shape[1])
        starts = range(0, flat.shape[0], rows)

        def block(r0: int) -> None:
            flat[r0 : r0 + rows].normal_(mean, std, generator=_gen(self.seed, f"{canon}#rows{r0}"))

        self.map(block, starts, out.numel())
        return out

    def normal(self, name: str, shape, std: float) -> torch.Tensor:
        return self.fill_normal(torch.empty(shape), name, 0.0, std)

    def near(self, name: str, shape, center: float, std: float = 0.1) -> torch.Tensor:
        return self.fill_normal(torch.empty(shape), name, center, std)

    def a_log(self, name: str, shape) -> torch.Tensor:
        g = _gen(self.seed, _canonical(name))
        return torch.empty(shape).uniform_(1.0, 16.0, generator=g).log_()

    def dt_bias(self, name: str, shape) -> torch.Tensor:
        # Mamba-style: softplus(dt_bias) = dt, dt log-uniform in [1e-3, 1e-1]. With A in
        # [1, 16] the per-token decay exp(-A*dt) spans ~0.2 .. ~0.999, so some heads carry
        # state over hundreds of tokens (a state hand-off bug changes the logits) and none
        # forget everything in one step (as dt_bias = 1 would, softplus(1)*A up to ~21).
        g = _gen(self.seed, _canonical(name))
        u = torch.rand(shape, generator=g)
        dt = torch.exp(u * (math.log(1e-1) - math.log(1e-3)) + math.log(1e-3))
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus


def _check_router_skew(skew: float) -> None:
    if not (math.isfinite(skew) and skew >= 0):
        raise ValueError(f"router_skew must be a finite number >= 0, got {skew}")


def router_gains(num_experts: int, skew: float, seed: int, gate_name: str) -> torch.Tensor:
    """Row gains [E] of one router for `router_skew` (see the module docstring): a seeded
    per-layer permutation gives expert e the popularity rank r_e; its gain is (r_e + 1)^-skew."""
    _check_router_skew(skew)
    rank = torch.randperm(num_experts, generator=_gen(seed, _canonical(gate_name) + "/router-skew"))
    return (rank.double() + 1.0).pow(-skew).float()


def _text_layer_specs(cfg: dict, arch: str, i: int, prefix: str, layout: str, d: _Draw,
                      router_skew: float = 0.0) -> list[TensorSpec]:
    H = cfg["hidden_size"]
    hd, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    E, I = cfg["num_experts"], cfg["moe_intermediate_size"]
    p = f"{prefix}layers.{i}."
    zero_centred = arch == "qwen3_5_moe"
    norm_center = 0.0 if zero_centred else 1.0
    specs: list[TensorSpec] = []

    def add(name, shape, fn):
        specs.append(TensorSpec(name, tuple(shape), fn))

    def linear(name, out_f, in_f, gain=1.0):
        add(name, (out_f, in_f), lambda: d.normal(name, (out_f, in_f), gain / math.sqrt(in_f)))

    def norm(name, n, center=norm_center):
        add(name, (n,), lambda: d.near(name, (n,), center))

    norm(p + "input_layernorm.weight", H)
    kind = cfg["layer_types"][i] if arch == "qwen3_5_moe" else "full_attention"
    if kind == "full_attention":
        a = p + "self_attn."
        linear(a + "q_proj.weight", nq * hd * (2 if arch == "qwen3_5_moe" else 1), H)
        linear(a + "k_proj.weight", nkv * hd, H)
        linear(a + "v_proj.weight", nkv * hd, H)
        linear(a + "o_proj.weight", H, nq * hd)
        norm(a + "q_norm.weight", hd)
        norm(a + "k_norm.weight", hd)
    else:
        la = p + "linear_attn."
        nk, nv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
        dk, dv = cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
        K = cfg["linear_conv_kernel_dim"]
        conv_dim = 2 * nk * dk + nv * dv
        linear(la + "in_proj_qkv.weight", conv_dim, H)
        linear(la + "in_proj_z.weight", nv * dv, H)
        linear(la + "in_proj_b.weight", nv, H)
        linear(la + "in_proj_a.weight", nv, H, gain=0.5)  # a ~ N(0, 0.5^2): gentle data-dependent decay
        name = la + "conv1d.weight"
        add(name, (conv_dim, 1, K), lambda name=name: d.normal(name, (conv_dim, 1, K), 1.0 / math.sqrt(K)))
        name = la + "dt_bias"
        add(name, (nv,), lambda name=name: d.dt_bias(name, (nv,)))
        name = la + "A_log"
        add(name, (nv,), lambda name=name: d.a_log(name, (nv,)))
        norm(la + "norm.weight", dv, center=1.0)  # gated RMSNorm: plain weight, not zero-centred
        linear(la + "out_proj.weight", H, nv * dv)
    norm(p + "post_attention_layernorm.weight", H)

    m = p + "mlp."
    gate = m + "gate.weight"
    if router_skew:  # Zipf-like expert popularity (module docstring)
        add(gate, (E, H), lambda: d.normal(gate, (E, H), 1.0 / math.sqrt(H))
            * router_gains(E, router_skew, d.seed, gate)[:, None])
    else:
        linear(gate, E, H)  # router logits ~ N(0, 1): tokens spread over experts
    ex = m + "experts."
    if layout == "per-expert":
        for e in range(E):
            linear(f"{ex}{e}.gate_proj.weight", I, H)
            linear(f"{ex}{e}.up_proj.weight", I, H)
            linear(f"{ex}{e}.down_proj.weight", H, I)
    else:
        # The same values as the per-expert layout: expert e's slices are drawn under the
        # per-expert names.
        def gate_up(ex=ex):
            out = torch.empty(E, 2 * I, H)

            def one(e):
                d.fill_normal(out[e, :I], f"{ex}{e}.gate_proj.weight", 0.0, 1.0 / math.sqrt(H))
                d.fill_normal(out[e, I:], f"{ex}{e}.up_proj.weight", 0.0, 1.0 / math.sqrt(H))

            d.map(one, range(E), out.numel())
            return out

        def down(ex=ex):
            out = torch.empty(E, H, I)
            def one(e):
                d.fill_normal(out[e], f"{ex}{e}.down_proj.weight", 0.0, 1.0 / math.sqrt(I))

            d.map(one, range(E), out.numel())
            return out

        add(ex + "gate_up_proj", (E, 2 * I, H), gate_up)
        add(ex + "down_proj", (E, H, I), down)
    if arch == "qwen3_5_moe":
        Is = cfg["shared_expert_intermediate_size"]
        linear(m + "shared_expert.gate_proj.weight", Is, H)
        linear(m + "shared_expert.up_proj.weight", Is, H)
        linear(m + "shared_expert.down_proj.weight", H, Is)
        linear(m + "shared_expert_gate.weight", 1, H)
    return specs


def _vision_specs(vcfg: dict, d: _Draw) -> list[TensorSpec]:
    vh, vi = vcfg["hidden_size"], vcfg["intermediate_size"]
    C, T, P = vcfg["in_channels"], vcfg["temporal_patch_size"], vcfg["patch_size"]
    merged = vh * vcfg["spatial_merge_size"] ** 2
    out = vcfg["out_hidden_size"]
    specs: list[TensorSpec] = []

    def w(name, shape, std):
        specs.append(TensorSpec(name, tuple(shape), lambda: d.normal(name, shape, std)))

    def const(name, n, value):
        specs.append(TensorSpec(name, (n,), lambda: torch.full((n,), float(value))))

    v = "model.visual."
    w(v + "patch_embed.proj.weight", (vh, C, T, P, P), 1.0 / math.sqrt(C * T * P * P))
    const(v + "patch_embed.proj.bias", vh, 0.0)
    w(v + "pos_embed.weight", (vcfg["num_position_embeddings"], vh), 0.02)
    for j in range(vcfg["depth"]):
        b = f"{v}blocks.{j}."
        for n in ("norm1", "norm2"):
            const(b + n + ".weight", vh, 1.0)
            const(b + n + ".bias", vh, 0.0)
        w(b + "attn.qkv.weight", (3 * vh, vh), 1.0 / math.sqrt(vh))
        const(b + "attn.qkv.bias", 3 * vh, 0.0)
        w(b + "attn.proj.weight", (vh, vh), 0.5 / math.sqrt(vh))
        const(b + "attn.proj.bias", vh, 0.0)
        w(b + "mlp.linear_fc1.weight", (vi, vh), 1.0 / math.sqrt(vh))
        const(b + "mlp.linear_fc1.bias", vi, 0.0)
        w(b + "mlp.linear_fc2.weight", (vh, vi), 0.5 / math.sqrt(vi))
        const(b + "mlp.linear_fc2.bias", vh, 0.0)
    const(v + "merger.norm.weight", vh, 1.0)
    const(v + "merger.norm.bias", vh, 0.0)
    w(v + "merger.linear_fc1.weight", (merged, merged), 1.0 / math.sqrt(merged))
    const(v + "merger.linear_fc1.bias", merged, 0.0)
    w(v + "merger.linear_fc2.weight", (out, merged), 1.0 / math.sqrt(merged))
    const(v + "merger.linear_fc2.bias", out, 0.0)
    return specs


def _mtp_specs(tcfg: dict, layout: str, d: _Draw, router_skew: float = 0.0) -> list[TensorSpec]:
    """The multi-token-prediction head of Qwen3.5/3.6 releases: one full-attention layer."""
    H = tcfg["hidden_size"]
    specs = [
        TensorSpec("mtp.fc.weight", (H, 2 * H), lambda: d.normal("mtp.fc.weight", (H, 2 * H), 1 / math.sqrt(2 * H)))
    ]
    for n in ("mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"):
        specs.append(TensorSpec(n, (H,), lambda n=n: d.near(n, (H,), 0.0)))
    mtp_cfg = dict(tcfg, layer_types=["full_attention"])
    specs += _text_layer_specs(mtp_cfg, "qwen3_5_moe", 0, "mtp.", layout, d, router_skew)
    return specs


def _planted(d: "_Draw", emb: str, vocab: int, hidden: int) -> torch.Tensor:
    """The planted head: row pi(t) = embedding of t / sqrt(hidden), pi a seeded permutation."""
    perm = torch.randperm(vocab, generator=_gen(d.seed, "lm_head.weight#planted"))
    head = torch.empty(vocab, hidden)
    head[perm] = d.normal(emb, (vocab, hidden), 1.0)  # the embedding's own values (same seed, same name)
    return head.mul_(hidden ** -0.5)


def iter_tensor_groups(
    config: dict, expert_layout: str = "per-expert", seed: int = 0, pool: ThreadPoolExecutor | None = None,
    router_skew: float = 0.0, planted_head: bool = False,
) -> Iterator[tuple[str, list[TensorSpec]]]:
    """(group, specs) for every tensor of the checkpoint described by `config`, in write order.

    Groups: ``embed``, ``layers.{i}``, ``final``, then ``visual`` and ``mtp`` for the
    multimodal layout. Values are only drawn when a spec's `init()` is called.
    `router_skew` > 0 skews each router's expert popularity, `planted_head` plants the head
    (module docstring).
    """
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout must be one of {EXPERT_LAYOUTS}")
    _check_router_skew(router_skew)
    mt = config["model_type"]
    multimodal = mt == "qwen3_5_moe"
    tcfg = config["text_config"] if multimodal else config
    arch = "qwen3_moe" if tcfg["model_type"] == "qwen3_moe" else "qwen3_5_moe"
    prefix = "model.language_model." if multimodal else "model."
    d = _Draw(seed, pool)
    H, V = tcfg["hidden_size"], tcfg["vocab_size"]
    final_center = 0.0 if arch == "qwen3_5_moe" else 1.0

    emb = prefix + "embed_tokens.weight"
    yield "embed", [TensorSpec(emb, (V, H), lambda: d.normal(emb, (V, H), 1.0))]
    for i in range(tcfg["num_hidden_layers"]):
        yield f"layers.{i}", _text_layer_specs(tcfg, arch, i, prefix, expert_layout, d, router_skew)
    norm = prefix + "norm.weight"
    final = [TensorSpec(norm, (H,), lambda: d.near(norm, (H,), final_center))]
    if not tcfg["tie_word_embeddings"]:
        # logits ~ N(0, 2^2) for a unit-RMS final hidden state: peaked, never saturated
        head = "lm_head.weight"
        draw_head = (lambda: _planted(d, emb, V, H)) if planted_head else (lambda: d.normal(head, (V, H), 2.0 / math.sqrt(H)))
        final.append(TensorSpec(head, (V, H), draw_head))
    elif planted_head:
        raise ValueError("planted_head needs an untied lm_head")
    yield "final", final
    if multimodal:
        yield "visual", _vision_specs(config["vision_config"], d)
        if tcfg.get("mtp_num_hidden_layers", 0):
            yield "mtp", _mtp_specs(tcfg, expert_layout, d, router_skew)


# ---------------------------------------------------------------------------------------
# Writing


class ShardWriter:
    """Collects tensors into safetensors shards of at most `max_shard_bytes` (a bigger
    tensor gets a shard of its own). One shard -> ``model.safetensors``; more ->
    ``model-0000k-of-0000N.safetensors`` plus ``model.safetensors.index.json``."""

    def __init__(self, out_dir: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES):
        if max_shard_bytes <= 0:
            raise ValueError("max_shard_bytes must be positive")
        self.out_dir = Path(out_dir)
        self.max_shard_bytes = int(max_shard_bytes)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []
        self._names: set[str] = set()
        self.total_bytes = 0
        self.total_params = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._names:
            raise ValueError(f"duplicate tensor name {name!r}")
        self._names.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self.flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += nbytes
        self.total_bytes += nbytes
        self.total_params += tensor.numel()

    def flush(self) -> None:
        if not self._pending:
            return
        from safetensors.torch import save_file

        path = self.out_dir / f".shard-{len(self._shards):05d}.tmp"
        save_file(self._pending, str(path), metadata={"format": "pt"})
        self._shards.append((path, list(self._pending)))
        self._pending = {}
        self._pending_bytes = 0

    def finish(self) -> list[Path]:
        self.flush()
        n = len(self._shards)
        if n == 1:
            final = self.out_dir / "model.safetensors"
            os.replace(self._shards[0][0], final)
            os.chmod(final, 0o644)
            return [final]
        weight_map: dict[str, str] = {}
        paths = []
        for k, (tmp, names) in enumerate(self._shards):
            fname = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            os.replace(tmp, self.out_dir / fname)
            os.chmod(self.out_dir / fname, 0o644)
            paths.append(self.out_dir / fname)
            weight_map.update({nm: fname for nm in names})
        index = {
            "metadata": {"total_parameters": self.total_params, "total_size": self.total_bytes},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        return paths


class Emitter:
    """The one place every checkpoint tensor goes through (the quantization hook).

    ``emit(name, fp32_tensor)`` = ``write(convert(name, fp32_tensor))``. `convert` gets the
    fp32 master value of one tensor and returns the (name, tensor) pairs to store; it must
    be pure and thread-safe, because `make_model` runs it on worker threads right after
    drawing each tensor and then `write`s the results in checkpoint order on the main
    thread. `end_group` is called after each group (``embed``, ``layers.{i}``, ``final``,
    ``visual``, ``mtp``); `config_patch` is merged into config.json (e.g. a
    ``quantization_config``). The plain emitter casts to the checkpoint dtype. A quantized
    format overrides `convert` (e.g. returning ``weight`` + ``weight_scale``),
    `config_patch`, and is selected in `_make_emitter`.
    """

    def __init__(self, writer: ShardWriter, dtype: torch.dtype):
        self.writer = writer
        self.dtype = dtype

    def convert(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return [(name, tensor.to(self.dtype))]

    def write(self, items: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in items:
            self.writer.add(name, tensor)

    def emit(self, name: str, tensor: torch.Tensor) -> None:
        self.write(self.convert(name, tensor))

    def end_group(self, group: str) -> None:
        pass

    def config_patch(self) -> dict:
        return {}

    def extra_files(self) -> dict[str, dict]:
        """Further JSON files of the checkpoint directory (name -> content)."""
        return {}


class QuantEmitter(Emitter):
    """Quantizes every linear weight per a preset of `moeferry.checkpoint.formats.presets`.

    Each 2-D ``*.weight`` goes through `quantize_module(preset, module, w)` with `w` cast to
    the checkpoint dtype first (the real quantizers read the released bf16 weights); the
    modules a preset leaves unquantized (routers, norms, embeddings, conv1d, visual, mtp,
    ...) come back as a plain ``.weight`` in the checkpoint dtype. Every other tensor
    (biases, A_log, dt_bias, 1-D norms) is cast as by the plain emitter. The module names
    are collected as they pass, because ModelOpt's MIXED_PRECISION config lists every
    quantized layer; `config_patch` / `extra_files` build the config files at the end.
    """

    def __init__(self, writer: ShardWriter, dtype: torch.dtype, quant: str, device: str | None = None):
        super().__init__(writer, dtype)
        from moeferry.checkpoint.formats import PRESETS as QUANT_PRESETS

        if quant not in QUANT_PRESETS:
            raise ValueError(f"unknown quantization preset {quant!r}; known: {', '.join(QUANT_PRESETS)}")
        self.quant = quant
        # Optional accelerator for the quantizer math (fp8 / nvfp4 formats run there; a
        # format that cannot falls back to the CPU). Values are drawn on the CPU either way.
        self.device = torch.device(device) if device else None
        self._modules: set[str] = set()
        self._lock = threading.Lock()
        self._configs: tuple[dict | None, dict | None] | None = None

    def _quantize(self, module: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        from moeferry.checkpoint.formats import quantize_module

        if self.device is not None:
            try:
                out = quantize_module(self.quant, module, w.to(self.device))
                return {k: v.cpu() for k, v in out.items()}
            except RuntimeError as e:
                if "device" not in str(e):
                    raise
                self.device = None  # this format's quantizer is CPU-only
        return quantize_module(self.quant, module, w)

    def convert(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if not (name.endswith(".weight") and tensor.ndim == 2):
            return [(name, tensor.to(self.dtype))]
        module = name[: -len(".weight")]
        with self._lock:
            self._modules.add(module)
        out = self._quantize(module, tensor.to(self.dtype))
        return [(k, v.contiguous()) for k, v in out.items()]

    def _quant_configs(self) -> tuple[dict | None, dict | None]:
        if self._configs is None:
            from moeferry.checkpoint.formats import synthetic_quant_config

            self._configs = synthetic_quant_config(self.quant, sorted(self._modules))
        return self._configs

    def config_patch(self) -> dict:
        qc, _ = self._quant_configs()
        return {"quantization_config": qc} if qc is not None else {}

    def extra_files(self) -> dict[str, dict]:
        _, hq = self._quant_configs()
        return {"hf_quant_config.json": hq} if hq is not None else {}


def _make_emitter(quant: str | None, writer: ShardWriter, dtype: torch.dtype) -> Emitter:
    if quant is None:
        return Emitter(writer, dtype)
    # MOEFERRY_QUANT_DEVICE=cuda quantizes on the GPU (35B-class checkpoints in seconds
    # instead of minutes); the CPU path is the default and the reference.
    return QuantEmitter(writer, dtype, quant, device=os.environ.get("MOEFERRY_QUANT_DEVICE") or None)


def _produce(spec: TensorSpec, convert) -> list[tuple[str, torch.Tensor]]:
    t = spec.init()
    if tuple(t.shape) != spec.shape:
        raise AssertionError(f"{spec.name}: drew {tuple(t.shape)}, spec says {spec.shape}")
    return convert(spec.name, t)


def _draw(specs: list[TensorSpec], pool: ThreadPoolExecutor, convert, batch_numel: int = 1 << 26):
    """convert(name, value) for each spec, in order. Small tensors are drawn and converted
    on the pool in batches of at most `batch_numel` elements; a large one on this thread
    (its drawing uses the pool itself)."""
    batch: list[TensorSpec] = []
    size = 0

    def run(batch):
        yield from pool.map(lambda sp: _produce(sp, convert), batch)

    for spec in specs:
        if spec.numel > _BLOCK:
            yield from run(batch)
            batch, size = [], 0
            yield _produce(spec, convert)
            continue
        if batch and size + spec.numel > batch_numel:
            yield from run(batch)
            batch, size = [], 0
        batch.append(spec)
        size += spec.numel
    yield from run(batch)


def make_model(
    out_dir: str | os.PathLike,
    arch: str,
    size: str,
    expert_layout: str = "per-expert",
    seed: int = 0,
    dtype: str = "float32",
    multimodal: bool = False,
    num_layers: int | None = None,
    *,
    quant: str | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    router_skew: float = 0.0,
    planted_head: bool = False,
) -> Path:
    """Write a complete random Hugging Face checkpoint directory and return its path.

    `arch` in ARCHS, `size` in SIZES (see PRESETS for the valid pairs), `num_layers`
    overrides the preset's layer count, `max_shard_bytes` caps a safetensors shard (tests
    use a small value to get an index and several shards). `quant` writes a quantized
    checkpoint (per-expert layout only). `router_skew` > 0 gives the routers a Zipf-like
    expert popularity (module docstring; 0 leaves every byte as without it); `planted_head`
    plants the head (module docstring). Same arguments, same bytes.
    """
    if expert_layout not in EXPERT_LAYOUTS:
        raise ValueError(f"expert_layout must be one of {EXPERT_LAYOUTS}")
    if quant is not None and expert_layout != "per-expert":
        raise ValueError(f"quant={quant!r} needs expert_layout='per-expert': quantized checkpoints "
                         "(ModelOpt, compressed-tensors, AWQ, fine-grained FP8) store experts one by one")
    _check_router_skew(router_skew)
    config = model_config(arch, size, multimodal=multimodal, num_layers=num_layers, dtype=dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for stale in list(out.glob("model*.safetensors")) + list(out.glob(".shard-*.tmp")):
        stale.unlink()
    (out / "model.safetensors.index.json").unlink(missing_ok=True)
    (out / "hf_quant_config.json").unlink(missing_ok=True)

    writer = ShardWriter(out, max_shard_bytes)
    emitter = _make_emitter(quant, writer, DTYPES[dtype])
    workers = max(1, min(32, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for group, specs in iter_tensor_groups(config, expert_layout, seed, pool, router_skew, planted_head):
            for items in _draw(specs, pool, emitter.convert):
                emitter.write(items)
            emitter.end_group(group)
    writer.finish()

    config.update(emitter.config_patch())
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for fname, content in emitter.extra_files().items():
        (out / fname).write_text(json.dumps(content, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation_config(), indent=2) + "\n")
    tcfg = config.get("text_config", config)
    train_demo_tokenizer(out, TOKENIZER_VOCAB, model_max_length=tcfg["max_position_embeddings"])
    return out
