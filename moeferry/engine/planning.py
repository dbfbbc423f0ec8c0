"""The engine's memory phase: measure the plan's inputs, make the plan, and test it for real.

    free_memory(device)           free device memory (host MemAvailable on the CPU), before loading
    needs_plan(cfg, device, ...)  whether pool sizes come from a measured plan
    make_engine_plan(...)         probe the worst steps, then `moeferry.memory.plan.make_plan`
    settle_after_warm_up(...)     count what the graphs and kernels hold beyond the plan (expert cache gives it)
    self_test(engine)             run the worst step through the real pools (boot self-test)
"""
from __future__ import annotations

import gc
import logging
from dataclasses import replace

import torch

from moeferry.cache.kv_pool import kv_bytes_per_token
from moeferry.cache.state_pool import state_bytes_per_slot
from moeferry.engine.config import OFFLOAD_SETTINGS, EngineConfig, context_limit, state_slots_for
from moeferry.memory.plan import (MemoryPlan, PlanInputs, PlanRefused, PlanRequest, Term, human_bytes, make_plan,
                                  usable_memory)
from moeferry.memory.probe import Transients, probe_transients
from moeferry.model.batch import SeqChunk
from moeferry.moe.bank import available_host_ram

log = logging.getLogger("moeferry.engine")

# On the CPU the self-test is a smoke test of the same path: the reference kernels would take
# minutes at full depth (the plan's transient there comes from the probe's extrapolation).
CPU_SELF_TEST_TOKENS = 256


def free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_host_ram()


def used_memory(device: torch.device, free_at_start: int) -> int:
    """What this process holds since `free_at_start` and keeps: the placed weights, plus (CUDA)
    memory outside the allocator that appeared since (kernel modules, library workspaces)."""
    if device.type == "cuda":
        gc.collect()  # (the build runs with the collector paused: no cyclic garbage counted as held)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        allocated = torch.cuda.memory_allocated(device)
        outside = free_at_start - free_memory(device) - torch.cuda.memory_reserved(device)
        return allocated + max(outside, 0)
    return max(free_at_start - available_host_ram(), 0)


def choose_backend(cfg: EngineConfig, reader, device: torch.device, free_at_start: int) -> EngineConfig:
    """Resolve `moe_backend="auto"`: offload when an expert cache flag sizes its cache; else, on
    CUDA, resident when the checkpoint's files take at most 80% of the budget (the free device
    memory, or --gpu-memory-limit) and offload with a planned cache otherwise; on the CPU resident."""
    if cfg.moe_backend != "auto":
        return cfg
    if cfg.sizes_expert_cache or cfg.moe_cpu_layers:
        log.info("--moe-backend auto: offload (%s was given)",
                 "--moe-cpu-layers" if cfg.moe_cpu_layers else "an expert cache flag")
        return replace(cfg, moe_backend="offload")
    budget = free_at_start if cfg.gpu_memory_limit is None else min(free_at_start, cfg.gpu_memory_limit)
    files = {info.file for info in reader.tensors.values()}
    size = sum(f.stat().st_size for f in files if f.exists())
    backend = "resident" if device.type != "cuda" or size <= 0.8 * budget else "offload"
    log.info("--moe-backend auto: %s (checkpoint %s, budget %s%s)", backend, human_bytes(size), human_bytes(budget),
             "" if device.type == "cuda" else "; the CPU holds every expert")
    given = {field: getattr(cfg, field) for field, default, _, _ in OFFLOAD_SETTINGS if getattr(cfg, field) != default}
    if backend == "resident" and given:
        log.info("every expert is resident: offload settings left at their defaults (given: %s)",
                 ", ".join(f"{k}={v}" for k, v in given.items()))
        cfg = replace(cfg, **{field: default for field, default, _, _ in OFFLOAD_SETTINGS})
    return replace(cfg, moe_backend=backend)


def needs_plan(cfg: EngineConfig, device: torch.device, requested_slots: int | None) -> bool:
    """CUDA always plans (a plan that cannot fit is refused at boot, never met at run time);
    the CPU plans when a flag asks for it or an offload backend has no explicit cache size."""
    return device.type == "cuda" or cfg.plans_memory or (cfg.offloads_experts and requested_slots is None)


