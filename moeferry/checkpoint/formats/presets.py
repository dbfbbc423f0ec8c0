"""Quantization presets for synthetic checkpoints, written the way each producer writes them.

    qc, hq = synthetic_quant_config("nvfp4")        # config.json quantization_config, hf_quant_config.json
    tensors = quantize_module("nvfp4", "model.layers.0.mlp.experts.3.up_proj", w)

Presets and the producer they imitate:
    fp8_tensor   ModelOpt FP8 (per-tensor weight_scale, static input_scale)
    fp8_block    HF/DeepSeek fine-grained FP8 (quant_method fp8, weight_block_size [128, 128])
    nvfp4        ModelOpt NVFP4 (W4A4: input_scale present)
    nvfp4_ct     llm-compressor NVFP4A16 (compressed-tensors nvfp4-pack-quantized)
    int4_awq     AutoAWQ GEMM, group 128, zero points
    int4_ct      llm-compressor W4A16 (compressed-tensors pack-quantized, symmetric, group 128)
    mixed_nvfp4  like nvidia/Qwen3.6-35B-A3B-NVFP4: ModelOpt MIXED_PRECISION, W4A16_NVFP4 for
                 routed experts, the shared expert's gate/up/down and lm_head, FP8 for
                 attention / GDN / dense-MLP projections, bf16 routers, norms, embeddings,
                 conv1d, GDN in_proj_a/in_proj_b (ModelOpt's Qwen3.5 recipe leaves those two
                 unquantized). The release lists each shared_expert projection as
                 W4A16_NVFP4 in quantized_layers (FreeToken 0.1.2's loader reads them as NVFP4).

Routers, norms, embeddings, `visual` and `mtp` are unquantized in every preset, and so is
lm_head except in mixed_nvfp4. MIXED_PRECISION lists every quantized layer by name, so
`synthetic_quant_config("mixed_nvfp4", module_names)` needs the model's linear module
names; `quantize_module` derives the same per-layer choice from the name alone.
"""
from __future__ import annotations

import re
from functools import lru_cache
from typing import Iterable

import torch

from .base import FP8_MAX, QuantParams
from .detect import BF16, LayerQuant, QuantScheme, canonical_module, detect_scheme, never_quantized

PRESETS = ("fp8_tensor", "fp8_block", "nvfp4", "nvfp4_ct", "int4_awq", "int4_ct", "mixed_nvfp4")
MODELOPT_PRODUCER = {"name": "modelopt", "version": "0.37.0"}
ACT_AMAX = 4.0  # assumed calibration amax behind the synthetic static input scales

_MODELOPT_EXCLUDE = ["lm_head", "*mlp.gate", "*shared_expert_gate", "*linear_attn.in_proj_a",
                     "*linear_attn.in_proj_b", "*linear_attn.conv1d", "model.visual*", "mtp*"]
_HF_NOT_CONVERT = ["lm_head", "mlp.gate", "shared_expert_gate", "linear_attn.in_proj_a",
                   "linear_attn.in_proj_b", "model.visual", "mtp"]
_CT_IGNORE = ["lm_head", "re:.*mlp.gate$", "re:.*shared_expert_gate$", "re:.*linear_attn.in_proj_[ab]$",
              "re:.*visual.*", "re:^mtp.*"]
_EXPERT = re.compile(r"^(.*\.mlp\.experts)(\.\d+\.[^.]+)?$")


def _check(quant: str) -> None:
    if quant not in PRESETS:
        raise ValueError(f"unknown quantization preset {quant!r}; known: {', '.join(PRESETS)}")


# -- config files ---------------------------------------------------------------------------
def _ct_group(weights: dict, fmt: str) -> dict:
    return {"targets": ["Linear"], "weights": weights, "input_activations": None,
            "output_activations": None, "format": fmt}


def _ct_config(weights: dict, fmt: str) -> dict:
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": _ct_group(weights, fmt)}, "ignore": list(_CT_IGNORE),
            "kv_cache_scheme": None, "global_compression_ratio": None, "sparsity_config": {}}


def _modelopt_group(algo: str, group_size: int | None) -> dict:
    """ModelOpt's convert_hf_quant_config_format mapping of one quant_algo to a config group."""
    if algo == "FP8":
        return {"input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
                "weights": {"dynamic": False, "num_bits": 8, "type": "float"}}
    w = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": group_size or 16}
    if algo == "W4A16_NVFP4":
        return {"weights": w}
    return {"input_activations": dict(w), "weights": w}


def _modelopt_config(hq: dict) -> dict:
    """config.json quantization_config as ModelOpt's export writes it next to hf_quant_config."""
    q = hq["quantization"]
    algo = q["quant_algo"]
    if algo == "MIXED_PRECISION":
        by_cfg: dict[tuple, list[str]] = {}
        for name, cfg in q["quantized_layers"].items():
            by_cfg.setdefault(tuple(sorted(cfg.items())), []).append(name)
        groups = {}
        for i, (key, names) in enumerate(by_cfg.items()):
            cfg = dict(key)
            groups[f"group_{i}"] = {**_modelopt_group(cfg["quant_algo"], cfg.get("group_size")),
                                    "targets": sorted(names)}
        out = {"config_groups": groups, "quantized_layers": q["quantized_layers"]}
    else:
        out = {"config_groups": {"group_0": {**_modelopt_group(algo, q.get("group_size")),
                                             "targets": ["Linear"]}}}
    out["ignore"] = list(q.get("exclude_modules") or [])
    out["quant_algo"] = algo
    out["producer"] = hq["producer"]
    out["quant_method"] = "modelopt"
    return out


