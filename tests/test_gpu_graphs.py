"""Decode runs in CUDA graphs for every quantization preset (GPU), and a capture failure
names the op that synchronised (CPU).

For each preset a tiny Qwen3.5-MoE checkpoint is written, loaded on the GPU, two prompts are
prefilled and decoded greedily for 8 steps as one batch: the graphs must be in use (a graph
captured, none disabled) and the graph logits must match the same steps run eagerly. (The
kernels themselves are checked against the CPU reference in test_quant_linear.py and
test_moe_kernels.py; whole tiny random models in bf16 are too ill-conditioned for a logits
comparison with the fp32 CPU path: on the H200 even the bf16 preset differed by 0.2-0.4.)
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from moeferry.checkpoint.formats import PRESETS
from moeferry.engine.cuda_graph import sync_site

ALL = ("bf16",) + PRESETS
STEPS = 8


def test_sync_site_names_the_moeferry_frame():
    from moeferry.checkpoint.formats.fp4 import e2m1_decode
    with pytest.raises(AttributeError) as info:
        e2m1_decode(None)
    site = sync_site(info.value)
    assert site.startswith(" at moeferry/checkpoint/formats/fp4.py:") and "e2m1_decode" in site, site


def _decode(engine, prompts, steps, before_steps=lambda: None):
    """Greedy decode-step logits: [steps] of [B, V] on the CPU (before_steps: called between the prefill
    and the first decode step)."""
    from moeferry.model.batch import SeqChunk
    with engine.cache.sequences([len(p) + steps + 1 for p in prompts]) as held:
        pages, slots = [b.pages for b in held], [b.state_slot for b in held]
        logits = engine.forward([SeqChunk(p, 0, pages[i], slots[i]) for i, p in enumerate(prompts)])
        toks, out = logits.argmax(-1).tolist(), []
        before_steps()
        for s in range(steps):
            step = engine.forward([SeqChunk([toks[i]], len(p) + s, pages[i], slots[i]) for i, p in enumerate(prompts)])
            out.append(step.float().cpu())
            toks = step.argmax(-1).tolist()
        return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset,backend", [(p, "resident") for p in ALL]
                         + [("mixed_nvfp4", "offload"), ("mixed_nvfp4", "offload-partial"),
                            ("mixed_nvfp4", "offload-piecewise"), ("mixed_nvfp4", "offload-lfu"),
                            ("mixed_nvfp4", "cpu"), ("mixed_nvfp4", "hybrid"), ("mixed_nvfp4", "hybrid-cut"),
                            ("mixed_nvfp4", "hybrid-offload"),
                            ("mixed_nvfp4", "offload-cpulayer")])
def test_decode_graphs_in_use(preset, backend, tmp_path):
    """(offload: a cache of every expert, which reads nothing on the host, is captured whole;
    offload-partial: half the experts cached, managed on the device: captured whole, the misses
    looked up and fetched inside the graph; offload-piecewise: the same cache managed on the
    host, captured piecewise, the misses fetched between the graphs; offload-lfu: 24 of the 32
    experts managed on the device by LFU, which needs three steps' experts; cpu and hybrid: 16
    slots; cpu captured piecewise, two cuts a layer, the CPU lane computed between them while the
    cached experts run; hybrid: managed on the device, captured whole, every miss on the CPU lane
    in the graph (`cpu_lane`: the host thread computes what the graph posts, no cut) as in the
    eager steps (so that both compute the same experts in fp32); hybrid-cut: without that lane,
    fetching at most one expert a layer, so that both lanes work, its lanes from batch 1: captured
    piecewise as cpu; hybrid-offload: no lane and no batch splitting its misses (`lanes_from` inf):
    managed on the device as offload-partial;
    offload-cpulayer: offload-partial with MoE layer 1
    on the CPU (`--moe-cpu-layers 1,`): managed on the device, cut twice, at that layer.)"""
    from moeferry.checkpoint.synthetic import make_model
    from moeferry.engine.config import EngineConfig
    from moeferry.engine.engine import Engine
    path = make_model(tmp_path / preset, arch="qwen3_5_moe", size="tiny", seed=1, dtype="bfloat16",
                      quant=None if preset == "bf16" else preset)
    extra = {"offload": dict(moe_cache_rate=1.0), "offload-lfu": dict(moe_cache_size=24, moe_cache_policy="lfu"),
             "hybrid": dict(moe_cache_size=16), "hybrid-cut": dict(moe_cache_size=16, moe_hybrid_max_fetch=1),
             "hybrid-offload": dict(moe_cache_size=16, moe_hybrid_max_fetch=1),
             "offload-cpulayer": dict(moe_cache_size=16, moe_cpu_layers="1,")}.get(
        backend, dict(moe_cache_size=16) if "-" in backend or backend == "cpu" else {})
    piecewise = backend in ("offload-piecewise", "cpu", "hybrid-cut")
    engine = Engine.build(EngineConfig(str(path), "cuda", "bfloat16", moe_backend=backend.split("-")[0],
                                       num_tokens=256, num_state_slots=4, **extra))
    if backend.startswith("hybrid"):  # (the tiny model's lanes measured at boot would choose either)
        assert engine.experts.lane is not None  # opened at boot
        if backend == "hybrid":  # every miss on the CPU, in the graph's lane and in the eager steps alike
            engine.experts.split = dataclasses.replace(engine.experts.split, max_fetch=0)
            engine.experts.open_lane()  # (its table from the new split)
            engine.experts.lane_batches = frozenset(range(1, 5))  # (whatever the lanes measured here would save)
        else:
            engine.experts.lane.close()
            engine.experts.lane = None
        engine.experts.lanes_from = 1 if backend == "hybrid-cut" else math.inf
        if backend == "hybrid-offload":  # eager steps fetch every miss too: then the eager logits below compute
            # every expert on the device, as the graph does (split, bf16 and fp32 experts drift apart over 8 steps)
            engine.experts.split = dataclasses.replace(engine.experts.split, fetch_s=0.0, max_fetch=None)
        engine.graphs.invalidate()  # (captured at boot with the measured choice)
    if backend.startswith(("offload-", "hybrid")) or piecewise:
        want = "piecewise" if backend in ("cpu", "hybrid-cut") else "device"
        assert engine.experts.graph_mode(4) == want, engine.experts.graph_mode(4)
    if backend == "offload-piecewise":
        engine.experts.device_managed = False
        engine.graphs.invalidate()
    engine.graphs.capture_missing()  # (each capture's eager warm-up step splits its misses at any batch)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, engine.spec.vocab_size, (n,), generator=gen).tolist() for n in (5, 11)]

    def cpu_experts():
        return engine.stats()["experts"]["cpu_experts"] if backend != "resident" else 0

    def decode():  # both runs from the boot's cache contents: which experts hybrid's CPU lane
        if backend != "resident":  # computes (exact fp32) depends on them, and in bf16 that shows
            engine.experts.refill()
        return _decode(engine, prompts, STEPS, lambda: marks.append(cpu_experts()))

    marks = []  # the CPU lane's count when the decode steps begin (eager prefill chunks split at any batch)

    graphed = decode()
    assert engine.graphs.disabled is None, f"{preset}: {engine.graphs.disabled}"
    assert engine.graphs.graphs, f"{preset}: no decode graph captured"
    pieces = {len(step.graphs) for step, _ in engine.graphs.graphs.values()}
    cuts = {"offload-piecewise": engine.spec.num_layers, "cpu": 2 * engine.spec.num_layers,
            "hybrid-cut": 2 * engine.spec.num_layers, "offload-cpulayer": 2}.get(backend, 0)  # (every tiny layer is MoE)
    assert pieces == {cuts + 1}, pieces
    if backend.startswith(("offload-", "hybrid")) or piecewise:
        s = engine.stats()["experts"]
        assert s["misses"] > 0 and s["hits"] > 0, s
        in_steps = s["cpu_experts"] - marks[0]  # the decode graphs' own
        assert (in_steps > 0) == (backend in ("cpu", "hybrid", "hybrid-cut", "offload-cpulayer")), (in_steps, s)
    graphs, engine.graphs = engine.graphs, None
    eager = decode()
    engine.graphs = graphs
    for s, (a, b) in enumerate(zip(graphed, eager)):
        err = ((a - b).norm() / b.norm()).item()
        assert err < 2e-2, f"{preset} step {s}: graph vs eager logits rel err {err:.3g}"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_hybrid_lane_retunes_its_table_between_replays(tmp_path, monkeypatch):
    """hybrid's CPU lane in whole decode graphs, its split first assuming 1 s for a fetch and for a
    CPU expert (about half of the misses on each lane): after a few of the lane's experts the
    split takes the CPU's time from the thread's work (far below 1 s), the device table is
    rewritten between replays (every miss to the lane), and the graphs go on with it (finite
    logits, no fault). (Which experts each step sends to the lane then differs from an eager
    run's, whose split starts retuned: fp32 and bf16 experts, so no logits comparison here; the
    lane's arithmetic is `test_decode_graphs_in_use[hybrid]`'s.)"""
    import moeferry.moe.offload as offload
    from moeferry.checkpoint.synthetic import make_model
    from moeferry.engine.config import EngineConfig
    from moeferry.engine.engine import Engine
    from moeferry.moe.bandwidth import MissSplit
    monkeypatch.setattr(offload, "RETUNE_EXPERTS", 10**9)  # (not while the graphs are captured)
    path = make_model(tmp_path / "m", arch="qwen3_5_moe", size="tiny", seed=1, dtype="bfloat16", quant="mixed_nvfp4")
    engine = Engine.build(EngineConfig(str(path), "cuda", "bfloat16", moe_backend="hybrid", num_tokens=256,
                                       num_state_slots=4, moe_cache_size=16))
    backend = engine.experts
    backend.split = MissSplit(fetch_s=1.0, cpu_s=1.0)
    backend.open_lane()
    backend.lane_batches = frozenset(range(1, 5))
    engine.graphs.invalidate()
    engine.graphs.capture_missing()
    before = backend.lane_fetches.cpu()
    monkeypatch.setattr(offload, "RETUNE_EXPERTS", 4)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, engine.spec.vocab_size, (n,), generator=gen).tolist() for n in (5, 11)]
    graphed = _decode(engine, prompts, STEPS)
    assert engine.graphs.disabled is None and engine.graphs.graphs
    assert backend.split.cpu_s < 0.1, backend.split  # retuned from the thread's work
    after = backend.lane_fetches.cpu()
    assert before.any() and not after.any()  # (from a split of about half to every miss on the lane)
    assert engine.stats()["experts"]["cpu_experts"] > 0
    backend.lane.check()
    assert all(torch.isfinite(step).all() for step in graphed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["resident", "offload-partial"])
def test_overlapped_steps_feed_the_graphs(backend, tmp_path):
    """The overlapped scheduler feeds each decode graph from the tokens the step before sampled on
    the device: greedy outputs equal reading every step first (the same batches: every request
    runs to max_tokens), the graphs in use, the decode chunks fed; a seeded top-k row, drawn on
    the device, stays among its k best (its logprobs' top list)."""
    from moeferry import LLM
    from moeferry.checkpoint.synthetic import make_model
    from moeferry.scheduler.sampling import SamplingParams
    path = make_model(tmp_path / "m", arch="qwen3_5_moe", size="tiny", seed=2, dtype="bfloat16", quant="mixed_nvfp4")
    extra = dict(moe_backend="offload", moe_cache_size=16) if backend != "resident" else {}
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in (5, 11, 3)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    drawn = SamplingParams(temperature=0.8, top_k=5, seed=3, logprobs=5, max_tokens=12, ignore_eos=True)
    outs, fed = {}, {}
    for overlap in (True, False):
        llm = LLM(str(path), device="cuda", dtype="bfloat16", num_tokens=256, num_state_slots=3,
                  max_running_requests=3, prefix_cache=False, overlap_schedule=overlap, **extra)
        plain, fed[overlap] = llm.engine.forward, []

        def forward(chunks, feed=None, plain=plain, seen=fed[overlap]):
            seen += [c.fed for c in chunks if c.fed >= 0]
            return plain(chunks, feed)

        llm.engine.forward = forward
        outs[overlap] = [o.token_ids for o in llm.generate(prompts, greedy)]
        sampled = llm.generate(prompts[:1], drawn)[0]
        assert all(lp.token_id in [t for t, _ in lp.top] for lp in sampled.logprobs), sampled.logprobs
        assert llm.engine.graphs.disabled is None and llm.engine.graphs.graphs
    assert outs[True] == outs[False]
    assert len(fed[True]) >= 3 * 10 and not fed[False]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_launching_a_steps_sampling_never_waits_for_the_device():
    """With overlapped steps the sampling of step k is launched while step k+1's forward is
    queued; a synchronising copy there (the parameters, penalties, a logit bias, a grammar's
    mask, the repetition set from pageable memory) would make the host wait for that forward and
    undo the overlap. Launched under the sync check, for a batch that takes every such input."""
    from moeferry.scheduler.batch_sampler import launch_sampling
    from moeferry.scheduler.request import Request
    from moeferry.scheduler.sampling import SamplingParams

    vocab = 1000
    params = [SamplingParams(temperature=0.7, top_k=20, top_p=0.8, seed=1),
              SamplingParams(temperature=0.9, repetition_penalty=1.05, presence_penalty=0.5, frequency_penalty=0.2,
                             logit_bias=((7, 2.0),), min_tokens=4, seed=2),
              SamplingParams(temperature=0.0, logprobs=3)]
    reqs = []
    for i, p in enumerate(params):
        r = Request(f"r{i}", list(range(10 + i, 60 + i)), p)
        r.output_ids = [3, 4, 5]
        reqs.append(r)
    logits = torch.randn(len(reqs), vocab, device="cuda")
    launch_sampling(reqs, logits, {0}, on_device=True).read()  # warm: allocators, pinned blocks
    for r in reqs:
        r.output_ids.append(9)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step = launch_sampling(reqs, logits, {0}, on_device=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    tokens, _ = step.read()
    assert len(tokens) == 3 and all(0 <= t < vocab for t in tokens)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_loading_a_decode_graphs_inputs_never_waits_for_the_device():
    """The static inputs of the next decode graph are loaded while the step before runs
    (overlapped steps): the token, position, slot and metadata copies, the fed tokens and the
    page table's rows (scattered and whole) are queued, never waited for; and they land."""
    from moeferry.engine.cuda_graph import SCATTER_PAGES, DecodeGraphs
    from moeferry.model.batch import SeqChunk

    graphs = DecodeGraphs(None, None, None, max_batch=4, max_pages=SCATTER_PAGES * 2 + 8, page_size=1,
                          device=torch.device("cuda"))
    feed = torch.randint(10, 1000, (5,), device="cuda")
    long_pages = list(range(100, 100 + SCATTER_PAGES * 2))
    steps = [[SeqChunk([0], 3, [0, 1, 2, 3], 0, fed=4), SeqChunk([77], 2, [4, 5, 6], 1)],
             [SeqChunk([0], 4, [0, 1, 2, 3, 9], 0, fed=1), SeqChunk([78], len(long_pages) - 1, long_pages, 1)]]
    graphs._load(steps[0], 4, feed)  # warm: pinned blocks
    torch.cuda.synchronize()
    for chunks in steps:
        torch.cuda.set_sync_debug_mode("error")
        try:
            graphs._load(chunks, 4, feed)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert graphs.tokens[0, :2].tolist() == [int(feed[1]), 78]
    assert graphs.page_table[1, :len(long_pages)].tolist() == long_pages and graphs.page_table[0, 4] == 9