def plan_request(cfg: EngineConfig, device: torch.device, context: int) -> PlanRequest:
    resident = not cfg.offloads_experts
    auto = not resident and cfg.moe_cache_size is None and cfg.moe_cache_rate is None
    kv_tokens, reserve = cfg.num_tokens, cfg.kv_reserve_tokens
    if device.type != "cuda" and kv_tokens is None:
        # CPU mode: the "device" is host RAM, shared with everything else: the KV pool is the
        # floor asked for (or one context), never grown into all of the RAM that is left.
        kv_tokens, reserve = reserve or context, None
    return PlanRequest(expert_slots=None if resident else cfg.moe_cache_size,
                       expert_rate=None if resident else cfg.moe_cache_rate,
                       expert_auto=auto, resident_experts=resident, kv_tokens=kv_tokens, kv_reserve_tokens=reserve)


def make_engine_plan(cfg: EngineConfig, spec, model, experts, device: torch.device, dtype: torch.dtype,
                     free_at_start: int) -> tuple[MemoryPlan, Transients]:
    context = context_limit(cfg, spec.max_position_embeddings)
    transients = probe_transients(model, spec, cfg, context, dtype, device)
    weights = used_memory(device, free_at_start)  # after the probe: the kernels it loaded stay
    graphs = transients.decode if (device.type == "cuda" and cfg.cuda_graphs) else 0
    where = "device" if device.type == "cuda" else "host (CPU mode)"
    inputs = PlanInputs(
        usable=usable_memory(free_at_start if cfg.gpu_memory_limit is None or device.type == "cuda" else None,
                             cfg.memory_ratio, cfg.gpu_memory_limit),
        weights=Term(weights, f"measured: {where} memory after loading and the probe"
                              + (" (incl. every expert)" if not cfg.offloads_experts else "")
                              + (", allocator + outside it" if device.type == "cuda" else "")),
        expert_slot_bytes=experts.slot_bytes, experts_total=experts.experts_total,
        staging=Term(experts.staging_bytes, "derived: 2 x staging slots" if experts.staging_bytes else "none"),
        kv_bytes_per_token=kv_bytes_per_token(len(spec.attention_layers), spec.num_kv_heads, spec.head_dim, dtype),
        page_size=cfg.page_size, state_bytes_per_slot=state_bytes_per_slot(spec, dtype),
        state_slots=state_slots_for(cfg),
        transient=Term(transients.worst, transients.note),
        graphs=Term(graphs, "measured: decode step at the largest batch (shared graph pool)" if graphs else "none"),
        margin=Term(transients.margin, "measured: allocator fragmentation + 2 x run-to-run spread"),
        context_tokens=context)
    return make_plan(inputs, plan_request(cfg, device, context)), transients


HELD_AFTER_WARM_UP = "held after the warm-up beyond the plan (graph executables, kernel modules)"


def settle_after_warm_up(engine, free_at_start: int) -> None:
    """The plan was measured before the pools, the decode graphs and the warm-up's kernels
    existed; graph executables and kernel modules then take device memory outside the allocator
    that the probe could not see (on the H200's seed boot ~200 MiB, which the self-test's first
    8192-token chunk found twice by running out of memory). Measure what the process holds now
    against what the plan says it holds (every term but the transient and margin reserves), and
    give any excess back from the expert cache before the self-test, which then proves the plan."""
    if engine.plan is None or engine.device.type != "cuda":
        return
    gc.collect()  # (as in `used_memory`)
    torch.cuda.synchronize(engine.device)
    torch.cuda.empty_cache()
    plan = engine.plan
    held = free_at_start - free_memory(engine.device)
    account_held(engine, held - (plan.total() - plan.transient.bytes - plan.margin.bytes))


