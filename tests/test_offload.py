"""Offloaded experts on the CPU (fp32): the `offload`, `cpu` and `hybrid` backends against
`resident`, and the expert cache against brute-force LRU and LFU simulations.

On a CPU-only machine the "device" is the CPU: slot copies are memcpy and the MoE runs through
`SlotBuffer.run_reference`, so these tests exercise the real cache logic (fill, hits, misses,
LRU eviction, the staging area, the CPU lane, the hybrid split, shrink). The reference for
every output is the resident backend on the same checkpoint; the reference for the cache's
bookkeeping is a plain-Python LRU (or LFU) replaying the routing trace the executors received.
"""
from __future__ import annotations

import functools
import math
import os
import shutil
import sys
from collections import defaultdict
from typing import NamedTuple

import pytest
import torch

import moeferry.moe.offload as offload_mod
from moeferry import LLM
from moeferry.checkpoint.reader import CheckpointReader
from moeferry.model.loader import _layer_experts
from moeferry.model.registry import resolve_spec
from moeferry.model.weights import WeightLoader
from moeferry.moe.bandwidth import MissSplit, expected_misses
from moeferry.memory.allocator import allocator_settings, configure_allocator, pinned_register_settings
from moeferry.moe.bank import HostRamError, build_bank, plan_loading
from moeferry.moe.offload import OffloadExperts
from moeferry.moe.slots import HostStaging, SlotBuffer
from moeferry.moe.placement import Placement
from moeferry.scheduler.sampling import SamplingParams
from tests.conftest import rel_err
from tests.test_quant_models import quant_checkpoint  # noqa: F401  (session fixture)
from tests.test_slot_reference import CASES as SLOT_CASES, _buffer

