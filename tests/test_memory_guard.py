"""The runtime OOM guard: an out-of-memory error in a step (injected through the test hook
MOEFERRY_FAULT_OOM_STEPS) shrinks the expert cache and the step is retried, so the request
completes exactly as without the fault; where nothing can shrink, that request fails alone."""
from __future__ import annotations

import pytest

from moeferry import LLM
from moeferry.scheduler.sampling import SamplingParams

PROMPTS = [[5, 9, 13, 200, 7, 7, 31, 64, 2, 99, 100, 3, 18, 21, 400, 8, 9], [44, 45, 46]]


def _generate(llm):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    return [(o.token_ids, o.finish_reason) for o in outs]


@pytest.fixture(scope="module")
def model(checkpoint):
    return str(checkpoint("qwen3_5_moe"))


@pytest.fixture(scope="module")
def reference(model):
    return _generate(LLM(model, dtype="float32", max_extend_tokens=8))


def test_injected_oom_in_prefill_and_decode_is_absorbed(model, reference, monkeypatch):
    # step 1 prefills (chunks of 8 tokens), step 4 decodes the short prompt next to a prefill chunk, step 6 decodes
    monkeypatch.setenv("MOEFERRY_FAULT_OOM_STEPS", "1,4,6")
    llm = LLM(model, dtype="float32", max_extend_tokens=8, moe_backend="offload", moe_cache_rate=1.0)
    before = llm.engine.experts.expert_slots
    assert _generate(llm) == reference
    memory = llm.engine.stats()["memory"]
    assert memory["oom_caught"] == 3 and memory["cache_shrinks"] == 3
    assert llm.engine.experts.expert_slots < before
    assert memory["last_shrink"]["slots_after"] == llm.engine.experts.expert_slots
    assert llm.engine.sizes.expert_slots == llm.engine.experts.expert_slots
    for cache in set(llm.engine.experts.caches.values()):
        cache.check()
    llm.engine.cache.check()


def test_oom_without_a_cache_to_shrink_fails_only_that_step(model, reference, monkeypatch):
    monkeypatch.setenv("MOEFERRY_FAULT_OOM_STEPS", "1")
    llm = LLM(model, dtype="float32", max_extend_tokens=8)  # resident: nothing to shrink
    first, second = _generate(llm)  # step 1 holds only the first prompt's first chunk
    assert first == ([], "error") and second == reference[1]
    assert _generate(llm) == reference  # the engine keeps serving
    assert llm.engine.stats()["memory"]["oom_caught"] == 1
    llm.engine.cache.check()


def test_requested_bytes_reads_the_failed_allocation():
    from moeferry.memory.guard import requested_bytes

    msg = "CUDA out of memory. Tried to allocate 604.00 MiB. GPU 0 has a total capacity of 139.80 GiB"
    assert requested_bytes(msg) == 604 * 2**20
    assert requested_bytes("Tried to allocate 3.83 GiB.") == int(3.83 * 2**30)
    assert requested_bytes("injected out-of-memory error in step 3") == 0
