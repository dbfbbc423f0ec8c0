"""Build a CausalLM from a checkpoint, one layer at a time."""
from __future__ import annotations

import logging
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch
from tqdm import tqdm

from moeferry.checkpoint.experts import read_experts
from moeferry.checkpoint.formats import BF16, FORMATS
from moeferry.checkpoint.reader import CheckpointError, CheckpointReader
from moeferry.model.linear import Linear
from moeferry.model.layers import DecoderLayer, DenseMLP, FullAttention, GatedDeltaNet, SparseMoE
from moeferry.model.model import CausalLM
from moeferry.model.spec import FULL_ATTENTION, ModelSpec
from moeferry.model.weights import WeightLoader
from moeferry.moe.layer_experts import ExpertSource, LayerExperts, LazyExperts

log = logging.getLogger(__name__)


class LoadTimes:
    """Seconds per loading phase, so the boot log says where loading went."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.start = time.perf_counter()

    @contextmanager
    def phase(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t

    def describe(self) -> str:
        total = time.perf_counter() - self.start
        rest = total - sum(self.seconds.values())
        parts = [f"{name} {s:.1f} s" for name, s in self.seconds.items()] + [f"dense weights and the rest {rest:.1f} s"]
        return f"{total:.1f} s: " + ", ".join(parts)


def _attention(w: WeightLoader, spec: ModelSpec, p: str, kv_index: int) -> FullAttention:
    h, d = spec.hidden_size, spec.head_dim
    q_out = spec.num_heads * d * (2 if spec.attn_output_gate else 1)
    return FullAttention(
        spec, w.linear(p + "q_proj", q_out, h), w.linear(p + "k_proj", spec.num_kv_heads * d, h),
        w.linear(p + "v_proj", spec.num_kv_heads * d, h), w.linear(p + "o_proj", h, spec.num_heads * d),
        w.tensor(p + "q_norm.weight", (d,)), w.tensor(p + "k_norm.weight", (d,)), kv_index)


def _gdn(w: WeightLoader, spec: ModelSpec, p: str, state_index: int) -> GatedDeltaNet:
    h, hv = spec.hidden_size, spec.linear_num_v_heads
    value_dim = hv * spec.linear_v_head_dim
    conv = w.tensor(p + "conv1d.weight", (spec.conv_dim, 1, spec.conv_kernel))[:, 0, :].contiguous()
    return GatedDeltaNet(
        spec, w.linear(p + "in_proj_qkv", spec.conv_dim, h), w.linear(p + "in_proj_z", value_dim, h),
        w.linear(p + "in_proj_b", hv, h), w.linear(p + "in_proj_a", hv, h), w.linear(p + "out_proj", h, value_dim),
        conv, w.tensor(p + "A_log", (hv,)), w.tensor(p + "dt_bias", (hv,)),
        w.tensor(p + "norm.weight", (spec.linear_v_head_dim,)), state_index)


def _mlp(w: WeightLoader, p: str, hidden: int, inter: int) -> DenseMLP:
    return DenseMLP(w.linear(p + "gate_proj", inter, hidden), w.linear(p + "up_proj", inter, hidden),
                    w.linear(p + "down_proj", hidden, inter))


def _layer_experts(w: WeightLoader, spec: ModelSpec, p: str, threads: int = 1, mapped: bool = True) -> LayerExperts:
    """A layer's routed experts on the host, read once (packed as stored, or stacked dense).
    `mapped`: quantized experts are views of the memory-mapped checkpoint (False: read copies)."""
    h, e, i = spec.hidden_size, spec.num_experts, spec.moe_intermediate_size
    if not w.is_quantized(p + "experts.0.gate_proj"):
        gate_up, down = read_experts(w.reader, p, e, h, i)
        return LayerExperts.from_stacked(gate_up.to(dtype=w.dtype), down.to(dtype=w.dtype))
    # quantized checkpoints store experts one by one; they are read as views of the mapped
    # files, and the backend copies each part once, straight into its slots or bank
    fmt = w.format_for(p + "experts.0.gate_proj")

    def read(x: int):
        q = f"{p}experts.{x}."
        return (w.packed(q + "gate_proj", i, h, mapped), w.packed(q + "up_proj", i, h, mapped),
                w.packed(q + "down_proj", h, i, mapped))

    source = None
    if threads > 1 and (FORMATS[fmt].repacks or not mapped):  # views are Python work: threads only contend
        with ThreadPoolExecutor(threads) as pool:
            experts = list(pool.map(read, range(e)))
    elif mapped:  # views made when asked for: a placement from the files' index makes none
        experts, source = LazyExperts(e, read), ExpertSource(w.reader, p)
    else:
        experts = [read(x) for x in range(e)]
    mixed = {w.format_for(f"{p}experts.{x}.{m}") for x in range(e) for m in ("gate_proj", "up_proj", "down_proj")}
    if len(mixed) > 1:
        raise CheckpointError(f"{p}experts mix formats {sorted(mixed)} within one layer; one format per layer "
                              f"is supported (checkpoint {w.reader.dir})")
    return LayerExperts(fmt, experts, source=source)


def _moe(w: WeightLoader, spec: ModelSpec, p: str, layer: int, experts_backend, times: LoadTimes) -> SparseMoE:
    h, si = spec.hidden_size, spec.shared_expert_intermediate_size
    with times.phase("expert reads"):
        routed = _layer_experts(w, spec, p, experts_backend.load_threads)

    def place(*shared):
        with times.phase("expert placement (host banks or device slots)"):
            return experts_backend.add_layer(layer, routed, *shared)

    router = w.linear(p + "gate", spec.num_experts, h)
    if not si:
        return SparseMoE(spec, router, place(), None, None)
    shared_gate = w.linear(p + "shared_expert_gate", 1, h)
    sp = p + "shared_expert."
    if _shared_fits_slots(w, spec, p, routed, experts_backend):  # the shared expert as one more slot
        shared = tuple(w.packed(sp + m, o, n, mapped=True) for m, o, n in
                       (("gate_proj", si, h), ("up_proj", si, h), ("down_proj", h, si)))
        return SparseMoE(spec, router, place(shared), None, shared_gate)
    return SparseMoE(spec, router, place(), _mlp(w, sp, h, si), shared_gate)


def _shared_fits_slots(w: WeightLoader, spec: ModelSpec, p: str, routed: LayerExperts, experts_backend) -> bool:
    """Whether the backend runs the shared expert in the routed experts' kernel: it must take it
    (resident on CUDA) and the shared expert must have the routed experts' slot layout (same
    intermediate size, format and quantization parameters)."""
    if not experts_backend.takes_shared or spec.shared_expert_intermediate_size != spec.moe_intermediate_size:
        return False
    pairs = [(f"{p}shared_expert.{m}", f"{p}experts.0.{m}") for m in ("gate_proj", "up_proj", "down_proj")]
    return all(w.format_for(s) == routed.format and w.scheme.params_for(s) == w.scheme.params_for(r)
               for s, r in pairs)


def expert_bytes(w: WeightLoader, spec: ModelSpec) -> tuple[int, int]:
    """(all routed experts, the largest layer's) in bytes, from the format registry's sizes."""
    h, e, i = spec.hidden_size, spec.num_experts, spec.moe_intermediate_size
    per_layer = []
    for layer in range(spec.num_layers):
        if not spec.is_moe_layer(layer):
            continue
        module = f"model.layers.{layer}.mlp.experts.0.gate_proj"
        fmt_name = w.format_for(module)
        if fmt_name == BF16.format:
            per_expert = 3 * h * i * w.dtype.itemsize
        else:
            fmt, params = FORMATS[fmt_name], w.scheme.params_for(module)
            per_expert = 2 * fmt.bytes_for(i, h, params) + fmt.bytes_for(h, i, params)
        per_layer.append(per_expert * e)
    return sum(per_layer), max(per_layer, default=0)


def load_model(reader: CheckpointReader, spec: ModelSpec, dtype: torch.dtype, device, experts_backend,
               progress: bool = True) -> CausalLM:
    """Dense weights go to `device`; each MoE layer's experts go to `experts_backend` (which
    returns the layer's executor)."""
    w = WeightLoader(reader, dtype, device)
    times = LoadTimes()
    experts_backend.prepare(*expert_bytes(w, spec))
    h = spec.hidden_size
    layers, kv_index, state_index = [], 0, 0
    for i in tqdm(range(spec.num_layers), desc="loading layers", unit="layer", disable=not progress):
        p = f"model.layers.{i}."
        if spec.layer_types[i] == FULL_ATTENTION:
            mixer = _attention(w, spec, p + "self_attn.", kv_index)
            kv_index += 1
        else:
            mixer = _gdn(w, spec, p + "linear_attn.", state_index)
            state_index += 1
        mlp = (_moe(w, spec, p + "mlp.", i, experts_backend, times) if spec.is_moe_layer(i)
               else _mlp(w, p + "mlp.", h, spec.dense_intermediate_size))
        layers.append(DecoderLayer(spec, mixer, mlp, w.tensor(p + "input_layernorm.weight", (h,)),
                                   w.tensor(p + "post_attention_layernorm.weight", (h,))))
    experts_backend.link_routers({i: l.mlp.router_logits for i, l in enumerate(layers) if isinstance(l.mlp, SparseMoE)})
    embed = w.tensor("model.embed_tokens.weight", (spec.vocab_size, h))
    tied = spec.tie_word_embeddings and not any(n.startswith("lm_head.") for n in reader.tensors)
    lm_head = Linear(embed) if tied else w.linear("lm_head", spec.vocab_size, h)
    model = CausalLM(spec, embed, layers, w.tensor("model.norm.weight", (h,)), lm_head)
    log.info("loaded %d layers in %s", spec.num_layers, times.describe())
    return model
