"""ModelSpec: the architecture numbers of a checkpoint, parsed once from its config."""
from __future__ import annotations

from dataclasses import dataclass

from moeferry.checkpoint.reader import CheckpointError

FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attn_output_gate: bool
    rotary_dim: int
    rope_theta: float
    rms_norm_eps: float
    zero_centered_norm: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    # MoE
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int  # 0 = no shared expert
    dense_layers: tuple[int, ...]  # layers with a dense MLP instead of experts (Qwen3-MoE)
    dense_intermediate_size: int
    # Gated DeltaNet (linear attention)
    linear_num_k_heads: int = 0
    linear_num_v_heads: int = 0
    linear_k_head_dim: int = 0
    linear_v_head_dim: int = 0
    conv_kernel: int = 0
    eos_token_ids: tuple[int, ...] = ()

    @property
    def attention_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION]

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION]

    @property
    def conv_dim(self) -> int:
        return 2 * self.linear_num_k_heads * self.linear_k_head_dim + self.linear_num_v_heads * self.linear_v_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers


def _rope(cfg: dict, head_dim: int) -> tuple[int, float]:
    """(rotary_dim, theta) from `rope_parameters` (transformers 5) or legacy top-level keys."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type", legacy.get("rope_type", legacy.get("type", "default")))
    if rope_type != "default":
        raise CheckpointError(f"rope_type '{rope_type}' is not supported yet (only 'default')")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    factor = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    return int(head_dim * factor), float(theta)


def _eos_ids(cfg: dict, generation: dict) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (generation.get("eos_token_id"), cfg.get("eos_token_id")):
        for i in source if isinstance(source, list) else [source]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)


def _normalise(cfg: dict) -> dict:
    """Accept both spellings transformers has used for the expert count."""
    if "num_experts" not in cfg and "num_local_experts" in cfg:
        cfg = {**cfg, "num_experts": cfg["num_local_experts"]}
    return cfg


def parse_qwen3_moe(arch: str, cfg: dict, generation: dict) -> ModelSpec:
    cfg = _normalise(cfg)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rotary_dim, theta = _rope(cfg, head_dim)
    n = cfg["num_hidden_layers"]
    if cfg.get("use_sliding_window"):
        raise CheckpointError("sliding-window attention is not supported yet")
    step = cfg.get("decoder_sparse_step", 1) or 1
    mlp_only = set(cfg.get("mlp_only_layers") or [])
    dense = tuple(i for i in range(n) if i in mlp_only or cfg["num_experts"] == 0 or (i + 1) % step != 0)
    return ModelSpec(
        architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        num_layers=n, layer_types=(FULL_ATTENTION,) * n, num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"], head_dim=head_dim, attn_output_gate=False,
        rotary_dim=rotary_dim, rope_theta=theta, rms_norm_eps=cfg["rms_norm_eps"], zero_centered_norm=False,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=cfg.get("max_position_embeddings", 32768),
        num_experts=cfg["num_experts"], top_k=cfg["num_experts_per_tok"],
        moe_intermediate_size=cfg["moe_intermediate_size"], norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=0, dense_layers=dense,
        dense_intermediate_size=cfg.get("intermediate_size", 0), eos_token_ids=_eos_ids(cfg, generation),
    )


def parse_qwen3_5_moe(arch: str, cfg: dict, generation: dict) -> ModelSpec:
    cfg = _normalise(cfg)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    rotary_dim, theta = _rope({"partial_rotary_factor": 0.25, **cfg}, head_dim)
    n = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        interval = cfg.get("full_attention_interval", 4)
        types = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(n)]
    if len(types) != n or not set(types) <= {FULL_ATTENTION, LINEAR_ATTENTION}:
        raise CheckpointError(f"layer_types must list {n} of {FULL_ATTENTION}/{LINEAR_ATTENTION}, got {types}")
    return ModelSpec(
        architecture=arch, vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
        num_layers=n, layer_types=tuple(types), num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"], head_dim=head_dim, attn_output_gate=True,
        rotary_dim=rotary_dim, rope_theta=theta, rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        zero_centered_norm=True, tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=cfg.get("max_position_embeddings", 32768),
        num_experts=cfg["num_experts"], top_k=cfg["num_experts_per_tok"],
        moe_intermediate_size=cfg["moe_intermediate_size"], norm_topk_prob=True,
        shared_expert_intermediate_size=cfg.get("shared_expert_intermediate_size", 0), dense_layers=(),
        dense_intermediate_size=0,
        linear_num_k_heads=cfg["linear_num_key_heads"], linear_num_v_heads=cfg["linear_num_value_heads"],
        linear_k_head_dim=cfg["linear_key_head_dim"], linear_v_head_dim=cfg["linear_value_head_dim"],
        conv_kernel=cfg.get("linear_conv_kernel_dim", 4), eos_token_ids=_eos_ids(cfg, generation),
    )
