"""Shared fixtures: tiny random checkpoints, built once per test session."""
from __future__ import annotations

import functools

import pytest
import torch

from moeferry.checkpoint.synthetic import make_model

torch.set_num_threads(2)


def pytest_addoption(parser):
    parser.addoption("--soak", action="store_true", default=False,
                     help="tests/reliability: run the long adversarial soak (a few hundred requests) instead of "
                          "its short CI version, and write its numbers to $TMPDIR/moeferry-soak.json")

CHECKPOINTS = {
    "qwen3_moe": dict(arch="qwen3_moe", expert_layout="per-expert"),
    "qwen3_moe-fused": dict(arch="qwen3_moe", expert_layout="fused"),
    "qwen3_5_moe": dict(arch="qwen3_5_moe", expert_layout="per-expert"),
    "qwen3_5_moe-fused": dict(arch="qwen3_5_moe", expert_layout="fused"),
    "qwen3_5_moe-multimodal": dict(arch="qwen3_5_moe", expert_layout="fused", multimodal=True),
}


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(name) -> path of a tiny fp32 random checkpoint (built on first use)."""
    root = tmp_path_factory.mktemp("checkpoints")

    @functools.cache
    def build(name: str):
        return make_model(root / name, size="tiny", seed=0, dtype="float32", **CHECKPOINTS[name])

    return build


@pytest.fixture(scope="session")
def hf_model(checkpoint):
    """hf_model(name) -> the transformers model of that checkpoint (fp32, eval)."""

    @functools.cache
    def load(name: str):
        from transformers import AutoModelForCausalLM, Qwen3_5MoeForConditionalGeneration

        cls = Qwen3_5MoeForConditionalGeneration if "multimodal" in name else AutoModelForCausalLM
        return cls.from_pretrained(checkpoint(name), dtype=torch.float32).eval()

    return load


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
