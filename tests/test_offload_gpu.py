"""Offload backends on the GPU (Triton kernels over the slot cache, pinned host banks, the copy
stream and the staging area) against the resident backend on the same checkpoint."""
from __future__ import annotations

import functools

import pytest
import torch

from moeferry import LLM
from moeferry.checkpoint.synthetic import make_model
from moeferry.scheduler.sampling import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PRESETS = [None, "mixed_nvfp4", "int4_awq", "fp8_block"]
BACKENDS = [dict(moe_backend="offload", moe_cache_rate=1.0), dict(moe_backend="offload", moe_cache_rate=0.25),
            dict(moe_backend="offload", moe_cache_size=1), dict(moe_backend="cpu", moe_cache_rate=0.25),
            dict(moe_backend="hybrid", moe_cache_rate=0.25)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu-offload")

    @functools.cache
    def build(quant):
        return str(make_model(root / str(quant), "qwen3_5_moe", "small", seed=1, dtype="bfloat16", quant=quant,
                              router_skew=1.0))
    return build


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


class Recorder:
    """Wraps an executor: keeps each call's inputs and output (to replay them on another backend)."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __call__(self, x, ids, weights):
        out = self.inner(x, ids, weights)
        self.calls.append((x.clone(), ids.clone(), weights.clone(), out.clone()))
        return out


@pytest.mark.parametrize("quant", PRESETS, ids=lambda q: q or "bf16")
def test_offload_matches_resident_on_gpu(checkpoints, quant):
    """Every MoE call of an offload run (prefill chunks through the staging area, decode steps
    through the slot cache) gives the resident executor's output on the same inputs. Whole-model
    greedy tokens are only reported: in bf16 a sum split over two kernels rounds differently, a
    near-tie in routing then flips, and a random-weight model amplifies it (measured on the H200:
    21% of 24 tokens agreeing at a 25% cache, at least 90% at a full cache). The CPU suite checks exact
    greedy identity in fp32."""
    path = checkpoints(quant)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (700, 33)]
    common = dict(device="cuda", num_tokens=4096, max_extend_tokens=512)
    resident = LLM(path, **common)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ref_tokens = [o.token_ids for o in resident.generate(prompts, params)]
    layers = {i: layer.mlp.experts for i, layer in enumerate(resident.engine.model.layers)
              if hasattr(layer.mlp, "experts")}
    for kw in BACKENDS:
        llm = LLM(path, **common, **kw)
        recorders = {}
        for i, layer in enumerate(llm.engine.model.layers):
            if i in layers:
                recorders[i] = layer.mlp.experts = Recorder(layer.mlp.experts)
        llm.logits_batch(prompts, chunk_size=[512, 100, 1, 1])
        worst = 0.0
        for i, rec in recorders.items():
            for x, ids, w, out in rec.calls:
                worst = max(worst, _rel(out, layers[i](x, ids, w)))
        assert worst < 2e-2, (kw, worst)
        tokens = [o.token_ids for o in llm.generate(prompts, params)]
        agree = sum(a == b for t, r in zip(tokens, ref_tokens) for a, b in zip(t, r)) / sum(map(len, ref_tokens))
        print(f"{quant or 'bf16'} {kw}: worst MoE call {worst:.2e}, greedy tokens agreeing {agree:.0%}")
        assert all(len(t) == len(r) for t, r in zip(tokens, ref_tokens))
        stats = llm.engine.experts.stats()
        assert stats["hits"] + stats["misses"] > 0
        for cache in set(llm.engine.experts.caches.values()):
            cache.check()
        del llm
        torch.cuda.empty_cache()


@pytest.mark.parametrize("quant", ["mixed_nvfp4", "int4_awq"])
def test_gather_config_chosen_by_device_time_on_both_grids(checkpoints, quant):
    """The boot picks the gather config by device time on a full grid and on the prefetch's
    capped grid; the timing moves the bytes a gather would (a real, positive time per expert)."""
    from moeferry.moe.bandwidth import choose_gather, time_gather
    from moeferry.moe.offload import prefetch_programs
    llm = LLM(checkpoints(quant), moe_backend="offload", moe_cache_rate=0.25)
    backend = llm.engine.experts
    bank = next(iter(backend.banks.values()))
    config, _, what, device_s = choose_gather(bank, llm.engine.device, prefetch_programs(llm.engine.device))
    assert config is not None and "full grid / " in what, what
    assert device_s is not None and all(t > 0 for t in device_s), device_s
    assert backend.gather_kernel is not None
    full, capped = time_gather(bank, llm.engine.device, config), time_gather(bank, llm.engine.device, config, 1)
    assert 0 < full <= capped * 1.5, (full, capped)  # one program cannot beat a full grid by much