TOL = 1e-5
ARCHS = ["qwen3_5_moe", "qwen3_moe"]
COMMON = dict(dtype="float32", num_tokens=256, max_running_requests=4, max_extend_tokens=8, prefix_cache=False)
VARIANTS = {
    "offload-1": dict(moe_backend="offload", moe_cache_size=1),
    "offload-25%": dict(moe_backend="offload", moe_cache_rate=0.25),
    "offload-100%": dict(moe_backend="offload", moe_cache_rate=1.0),
    "offload-lfu-25%": dict(moe_backend="offload", moe_cache_rate=0.25, moe_cache_policy="lfu"),
    "cpu": dict(moe_backend="cpu", moe_cache_rate=0.25),
    "hybrid": dict(moe_backend="hybrid", moe_cache_rate=0.25),
    "hybrid-max1": dict(moe_backend="hybrid", moe_cache_size=1, moe_hybrid_max_fetch=1),  # both lanes every step
}
CHUNKS = [9, 5, 1]  # two prefill chunks, then decode-sized steps


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 4000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPT = _prompt(20, 3)
BATCH = [_prompt(13, 4), _prompt(6, 5), _prompt(17, 6)]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: these steps are tiny, and on a shared 2-core machine two spinning
    OpenMP threads per step cost far more than they give (25x slower under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ckpt(checkpoint, quant_checkpoint):  # noqa: F811
    """ckpt(arch, preset) -> checkpoint path (bf16 = the plain fp32 tiny checkpoint)."""
    return lambda arch, preset: checkpoint(arch) if preset == "bf16" else quant_checkpoint(arch, preset)


@pytest.fixture(scope="module")
def resident(ckpt):
    """resident(arch, preset) -> the resident LLM of that checkpoint (built once)."""
    return functools.cache(lambda arch, preset: LLM(str(ckpt(arch, preset)), **COMMON))


@pytest.fixture(scope="module")
def ref_logits(resident):
    """ref_logits(arch, preset, prompts, chunks) -> resident logits_batch (cached)."""
    @functools.cache
    def run(arch, preset, prompts, chunks):
        return resident(arch, preset).logits_batch([list(p) for p in prompts], list(chunks))
    return lambda arch, preset, prompts, chunks: run(arch, preset, tuple(map(tuple, prompts)), tuple(chunks))


def build(ckpt, arch, preset, variant, **extra) -> LLM:
    """An LLM of `variant` (`extra` overrides; a cache size given replaces the variant's)."""
    sizes = ("moe_cache_size", "moe_cache_rate")
    kw = {k: v for k, v in VARIANTS[variant].items() if not (k in sizes and any(x in sizes for x in extra))}
    return LLM(str(ckpt(arch, preset)), **COMMON, **kw, **extra)


def caches(llm: LLM) -> list:
    return list({id(c): c for c in llm.engine.experts.caches.values()}.values())


def check_all(llm: LLM) -> None:
    for c in caches(llm):
        c.check()


def contents(llm: LLM) -> list:
    """Every cache's (owner list, host table), to compare before/after."""
    return [(list(c.owner), c.host_table.clone()) for c in caches(llm)]


def assert_same_contents(a, b) -> None:
    assert len(a) == len(b)
    for (owner_a, table_a), (owner_b, table_b) in zip(a, b):
        assert owner_a == owner_b
        assert torch.equal(table_a, table_b)


def assert_slots_hold_their_experts(cache, banks) -> None:
    """Every slot holds its owner's bytes from the bank, every tensor of both matrices."""
    for slot, key in enumerate(cache.owner):
        bank = banks[key[0]]
        for m, src in ((cache.buffer.gate_up, bank.gate_up), (cache.buffer.down, bank.down)):
            for name, t in m.tensors().items():
                assert torch.equal(t[slot], src.tensors()[name][key[1]])


@pytest.fixture
def trace(monkeypatch):
    """Records (layer, needed experts, tokens) of every offload executor call, in order, and
    checks every cache's integrity after each call."""
    calls = []
    orig = OffloadExperts.__call__

    def call(self, x, ids, weights, **kw):
        calls.append((self.layer, torch.unique(ids).tolist(), x.shape[0]))
        out = orig(self, x, ids, weights, **kw)
        for c in {id(c): c for c in self.b.caches.values()}.values():
            c.check()
        return out

    monkeypatch.setattr(OffloadExperts, "__call__", call)
    return calls


# -- 1. logits equal resident's, through chunked prefill and decode -----------------------------
QUANT_CASES = [
    ("qwen3_5_moe", "mixed_nvfp4", "offload-1"), ("qwen3_5_moe", "mixed_nvfp4", "cpu"),
    ("qwen3_5_moe", "mixed_nvfp4", "hybrid-max1"), ("qwen3_moe", "mixed_nvfp4", "offload-25%"),
    ("qwen3_moe", "mixed_nvfp4", "offload-100%"), ("qwen3_moe", "mixed_nvfp4", "hybrid"),
    ("qwen3_5_moe", "int4_awq", "offload-25%"), ("qwen3_5_moe", "int4_awq", "hybrid"),
    ("qwen3_5_moe", "int4_awq", "offload-100%"), ("qwen3_moe", "int4_awq", "offload-1"),
    ("qwen3_moe", "int4_awq", "cpu"), ("qwen3_moe", "int4_awq", "hybrid-max1"),
    ("qwen3_5_moe", "fp8_block", "offload-1"), ("qwen3_5_moe", "fp8_block", "cpu"),
    ("qwen3_5_moe", "fp8_block", "offload-100%"), ("qwen3_moe", "fp8_block", "offload-25%"),
    ("qwen3_moe", "fp8_block", "hybrid-max1"), ("qwen3_moe", "fp8_block", "hybrid"),
]
LOGIT_CASES = [(a, "bf16", v) for a in ARCHS for v in VARIANTS] + QUANT_CASES


@pytest.mark.parametrize("arch,preset,variant", LOGIT_CASES, ids=["-".join(c) for c in LOGIT_CASES])
def test_logits_equal_resident(arch, preset, variant, ckpt, ref_logits, trace):
    llm = build(ckpt, arch, preset, variant)
    got = llm.logits(PROMPT, chunk_size=CHUNKS)
    want = ref_logits(arch, preset, [PROMPT], CHUNKS)[0]
    assert got.shape == want.shape
    assert rel_err(got, want) <= TOL
    assert trace and max(t for _, _, t in trace) == CHUNKS[0] and min(t for _, _, t in trace) == 1
    s = llm.engine.stats()["experts"]
    assert s["backend"] == VARIANTS[variant]["moe_backend"]
    assert s["hits"] + s["misses"] == sum(len(n) for _, n, _ in trace)
    if variant == "offload-100%":
        assert s["misses"] == 0 and s["bytes_fetched"] == 0 and s["hit_rate"] == 1.0
    elif variant.startswith("offload"):
        assert s["misses"] > 0 and s["cpu_experts"] == 0
    if variant == "cpu":
        assert s["bytes_fetched"] == 0 and s["cpu_experts"] == s["misses"] > 0
    if variant == "hybrid-max1":  # one fetch per layer and step at most, the rest on the CPU
        assert 0 < s["cpu_experts"] < s["misses"]


# -- 2. greedy generation identical to resident's, batched and alone -----------------------------
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
GEN_CASES = [("qwen3_5_moe", "bf16", "offload-1"), ("qwen3_moe", "bf16", "offload-25%"),
             ("qwen3_moe", "bf16", "cpu"), ("qwen3_5_moe", "bf16", "hybrid-max1"),
             ("qwen3_5_moe", "mixed_nvfp4", "cpu"), ("qwen3_moe", "int4_awq", "offload-1"),
             ("qwen3_5_moe", "mixed_nvfp4", "offload-lfu-25%")]


@pytest.fixture(scope="module")
def ref_generate(resident):
    @functools.cache
    def run(arch, preset):
        llm = resident(arch, preset)
        return [o.token_ids for o in llm.generate(BATCH, GREEDY)], llm.generate([BATCH[2]], GREEDY)[0].token_ids
    return run


@pytest.mark.parametrize("arch,preset,variant", GEN_CASES, ids=["-".join(c) for c in GEN_CASES])
def test_greedy_generate_equals_resident(arch, preset, variant, ckpt, ref_generate, trace):
    batched, alone = ref_generate(arch, preset)
    llm = build(ckpt, arch, preset, variant)
    outs = llm.generate(BATCH, GREEDY)  # all 3 running at once, at most 8 prompt tokens a step
    assert [o.token_ids for o in outs] == batched
    assert all(o.finish_reason == "length" and len(o.token_ids) == 6 for o in outs)
    assert 8 < max(t for _, _, t in trace) <= 8 + 3  # prefill chunks of 8 sharing steps with decodes
    assert llm.generate([BATCH[2]], GREEDY)[0].token_ids == alone


# -- 3. the eviction order and counters against a brute-force simulation -------------------------
class BruteForceLRU:
    """A global LRU over (layer, expert): every key stamped with its last use; a miss takes a
    free slot or evicts the oldest key the step does not need, and when every cached key is
    needed the remaining misses get no slot (they are streamed)."""

    def __init__(self, num_slots: int, cached: list):
        """`cached`: the keys in the cache, least recently used first."""
        self.num_slots, self.clock, self.last_use = num_slots, 0, {}
        self.hits, self.misses = defaultdict(int), defaultdict(int)
        for key in cached:
            self._enter(key)

    @classmethod
    def booted(cls, num_slots: int, layers: list[int], num_experts: int):
        """After the boot fill: slots spread evenly over the layers, experts 0..n-1 of each."""
        per, extra = divmod(num_slots, len(layers))
        return cls(num_slots, [(layer, e) for i, layer in enumerate(layers)
                               for e in range(min(per + (i < extra), num_experts))])

    def _use(self, key) -> None:
        self.clock += 1
        self.last_use[key] = self.clock

    _enter = _use  # a key placed in the cache

    def step(self, layer: int, needed: list[int]) -> None:
        hits = [e for e in needed if (layer, e) in self.last_use]
        misses = [e for e in needed if (layer, e) not in self.last_use]
        self.hits[layer] += len(hits)
        self.misses[layer] += len(misses)
        for e in hits:
            self._use((layer, e))
        self._place(layer, needed, misses)

    def _place(self, layer: int, needed: list[int], misses: list[int]) -> None:
        for e in misses:
            if len(self.last_use) == self.num_slots:
                evictable = [k for k in self.last_use if k[0] != layer or k[1] not in needed]
                if not evictable:
                    break
                del self.last_use[min(evictable, key=self.last_use.__getitem__)]
            self._use((layer, e))

    def order(self) -> list:
        return sorted(self.last_use, key=self.last_use.__getitem__)

    ranked = order  # the first to evict first


class BruteForceLFU(BruteForceLRU):
    """A global LFU with dynamic aging over (layer, expert), the plain way: a key's priority is
    the age plus its uses; a step's misses evict the keys of lowest (priority, last use) that
    the step does not need, the age rises to the largest priority evicted, and the misses enter
    with one use (those left without a slot are streamed)."""

    def __init__(self, num_slots: int, cached: list):
        self.age, self.uses, self.prio = 0, {}, {}
        super().__init__(num_slots, cached)

    def _use(self, key) -> None:
        self.uses[key] += 1
        self.prio[key] = self.age + self.uses[key]
        super()._use(key)

    def _enter(self, key) -> None:
        self.uses[key] = 0
        self._use(key)

    def _place(self, layer: int, needed: list[int], misses: list[int]) -> None:
        room = self.num_slots - len(self.last_use)
        evictable = [k for k in self.ranked() if k[0] != layer or k[1] not in needed]
        for key in evictable[:max(0, len(misses) - room)]:
            self.age = max(self.age, self.prio.pop(key))
            del self.uses[key], self.last_use[key]
        for e in misses[:self.num_slots - len(self.last_use)]:
            self._enter((layer, e))

    def ranked(self) -> list:
        return sorted(self.last_use, key=lambda k: (self.prio[k], self.last_use[k]))


SIMULATIONS = {"lru": BruteForceLRU, "lfu": BruteForceLFU}


def replay(llm: LLM, trace, policy: str = "lru"):
    (cache,) = caches(llm)
    sim = SIMULATIONS[policy].booted(cache.num_slots, cache.layers, cache.num_experts)
    for layer, needed, _ in trace:
        sim.step(layer, needed)
    return sim


def assert_matches_simulation(llm: LLM, trace) -> None:
    (cache,) = caches(llm)
    sim = replay(llm, trace, cache.policy.name)
    stats = llm.engine.stats()["experts"]
    for layer in cache.layers:
        c = cache.counters[layer]
        assert (c.hits, c.misses) == (sim.hits[layer], sim.misses[layer]), layer
        assert stats["layers"][str(layer)]["hits"] == sim.hits[layer]
    assert cache.policy.ranked() == sim.ranked()  # the eviction order, first out first
    if cache.policy.name == "lfu":
        assert cache.policy.prio == sim.prio and cache.policy.age == sim.age
    assert {k for k in cache.owner if k is not None} == set(sim.last_use)
    for (layer, e) in sim.last_use:
        s = cache.slot_of(layer, e)
        assert s >= 0 and cache.owner[s] == (layer, e)
    assert int((cache.host_table >= 0).sum()) == len(sim.last_use)


POLICY_CASES = [("qwen3_5_moe", 6, "lru"), ("qwen3_moe", 3, "lru"), ("qwen3_5_moe", 1, "lru"),
                ("qwen3_5_moe", 6, "lfu"), ("qwen3_moe", 3, "lfu")]


@pytest.mark.parametrize("arch,slots,policy", POLICY_CASES, ids=["-".join(map(str, c)) for c in POLICY_CASES])
def test_policy_and_counters_match_brute_force(arch, slots, policy, ckpt, ref_logits, trace):
    llm = build(ckpt, arch, "bf16", "offload-1", moe_cache_size=slots, moe_cache_policy=policy)
    (cache,) = caches(llm)
    assert cache.num_slots == slots and cache.policy.name == policy
    got = llm.logits_batch(BATCH, [5, 3, 1])
    for g, w in zip(got, ref_logits(arch, "bf16", BATCH, [5, 3, 1])):
        assert rel_err(g, w) <= TOL
    assert_matches_simulation(llm, trace)
    first = len(trace)
    llm.logits(PROMPT, chunk_size=CHUNKS)  # the cache carries over from the previous sequences
    assert len(trace) > first
    assert_matches_simulation(llm, trace)


def test_lfu_keeps_popular_experts_through_a_burst():
    """What LFU is for: experts used often stay while a burst of once-used ones passes through
    (LRU would let the burst push them out); a prefetched expert no step used goes first."""
    from moeferry.moe.expert_cache import LFUPolicy, LRUPolicy
    popular, burst = [(0, e) for e in range(3)], [(0, e) for e in range(10, 20)]
    kept = {}
    for policy in (LFUPolicy(), LRUPolicy()):
        cached = []
        for key in popular:
            policy.insert(key)
            cached.append(key)
        for _ in range(4):
            policy.touch(popular)
        for key in burst:  # a cache of 5: each burst key evicts one victim
            if len(cached) == 5:
                victim = policy.victims(1, {key})[0]
                policy.remove(victim)
                cached.remove(victim)
            policy.insert(key)
            cached.append(key)
        kept[policy.name] = set(cached)
    assert set(popular) <= kept["lfu"] and not set(popular) & kept["lru"]
    lfu = LFUPolicy()
    for key in popular:
        lfu.insert(key)
    lfu.insert((1, 7), prefetched=True)
    assert lfu.victims(1, set()) == [(1, 7)]


# -- 4. a cache smaller than one step's working set ---------------------------------------------
@pytest.mark.parametrize("arch,preset", [("qwen3_moe", "bf16"), ("qwen3_5_moe", "fp8_block")])
def test_cache_smaller_than_the_working_set(arch, preset, ckpt, ref_logits, trace):
    llm = build(ckpt, arch, preset, "offload-1")
    prompts = BATCH + [_prompt(9, 7)]
    got = llm.logits_batch(prompts, [4, 1])
    for g, w in zip(got, ref_logits(arch, preset, prompts, [4, 1])):
        assert rel_err(g, w) <= TOL
    assert max(len(n) for _, n, _ in trace) > 1  # steps needed more experts than the one slot
    decode = [n for _, n, t in trace if t == len(prompts)]
    assert decode and max(map(len, decode)) > 1  # ... decode steps of the batch too
    assert_matches_simulation(llm, trace)
    s = llm.engine.stats()["experts"]
    assert s["bytes_fetched"] == s["misses"] * llm.engine.experts.slot_bytes


# -- 5. prefill streaming through the staging area ----------------------------------------------
@pytest.mark.parametrize("preset,overlap", [("bf16", True), ("bf16", False), ("mixed_nvfp4", True)])
def test_prefill_streams_without_touching_the_cache(preset, overlap, ckpt, ref_logits, monkeypatch, trace):
    arch = "qwen3_5_moe"
    monkeypatch.setattr(offload_mod, "STAGING_SLOTS", 2)  # 2 slots per staging half: a tiny layer streams
    streamed = []  # (layer, experts through the staging area, tokens)
    orig_stream = OffloadExperts._stream

    def stream(self, x, ids, weights, experts):
        streamed.append((self.layer, list(experts), x.shape[0]))
        return orig_stream(self, x, ids, weights, experts)

    monkeypatch.setattr(OffloadExperts, "_stream", stream)
    llm = build(ckpt, arch, preset, "offload-25%", moe_prefill_overlap=overlap)
    backend = llm.engine.experts
    assert backend.cfg.moe_prefill_overlap is overlap  # (on the CPU both run the copies in line)
    assert backend.staging_bytes == 2 * 2 * backend.slot_bytes  # one layout group, 2 halves of 2 slots
    assert backend.device_bytes == backend.expert_slots * backend.slot_bytes + backend.staging_bytes

    before = contents(llm)
    prompt = _prompt(24, 8)
    got = llm.logits(prompt)  # one 24-token prefill chunk
    assert rel_err(got, ref_logits(arch, preset, [prompt], [24])[0]) <= TOL
    assert streamed and all(t == 24 for _, _, t in streamed)
    assert max(len(e) for _, e, _ in streamed) > 2  # more misses than a staging half: several chunks
    assert_same_contents(before, contents(llm))  # prefill did not flush the decode cache
    s = llm.engine.stats()["experts"]
    assert s["misses"] > 0 and s["bytes_fetched"] == s["misses"] * backend.slot_bytes

    got = llm.logits(PROMPT, chunk_size=[16, 1])  # a streamed prefill, then the decode path
    assert rel_err(got, ref_logits(arch, preset, [PROMPT], [16, 1])[0]) <= TOL
    decode_changed = any(o1 != o2 for (o1, _), (o2, _) in zip(before, contents(llm)))
    assert decode_changed  # decode steps fetched misses into the cache
    check_all(llm)


# -- 5b. decode prefetch (on the CPU the predicted misses are copied in line) ---------------------
PREFETCH_CASES = [("qwen3_5_moe", "bf16", "offload-1"), ("qwen3_moe", "bf16", "offload-25%"),
                  ("qwen3_5_moe", "mixed_nvfp4", "offload-25%"), ("qwen3_moe", "int4_awq", "offload-25%")]


@pytest.mark.parametrize("arch,preset,variant", PREFETCH_CASES, ids=["-".join(c) for c in PREFETCH_CASES])
def test_decode_prefetch_keeps_logits(arch, preset, variant, ckpt, ref_logits, trace):
    llm = build(ckpt, arch, preset, variant)
    backend = llm.engine.experts
    assert not backend.prefetch  # on only where copies overlap compute (CUDA)
    backend.prefetch = True
    moe = sorted(backend.executors)
    assert all(backend.executors[a].next is backend.executors[b] for a, b in zip(moe, moe[1:]))
    got = llm.logits(PROMPT, chunk_size=CHUNKS)  # the trace checks every cache after each layer
    assert rel_err(got, ref_logits(arch, preset, [PROMPT], CHUNKS)[0]) <= TOL
    s = llm.engine.stats()["experts"]
    if variant == "offload-1":  # the one slot always holds an expert of the step in flight
        assert s["prefetched"] == 0
    else:
        assert s["prefetched"] > 0 and 0 <= s["prefetch_hits"] <= s["prefetched"]
    assert s["hits"] + s["misses"] == sum(len(n) for _, n, _ in trace)
    assert s["bytes_fetched"] == (s["misses"] + s["prefetched"]) * backend.slot_bytes


class RunAtOnce:
    """A capture's cuts, for the CPU: each cut's host part runs at once (all rows real)."""

    def __init__(self):
        self.cuts = 0

    def cut(self, work) -> None:
        self.cuts += 1
        work(1 << 30)


@pytest.mark.parametrize("arch,preset", [("qwen3_5_moe", "mixed_nvfp4"), ("qwen3_moe", "bf16")])
def test_cut_step_equals_eager(arch, preset, ckpt, ref_logits):
    """A partial cache captured piecewise: the host part each layer runs at its cut (read the
    ids, fetch, prefetch) gives the eager step's logits, counters and cache contents."""
    runs = {}
    for cut in (False, True):
        llm = build(ckpt, arch, preset, "offload-25%")
        backend = llm.engine.experts
        backend.prefetch, backend.device_managed = True, False  # host-managed: the piecewise path
        cuts = backend.capturing = RunAtOnce() if cut else None
        got = llm.logits(PROMPT, chunk_size=CHUNKS)
        backend.capturing = None
        assert rel_err(got, ref_logits(arch, preset, [PROMPT], CHUNKS)[0]) <= TOL
        stats = llm.engine.stats()["experts"]
        runs[cut] = (got, {k: stats[k] for k in ("hits", "misses", "prefetched", "bytes_fetched")}, contents(llm))
        check_all(llm)
        if cut:
            assert cuts.cuts > 0 and cuts.cuts % len(backend.executors) == 0  # every layer of every step
    assert torch.equal(runs[True][0], runs[False][0])
    assert runs[True][1] == runs[False][1]
    assert_same_contents(runs[True][2], runs[False][2])


class CutStep(NamedTuple):
    rows: int
    capture: object     # the step's stand-in capture (its `cuts`)
    cpu_experts: int    # experts the step's CPU lane computed


def cut_decode_steps(llm, monkeypatch, capture) -> list[CutStep]:
    """Run every all-decode step as a decode graph would: the cache's state handed over first
    where the step manages it on the device (`before_graph`), then the step through `capture` (a
    RunAtOnce-like stand-in for a piecewise graph's cuts); prefill chunks stay eager. Returns
    each step run so."""
    engine, backend, steps = llm.engine, llm.engine.experts, []
    plain = engine.run_batch

    def cpu_experts() -> int:
        return sum(ex.cpu_experts for ex in backend.executors.values())

    def run(chunks, feed=None):
        if not all(len(c.tokens) == 1 for c in chunks):
            return plain(chunks, feed)
        backend.before_graph(len(chunks))
        backend.capturing, before = capture(), cpu_experts()
        try:
            return plain(chunks, feed)
        finally:
            steps.append(CutStep(len(chunks), backend.capturing, cpu_experts() - before))
            backend.capturing = None

    monkeypatch.setattr(engine, "run_batch", run)
    return steps


LANE_CUTS = [("qwen3_5_moe", "mixed_nvfp4", "cpu"), ("qwen3_moe", "int4_awq", "hybrid"),
             ("qwen3_5_moe", "bf16", "hybrid-max1"), ("qwen3_moe", "fp8_block", "cpu")]


@pytest.mark.parametrize("arch,preset,variant", LANE_CUTS)
def test_cpu_lanes_at_the_cut_equal_resident(arch, preset, variant, ckpt, ref_logits, monkeypatch):
    """cpu and hybrid decode captured piecewise, two cuts a MoE layer: after the router the host
    reads the choices (hybrid: and the guess of the next layer's) and fetches the split's share
    (hybrid: then prefetches); at the second cut (the cached experts' graph queued before it) it
    computes the CPU lane and writes its output into the buffer the next graph adds. Resident's
    logits alone and batched, and the eager step's hits, misses and prefetches (with hybrid-max1,
    an expert the single slot cannot take goes to the CPU instead of the staging area, so only
    there the CPU's count differs). The lane ran at the second cut."""
    runs = {}
    for cut in (False, True):
        llm = build(ckpt, arch, preset, variant)
        backend = llm.engine.experts
        assert not backend.prefetch  # on only where copies overlap compute (CUDA)
        backend.prefetch = backend.name == "hybrid"
        backend.lanes_from = 1  # (hybrid: the CPU lane at every batch, whatever the tiny lanes measured)
        if backend.split is not None:  # the same split in both runs, not two boots' timings
            backend.split = MissSplit(fetch_s=1.0, cpu_s=1.0, max_fetch=backend.split.max_fetch)
        used = cut_decode_steps(llm, monkeypatch, RunAtOnce) if cut else []
        callers = set()
        plain_run_host = SlotBuffer.run_host

        def run_host(*args, **kw):
            callers.add(sys._getframe(1).f_code.co_name)
            return plain_run_host(*args, **kw)

        monkeypatch.setattr(SlotBuffer, "run_host", run_host)
        got = llm.logits_batch(BATCH, CHUNKS)
        for g, w in zip(got, ref_logits(arch, preset, BATCH, CHUNKS)):
            assert rel_err(g, w) <= TOL
        stats = llm.engine.stats()["experts"]
        runs[cut] = ({k: stats[k] for k in ("hits", "misses", "prefetched")}, stats["cpu_experts"], contents(llm))
        assert (stats["prefetched"] > 0) == variant.startswith("hybrid")  # (hybrid-max1: its one slot is free
        # where the split, counting the prefetch's copies on the link's side, sends a step's own misses to the CPU)
        check_all(llm)
        monkeypatch.undo()
        if cut:
            assert used and all(u.capture.cuts == 2 * len(backend.executors) for u in used)  # two per MoE layer and step
            assert "_run_lane" in callers  # (prefill chunks compute theirs eagerly, in `_on_cpu`)
    assert runs[True][0] == runs[False][0] and runs[True][1] > 0
    assert_same_contents(runs[True][2], runs[False][2])
    if variant != "hybrid-max1":
        assert runs[True][1] == runs[False][1]


def test_lane_cut_reads_only_the_real_rows(ckpt):
    """A padded graph batch: the rows past the real ones are neither looked up nor computed,
    and the lane's buffer is zero there."""
    llm = build(ckpt, "qwen3_moe", "bf16", "cpu", moe_cache_size=2)
    backend = llm.engine.experts
    ex = next(iter(backend.executors.values()))
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, ex.bank.hidden, generator=gen)
    ids = torch.tensor([[0, 1], [1, 2], [0, 2], [5, 6]])  # row 3 is padding: experts 5 and 6 only there
    weights = torch.rand(4, 2, generator=gen)

    class ThreeRows:
        def cut(self, work):
            work(3)

    before = llm.engine.stats()["experts"]
    backend.capturing = ThreeRows()
    try:
        out = ex(x, ids, weights)
    finally:
        backend.capturing = None
    after = llm.engine.stats()["experts"]
    assert after["hits"] + after["misses"] - before["hits"] - before["misses"] == 3  # experts 0, 1, 2
    assert rel_err(out[:3], ex(x[:3], ids[:3], weights[:3])) <= TOL
    assert not torch.isnan(out[3]).any()