def _mixed_algo(name: str) -> str | None:
    """nvidia/Qwen3.6-35B-A3B-NVFP4's per-layer choice for one linear module."""
    canon = canonical_module(name)
    if (never_quantized(canon) or canon.startswith(("model.visual", "visual.", "mtp."))
            or re.search(r"linear_attn\.in_proj_[ab]$", canon)):
        return None
    if canon == "lm_head" or _EXPERT.match(canon) or ".mlp.shared_expert." in canon:
        return "W4A16_NVFP4"
    return "FP8"


def _mixed_layers(module_names: Iterable[str]) -> dict[str, dict]:
    layers: dict[str, dict] = {}
    for name in module_names:
        name = name.removesuffix(".weight")
        algo = _mixed_algo(name)
        if algo is None:
            continue
        m = _EXPERT.match(name)
        key = m.group(1) if m else name  # ModelOpt lists the experts module, not each expert
        layers[key] = {"quant_algo": algo, "group_size": 16} if algo != "FP8" else {"quant_algo": "FP8"}
    return dict(sorted(layers.items()))


def synthetic_quant_config(quant: str, module_names: Iterable[str] | None = None
                           ) -> tuple[dict | None, dict | None]:
    """(config.json `quantization_config`, hf_quant_config.json) for a preset; None when the
    producer does not write that file. `module_names` (linear modules, with or without
    `.weight`) is required for mixed_nvfp4 only."""
    _check(quant)
    if quant == "fp8_block":
        return ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                 "weight_block_size": [128, 128], "modules_to_not_convert": list(_HF_NOT_CONVERT)}, None)
    if quant == "int4_awq":
        return ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True,
                 "version": "gemm", "modules_to_not_convert": list(_HF_NOT_CONVERT)}, None)
    if quant == "int4_ct":
        return (_ct_config({"num_bits": 4, "type": "int", "symmetric": True, "group_size": 128,
                            "strategy": "group", "dynamic": False, "actorder": None,
                            "block_structure": None, "observer": "minmax"}, "pack-quantized"), None)
    if quant == "nvfp4_ct":
        return (_ct_config({"num_bits": 4, "type": "float", "symmetric": True, "group_size": 16,
                            "strategy": "tensor_group", "dynamic": False, "actorder": None,
                            "block_structure": None, "observer": "minmax"}, "nvfp4-pack-quantized"), None)
    q: dict = {"exclude_modules": list(_MODELOPT_EXCLUDE), "kv_cache_quant_algo": None}
    if quant == "fp8_tensor":
        q["quant_algo"] = "FP8"
    elif quant == "nvfp4":
        q.update(quant_algo="NVFP4", group_size=16)
    else:  # mixed_nvfp4
        if module_names is None:
            raise ValueError("synthetic_quant_config('mixed_nvfp4') needs module_names: "
                             "MIXED_PRECISION lists every quantized layer by name")
        q.update(quant_algo="MIXED_PRECISION",
                 exclude_modules=[p for p in _MODELOPT_EXCLUDE if p != "lm_head"],
                 quantized_layers=_mixed_layers(module_names))
    hq = {"producer": dict(MODELOPT_PRODUCER), "quantization": dict(sorted(q.items()))}
    return _modelopt_config(hq), hq


# -- tensors --------------------------------------------------------------------------------
def _layer_for(quant: str, module_name: str) -> tuple[LayerQuant, str | None]:
    """The module's (format, params) under a preset and its ModelOpt algo (for input scales)."""
    if quant == "mixed_nvfp4":
        algo = _mixed_algo(module_name)
        if algo is None:
            return BF16, None
        return (LayerQuant("nvfp4", QuantParams(group_size=16)) if algo != "FP8"
                else LayerQuant("fp8_tensor")), algo
    scheme, algo = _preset_scheme(quant)
    return scheme.layer_for(module_name), algo


@lru_cache(maxsize=None)
def _preset_scheme(quant: str) -> tuple[QuantScheme, str | None]:
    qc, hq = synthetic_quant_config(quant)
    return detect_scheme({"quantization_config": qc}, hq), (hq["quantization"]["quant_algo"] if hq else None)


def quantize_module(quant_preset: str, module_name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (full names) for one linear weight [out, in] under a preset.
    Unquantized modules come back as `{f"{module_name}.weight": weight}`."""
    from . import get_format

    _check(quant_preset)
    module_name = module_name.removesuffix(".weight")
    layer, algo = _layer_for(quant_preset, module_name)
    if weight.ndim != 2:
        if layer.format == "bf16":
            return {f"{module_name}.weight": weight}
        raise ValueError(f"{module_name}: {quant_preset} quantizes 2-D linear weights, got shape "
                         f"{list(weight.shape)}; write experts one per module")
    try:
        tensors = get_format(layer.format).quantize(weight, layer.params)
    except ValueError as e:
        raise ValueError(f"{module_name}: cannot quantize to {layer.format} ({quant_preset}): {e}") from None
    if algo == "FP8" and layer.format == "fp8_tensor":
        tensors["input_scale"] = torch.tensor(ACT_AMAX / FP8_MAX, dtype=torch.float32)
    elif algo == "NVFP4" and layer.format == "nvfp4":
        tensors["input_scale"] = torch.tensor(ACT_AMAX / (6.0 * FP8_MAX), dtype=torch.float32)
    return {f"{module_name}.{k}": v for k, v in tensors.items()}
