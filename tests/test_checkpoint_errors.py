"""Broken checkpoints fail at load with one line naming the problem."""
from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from moeferry import LLM
from moeferry.checkpoint.reader import CheckpointError


@pytest.fixture
def copy(checkpoint, tmp_path):
    def make(name="qwen3_5_moe"):
        dst = tmp_path / name
        shutil.copytree(checkpoint(name), dst)
        return dst

    return make


def _rewrite(path, edit):
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def _load_error(path) -> str:
    with pytest.raises(CheckpointError) as e:
        LLM(str(path), dtype="float32")
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_missing_tensor(copy):
    path = copy()
    name = "model.layers.3.self_attn.k_proj.weight"
    _rewrite(path, lambda t: t.pop(name))
    msg = _load_error(path)
    assert name in msg and "missing" in msg and "expected shape" in msg


def test_wrong_shape(copy):
    path = copy()
    name = "model.layers.0.linear_attn.in_proj_b.weight"

    def edit(t):
        t[name] = t[name][:, :-1].contiguous()

    _rewrite(path, edit)
    msg = _load_error(path)
    assert name in msg and "model.safetensors" in msg and "expected" in msg


def test_unknown_architecture(copy):
    path = copy()
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    msg = _load_error(path)
    assert "LlamaForCausalLM" in msg and "Qwen3MoeForCausalLM" in msg and "Qwen3_5MoeForCausalLM" in msg


def test_truncated_safetensors(copy):
    path = copy()
    f = path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    msg = _load_error(path)
    assert "truncated" in msg and "model.safetensors" in msg


def test_not_a_model_directory(tmp_path):
    assert "config.json" in _load_error(tmp_path)