def decode_on_device(llm, monkeypatch) -> list[int]:
    """Run every all-decode step the way a graph managing the cache on the device does (here
    eagerly: the CPU is the device): the state handed over first, the layers inside a "capture"
    cut only at the layers without slots (`--moe-cpu-layers`). Returns the batch sizes of the
    steps run that way."""
    engine, backend = llm.engine, llm.engine.experts
    plain, steps = engine.run_batch, []

    def run(chunks, feed=None):
        if not (all(len(c.tokens) == 1 for c in chunks) and backend.steps_on_device(len(chunks))):
            return plain(chunks, feed)
        backend.before_graph(len(chunks))
        backend.capturing = never = RunAtOnce()
        try:
            return plain(chunks, feed)
        finally:
            backend.capturing = None
            assert never.cuts == 2 * len(backend.cpu_layers)
            steps.append(len(chunks))

    monkeypatch.setattr(engine, "run_batch", run)
    return steps


DEVICE_CASES = [("qwen3_5_moe", "mixed_nvfp4", "after", "lru", None), ("qwen3_moe", "bf16", "after", "lru", None),
                ("qwen3_5_moe", "bf16", "none", "lru", None), ("qwen3_moe", "int4_awq", "before", "lru", None),
                ("qwen3_5_moe", "mixed_nvfp4", "before", "lfu", None), ("qwen3_moe", "bf16", "none", "lfu", None),
                ("qwen3_5_moe", "mixed_nvfp4", "after", "lru", "2,"), ("qwen3_moe", "bf16", "before", "lfu", "3,")]


@pytest.mark.parametrize("arch,preset,prefetch,policy,cpu_layers", DEVICE_CASES,
                         ids=["-".join(map(str, c)) for c in DEVICE_CASES])
def test_device_managed_decode_equals_resident(arch, preset, prefetch, policy, cpu_layers, ckpt, ref_logits,
                                               monkeypatch):
    """Decode steps that look up, evict and fetch on the device (`DevicePolicy`), between
    prefill chunks managed on the host: resident's logits, alone and batched; the state handed
    back and forth stays whole (owners, table, eviction order, free list); the counters add up.
    With --moe-cpu-layers, those layers cut the step and run on the CPU between the pieces."""
    slots = 24 if not cpu_layers else {"lru": 16, "lfu": 20}[policy]  # partial, and >= graph_steps x 3 rows x top-2
    llm = build(ckpt, arch, preset, "offload-25%", moe_cache_size=slots, moe_cache_policy=policy,
                moe_cpu_layers=cpu_layers)
    backend = llm.engine.experts
    backend.prefetch, backend.prefetch_first = prefetch != "none", prefetch == "before"  # before / after the own gather
    calls = []
    plain_call = OffloadExperts.__call__

    def call(self, x, ids, weights, **kw):
        calls.append(len(torch.unique(ids)))
        return plain_call(self, x, ids, weights, **kw)

    monkeypatch.setattr(OffloadExperts, "__call__", call)
    steps = decode_on_device(llm, monkeypatch)
    got = llm.logits(PROMPT, chunk_size=CHUNKS)
    assert rel_err(got, ref_logits(arch, preset, [PROMPT], CHUNKS)[0]) <= TOL
    for g, w in zip(llm.logits_batch(BATCH, [5, 3, 1]), ref_logits(arch, preset, BATCH, [5, 3, 1])):
        assert rel_err(g, w) <= TOL
    assert 1 in steps and max(steps) > 1, steps  # alone and batched, on the device
    check_all(llm)  # (takes the state back from the device first)
    s = llm.engine.stats()["experts"]
    assert s["hits"] + s["misses"] + s["cpu_experts"] == sum(calls) and s["misses"] > 0
    assert s["bytes_fetched"] == (s["misses"] + s["prefetched"]) * backend.slot_bytes
    assert (s["prefetched"] > 0) == (prefetch != "none")
    assert (s["cpu_experts"] > 0) == bool(cpu_layers)


def test_hybrid_below_its_lanes_decodes_as_offload(ckpt, ref_logits, monkeypatch):
    """hybrid with `lanes_from` 2: a decode step of one row is managed on the device as offload's
    (no cut, no CPU lane), a batched one is cut twice a layer with the split's CPU lane; both give
    resident's logits, and the cache's state passes between device and host intact."""
    llm = build(ckpt, "qwen3_moe", "bf16", "hybrid", moe_cache_size=24)
    backend = llm.engine.experts
    backend.prefetch, backend.lanes_from = True, 2
    backend.split = MissSplit(fetch_s=1.0, cpu_s=1.0)  # both lanes every batched step
    steps = cut_decode_steps(llm, monkeypatch, RunAtOnce)
    got = llm.logits(PROMPT, chunk_size=CHUNKS)
    assert rel_err(got, ref_logits("qwen3_moe", "bf16", [PROMPT], CHUNKS)[0]) <= TOL
    for g, w in zip(llm.logits_batch(BATCH, [5, 3, 1]), ref_logits("qwen3_moe", "bf16", BATCH, [5, 3, 1])):
        assert rel_err(g, w) <= TOL
    alone = [(s.capture.cuts, s.cpu_experts) for s in steps if s.rows == 1]
    batched = [(s.capture.cuts, s.cpu_experts) for s in steps if s.rows > 1]
    assert alone and all(c == (0, 0) for c in alone), alone
    assert batched and all(cuts == 2 * len(backend.executors) for cuts, _ in batched)
    assert sum(cpu for _, cpu in batched) > 0
    check_all(llm)  # (takes the state back from the device first)
    assert llm.engine.stats()["experts"]["prefetched"] > 0


