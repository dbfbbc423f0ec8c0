"""Logits through the real engine (pools, chunked prefill, decode) equal transformers'."""
from __future__ import annotations

import random

import pytest
import torch

from moeferry import LLM
from tests.conftest import rel_err

ALL = ["qwen3_moe", "qwen3_moe-fused", "qwen3_5_moe", "qwen3_5_moe-fused", "qwen3_5_moe-multimodal"]
TOL = 1e-4


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def prompt(n: int, seed: int, vocab: int = 4000) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def engines(checkpoint):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = LLM(str(checkpoint(name)), device="cpu", dtype="float32", num_tokens=1024)
        return cache[name]

    return get


@pytest.mark.parametrize("name", ALL)
def test_full_prefill(name, engines, hf_model):
    ids = prompt(77, 1)
    assert rel_err(engines(name).logits(ids), hf_logits(hf_model(name), ids)) <= TOL


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_5_moe"])
def test_random_chunks_equal_one_pass(name, engines, hf_model):
    ids = prompt(150, 2)
    rng = random.Random(0)
    sizes = [rng.randint(1, 70) for _ in range(40)]
    ref = hf_logits(hf_model(name), ids)
    assert rel_err(engines(name).logits(ids, chunk_size=sizes), ref) <= TOL


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_5_moe"])
def test_prompt_then_16_decode_steps(name, engines, hf_model):
    ids = prompt(40, 3)  # 24-token prefill, then 16 single-token steps
    ref = hf_logits(hf_model(name), ids)
    assert rel_err(engines(name).logits(ids, chunk_size=[24, 1]), ref) <= TOL


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen3_5_moe"])
def test_batch_of_four_equals_alone(name, engines, hf_model):
    prompts = [prompt(n, 10 + n) for n in (5, 33, 64, 90)]
    llm = engines(name)
    together = llm.logits_batch(prompts, chunk_size=[17, 1, 9, 30])
    for p, t in zip(prompts, together):
        assert rel_err(t, llm.logits(p)) <= TOL
        assert rel_err(t, hf_logits(hf_model(name), p)) <= TOL


def test_multimodal_layout_skips_visual_and_mtp(checkpoint, engines):
    from moeferry.checkpoint.reader import CheckpointReader

    path = checkpoint("qwen3_5_moe-multimodal")
    raw = CheckpointReader(path)
    assert not any(n.startswith(("model.visual", "mtp.")) for n in raw.tensors)
    import json
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert any(k.startswith("model.visual.") for k in keys) and any(k.startswith("mtp.") for k in keys)
    assert any(k.startswith("model.language_model.") for k in keys)
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    # same seed -> same text weights as the flat checkpoint: identical logits
    ids = prompt(20, 4)
    assert rel_err(engines("qwen3_5_moe-multimodal").logits(ids), engines("qwen3_5_moe").logits(ids)) <= 1e-6


def test_sharded_checkpoint(tmp_path, engines):
    from moeferry.checkpoint.synthetic import make_model

    path = make_model(tmp_path / "sharded", "qwen3_5_moe", "tiny", seed=0, max_shard_bytes=200_000)
    assert (path / "model.safetensors.index.json").is_file()
    ids = prompt(30, 5)
    assert rel_err(LLM(str(path), dtype="float32").logits(ids), engines("qwen3_5_moe").logits(ids)) <= 1e-6
