"""Synthetic checkpoints (`make-model`) and the demo tokenizer, checked against transformers."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch

from moeferry.checkpoint.synthetic import (
    iter_tensor_groups,
    make_model,
    model_config,
    router_gains,
)
from moeferry.text.demo_tokenizer import NON_SPECIAL_ADDED, SPECIAL_TOKENS, special_token_ids

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoTokenizer,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeTextConfig,
    Qwen3MoeConfig,
)

transformers.logging.set_verbosity_error()

# name -> (arch, expert_layout, multimodal, max_shard_bytes)
CASES = {
    "qwen3_moe-per-expert": ("qwen3_moe", "per-expert", False, None),
    "qwen3_moe-fused": ("qwen3_moe", "fused", False, 200_000),
    "qwen3_5_moe-per-expert": ("qwen3_5_moe", "per-expert", False, 200_000),
    "qwen3_5_moe-fused": ("qwen3_5_moe", "fused", False, None),
    "qwen3_5_moe-multimodal": ("qwen3_5_moe", "fused", True, 300_000),
}
EXPECTED_CLASS = {
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
}
IDS = special_token_ids(4096)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic")
    out = {}
    for name, (arch, layout, mm, shard) in CASES.items():
        kw = {} if shard is None else {"max_shard_bytes": shard}
        out[name] = make_model(root / name, arch, "tiny", layout, seed=0, multimodal=mm, **kw)
    return out


@pytest.fixture(scope="module")
def loaded(ckpts):
    """name -> (model, loading_info)."""
    out = {}
    for name, path in ckpts.items():
        cls = Qwen3_5MoeForConditionalGeneration if CASES[name][2] else AutoModelForCausalLM
        model, info = cls.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
        out[name] = (model.eval(), info)
    return out


def _tokens(n=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, IDS["<|endoftext|>"], (1, n), generator=g)


@pytest.fixture(scope="module")
def logits(loaded):
    ids = _tokens()
    with torch.no_grad():
        return {name: m(ids).logits[0] for name, (m, _) in loaded.items()}


def _checkpoint_tensors(path) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """name -> (file, shape, dtype) from the safetensors headers."""
    from safetensors import safe_open

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "pt") as sf:
            for k in sf.keys():
                sl = sf.get_slice(k)
                out[k] = (f.name, tuple(sl.get_shape()), sl.get_dtype())
    return out


# --- loading -------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_loads_with_no_missing_or_unexpected_keys(loaded, name):
    model, info = loaded[name]
    arch, _, mm, _ = CASES[name]
    expected = "Qwen3_5MoeForConditionalGeneration" if mm else EXPECTED_CLASS[arch]
    assert type(model).__name__ == expected
    assert not info["missing_keys"], sorted(info["missing_keys"])[:10]
    assert not info["unexpected_keys"], sorted(info["unexpected_keys"])[:10]
    assert not info["mismatched_keys"]
    assert not info["error_msgs"]


def test_multimodal_checkpoint_loads_as_text_model(ckpts):
    # The text class strips `language_model.` and ignores model.visual.* and mtp.*.
    model, info = AutoModelForCausalLM.from_pretrained(
        ckpts["qwen3_5_moe-multimodal"], dtype=torch.float32, output_loading_info=True
    )
    assert type(model).__name__ == "Qwen3_5MoeForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]


# --- numerics ------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_forward_is_finite_and_not_saturated(logits, name):
    lg = logits[name]
    assert lg.shape == (16, 4096)
    assert torch.isfinite(lg).all()
    std = lg.std(dim=-1)
    assert (std > 0.5).all() and (std < 8).all(), std
    assert lg.softmax(-1).max(-1).values.max() < 0.9
    # positions differ (the model is not ignoring its input)
    assert len(set(lg.argmax(-1).tolist())) > 8


@pytest.mark.parametrize("name", ["qwen3_moe-per-expert", "qwen3_5_moe-fused"])
def test_routing_spreads_over_experts(loaded, name):
    model, _ = loaded[name]
    E, k = 8, 2
    with torch.no_grad():
        out = model(_tokens(32, seed=2), output_router_logits=True)
    assert len(out.router_logits) == 4
    for rl in out.router_logits:
        assert rl.shape == (32, E)
        top = rl.topk(k, dim=-1).indices
        assert len(set(top.flatten().tolist())) >= E - 1  # nearly every expert is used
        assert len({tuple(sorted(t)) for t in top.tolist()}) >= 8  # many distinct top-k sets
        probs = rl.float().softmax(-1)
        assert probs.max(-1).values.mean() < 0.8  # router not one-hot


def test_layouts_and_prefixes_are_the_same_model(logits):
    # Values are seeded by canonical names: fused == per-expert, multimodal == flat text.
    for arch in ("qwen3_moe", "qwen3_5_moe"):
        torch.testing.assert_close(logits[f"{arch}-per-expert"], logits[f"{arch}-fused"], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(
        logits["qwen3_5_moe-multimodal"], logits["qwen3_5_moe-fused"], atol=1e-4, rtol=1e-4
    )
    # ... and the two architectures are different models
    assert not torch.allclose(logits["qwen3_moe-fused"], logits["qwen3_5_moe-fused"], atol=1e-2)


def test_gdn_state_carries_across_tokens(loaded):
    # A changed first token must still move the output of layer 0 (GDN) 12+ tokens later,
    # past the conv window: only the recurrent state carries it. (With dt_bias = 1 the
    # state forgets within a token or two and the difference is ~1e-6.)
    model, _ = loaded["qwen3_5_moe-fused"]
    a = _tokens(24, seed=3)
    b = a.clone()
    b[0, 0] = (b[0, 0] + 1) % 4000
    with torch.no_grad():
        ha = model(a, output_hidden_states=True).hidden_states[1]
        hb = model(b, output_hidden_states=True).hidden_states[1]
    assert model.config.layer_types[0] == "linear_attention"
    # beyond the conv window (4), only the recurrent state can carry the difference
    assert (ha[0, 12:] - hb[0, 12:]).abs().max() > 1e-2


# --- files ---------------------------------------------------------------------------


def test_tensor_names_and_layouts(ckpts):
    pe = _checkpoint_tensors(ckpts["qwen3_5_moe-per-expert"])
    fu = _checkpoint_tensors(ckpts["qwen3_5_moe-fused"])
    mm = _checkpoint_tensors(ckpts["qwen3_5_moe-multimodal"])
    H, I, E = 64, 32, 8
    assert pe["model.layers.0.mlp.experts.3.gate_proj.weight"][1] == (I, H)
    assert pe["model.layers.0.mlp.experts.3.up_proj.weight"][1] == (I, H)
    assert pe["model.layers.0.mlp.experts.3.down_proj.weight"][1] == (H, I)
    assert fu["model.layers.0.mlp.experts.gate_up_proj"][1] == (E, 2 * I, H)
    assert fu["model.layers.0.mlp.experts.down_proj"][1] == (E, H, I)
    assert not any(".experts.0." in k for k in fu)
    for k in (
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.mlp.shared_expert_gate.weight",
        "model.layers.0.linear_attn.conv1d.weight",
        "model.layers.0.linear_attn.A_log",
        "model.layers.3.self_attn.q_norm.weight",
        "lm_head.weight",
    ):
        assert k in fu, k
    assert fu["model.layers.0.mlp.gate.weight"][1] == (E, H)
    assert fu["model.layers.0.mlp.shared_expert_gate.weight"][1] == (1, H)
    assert fu["model.layers.0.linear_attn.conv1d.weight"][1] == (2 * 2 * 16 + 4 * 16, 1, 4)
    assert fu["model.layers.3.self_attn.q_proj.weight"][1] == (4 * 32 * 2, H)  # query + gate
    assert "model.layers.0.self_attn.q_proj.weight" not in fu  # layer 0 is GDN
    assert all(k.startswith(("model.language_model.", "model.visual.", "mtp.", "lm_head.")) for k in mm)
    assert any(k.startswith("model.visual.") for k in mm) and any(k.startswith("mtp.") for k in mm)
    assert not any(k.startswith("model.layers.") for k in mm)
    q3 = _checkpoint_tensors(ckpts["qwen3_moe-per-expert"])
    assert q3["model.layers.0.self_attn.q_proj.weight"][1] == (4 * 16, H)
    assert not any("shared_expert" in k or "linear_attn" in k for k in q3)


@pytest.mark.parametrize("name", ["qwen3_moe-fused", "qwen3_5_moe-multimodal"])
def test_sharded_index_matches_shards(ckpts, name):
    path = ckpts[name]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    tensors = _checkpoint_tensors(path)
    files = sorted(p.name for p in path.glob("*.safetensors"))
    n = len(files)
    assert n > 2 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (path / "model.safetensors").exists()
    assert index["weight_map"] == {k: v[0] for k, v in tensors.items()}
    nbytes = {"F32": 4, "BF16": 2}
    total = sum(math.prod(s) * nbytes[d] for _, s, d in tensors.values())
    assert index["metadata"]["total_size"] == total
    limit = CASES[name][3]
    for f in files:
        in_file = [(s, d) for fn, s, d in tensors.values() if fn == f]
        size = sum(math.prod(s) * nbytes[d] for s, d in in_file)
        assert size <= limit or len(in_file) == 1


def test_single_file_without_index(ckpts):
    path = ckpts["qwen3_moe-per-expert"]
    assert (path / "model.safetensors").exists()
    assert not (path / "model.safetensors.index.json").exists()
    assert not list(path.glob(".shard-*"))


def test_configs(ckpts):
    for name, path in ckpts.items():
        cfg = json.loads((path / "config.json").read_text())
        gen = json.loads((path / "generation_config.json").read_text())
        text = cfg.get("text_config", cfg)
        assert text["eos_token_id"] == IDS["<|im_end|>"]
        assert gen["eos_token_id"] == [IDS["<|im_end|>"], IDS["<|endoftext|>"]]
        assert (gen["temperature"], gen["top_p"], gen["top_k"], gen["do_sample"]) == (0.7, 0.8, 20, True)
        assert text["vocab_size"] == 4096 and text["vocab_size"] % 64 == 0
        assert text["hidden_size"] == 64 and text["num_hidden_layers"] == 4
        assert (text["num_experts"], text["num_experts_per_tok"], text["moe_intermediate_size"]) == (8, 2, 32)
        assert text["max_position_embeddings"] == 4096
        assert text["rope_parameters"]["rope_theta"] == 10000.0
        if CASES[name][0] == "qwen3_5_moe":
            assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
            assert text["rope_parameters"]["partial_rotary_factor"] == 0.25
            assert int(text["head_dim"] * 0.25) % 2 == 0
        if CASES[name][2]:
            assert cfg["model_type"] == "qwen3_5_moe" and text["model_type"] == "qwen3_5_moe_text"
            assert cfg["vision_config"]["out_hidden_size"] == 64
            assert cfg["image_token_id"] == IDS["<|image_pad|>"]


def test_deterministic_and_seeded(tmp_path, ckpts):
    def digest(path):
        return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}

    again = make_model(tmp_path / "again", "qwen3_5_moe", "tiny", "fused", seed=0)
    assert digest(again) == digest(ckpts["qwen3_5_moe-fused"])
    other = make_model(tmp_path / "other", "qwen3_5_moe", "tiny", "fused", seed=1)
    assert digest(other)["model.safetensors"] != digest(again)["model.safetensors"]


def test_bfloat16_and_num_layers(tmp_path):
    path = make_model(tmp_path / "bf16", "qwen3_moe", "tiny", dtype="bfloat16", num_layers=2)
    tensors = _checkpoint_tensors(path)
    assert {d for _, _, d in tensors.values()} == {"BF16"}
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and cfg["num_hidden_layers"] == 2
    assert not any(k.startswith("model.layers.2.") for k in tensors)
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert model.dtype == torch.bfloat16 and not info["missing_keys"]


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown quantization preset"):
        make_model(tmp_path / "q", "qwen3_moe", "tiny", quant="int3")
    with pytest.raises(ValueError, match="per-expert"):
        make_model(tmp_path / "q", "qwen3_moe", "tiny", quant="nvfp4", expert_layout="fused")
    with pytest.raises(ValueError):
        make_model(tmp_path / "x", "qwen3_moe", "qwen3.6-35b-a3b")
    with pytest.raises(ValueError):
        make_model(tmp_path / "x", "qwen3_moe", "tiny", multimodal=True)
    with pytest.raises(ValueError):
        make_model(tmp_path / "x", "qwen3_moe", "tiny", expert_layout="stacked")


# --- real geometries, checked without writing them ------------------------------------


@pytest.mark.parametrize(
    "arch,size,mm,params",
    [
        ("qwen3_5_moe", "qwen3.6-35b-a3b", False, 34.66e9),
        ("qwen3_5_moe", "qwen3.6-35b-a3b", True, None),
        ("qwen3_moe", "qwen3-30b-a3b", False, 30.53e9),
        ("qwen3_5_moe", "small", False, None),
        ("qwen3_moe", "small", False, None),
    ],
)
def test_presets_match_transformers_shapes(arch, size, mm, params):
    full = model_config(arch, size, multimodal=mm)
    if params is not None:
        n = sum(math.prod(s.shape) for _, specs in iter_tensor_groups(full, "fused") for s in specs)
        assert abs(n - params) / params < 0.01, n
    cfg = model_config(arch, size, multimodal=mm, num_layers=4)
    cls = {"qwen3_moe": Qwen3MoeConfig, "qwen3_5_moe_text": Qwen3_5MoeTextConfig, "qwen3_5_moe": Qwen3_5MoeConfig}
    hf_cfg = cls[cfg["model_type"]].from_dict(cfg)
    with torch.device("meta"):
        if mm:
            model = Qwen3_5MoeForConditionalGeneration._from_config(hf_cfg)
        else:
            model = AutoModelForCausalLM.from_config(hf_cfg)
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {s.name: s.shape for _, specs in iter_tensor_groups(cfg, "fused") for s in specs}
    assert {k: v for k, v in got.items() if not k.startswith("mtp.")} == want
    if size == "qwen3.6-35b-a3b":
        t = cfg["text_config"] if mm else cfg
        geometry = (t["hidden_size"], t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"])
        assert geometry == (2048, 16, 2, 256)
        assert (t["num_experts"], t["num_experts_per_tok"], t["vocab_size"]) == (256, 8, 248320)
        assert full.get("text_config", full)["layer_types"].count("full_attention") == 10


# --- tokenizer -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizers_(ckpts):
    return {
        "qwen3_moe": AutoTokenizer.from_pretrained(ckpts["qwen3_moe-fused"]),
        "qwen3_5_moe": AutoTokenizer.from_pretrained(ckpts["qwen3_5_moe-fused"]),
    }


TEXT = (
    "Héllo, wörld! Ünïcode: 日本語, Ελληνικά, emoji 🚀✅ — “quotes”.\n"
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    '{"name": "get_weather", "arguments": {"city": "Zürich", "days": 3}}\n\ttabs  and   spaces\n'
)


def test_tokenizer_round_trip(tokenizers_):
    a, b = tokenizers_["qwen3_moe"], tokenizers_["qwen3_5_moe"]
    ids = a.encode(TEXT, add_special_tokens=False)
    assert a.decode(ids) == TEXT
    assert len(ids) < len(TEXT.encode()) * 0.8  # merges actually compress
    # whichever tokenizer class AutoTokenizer picks per model type, ids are the same
    assert b.encode(TEXT, add_special_tokens=False) == ids
    assert len(a) == 4096 and a.eos_token == "<|im_end|>" and a.pad_token == "<|endoftext|>"
    assert a.bos_token is None


def test_special_tokens_are_single_ids(tokenizers_):
    tok = tokenizers_["qwen3_moe"]
    assert IDS["<|endoftext|>"] == 4083 and IDS["<|im_end|>"] == 4085
    for t in SPECIAL_TOKENS:
        assert tok.encode(t, add_special_tokens=False) == [IDS[t]], t
        assert tok.convert_ids_to_tokens(IDS[t]) == t
    text = "<|im_start|>user\nhi<think>x</think><tool_call>{}</tool_call><|im_end|>"
    ids = tok.encode(text, add_special_tokens=False)
    kept = tok.decode(ids, skip_special_tokens=True)
    assert kept == "user\nhi<think>x</think><tool_call>{}</tool_call>"  # like Qwen3
    assert all(t in kept for t in NON_SPECIAL_ADDED if "response" not in t)


def test_chat_template(tokenizers_, ckpts):
    tok = tokenizers_["qwen3_5_moe"]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "18C"},
    ]
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.dumps(tools[0]) in text
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
    assert call in text
    assert "<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    off = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    on = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True, enable_thinking=True)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert on.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    assert "# Tools" not in on
    ids = tok.apply_chat_template(msgs[:2], add_generation_prompt=True, return_dict=False)
    assert ids[0] == IDS["<|im_start|>"] and ids.count(IDS["<|im_end|>"]) == 2
    path = ckpts["qwen3_5_moe-fused"]
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == (path / "chat_template.jinja").read_text()


# --- router skew (`make-model --router-skew`) ------------------------------------------


def _router_rows(cfg: dict, router_skew: float | None) -> dict[str, torch.Tensor]:
    kw = {} if router_skew is None else {"router_skew": router_skew}
    return {s.name: s.init() for _, specs in iter_tensor_groups(cfg, "per-expert", seed=0, **kw)
            for s in specs if s.name.endswith("mlp.gate.weight")}


def _top_share(gate: torch.Tensor, top_k: int, tokens: int = 4096) -> tuple[float, set[int]]:
    """Share of the top-k picks over random hidden states that go to the 10% most picked
    experts, and those experts."""
    h = torch.randn(tokens, gate.shape[1], generator=torch.Generator().manual_seed(7))
    picks = (h @ gate.T).softmax(-1).topk(top_k, dim=-1).indices.flatten()
    counts = torch.bincount(picks, minlength=gate.shape[0])
    top = counts.argsort(descending=True)[: math.ceil(0.1 * gate.shape[0])]
    return counts[top].sum().item() / picks.numel(), set(top.tolist())


def test_router_skew_concentrates_routing():
    cfg = model_config("qwen3_5_moe", "qwen3.6-35b-a3b", num_layers=2)  # 256 experts, top-8
    flat, skewed = _router_rows(cfg, None), _router_rows(cfg, 0.5)
    name0, name1 = "model.layers.0.mlp.gate.weight", "model.layers.1.mlp.gate.weight"
    share0, _ = _top_share(flat[name0], 8)
    share, popular0 = _top_share(skewed[name0], 8)
    _, popular1 = _top_share(skewed[name1], 8)
    assert share0 < 0.15  # uniform routing: the top 10% get about 10%
    assert share > 0.5 and share > 3.5 * share0, (share0, share)
    assert len(popular0 & popular1) < len(popular0) // 2  # each layer has its own popular experts
    # the skew is a per-row gain (r+1)^-S over the unskewed draw, rank from a seeded permutation
    gains = skewed[name0][:, 0] / flat[name0][:, 0]
    assert torch.equal(skewed[name0], flat[name0] * router_gains(256, 0.5, 0, name0)[:, None])
    assert sorted(gains.tolist()) == pytest.approx(sorted(((torch.arange(256.0) + 1) ** -0.5).tolist()), rel=1e-5)


def test_router_skew_touches_only_routers():
    cfg = model_config("qwen3_5_moe", "tiny", multimodal=True)  # text, visual and mtp tensors

    def values(**kw):
        return {s.name: s.init() for _, specs in iter_tensor_groups(cfg, "fused", seed=0, **kw) for s in specs}

    plain, zero, skewed = values(), values(router_skew=0.0), values(router_skew=1.0)
    assert plain.keys() == zero.keys() == skewed.keys()
    assert all(torch.equal(plain[k], zero[k]) for k in plain)  # S=0: bit for bit the unskewed model
    changed = {k for k in plain if not torch.equal(plain[k], skewed[k])}
    assert changed == {k for k in plain if k.endswith("mlp.gate.weight")} and len(changed) == 5  # 4 layers + mtp
    with pytest.raises(ValueError, match="router_skew"):
        values(router_skew=-0.5)


def test_planted_head_is_the_permuted_embedding():
    """planted_head: every head row is an embedding row / sqrt(hidden), each exactly once, and
    only the head changes; a tied head refuses it."""
    cfg = model_config("qwen3_5_moe", "tiny")

    def values(**kw):
        return {s.name: s.init() for _, specs in iter_tensor_groups(cfg, "per-expert", seed=0, **kw) for s in specs}

    plain, planted = values(), values(planted_head=True)
    assert {k for k in plain if not torch.equal(plain[k], planted[k])} == {"lm_head.weight"}
    emb, head = planted["model.embed_tokens.weight"], planted["lm_head.weight"]
    h = emb.shape[1]
    match = (head @ emb.T).argmax(0)  # for token t: the head row holding its embedding
    assert sorted(match.tolist()) == list(range(emb.shape[0]))  # a permutation
    assert torch.allclose(head[match], emb * h ** -0.5)
    with pytest.raises(ValueError, match="untied"):
        values_tied = dict(cfg, tie_word_embeddings=True)
        [s.init() for _, specs in iter_tensor_groups(values_tied, planted_head=True) for s in specs]


def test_router_skew_in_quantized_checkpoints(tmp_path):
    from safetensors import safe_open

    from moeferry.checkpoint.formats import PRESETS, quantize_module
    from moeferry.cli import main

    w = torch.randn(8, 64, dtype=torch.bfloat16)
    for preset in PRESETS:  # the router stays a plain weight in every preset, so the skew is exact
        for gate in ("model.layers.0.mlp.gate", "model.language_model.layers.3.mlp.gate"):
            out = quantize_module(preset, gate, w)
            assert out.keys() == {gate + ".weight"} and out[gate + ".weight"] is w, preset
    for arch, quant, mm in (("qwen3_5_moe", "mixed_nvfp4", True), ("qwen3_moe", "int4_awq", False)):
        path = tmp_path / arch
        args = ["make-model", "--arch", arch, "--quant", quant, "--router-skew", "1", "--out", str(path)]
        assert main(args + (["--multimodal"] if mm else [])) == 0
        cfg = json.loads((path / "config.json").read_text())
        expected = _router_rows(cfg, 1.0)
        assert len(expected) == (5 if mm else 4)
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            for name, value in expected.items():  # checkpoint names (model.language_model.*, mtp.*)
                assert torch.equal(f.get_tensor(name), value), name
    with pytest.raises(ValueError, match="router_skew"):
        make_model(tmp_path / "bad", "qwen3_moe", "tiny", router_skew=float("nan"))