@pytest.mark.parametrize("arch,preset", [("qwen3_moe", "bf16"), ("qwen3_5_moe", "mixed_nvfp4")])
def test_hybrid_lane_in_the_graph_equals_resident(arch, preset, ckpt, ref_logits, monkeypatch):
    """hybrid with its CPU lane inside the decode graph (`cpu_lane`): steps of up to the lane's
    rows split their misses as the device does (here the host: `split_reference`), post the
    lane's share to the C thread, resolve and gather the rest, and add the thread's output; no
    cut. Resident's logits alone and batched (steps of three rows, past the lane's two, split on
    the host); the lane's experts count as misses and as CPU experts but not as bytes fetched,
    and the thread counted the same experts; the state stays whole. Every few experts the split
    takes the CPU's time from the thread's work (`_retune_lane`): far faster than the 1 s the
    test's split assumed, so the rewritten table sends every miss to the lane, the logits still
    resident's."""
    import moeferry.moe.offload as offload
    monkeypatch.setattr(offload, "RETUNE_EXPERTS", 4)
    llm = build(ckpt, arch, preset, "hybrid", moe_cache_size=24)
    backend = llm.engine.experts
    backend.prefetch, backend.lanes_from = True, math.inf  # past the lane's rows: eager steps
    backend.split = MissSplit(fetch_s=1.0, cpu_s=1.0)  # about half of a step's misses on each lane
    backend.open_lane(rows=2)
    backend.lane_batches = frozenset({1, 2})  # (this tiny cache holds most experts: the expected saving is nil)
    try:
        steps = decode_on_device(llm, monkeypatch)
        got = llm.logits(PROMPT, chunk_size=CHUNKS)
        assert rel_err(got, ref_logits(arch, preset, [PROMPT], CHUNKS)[0]) <= TOL
        for g, w in zip(llm.logits_batch(BATCH, [5, 3, 1]), ref_logits(arch, preset, BATCH, [5, 3, 1])):
            assert rel_err(g, w) <= TOL
        assert set(steps) == {1, 2}, steps  # alone and batched on the device, three rows not
        check_all(llm)  # (takes the state back from the device first)
        s = llm.engine.stats()["experts"]
        lane = sum(c.counters[layer].on_lane for c in caches(llm) for layer in c.layers)
        assert 0 < lane <= s["cpu_experts"] and s["cpu_experts"] == lane + sum(
            ex.cpu_experts for ex in backend.executors.values())
        assert s["bytes_fetched"] == (s["misses"] - s["cpu_experts"] + s["prefetched"]) * backend.slot_bytes
        assert sum(v["cpu_experts"] for v in s["layers"].values()) == s["cpu_experts"]
        work = backend.lane.counts()
        assert work.experts == lane and work.pairs >= lane and work.busy_s > 0 and work.failed == 0
        assert backend.split.cpu_s < 0.1 and backend.split.fetch_s == 1.0  # retuned from the thread's work
        assert torch.equal(backend.lane_fetches, backend._lane_table()) and not backend.lane_fetches.any()
    finally:
        backend.lane.close()


def test_hybrid_without_its_lane_thread_boots_and_says_why(ckpt, monkeypatch, caplog):
    """A lane whose C thread cannot be built or started, or without the C expert kernel, leaves
    hybrid on the cuts: the boot goes on, the log says why."""
    import moeferry.moe.offload as offload
    llm = build(ckpt, "qwen3_moe", "bf16", "hybrid", moe_cache_size=24)
    backend = llm.engine.experts

    def refuse(*args, **kw):
        raise OSError("the C compiler refused every flag set")

    monkeypatch.setattr(offload, "CpuLane", refuse)
    with caplog.at_level("WARNING", logger="moeferry.moe"):
        backend._try_lane()
    assert backend.lane is None and not backend.lane_batches
    assert "CPU lane inside the decode graphs unavailable (the C compiler refused" in caplog.text
    import moeferry.moe.cpu_lane as cpu_lane  # no C expert kernel: the real lane refuses to open
    monkeypatch.setattr(offload, "CpuLane", cpu_lane.CpuLane)
    monkeypatch.setattr(cpu_lane, "cpu_kernel", lambda: None)
    with caplog.at_level("WARNING", logger="moeferry.moe"):
        backend._try_lane()
    assert backend.lane is None and "unavailable (the CPU lane needs the C expert kernel" in caplog.text


def test_prefetch_budget_copies_the_best_guesses(ckpt, ref_logits, monkeypatch):
    """A device-managed prefetch guessing the whole top-k with a budget of one miss a row: each
    placement copies at most one expert a row, the best ranked of those not cached (over the rows,
    best rank first), and the logits stay resident's, alone and batched."""
    llm = build(ckpt, "qwen3_moe", "bf16", "offload-25%", moe_cache_size=24)
    backend = llm.engine.experts
    backend.prefetch, backend.prefetch_width, backend.prefetch_budget = True, 2, 1
    placed = []
    plain = type(backend).place_ahead

    def place_ahead(self, nxt, guess):
        cached = set((nxt.cache.table.table[nxt.cache.row_of[nxt.layer]] >= 0).nonzero().flatten().tolist())
        flat, slots = plain(self, nxt, guess)
        assert torch.equal(flat, guess.t().reshape(-1))  # rank-major
        missing = [e for e in dict.fromkeys(flat.tolist()) if e not in cached]
        copied = [e for e, s in zip(flat.tolist(), slots.tolist()) if s >= 0]
        assert copied == missing[:guess.shape[0]], (copied, missing)
        placed.append(len(copied))
        return flat, slots

    monkeypatch.setattr(type(backend), "place_ahead", place_ahead)
    decode_on_device(llm, monkeypatch)
    for g, w in zip(llm.logits_batch(BATCH, [5, 3, 1]), ref_logits("qwen3_moe", "bf16", BATCH, [5, 3, 1])):
        assert rel_err(g, w) <= TOL
    assert placed and max(placed) >= 1


def test_prefetch_gather_has_its_own_launch_shape(ckpt, ref_logits, monkeypatch):
    """The device-managed prefetch gathers in `prefetch_gather` (set apart from the own misses'
    `gather_kernel`): setting it makes each cache's gather in that shape at once (not inside
    the next capture), the prefetch's copies take it, the layer's own misses keep the boot's
    (on a grid capped at `own_programs`), and the logits stay resident's."""
    llm = build(ckpt, "qwen3_moe", "bf16", "offload-25%", moe_cache_size=24)
    backend = llm.engine.experts
    backend.prefetch, backend.own_programs = True, 3
    shape = (2048, 4, True)
    backend.prefetch_gather = shape
    (cache,) = caches(llm)
    assert all((id(b), shape) in cache.buffer._gathers for b in backend.banks.values())
    used = []
    plain = SlotBuffer.copy_indexed

    def copy_indexed(self, src, src_slots, dst_slots, gather, programs=None):
        used.append((gather, programs))
        return plain(self, src, src_slots, dst_slots, gather, programs)

    monkeypatch.setattr(SlotBuffer, "copy_indexed", copy_indexed)
    decode_on_device(llm, monkeypatch)
    got = llm.logits_batch(BATCH, [5, 3, 1])
    for g, w in zip(got, ref_logits("qwen3_moe", "bf16", BATCH, [5, 3, 1])):
        assert rel_err(g, w) <= TOL
    # here in line (no copy stream on the CPU: no grid cap); the prefetch counted its experts
    assert set(used) == {(shape, None), (backend.gather_kernel, 3)}, set(used)
    assert llm.engine.stats()["experts"]["prefetched"] > 0


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_device_hand_over_keeps_the_order(ckpt, policy):
    """on_device then on_host gives back the same owners, table, eviction state (order, LFU's
    priorities, uses and age) and prefetched set."""
    llm = build(ckpt, "qwen3_moe", "bf16", "offload-25%", moe_cache_policy=policy)
    llm.logits(PROMPT, chunk_size=CHUNKS)
    (cache,) = caches(llm)
    cache.prefetched = {cache.owner[s] for s in range(2) if cache.owner[s] is not None}
    before = (list(cache.owner), cache.host_table.clone(), cache.policy.entries(), cache.policy.age,
              set(cache.prefetched), sorted(cache.free_slots))
    with torch.inference_mode():  # made inside inference mode (a step's first capture) ...
        cache.on_device()
    cache.host_table.fill_(-1)  # stale while the device owns the state
    cache.on_host()
    after = (list(cache.owner), cache.host_table.clone(), cache.policy.entries(), cache.policy.age,
             set(cache.prefetched), sorted(cache.free_slots))
    assert policy == "lru" or before[3] > 0  # LFU evicted on the way: its age rose
    assert before[0] == after[0] and torch.equal(before[1], after[1]) and before[2:] == after[2:]
    cache.on_device()  # ... and handed over again outside it (the warm-up's captures)
    cache.check()


def test_failed_graph_reloads_the_cache(ckpt, ref_logits):
    """A decode graph that failed part-way may leave slots the table names but no copy filled:
    `graph_failed` takes the state back and copies every cached expert again."""
    llm = build(ckpt, "qwen3_moe", "bf16", "offload-25%")
    backend = llm.engine.experts
    backend.before_graph(1)  # the device owns the state, as before a capture
    (cache,) = caches(llm)
    assert cache.device_owned
    for m in (cache.buffer.gate_up, cache.buffer.down):
        for t in m.tensors().values():
            t.zero_()  # contents in doubt
    backend.graph_failed()
    assert not cache.device_owned
    got = llm.logits(PROMPT, chunk_size=CHUNKS)
    assert rel_err(got, ref_logits("qwen3_moe", "bf16", [PROMPT], CHUNKS)[0]) <= TOL
    check_all(llm)


def test_split_choices_reads_only_the_real_rows():
    """A padded graph batch: the host part reads the first rows' choices of the step and of
    the guess, never the padding rows' (nor the guess as the step's)."""
    ids = torch.tensor([[3, 1], [1, 7], [9, 9]])    # 3 rows, top-2; the last row is padding
    guess = torch.tensor([[5, 4], [4, 6], [8, 8]])  # best first: the guess comes back rank-major
    flat = offload_mod.choices(ids, guess).tolist()
    assert offload_mod.split_choices(flat, 2 * 2, ids.numel(), 2 * 2, 2) == ([1, 3, 7], [5, 4, 6])
    assert offload_mod.split_choices(flat, 1 << 30, ids.numel(), ids.numel(), 2) == ([1, 3, 7, 9], [5, 4, 8, 6])
    assert offload_mod.distinct_experts(ids, guess) == ([1, 3, 7, 9], [5, 4, 8, 6])
    wide = torch.tensor([[5, 4, 2], [4, 6, 0], [8, 8, 8]])  # a guess of 3 a row (`prefetch_width`)
    flat = offload_mod.choices(ids, wide).tolist()
    assert offload_mod.split_choices(flat, 2 * 2, ids.numel(), 2 * 3, 3) == ([1, 3, 7], [5, 4, 6, 2, 0])
    assert offload_mod.distinct_experts(ids, wide[:, :1]) == ([1, 3, 7, 9], [5, 4, 8])


