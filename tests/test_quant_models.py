"""Quantized checkpoints end to end: make-model --quant -> our engine == transformers on the
dequantized weights.

For each preset, a tiny checkpoint is quantized by `make_model(quant=...)` (the real
quantizers' math). The reference is transformers run on a plain fp32 checkpoint written from
the registry's `QuantFormat.dequantize` of those tensors (same config, no
quantization_config); the engine instead keeps the packed tensors and dequantizes each layer
on the fly through `PackedWeight.dequantize`. So the only difference the logits may show is
float rounding (<= 1e-4 relative): the quantization itself is computed identically.
"""
from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moeferry import LLM
from moeferry.checkpoint.formats import FORMATS, detect_scheme
from moeferry.checkpoint.reader import CheckpointError
from moeferry.checkpoint.synthetic import make_model
from moeferry.model.linear import Linear, QuantLinear
from moeferry.moe.resident import PackedExperts
from tests.conftest import rel_err

TOL = 1e-4
CASES = [("qwen3_5_moe", q) for q in
         ("fp8_tensor", "fp8_block", "nvfp4", "nvfp4_ct", "int4_awq", "int4_ct", "mixed_nvfp4")]
CASES += [("qwen3_moe", q) for q in ("fp8_block", "mixed_nvfp4")]
WEIGHT_BYTES = {"fp8_tensor": 1.0, "fp8_block": 1.0, "nvfp4": 0.5, "nvfp4_ct": 0.5, "int4_awq": 0.5, "int4_ct": 0.5}


@pytest.fixture(scope="session")
def quant_checkpoint(tmp_path_factory):
    """quant_checkpoint(arch, preset) -> tiny quantized checkpoint (built once per session)."""
    root = tmp_path_factory.mktemp("quant_checkpoints")

    @functools.cache
    def build(arch: str, preset: str):
        return make_model(root / f"{arch}-{preset}", arch, "tiny", seed=0, dtype="float32", quant=preset)

    return build


def _read_all(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.fixture(scope="session")
def dequantized(quant_checkpoint, checkpoint, tmp_path_factory):
    """dequantized(arch, preset) -> fp32 checkpoint of the registry's dequantization of the
    quantized tensors, in the plain layout (names and shapes from the unquantized twin)."""
    root = tmp_path_factory.mktemp("dequantized")

    @functools.cache
    def build(arch: str, preset: str):
        src = quant_checkpoint(arch, preset)
        cfg = json.loads((src / "config.json").read_text())
        hq = json.loads((src / "hf_quant_config.json").read_text()) if (src / "hf_quant_config.json").is_file() else None
        scheme = detect_scheme(cfg, hq)
        plain = _read_all(checkpoint(arch))  # same seed, unquantized: the names and shapes to produce
        quant = _read_all(src)
        out = {}
        for name, ref in plain.items():
            module = name.removesuffix(".weight")
            fmt = scheme.format_for(module) if name.endswith(".weight") and ref.ndim == 2 else "bf16"
            if fmt == "bf16":
                out[name] = quant[name].float()
                continue
            f = FORMATS[fmt]
            local = {k[len(module) + 1:]: v for k, v in quant.items() if k.startswith(module + ".")}
            w = f.dequantize(local, ref.shape[0], ref.shape[1], torch.float32, scheme.params_for(module))
            assert (w - ref).norm() / ref.norm() < 0.2, (module, fmt)  # really the same weight
            out[name] = w.contiguous()
        dst = root / f"{arch}-{preset}"
        dst.mkdir()
        save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
        cfg.pop("quantization_config")
        (dst / "config.json").write_text(json.dumps(cfg))
        shutil.copy(src / "generation_config.json", dst / "generation_config.json")
        return dst

    return build


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _modules(model):
    """Every Linear / QuantLinear / PackedExperts reachable from the model."""
    seen, stack, found = set(), [model], []
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (torch.Tensor, int, float, str, type(None))):
            continue
        seen.add(id(obj))
        if isinstance(obj, (Linear, QuantLinear, PackedExperts)):
            found.append(obj)
            if not isinstance(obj, PackedExperts):
                continue
        items = obj if isinstance(obj, (list, tuple)) else getattr(obj, "__dict__", {}).values()
        stack.extend(items)
    return found