def account_held(engine, extra: int) -> None:
    """Count `extra` bytes held beyond the plan (`MemoryPlan.account_held`), shrinking the
    expert cache when the plan's slack does not cover them; a plan that cannot absorb them is
    left to the self-test (which shrinks by the deficits it meets, or fails the boot)."""
    plan = engine.plan
    try:
        settled = plan.account_held(extra, HELD_AFTER_WARM_UP)
    except PlanRefused as e:
        log.warning("after the warm-up: %s; the boot self-test decides", str(e).splitlines()[0])
        return
    if settled is plan:
        log.info("after the warm-up: the process holds %s less than planned", human_bytes(-extra))
        return
    slots = settled.expert_slots
    if slots == plan.expert_slots:  # (always so for a resident plan: it has no slots)
        engine.plan = settled
        log.info("after the warm-up: %s %s; the plan's slack covers it", human_bytes(extra), HELD_AFTER_WARM_UP)
        return
    engine.shrink_expert_cache(slots, settled)
    log.info("after the warm-up: %s %s; expert cache %d -> %d slots, so that the transient (%s) and margin "
             "(%s) reserves stay free", human_bytes(extra), HELD_AFTER_WARM_UP, plan.expert_slots, slots,
             human_bytes(plan.transient.bytes), human_bytes(plan.margin.bytes))


SELF_TEST_ROUNDS = 4


def self_test(engine) -> None:
    """Run the worst steps the plan admits through the real pools (a prefill chunk at the
    deepest start, the largest decode batch at the deepest depth the pool gives each); the
    guard shrinks the expert cache if a step runs out of memory. A round that shrank is run
    again: a shrink drops the decode graphs, whose pool the recapture allocates after the
    prefill passed (measured on the H200: the first 8k prompt then ran out of memory again).
    Raises if nothing fits."""
    for done in range(1, SELF_TEST_ROUNDS + 1):
        before = len(engine.guard.shrinks)
        _self_test_round(engine)
        if len(engine.guard.shrinks) == before:
            break
        log.info("boot self-test: the expert cache shrank in round %d; running the worst steps again", done)
    else:
        log.warning("boot self-test: the expert cache still shrank in round %d of %d; serving with %d slots "
                    "(the runtime guard absorbs what is left)", SELF_TEST_ROUNDS, SELF_TEST_ROUNDS,
                    engine.experts.expert_slots)


def _self_test_round(engine) -> None:
    cfg, sizes = engine.cfg, engine.sizes
    vocab = engine.spec.vocab_size
    context = sizes.max_seq_len if engine.device.type == "cuda" else min(sizes.max_seq_len, CPU_SELF_TEST_TOKENS)
    chunk = max(1, min(cfg.max_extend_tokens, context - 1, CPU_SELF_TEST_TOKENS if engine.device.type != "cuda"
                       else cfg.max_extend_tokens))
    start = context - chunk
    ids = [i % vocab for i in range(chunk)]
    with engine.cache.sequences([context]) as (seq,):
        engine.guard.run(lambda: engine.run_batch([SeqChunk(ids, start, seq.pages, seq.state_slot)]), boot=True)
    batch = min(cfg.max_running_requests, sizes.num_state_slots)
    page = engine.cache.kv.page_size  # each sequence holds whole pages: share the pool by pages
    depth = max(1, min(context, sizes.kv_tokens // page // batch * page) - 1)
    with engine.cache.sequences([depth + 1] * batch) as held:
        chunks = [SeqChunk([1], depth, b.pages, b.state_slot) for b in held]
        engine.guard.run(lambda: engine.run_batch(chunks), boot=True)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    log.info("boot self-test passed: prefill %d tokens at depth %d, decode x%d at depth %d%s", chunk, start, batch,
             depth, f"; expert cache shrunk to {engine.experts.expert_slots} slots"
             if engine.guard.shrinks else "")


def describe_plan(plan: MemoryPlan) -> str:
    return (f"memory plan: {plan.expert_slots} expert slots, {plan.kv_tokens} KV tokens, {plan.state_slots} state "
            f"slots, transient reserve {human_bytes(plan.transient.bytes)}, margin {human_bytes(plan.margin.bytes)}"
            f" of {human_bytes(plan.usable.bytes)} usable\n{plan.table()}")