def test_prefetch_defaults_to_the_top_k_and_a_quarter_of_it(ckpt):
    """The decode prefetch guesses the top-k a row and copies at most a quarter of it unless
    --moe-prefetch-width / --moe-prefetch-budget say."""
    backend = build(ckpt, "qwen3_5_moe", "bf16", "offload-25%").engine.experts
    k = backend.spec.top_k
    assert (backend.prefetch_width, backend.prefetch_budget) == (k, max(1, k // 4))
    backend = build(ckpt, "qwen3_5_moe", "bf16", "offload-25%", moe_prefetch_width=3, moe_prefetch_budget=2).engine.experts
    assert (backend.prefetch_width, backend.prefetch_budget) == (3, 2)


@pytest.mark.parametrize("width", [1, 4])
def test_prefetch_width_keeps_logits(ckpt, ref_logits, monkeypatch, width):
    """A decode prefetch guessing `prefetch_width` experts a row (fewer or more than the top-k)
    gives resident's logits through the device-managed steps and through a piecewise capture's
    cuts, guesses that many (a wider guess prefetches more), and a device-managed cache must
    then hold that many a row for its steps."""
    arch, prefetched, guesses = "qwen3_moe", {}, []
    plain_guess = OffloadExperts._guess

    def guess(self, x, ids):
        out = plain_guess(self, x, ids)
        guesses.append(out.shape[-1])
        return out

    monkeypatch.setattr(OffloadExperts, "_guess", guess)
    for mode in ("device", "cut"):
        llm = build(ckpt, arch, "bf16", "offload-25%", moe_cache_size=24)
        backend = llm.engine.experts
        backend.prefetch, backend.prefetch_width = True, width
        guesses.clear()
        if mode == "device":
            decode_on_device(llm, monkeypatch)
        else:
            backend.device_managed = False
            cut_decode_steps(llm, monkeypatch, RunAtOnce)
        for g, w in zip(llm.logits_batch(BATCH, [5, 3, 1]), ref_logits(arch, "bf16", BATCH, [5, 3, 1])):
            assert rel_err(g, w) <= TOL
        check_all(llm)
        assert guesses and set(guesses) == {width}, set(guesses)
        prefetched[mode] = llm.engine.stats()["experts"]["prefetched"]
        assert prefetched[mode] > 0
    backend.device_managed = True
    backend.prefetch_width = 12  # LRU keeps 2 steps' experts: 2 x 12 a row, so 24 slots take one row only
    assert backend.steps_on_device(1) and not backend.steps_on_device(2)


def test_graph_mode_needs_a_steps_working_set(ckpt, monkeypatch):
    """Graphs of a partial cache only on CUDA. The offload lane: managed on the device when the
    gather kernel works and every cache holds two steps' experts, else piecewise with every
    cache holding max_batch x top_k experts (a step's experts could not be left over to stream
    inside a graph). cpu: piecewise at any size (the CPU lane takes what finds no slot); hybrid
    too from the batch its CPU lane starts at (`lanes_from`), as offload below it."""
    llm = build(ckpt, "qwen3_5_moe", "bf16", "offload-25%")  # 8 of 32 slots, top_k 2
    backend = llm.engine.experts
    assert backend.graph_mode(1) is None  # the CPU
    monkeypatch.setattr(backend, "device", torch.device("cuda"))
    assert backend.graph_mode(4) == "piecewise" and backend.graph_mode(5) is None
    backend.gathers_ready = True  # the gather kernel works for every cache: the device manages two steps' experts
    assert backend.graph_mode(2) == "device" and backend.graph_mode(3) == "piecewise"
    backend.device_managed = False
    assert backend.graph_mode(2) == "piecewise"
    for name in ("hybrid", "cpu"):
        backend.name, backend.lanes_from = name, 1
        assert backend.graph_mode(1) == backend.graph_mode(64) == "piecewise"
    backend.device_managed, backend.lanes_from = True, 2  # hybrid: batch 1 fetches every miss
    assert backend.graph_mode(1) == "device" and backend.graph_mode(2) == backend.graph_mode(64) == "piecewise"
    backend.name, backend.lanes_from = "hybrid", math.inf  # a cache too small to manage on the device: piecewise
    assert backend.graph_mode(2) == "device" and backend.graph_mode(3) == backend.graph_mode(64) == "piecewise"
    monkeypatch.setattr(backend, "device", torch.device("cpu"))
    assert backend.graph_mode(1) is None


def test_prefetch_never_evicts_what_the_step_uses(ckpt):
    """A prefetch into a cache holding only this step's experts places nothing."""
    llm = build(ckpt, "qwen3_moe", "bf16", "offload-1")
    backend = llm.engine.experts
    (cache,) = caches(llm)
    first, second = sorted(backend.executors)[:2]
    cache.fetch(first, [0], backend.banks[first], keep={0})
    assert cache.prefetch(second, [1, 2], backend.banks[second], protect={(first, 0)}) == []
    assert cache.slot_of(first, 0) >= 0
    cache.check()


def test_complete_cache_reads_nothing_on_the_host(ckpt, ref_logits, trace, monkeypatch):
    """Every expert cached: no step reads expert ids on the host (decode graphs may capture it);
    hits are counted on the device, and a shrink ends it."""
    arch = "qwen3_5_moe"
    llm = build(ckpt, arch, "bf16", "offload-100%")
    backend = llm.engine.experts
    assert backend.complete and backend.graph_mode(4) == "whole"

    def no_sync(*a, **k):
        raise AssertionError("a complete cache read expert ids on the host")

    original = offload_mod.distinct_experts
    monkeypatch.setattr(offload_mod, "distinct_experts", no_sync)
    got = llm.logits(PROMPT, chunk_size=CHUNKS)
    assert rel_err(got, ref_logits(arch, "bf16", [PROMPT], CHUNKS)[0]) <= TOL
    s = llm.engine.stats()["experts"]
    assert s["hits"] == sum(len(n) for _, n, _ in trace) > 0 and s["misses"] == 0 and s["hit_rate"] == 1.0
    assert llm.engine.stats()["experts"]["hits"] == s["hits"]  # folded in once
    monkeypatch.setattr(offload_mod, "distinct_experts", original)
    backend.shrink(backend.expert_slots - 1)
    assert not backend.complete and backend.graph_mode(4) is None  # CPU: nothing captures a partial cache
    got = llm.logits(PROMPT, chunk_size=CHUNKS)
    assert rel_err(got, ref_logits(arch, "bf16", [PROMPT], CHUNKS)[0]) <= TOL
    check_all(llm)


# -- 6. --moe-cpu-layers: layers without device slots ------------------------------------------
@pytest.mark.parametrize("arch,preset", [("qwen3_moe", "bf16"), ("qwen3_5_moe", "mixed_nvfp4")])
def test_cpu_layers(arch, preset, ckpt, ref_logits, trace):
    llm = build(ckpt, arch, preset, "cpu", moe_cpu_layers=1, moe_cache_size=6)
    backend = llm.engine.experts
    first = min(backend.banks)
    assert backend.cpu_layers == {first}  # a count of 1: the first MoE layer
    assert first not in backend.caches and backend.executors[first].cache is None
    assert all(first not in c.layers for c in caches(llm))
    assert backend.expert_slots == 6
    got = llm.logits(PROMPT, chunk_size=CHUNKS)
    assert rel_err(got, ref_logits(arch, preset, [PROMPT], CHUNKS)[0]) <= TOL
    s = llm.engine.stats()["experts"]
    assert s["layers"][str(first)] == {"cpu_experts": backend.executors[first].cpu_experts} and s["bytes_fetched"] == 0
    on_first = sum(len(n) for layer, n, _ in trace if layer == first)
    assert backend.executors[first].cpu_experts == on_first > 0
    assert s["cpu_experts"] == on_first + s["misses"]


def test_cpu_layer_specs():
    """FreeToken 0.1.2's spellings: MoE-layer ids, a count spread over the depth, a fraction."""
    from moeferry.moe.cpu_layers import check, resolve
    assert resolve(check("3,1,3"), 8) == [1, 3] and resolve(check("5,"), 8) == [5]
    assert resolve(check("4"), 8) == [0, 2, 4, 6] and resolve(check(3), 8) == [0, 2, 5]
    assert resolve(check("0.5"), 40) == list(range(0, 40, 2)) and resolve(check("1.0"), 5) == [0, 1, 2, 3, 4]
    assert check(None) is check("") is check(0) is check("0") is None and resolve(None, 8) == []
    for bad, said in (("x", "give MoE-layer ids"), ("-1", "at least 0"), ("1.5", "in \\[0, 1\\]"),
                      ("1,-2", "start at 0")):
        with pytest.raises(ValueError, match=said):
            check(bad)
    with pytest.raises(ValueError, match="out of range: the model has 8 MoE layers"):
        resolve("7,8", 8)
    with pytest.raises(ValueError, match="has 8 MoE layers"):
        resolve("9", 8)


LONG = _prompt(90, 8)
LONG_CHUNKS = [40, 45, 1]  # prefill chunks past a staging half (32), then decode-sized steps


def test_hybrid_prefill_chunks_fetch_every_miss(ckpt, ref_logits, monkeypatch):
    """hybrid's prefill-sized chunks (past a staging half) fetch or stream all their misses (the
    CPU lane's time for an expert's many tokens is not what its few-token timing predicts); its
    decode steps split theirs, here all to the CPU (the link priced out)."""
    llm = build(ckpt, "qwen3_moe", "bf16", "hybrid")
    backend = llm.engine.experts
    backend.split = MissSplit(fetch_s=1e9, cpu_s=1.0)
    rows = []
    plain = SlotBuffer.run_host
    monkeypatch.setattr(SlotBuffer, "run_host", lambda self, x, *a, **kw: rows.append(x.shape[0]) or plain(self, x, *a, **kw))
    got = llm.logits(LONG, chunk_size=LONG_CHUNKS)
    assert rel_err(got, ref_logits("qwen3_moe", "bf16", [LONG], LONG_CHUNKS)[0]) <= TOL
    assert rows and max(rows) == 1  # the decode steps' lone token only
    s = llm.engine.stats()["experts"]
    assert s["cpu_experts"] > 0 and s["bytes_fetched"] > 0
    check_all(llm)


@pytest.mark.parametrize("arch,preset,variant,spec", [("qwen3_moe", "bf16", "offload-25%", "1,3"),
                                                      ("qwen3_5_moe", "mixed_nvfp4", "offload-25%", "0.5"),
                                                      ("qwen3_moe", "int4_awq", "cpu", "2")])
def test_cpu_layers_stream_prefill_and_decode_on_the_cpu(arch, preset, variant, spec, ckpt, ref_logits, trace):
    """--moe-cpu-layers as FreeToken spells it, with offload (its meaning) and cpu: the chosen
    layers hold no slots; their prefill chunks stream through the staging area (the CPU would
    take far longer over hundreds of tokens) and their decode steps run on the CPU. The cpu
    backend's own misses in a prefill chunk stream too, and its cache stays as the boot filled it."""
    llm = build(ckpt, arch, preset, variant, moe_cpu_layers=spec)
    backend = llm.engine.experts
    moe = sorted(backend.banks)
    want = {"1,3": [1, 3], "0.5": [0, 2], "2": [0, 2]}[spec]
    assert backend.cpu_layers == {moe[i] for i in want}
    assert all(backend.executors[layer].cache is None for layer in backend.cpu_layers) and backend.staging
    filled = contents(llm)
    got = llm.logits(LONG, chunk_size=LONG_CHUNKS)
    assert rel_err(got, ref_logits(arch, preset, [LONG], LONG_CHUNKS)[0]) <= TOL
    s = llm.engine.stats()["experts"]
    decode = sum(len(n) for layer, n, t in trace if layer in backend.cpu_layers and t <= 32)
    prefill = sum(len(n) for layer, n, t in trace if layer in backend.cpu_layers and t > 32)
    on_cpu = sum(backend.executors[layer].cpu_experts for layer in backend.cpu_layers)
    assert on_cpu == decode > 0 and prefill > 0
    assert backend.streamed.bytes_fetched == prefill * backend.slot_bytes
    if variant == "cpu":
        assert_same_contents(contents(llm), filled)
        assert s["bytes_fetched"] > backend.streamed.bytes_fetched  # the cached layers' misses streamed too
    check_all(llm)


def test_cpu_layer_spec_errors_before_loading(ckpt):
    with pytest.raises(ValueError, match="moe-cpu-layers"):
        LLM(str(ckpt("qwen3_moe", "bf16")), **COMMON, moe_backend="cpu", moe_cache_size=4, moe_cpu_layers=-1)
    with pytest.raises(ValueError, match="applies to the offload and cpu backends"):
        LLM(str(ckpt("qwen3_moe", "bf16")), **COMMON, moe_backend="hybrid", moe_cache_size=4, moe_cpu_layers="1")
    with pytest.raises(ValueError, match="out of range: the model has 4 MoE layers"):
        LLM(str(ckpt("qwen3_moe", "bf16")), **COMMON, moe_backend="offload", moe_cache_size=4, moe_cpu_layers="2,4")


# -- 7. hybrid: the split ------------------------------------------------------------------------
def _brute_fetch_count(fetch_s: float, costs: list[float], cap: int | None, queued: int = 0) -> int:
    """The smallest n minimising max((queued + n) * fetch_s, cost of the misses left to the CPU)."""
    times = [(max((queued + n) * fetch_s, sum(costs[n:])), n) for n in range(len(costs) + 1)]
    best = min(times)[1]
    return best if cap is None else min(best, cap)


def test_miss_split_fetch_count_is_the_brute_force_optimum():
    gen = torch.Generator().manual_seed(0)
    for trial in range(300):
        m = int(torch.randint(0, 12, (1,), generator=gen))
        costs = sorted(torch.randint(1, 40, (m,), generator=gen).float().tolist(), reverse=True)
        fetch_s = float(torch.randint(1, 60, (1,), generator=gen))  # integers: exact float sums
        cap = None if trial % 3 else int(torch.randint(0, 5, (1,), generator=gen))
        split = MissSplit(fetch_s, 1.0, cap)
        queued = int(torch.randint(0, 4, (1,), generator=gen))  # prefetch copies the link carries too
        assert split.fetch_count(costs) == _brute_fetch_count(fetch_s, costs, cap), (fetch_s, costs, cap)
        assert split.fetch_count(costs, queued) == _brute_fetch_count(fetch_s, costs, cap, queued), queued
    # the extremes: free fetches take everything, free CPU takes nothing
    assert MissSplit(1e-9, 1.0).fetch_count([1.0] * 5) == 5
    assert MissSplit(1e9, 1.0).fetch_count([1.0] * 5) == 0


def test_miss_split_fetch_table_is_the_count_for_each_number_of_misses():
    """The device's split table: entry m is `fetch_count` of m misses of the given tokens each
    (the brute-force optimum), the link carrying the queued copies too."""
    split = MissSplit(fetch_s=2.0, cpu_s=1.0, cpu_token_s=1.0)
    for tokens, queued in ((1, 0), (1, 1), (2.4, 0), (3, 2)):
        want = [_brute_fetch_count(2.0, [float(round(tokens))] * m, None, queued) for m in range(9)]
        assert split.fetch_table(8, tokens, queued) == want
    assert MissSplit(fetch_s=1.0, cpu_s=1.0).fetch_table(4) == [0, 0, 1, 1, 2]  # ties: the fewer fetches
    assert MissSplit(fetch_s=1.0, cpu_s=1.0, max_fetch=1).fetch_table(4) == [0, 0, 1, 1, 1]


def test_miss_split_keeps_each_lanes_fastest_measurement():
    """A boot measures the lanes at each `finish`; work beside it only slows a lane, so each
    lane keeps its fastest time (an unmeasured one takes the other's)."""
    a = MissSplit(fetch_s=3.0, cpu_s=1.0, cpu_token_s=None, graph_fetch_s=4.0)
    b = MissSplit(fetch_s=2.0, cpu_s=9.0, max_fetch=2, cpu_token_s=0.5, graph_fetch_s=None)
    assert a.fastest(b) == MissSplit(2.0, 1.0, 2, 0.5, 4.0)
    assert b.fastest(a) == MissSplit(2.0, 1.0, None, 0.5, 4.0)  # (the cap is the latest's: a flag, not a rate)


def test_miss_split_takes_the_cpu_time_the_lane_was_seen_to_take():
    """The CPU lane's work (time, experts, pairs) gives the split's time an expert: each pair past
    an expert's first at the split's further-token time, the rest shared by the experts."""
    split = MissSplit(fetch_s=1.0, cpu_s=5.0, max_fetch=3, cpu_token_s=0.5)
    seen = split.with_cpu_observed(busy_s=10.0, experts=4, pairs=6)
    assert seen == MissSplit(1.0, (10.0 - 2 * 0.5) / 4, 3, 0.5)
    assert MissSplit(1.0, 5.0).with_cpu_observed(8.0, 4, 4).cpu_s == 2.0


def test_miss_split_divide_fetches_the_busiest_experts():
    split = MissSplit(fetch_s=2.0, cpu_s=1.0)
    ids = torch.tensor([[1, 4], [4, 6], [4, 1], [6, 4], [3, 4]])  # 4: 5 tokens, 1: 2, 6: 2, 3: 1
    fetch, on_cpu = split.divide([1, 3, 4, 6], ids)
    assert sorted(fetch + on_cpu) == [1, 3, 4, 6] and not set(fetch) & set(on_cpu)
    assert fetch[0] == 4 and set(on_cpu) <= {1, 3, 6}
    assert len(fetch) == _brute_fetch_count(2.0, [5.0, 2.0, 2.0, 1.0], None)
    capped = MissSplit(fetch_s=1e-9, cpu_s=1.0, max_fetch=2)
    fetch, on_cpu = capped.divide([1, 3, 4, 6], ids)
    assert len(fetch) == 2 and fetch[0] == 4 and len(on_cpu) == 2


def test_miss_split_charges_further_tokens_their_own_cost():
    split = MissSplit(fetch_s=1.0, cpu_s=2.0, cpu_token_s=0.5)
    assert [split.cpu_cost(t) for t in (0, 1, 3)] == [2.0, 2.0, 3.0]
    assert MissSplit(fetch_s=1.0, cpu_s=2.0).cpu_cost(3) == 6.0  # unmeasured: each token costs a whole expert
    assert "CPU 2000000 us/expert + 500000 us a further token" in split.describe()


def test_miss_split_lanes_from_weighs_the_saving_against_the_cuts():
    """The split's saving a layer is the brute-force optimum's; the lanes start at the first batch
    whose expected misses save more than the cuts cost: the H100 lanes measured for bf16 experts
    (fetch 127 us, CPU 247 us + 38 us a further token) from batch 2 at 50 of 256 experts cached a
    layer, NVFP4's (37 us, 72 us) only from a bigger batch; free cuts split from batch 1, costly
    ones never."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(100):
        m = int(torch.randint(0, 12, (1,), generator=gen))
        f, c = (float(torch.randint(1, 60, (1,), generator=gen)) for _ in range(2))
        split = MissSplit(f, c)
        assert split.saving(m) == m * f - min(max(n * f, (m - n) * c) for n in range(m + 1))
    misses, tokens = expected_misses(1, 8, 256, 50 / 256)
    assert 6 < misses < 6.5 and 1 < tokens < 1.02
    assert expected_misses(4, 8, 256, 1.0)[0] == 0 and expected_misses(1000, 8, 256, 0.0)[0] == pytest.approx(256)
    bf16 = MissSplit(127e-6, 247e-6, cpu_token_s=38e-6)
    at = functools.partial(expected_misses, top_k=8, experts=256, cached=50 / 256)
    assert bf16.lanes_from(at) == 2
    nvfp4 = MissSplit(37e-6, 72e-6, cpu_token_s=10e-6)
    assert 4 < nvfp4.lanes_from(functools.partial(expected_misses, top_k=8, experts=256, cached=90 / 256)) < 1024
    assert bf16.lanes_from(at, cut_s=0.0) == 1 and bf16.lanes_from(at, cut_s=1.0) == math.inf
    # an H100 host's link (the gather kernel moved a 6 MiB expert in 203 us, copies in 124 us; there b1
    # decoded 52.6 tok/s split, 31.0 unsplit) with another's CPU lane (90 us an expert): priced at the
    # copies, the split's saving at batch 1 is below the cuts' cost; priced as the graph that does not
    # split fetches (the gather kernel), well above it
    host = dict(fetch_s=124e-6, cpu_s=90e-6, cpu_token_s=16e-6)
    at = functools.partial(expected_misses, top_k=8, experts=256, cached=1200 / 24 / 256)
    assert MissSplit(**host).lanes_from(at) == 2 and MissSplit(**host, graph_fetch_s=203e-6).lanes_from(at) == 1
    assert MissSplit(**host, graph_fetch_s=124e-6).saving(6) == MissSplit(**host).saving(6)


def test_miss_split_times_the_fetch_the_caches_make(monkeypatch):
    """The hybrid split's fetch time is measured the way its caches fetch (`backend.gather`: the
    gather kernel where the boot chose it), over experts spread across the bank; the CPU lane
    with the threads it will run with."""
    from types import SimpleNamespace
    from moeferry.moe import bandwidth
    seen = []
    seen_threads = []
    monkeypatch.setattr(bandwidth, "time_cpu_expert", lambda bank, tokens, threads=None: seen_threads.append(threads)
                        or 1e-3 * tokens)
    monkeypatch.setattr(bandwidth, "time_fetch", lambda bank, device, gather=None: seen.append(gather) or 2e-3)
    backend = SimpleNamespace(banks={0: "bank"}, device=torch.device("cpu"), gather=(4096, 8, True),
                              gather_kernel_s=3e-3, device_managed=True)
    split = MissSplit.measure(backend, None)
    assert seen == [(4096, 8, True)] and split.fetch_s == 2e-3 and split.cpu_s == 1e-3
    assert seen_threads == [None, None]  # PyTorch's threads unless the lane's are given
    MissSplit.measure(backend, None, threads=3)
    assert seen_threads[2:] == [3, 3]
    assert split.graph_fetch_s == 3e-3  # what the device-managed graphs' gather costs, for `lanes_from`
    backend.device_managed = False  # (graphs that do not split then fetch as the split does)
    assert MissSplit.measure(backend, None).graph_fetch_s is None
    batches = bandwidth.spread(20, 8, 3)
    assert [len(b) for b in batches] == [8, 8, 8] and all(len(set(b.tolist())) == 8 for b in batches)
    assert len(set(batches[0].tolist()) | set(batches[1].tolist())) == 16  # the next batch reads others


def test_hybrid_split_counts_the_prefetch_on_the_link(ckpt, ref_logits, monkeypatch):
    """hybrid's split puts the decode prefetch's copies that follow a layer's fetches on the
    link's side (the next layer waits for them): each split is told how many the prefetch
    will copy, and those are the copies it then makes (unless this layer's own fetches evicted
    a guess: rare here); outputs stay resident's."""
    from moeferry.moe.expert_cache import ExpertCache
    told, copied = [], []  # a split's count, and the copies of the prefetch that followed it
    plain_divide, plain_prefetch = MissSplit.divide, ExpertCache.prefetch

    def divide(self, misses, ids, queued=0):
        copied.extend([0] * (len(told) - len(copied)))  # (no prefetch call: nothing was left to copy)
        told.append(queued)
        return plain_divide(self, misses, ids, queued)

    def prefetch(self, *args, **kw):
        placed = plain_prefetch(self, *args, **kw)
        if len(copied) < len(told):  # (a step that split nothing: no count told)
            copied.append(len(placed))
        return placed

    monkeypatch.setattr(MissSplit, "divide", divide)
    monkeypatch.setattr(ExpertCache, "prefetch", prefetch)
    llm = build(ckpt, "qwen3_moe", "bf16", "hybrid", moe_cache_size=12)
    backend = llm.engine.experts
    backend.prefetch, backend.split = True, MissSplit(fetch_s=1.0, cpu_s=1.0)
    got = llm.logits_batch(BATCH, [5, 1])
    for g, w in zip(got, ref_logits("qwen3_moe", "bf16", BATCH, [5, 1])):
        assert rel_err(g, w) <= TOL
    copied.extend([0] * (len(told) - len(copied)))
    pairs = list(zip(told, copied))
    assert any(q > 0 for q in told)
    assert sum(q == c for q, c in pairs) >= 0.8 * len(pairs), pairs


def test_hybrid_max_fetch_caps_fetches(ckpt, ref_logits, monkeypatch):
    arch = "qwen3_moe"
    fetched = []  # (misses, fetches) of every hybrid layer step
    orig = MissSplit.divide

    def divide(self, misses, ids, queued=0):
        fetch, on_cpu = orig(self, misses, ids, queued)
        fetched.append((len(misses), len(fetch)))
        return fetch, on_cpu

    monkeypatch.setattr(MissSplit, "divide", divide)
    llm = build(ckpt, arch, "bf16", "hybrid", moe_cache_size=2, moe_hybrid_max_fetch=1)
    backend = llm.engine.experts
    assert backend.split.max_fetch == 1 and backend.split.fetch_s > 0 and backend.split.cpu_s > 0
    got = llm.logits_batch(BATCH, [5, 1])
    for g, w in zip(got, ref_logits(arch, "bf16", BATCH, [5, 1])):
        assert rel_err(g, w) <= TOL
    assert fetched and all(n <= 1 for _, n in fetched)
    assert any(m > 1 for m, _ in fetched)  # the cap bound: more misses than fetches
    s = llm.engine.stats()["experts"]
    assert s["cpu_experts"] == sum(m - n for m, n in fetched) > 0
    assert s["bytes_fetched"] == sum(n for _, n in fetched) * backend.slot_bytes
    check_all(llm)

    # an even split (a fetch costs one CPU expert-token) uses both lanes within a step
    monkeypatch.setattr(backend, "split", MissSplit(fetch_s=1.0, cpu_s=1.0))
    fetched.clear()
    got = llm.logits(PROMPT, chunk_size=CHUNKS)
    assert rel_err(got, ref_logits(arch, "bf16", [PROMPT], CHUNKS)[0]) <= TOL
    assert any(0 < n < m for m, n in fetched)
    check_all(llm)


# -- 8. counters and Engine.stats() ----------------------------------------------------------------
def test_counters_and_stats(ckpt, resident):
    llm = build(ckpt, "qwen3_5_moe", "bf16", "offload-25%")
    backend = llm.engine.experts
    s = llm.engine.stats()["experts"]
    assert set(s) == {"backend", "policy", "slots", "slots_used", "device_bytes", "host_bytes", "hits", "misses",
                      "hit_rate", "bytes_fetched", "prefetched", "prefetch_hits", "cpu_experts", "layers"}
    assert s["policy"] == "lru"
    assert s["slots_used"] == s["slots"]  # the boot fill uses every slot
    assert (s["hits"], s["misses"], s["hit_rate"], s["bytes_fetched"]) == (0, 0, None, 0)  # boot fill is no traffic
    total = llm.spec.num_layers * llm.spec.num_experts
    assert s["slots"] == total // 4 and backend.experts_total == total
    assert s["host_bytes"] == total * backend.slot_bytes
    assert s["device_bytes"] == s["slots"] * backend.slot_bytes + backend.staging_bytes
    llm.logits_batch(BATCH, [5, 1])
    s = llm.engine.stats()["experts"]
    layers = s["layers"]
    assert set(layers) == {str(i) for i in range(llm.spec.num_layers)}
    assert s["hits"] == sum(v["hits"] for v in layers.values()) > 0
    assert s["misses"] == sum(v["misses"] for v in layers.values()) > 0
    assert s["hit_rate"] == round(s["hits"] / (s["hits"] + s["misses"]), 4)
    for v in layers.values():
        assert set(v) == {"hits", "misses", "bytes_fetched", "hit_rate", "prefetched", "prefetch_hits", "cpu_experts"}
        assert v["bytes_fetched"] == v["misses"] * backend.slot_bytes  # decode path: every miss one slot copy
        assert v["hit_rate"] == round(v["hits"] / (v["hits"] + v["misses"]), 4)
    assert s["bytes_fetched"] == s["misses"] * backend.slot_bytes
    res = resident("qwen3_5_moe", "bf16").engine.stats()["experts"]
    assert res["backend"] == "resident" and res["device_bytes"] > 0


# -- 9. host RAM and the bank loading mode -------------------------------------------------------------
def test_plan_loading(monkeypatch):
    gib = 2 ** 30
    monkeypatch.setattr("moeferry.moe.bank.os.cpu_count", lambda: 4)
    with pytest.raises(HostRamError) as e:
        plan_loading(10 * gib, gib, "auto", available=5 * gib)
    msg = str(e.value)
    assert "10.00 GiB" in msg and "1.00 GiB" in msg and "5.00 GiB" in msg
    for mode in ("serial", "parallel"):
        with pytest.raises(HostRamError):
            plan_loading(10 * gib, gib, mode, available=11 * gib - 1)
    assert plan_loading(10 * gib, gib, "serial", available=100 * gib) == 1
    assert plan_loading(10 * gib, gib, "parallel", available=100 * gib) == 4
    assert plan_loading(10 * gib, gib, "parallel", available=12 * gib) == 4  # asked for: read anyway (warned)
    assert plan_loading(10 * gib, gib, "auto", available=14 * gib) == 4  # banks + 4 layers in flight fit
    assert plan_loading(10 * gib, gib, "auto", available=14 * gib - 1) == 1
    assert plan_loading(10 * gib, gib, "auto", available=100 * gib, max_threads=1) == 1


def test_allocator_settings(monkeypatch):
    """Expandable device segments, and banks pinned by malloc + cudaHostRegister from a
    power-of-two number of threads (<= 16), each unless the user's settings already say."""
    assert pinned_register_settings(1).endswith("threads:1") and pinned_register_settings(12).endswith("threads:8")
    assert pinned_register_settings(64) == "pinned_use_cuda_host_register:True,pinned_num_register_threads:16"
    assert allocator_settings("", 16) == "expandable_segments:True," + pinned_register_settings(16)
    assert allocator_settings("expandable_segments:False", 4) == pinned_register_settings(4)
    assert allocator_settings("pinned_use_background_threads:True,expandable_segments:True") == ""
    calls = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    configure_allocator(torch.device("cpu"))
    assert calls == []
    configure_allocator(torch.device("cuda"))
    assert calls == [allocator_settings("")]
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,pinned_use_background_threads:True")
    configure_allocator(torch.device("cuda"))
    assert len(calls) == 1


def test_parallel_load_builds_identical_banks(ckpt, monkeypatch):
    monkeypatch.setattr("moeferry.moe.bank.os.cpu_count", lambda: 4)
    path = str(ckpt("qwen3_5_moe", "int4_awq"))
    serial = LLM(path, **COMMON, moe_backend="offload", moe_cache_size=4, expert_load="serial")
    parallel = LLM(path, **COMMON, moe_backend="offload", moe_cache_size=4, expert_load="parallel")
    assert serial.engine.experts.load_threads == 1 and parallel.engine.experts.load_threads == 4
    for layer, bank in serial.engine.experts.banks.items():
        other = parallel.engine.experts.banks[layer]
        for mine, theirs in ((bank.gate_up, other.gate_up), (bank.down, other.down)):
            a, b = mine.tensors(), theirs.tensors()
            assert a.keys() == b.keys()
            for k in a:
                assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), (layer, k)
    assert torch.equal(serial.logits(PROMPT, chunk_size=[9, 1]), parallel.logits(PROMPT, chunk_size=[9, 1]))

    monkeypatch.setattr("moeferry.moe.bank.available_host_ram", lambda: 1000)
    with pytest.raises(HostRamError, match="not enough host RAM"):
        LLM(path, **COMMON, moe_backend="offload", moe_cache_size=4)