@pytest.mark.parametrize("arch,preset", CASES, ids=[f"{a}-{q}" for a, q in CASES])
def test_logits_equal_transformers_on_dequantized_weights(arch, preset, quant_checkpoint, dequantized):
    from transformers import AutoModelForCausalLM

    llm = LLM(str(quant_checkpoint(arch, preset)), dtype="float32", num_tokens=256)
    hf = AutoModelForCausalLM.from_pretrained(dequantized(arch, preset), dtype=torch.float32).eval()
    ids = _prompt(24, 7)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert rel_err(llm.logits(ids), ref) <= TOL
    assert rel_err(llm.logits(ids, chunk_size=[20, 1]), ref) <= TOL  # prefill + decode steps

    # the weights stay packed in memory: quantized modules are QuantLinear over their
    # checkpoint format, experts are PackedExperts, and the bytes are the packed ones
    mods = _modules(llm.engine.model)
    quant = [m for m in mods if isinstance(m, QuantLinear)]
    experts = [m for m in mods if isinstance(m, PackedExperts)]
    assert quant and len(experts) == llm.spec.num_layers
    want = {"mixed_nvfp4": {"nvfp4", "fp8_tensor"}}.get(preset, {preset})
    assert {m.format for m in quant} == want
    for m in quant:
        dense = m.out_features * m.in_features
        assert m.nbytes < dense * (WEIGHT_BYTES[m.format] + 0.3), (m.format, m.nbytes, dense)
        assert all(t.dtype != torch.float32 or t.numel() * 8 < dense for t in m.packed.tensors().values())
    packed_experts = sum(e.nbytes for e in experts)
    e, i, h = llm.spec.num_experts, llm.spec.moe_intermediate_size, llm.spec.hidden_size
    assert packed_experts < llm.spec.num_layers * e * 3 * i * h * 1.3  # <= ~1 byte a weight, not 4
    routers = [m for m in mods if isinstance(m, Linear) and m.out_features == e]
    assert routers and all(m.weight.dtype == torch.float32 for m in routers)  # routers stay unquantized
    # projections of one input are one weight where they stack (fp8_block: rows in whole blocks)
    stacks = [getattr(layer.mixer, "qkv", None) or layer.mixer.in_qkvz for layer in llm.engine.model.layers]
    assert all(s.fused is not None for s in stacks) or preset == "fp8_block", preset


def test_config_files_match_the_producers(quant_checkpoint):
    mixed = quant_checkpoint("qwen3_5_moe", "mixed_nvfp4")
    cfg = json.loads((mixed / "config.json").read_text())
    hq = json.loads((mixed / "hf_quant_config.json").read_text())
    layers = hq["quantization"]["quantized_layers"]
    assert hq["quantization"]["quant_algo"] == cfg["quantization_config"]["quant_algo"] == "MIXED_PRECISION"
    assert layers["model.layers.0.mlp.experts"] == {"quant_algo": "W4A16_NVFP4", "group_size": 16}
    assert layers["model.layers.0.mlp.shared_expert.down_proj"]["quant_algo"] == "W4A16_NVFP4"
    assert layers["model.layers.3.self_attn.q_proj"] == {"quant_algo": "FP8"}
    assert layers["lm_head"]["quant_algo"] == "W4A16_NVFP4"
    assert not any(".experts.0." in k or k.endswith(("mlp.gate", "in_proj_a", "in_proj_b")) for k in layers)
    with safe_open(str(mixed / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_slice("model.layers.0.mlp.experts.5.up_proj.weight").get_dtype() == "U8"
        assert "model.layers.0.mlp.experts.5.up_proj.input_scale" not in keys  # W4A16: no activation scale
        assert "model.layers.3.self_attn.k_proj.input_scale" in keys  # FP8: static activation scale
    assert not any(k.startswith("model.layers.0.mlp.experts.gate_up") for k in keys)  # per expert
    for preset, method in (("fp8_block", "fp8"), ("int4_awq", "awq"), ("int4_ct", "compressed-tensors")):
        path = quant_checkpoint("qwen3_5_moe", preset)
        assert json.loads((path / "config.json").read_text())["quantization_config"]["quant_method"] == method
        assert not (path / "hf_quant_config.json").exists()


def test_quantized_fused_experts_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="per-expert"):
        make_model(tmp_path / "x", "qwen3_5_moe", "tiny", expert_layout="fused", quant="nvfp4")


def _copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _load_error(path) -> str:
    with pytest.raises(CheckpointError) as e:
        LLM(str(path), dtype="float32")
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("arch,preset,module,drop", [
    ("qwen3_5_moe", "nvfp4", "model.layers.1.mlp.experts.3.up_proj", "weight_scale"),
    ("qwen3_5_moe", "mixed_nvfp4", "lm_head", "weight_scale_2"),
    ("qwen3_5_moe", "nvfp4_ct", "model.layers.0.linear_attn.in_proj_qkv", "weight_global_scale"),
])
def test_nvfp4_config_but_scales_missing(arch, preset, module, drop, quant_checkpoint, tmp_path):
    path = _copy(quant_checkpoint(arch, preset), tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors[f"{module}.{drop}"]
    save_file(tensors, str(path / "model.safetensors"))
    msg = _load_error(path)
    assert module in msg and preset.removeprefix("mixed_") in msg and f"{module}.{drop}" in msg


def test_unsupported_quant_method(quant_checkpoint, tmp_path):
    path = _copy(quant_checkpoint("qwen3_5_moe", "fp8_block"), tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "gptq"
    (path / "config.json").write_text(json.dumps(cfg))
    msg = _load_error(path)
    assert "gptq" in msg and "unsupported" in msg