def _same_bytes(a: SlotBuffer, b: SlotBuffer, what) -> None:
    for mine, theirs in ((a.gate_up, b.gate_up), (a.down, b.down)):
        x, y = mine.tensors(), theirs.tensors()
        assert x.keys() == y.keys() and mine.group == theirs.group and mine.group_n == theirs.group_n
        for k in x:
            assert x[k].dtype == y[k].dtype and x[k].shape == y[k].shape, (what, k)
            assert torch.equal(x[k].contiguous().view(torch.uint8), y[k].contiguous().view(torch.uint8)), (what, k)


def _per_expert_slots(w: WeightLoader, spec, prefix: str) -> SlotBuffer:
    """A layer's experts the old way, the reference bytes: tensors read as copies, each expert
    `pack`ed, then written into its slot."""
    copied = _layer_experts(w, spec, prefix, mapped=False)
    ref = SlotBuffer.allocate(copied.format, copied.num_experts, copied.experts[0], "cpu")
    for e, ex in enumerate(copied.experts):
        ref.write_packed(e, ref.pack(ex))
    return ref


@pytest.mark.parametrize("preset", ["mixed_nvfp4", "int4_awq", "fp8_block", "nvfp4_ct", "int4_ct"])
def test_mapped_loading_is_byte_identical(ckpt, preset):
    """The loader's path (views of the mapped files, each part copied once into place; from a
    layout's second layer on the copies come from the first layer's template, without views)
    builds banks and resident slots byte for byte equal to
    the per-expert path (tensors read as copies, each expert `pack`ed, then written); mapped views
    equal the read tensors."""
    reader = CheckpointReader(ckpt("qwen3_5_moe", preset))
    spec = resolve_spec(reader)
    w = WeightLoader(reader, torch.float32, "cpu")
    for name in reader.tensors:
        view, read = reader.view(name), reader.get(name)
        assert view.dtype == read.dtype and view.shape == read.shape, name
        assert torch.equal(view.reshape(-1).view(torch.uint8), read.reshape(-1).view(torch.uint8)), name
    placement, staging = Placement(threads=8), HostStaging(pin=False)  # a GPU host's 8 copying threads
    layers = [i for i in range(spec.num_layers) if spec.is_moe_layer(i)]
    for layer in layers:
        p = f"model.layers.{layer}.mlp."
        ref = _per_expert_slots(w, spec, p)
        _same_bytes(build_bank(_layer_experts(w, spec, p), pin=False, placement=placement), ref,
                    (preset, layer, "bank"))
        _same_bytes(build_bank(_layer_experts(w, spec, p, threads=2), pin=False), ref, (preset, layer, "alone"))
        _same_bytes(staging.filled(_layer_experts(w, spec, p)).to("cpu"), ref, (preset, layer, "resident slots"))
        more = ref.to("cpu", ref.num_slots + 3)  # how resident slots reach a device: one copy per tensor
        assert more.num_slots == ref.num_slots + 3
        for mine, theirs in ((more.gate_up, ref.gate_up), (more.down, ref.down)):
            for k, t in theirs.tensors().items():
                assert torch.equal(mine.tensors()[k][:ref.num_slots].view(torch.uint8), t.view(torch.uint8))
    assert len(layers) >= 2
    # computed parts take no template: AWQ's repacked words, nvfp4_ct's row scale (1 / its stored global scale)
    templated = 0 if preset in ("int4_awq", "nvfp4_ct") else len(layers) - 1
    assert (placement.templated, placement.plain) == (templated, len(layers) - templated)
    assert staging.placement.templated == templated


def test_placement_template_falls_back_on_a_different_layer(ckpt, monkeypatch):
    """A layer whose tensors differ from the template layer's (shape or dtype) or run past their
    file, or a buffer too small for the copies, is not placed from the template: `instantiate`
    refuses it and the layer takes the plain path (same bytes)."""
    from moeferry.moe import placement as placement_mod

    reader = CheckpointReader(ckpt("qwen3_5_moe", "mixed_nvfp4"))
    spec = resolve_spec(reader)
    w = WeightLoader(reader, torch.float32, "cpu")
    first, second = [f"model.layers.{i}.mlp." for i in range(spec.num_layers) if spec.is_moe_layer(i)][:2]
    placement = Placement()
    bank = build_bank(_layer_experts(w, spec, first), pin=False, placement=placement)
    template = next(iter(placement._templates.values()))
    assert template is not None and template.instantiate(reader, second, bank) is not None
    name = second + "experts.1.down_proj.weight_scale"
    info = reader.tensors[name]
    monkeypatch.setitem(reader.tensors, name, info._replace(dtype="F32"))
    assert template.instantiate(reader, second, bank) is None
    past_end = reader.mapped_file(info.file).numel() + 1  # a truncated file: no raw copy may read past it
    monkeypatch.setitem(reader.tensors, name, info._replace(start=past_end - 4, end=past_end))
    assert template.instantiate(reader, second, bank) is None
    monkeypatch.undo()
    layer = _layer_experts(w, spec, second)
    small = SlotBuffer.allocate(layer.format, 2, layer.experts[0], "cpu")
    assert template.instantiate(reader, second, small) is None  # a buffer too small for the copies
    monkeypatch.setattr(placement_mod._Template, "instantiate", lambda *a: None)
    ref = _per_expert_slots(w, spec, second)
    _same_bytes(build_bank(_layer_experts(w, spec, second), pin=False, placement=placement), ref, "fallback")
    assert (placement.templated, placement.plain) == (0, 2)


@pytest.mark.parametrize("use_c", [True, False])
def test_copy_spans_copies_each_range_and_nothing_else(use_c):
    """`memory.spans.copy_spans` (the C helper, and the Python threads without a compiler): every
    (destination, source, bytes) range copied, empty and odd-sized ones and one above a piece
    (cut and shared) among them; the bytes between the ranges untouched."""
    from moeferry.memory import spans

    if use_c and shutil.which(os.environ.get("CC", "cc")) is not None:
        assert spans.copier() is not None, "the C helper did not build"
    gen = torch.Generator().manual_seed(3)
    src = torch.randint(0, 256, (spans.PIECE + (2 << 20),), dtype=torch.uint8, generator=gen)
    dst = torch.zeros_like(src)
    sizes = [0, 1, 7, 4096, 65537, 300_000, spans.PIECE + 12345]
    moves, at = [], 0
    for n in sizes:  # destinations in order with gaps of 3 bytes, sources from the end backwards
        moves.append((dst.data_ptr() + at, src.data_ptr() + src.numel() - at - n, n))
        at += n + 3
    want = torch.zeros_like(dst)
    for (d, s, n) in moves:
        a, b = d - dst.data_ptr(), s - src.data_ptr()
        want[a:a + n] = src[b:b + n]
    spans.copy_spans(moves, threads=3, use_c=use_c)
    assert torch.equal(dst, want)
    cut = spans.pieces([(100, 200, 10), (1000, 5000, 25)], piece=8)
    assert cut == [(100, 200, 8), (108, 208, 2), (1000, 5000, 8), (1008, 5008, 8), (1016, 5016, 8), (1024, 5024, 1)]


@pytest.mark.parametrize("use_c", [True, False])
def test_fill_spans_repeats_each_element_and_touches_nothing_else(use_c):
    """`memory.spans.fill_spans` (the C helper, and doubling memmoves without it): each
    (destination, source, element bytes, count) fill writes its element `count` times from its
    destination on (4-byte elements, the scales' case, and 1, 2, 3 and 8-byte ones; counts of
    0, 1 and odd ones); the bytes between the fills untouched."""
    from moeferry.memory import spans

    if use_c and shutil.which(os.environ.get("CC", "cc")) is not None:
        assert spans.copier() is not None, "the C helper did not build"
    src = torch.randint(1, 256, (64,), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    dst = torch.zeros(1 << 16, dtype=torch.uint8)
    fills, want, at = [], torch.zeros_like(dst), 5
    for i, (size, count) in enumerate([(4, 1024), (4, 0), (1, 17), (2, 333), (3, 1001), (8, 1), (4, 7)]):
        fills.append((dst.data_ptr() + at, src.data_ptr() + i * 8, size, count))
        want[at:at + size * count] = src[i * 8:i * 8 + size].repeat(count)
        at += size * count + 3
    spans.fill_spans(fills, threads=3, use_c=use_c)
    assert torch.equal(dst, want)


# -- 10. elastic shrink ----------------------------------------------------------------------------------
def test_shrink_keeps_the_most_recently_used(ckpt, ref_logits, trace):
    arch = "qwen3_moe"
    llm = build(ckpt, arch, "bf16", "offload-100%")
    backend = llm.engine.experts
    (cache,) = caches(llm)
    llm.logits_batch(BATCH, [5, 1])  # all hits: the LRU order is the order of use
    order = list(cache.policy.order)
    before = backend.device_bytes
    freed = backend.shrink(5)
    assert freed == (backend.experts_total - 5) * backend.slot_bytes == before - backend.device_bytes
    assert cache.num_slots == backend.expert_slots == 5
    cache.check()
    assert list(cache.policy.order) == order[-5:]  # the five most recently used, in LRU order
    assert_slots_hold_their_experts(cache, backend.banks)  # the kept slots still hold their experts
    assert backend.shrink(5) == 0
    trace.clear()
    sim_start = list(cache.policy.order)
    got = llm.logits(PROMPT, chunk_size=CHUNKS)
    assert rel_err(got, ref_logits(arch, "bf16", [PROMPT], CHUNKS)[0]) <= TOL
    # the shrunk cache continues as an LRU of 5 slots from the kept order
    lru = BruteForceLRU(5, sim_start)
    for layer, needed, _ in trace:
        lru.step(layer, needed)
    assert list(cache.policy.order) == lru.order()
    assert {k for k in cache.owner if k is not None} == set(lru.last_use)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_refill_restores_the_boot_contents(ckpt, ref_logits, policy):
    """`refill` puts every cache back as the boot filled it (each layer its first experts, in
    the same slots and policy order, the same free slots), whatever the steps did since; the
    slots hold those experts' bytes, and the logits after it are resident's."""
    arch = "qwen3_moe"
    llm = build(ckpt, arch, "bf16", "offload-25%", moe_cache_policy=policy)
    backend = llm.engine.experts
    (cache,) = caches(llm)

    def state():
        return list(cache.owner), cache.policy.ranked(), list(cache.free_slots), cache.host_table.clone()

    backend.refill()
    boot = state()
    per, extra = divmod(cache.num_slots, len(cache.layers))
    assert sorted(k for k in boot[0] if k is not None) == sorted(
        (layer, e) for i, layer in enumerate(cache.layers) for e in range(per + (i < extra)))
    llm.logits_batch(BATCH, [5, 1])  # steps move the experts around
    assert state()[0] != boot[0]
    backend.refill()
    after = state()
    assert after[:3] == boot[:3] and torch.equal(after[3], boot[3])
    cache.check()
    assert_slots_hold_their_experts(cache, backend.banks)
    got = llm.logits(PROMPT, chunk_size=CHUNKS)
    assert rel_err(got, ref_logits(arch, "bf16", [PROMPT], CHUNKS)[0]) <= TOL


def test_lfu_shrink_keeps_the_highest_priorities(ckpt, ref_logits):
    """LFU's shrink keeps the experts it would evict last, with their priorities, uses and age."""
    arch = "qwen3_moe"
    llm = build(ckpt, arch, "bf16", "offload-25%", moe_cache_policy="lfu")
    backend = llm.engine.experts
    (cache,) = caches(llm)
    llm.logits_batch(BATCH, [5, 1])
    kept = cache.policy.ranked()[-5:]
    state = {k: (cache.policy.prio[k], cache.policy.uses[k]) for k in kept}
    age = cache.policy.age
    assert age > 0 and len(set(state.values())) > 1  # it evicted, and the priorities differ
    backend.shrink(5)
    cache.check()
    assert set(cache.policy.ranked()) == set(kept) and cache.policy.age == age
    assert {k: (cache.policy.prio[k], cache.policy.uses[k]) for k in kept} == state
    got = llm.logits(PROMPT, chunk_size=CHUNKS)
    assert rel_err(got, ref_logits(arch, "bf16", [PROMPT], CHUNKS)[0]) <= TOL


# -- the CPU reference over an empty set of slots (a cpu-backend step with no cache hits) ------------
@pytest.mark.parametrize("case", sorted(SLOT_CASES))
def test_dense_slots_of_no_slots(case):
    buf, _, _, gen = _buffer(case, 0, 3, seed=5)
    assert buf.gate_up.dense_slots([], torch.float32).shape == (0, buf.gate_up.n, buf.gate_up.k)
    assert buf.down.dense_slots([], torch.float32).shape == (0, buf.down.n, buf.down.k)
    x, ids, w = torch.randn(4, buf.hidden, generator=gen), torch.tensor([[0, 1]] * 4), torch.full((4, 2), 0.5)
    out = buf.run_reference(x, ids, w, torch.full((3,), -1, dtype=torch.int32))  # every expert missing
    assert torch.equal(out, torch.zeros_like(x))


def test_warm_up_steps_give_everything_back(ckpt):
    """The warm-up's prefill buckets and eager decode batches run through the real pools (here on
    the CPU, where the engine skips them at boot) and leave the pools and the cache as they were."""
    llm = LLM(str(ckpt("qwen3_5_moe", "bf16")), dtype="float32", moe_backend="offload", moe_cache_rate=0.5,
              max_extend_tokens=64, max_running_requests=5, num_tokens=400)
    eng = llm.engine
    steps = eng.guard.steps
    eng.run_warm_steps()
    from moeferry.engine.engine import WARM_PREFILL
    chunks = {min(n, 64) for n in WARM_PREFILL}  # 2, 5, 9, 17, 33 and 64: the chunk bounds the rest
    assert eng.guard.steps - steps == 2 * len(chunks) + 2 * 2  # each prefill (+ decode), batches 2 and 5
    eng.cache.check()
    stats = eng.cache.stats()
    assert stats["kv_tokens_used"] == 0 and stats["state_slots_used"] == 0
    for cache in eng.experts.distinct_caches:
        cache.check()


def test_gather_work_items_are_the_blocks_that_hold_words():
    """The gather kernel's items for one expert are the (tensor, block) pieces that hold words:
    a narrow tensor (a scale) is one block, a wide one as many as it fills, none is empty."""
    from moeferry.ops.triton.slot_gather import SlotGather
    widths = (300, 17, 4101)
    pairs = [(torch.zeros(4, w, dtype=torch.int32), torch.zeros(3, w, dtype=torch.int32)) for w in widths]
    gather = SlotGather(pairs, (2048, 4, True))
    assert gather.pieces.tolist() == [[0, 0], [1, 0], [2, 0], [2, 1], [2, 2]]
