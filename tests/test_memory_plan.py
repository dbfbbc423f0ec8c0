"""The memory plan's arithmetic: its invariant over random inputs, explicit sizes honoured or refused
with numbers that really fit, auto using what is left, and hand-computed examples."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from moeferry.memory.plan import (MemoryPlan, PlanInputs, PlanRefused, PlanRequest, Term, human_bytes, make_plan,
                                  usable_memory)

MiB, GiB = 2**20, 2**30
FIXED = ("weights", "staging", "transient", "graphs", "margin")


def inputs(**kw) -> PlanInputs:
    base = dict(usable=Term(1000, "flag --gpu-memory-limit"), weights=Term(100, "measured"), expert_slot_bytes=100,
                experts_total=50, staging=Term(0, "default"), kv_bytes_per_token=1, page_size=1,
                state_bytes_per_slot=0, state_slots=0, transient=Term(0, "measured"), graphs=Term(0, "default"),
                margin=Term(0, "default"), context_tokens=50)
    for name in ("usable",) + FIXED:
        if isinstance(kw.get(name), int):
            kw[name] = Term(kw[name], "given")
    return PlanInputs(**{**base, **kw})


# ---------------------------------------------------------------- random inputs


def _term(draw, hi):
    return Term(draw(st.integers(0, hi)), "given")


@st.composite
def scenarios(draw):
    """Random geometry and request; the usable memory is drawn around what the request needs, so
    plans, refusals of each kind and exact fits all come up."""
    slot = draw(st.integers(1, 4 * MiB))
    experts_total = draw(st.integers(1, 3000))
    page_size = draw(st.sampled_from([1, 1, 16, 64, 256]) | st.integers(1, 300))
    kv_per_token = draw(st.integers(0, 50_000) | st.integers(1, 64))
    inp = PlanInputs(
        usable=Term(0, "given"), weights=_term(draw, 2 * GiB), expert_slot_bytes=slot,
        experts_total=experts_total, staging=_term(draw, 512 * MiB), kv_bytes_per_token=kv_per_token,
        page_size=page_size, state_bytes_per_slot=draw(st.integers(0, 64 * MiB)),
        state_slots=draw(st.integers(0, 24)), transient=_term(draw, 2 * GiB), graphs=_term(draw, 256 * MiB),
        margin=_term(draw, 512 * MiB), context_tokens=draw(st.integers(1, 300_000)),
        min_expert_slots=draw(st.integers(1, min(16, experts_total))))
    experts = draw(st.sampled_from(["resident", "size", "rate", "auto", "none"]))
    kv = draw(st.sampled_from(["default", "tokens", "pages", "reserve"]))
    req = {}
    if experts == "resident":
        req["resident_experts"] = True
    elif experts == "size":
        req["expert_slots"] = draw(st.integers(1, experts_total + 100))
    elif experts == "rate":
        req["expert_rate"] = draw(st.floats(0.0001, 1.0))
    elif experts == "auto":
        req["expert_auto"] = True
    if kv == "tokens":
        req["kv_tokens"] = draw(st.integers(1, 400_000))
    elif kv == "pages":
        req["kv_pages"] = draw(st.integers(1, 5000))
    elif kv == "reserve":
        req["kv_reserve_tokens"] = draw(st.integers(1, 400_000))
    req = PlanRequest(**req)
    slots = 0 if req.resident_experts else asked_slots(inp, req) or draw(st.sampled_from(
        [inp.min_expert_slots, experts_total]))
    pools = slots * slot + kv_floor_pages(inp, req) * page_size * kv_per_token  # the least the request needs
    need = fixed_bytes(inp) + pools
    usable = draw(st.integers(max(0, need - 3), need + 3)  # the edge
                  | st.integers(need, need + 3 * max(slot, page_size * kv_per_token))  # a little room
                  | st.floats(0.0, 1.5).map(lambda r: fixed_bytes(inp) + int(r * pools))
                  | st.integers(0, 8 * GiB))
    return replace(inp, usable=Term(usable, "given")), req


def fixed_bytes(inp: PlanInputs) -> int:
    return sum(getattr(inp, n).bytes for n in FIXED) + inp.state_slots * inp.state_bytes_per_slot


def kv_floor_pages(inp: PlanInputs, req: PlanRequest) -> int:
    if req.kv_pages is not None:
        return req.kv_pages
    return math.ceil((req.kv_tokens or req.kv_reserve_tokens or inp.context_tokens) / inp.page_size)


def asked_slots(inp: PlanInputs, req: PlanRequest) -> int | None:
    """The slots an explicit request means (None for auto and resident), computed independently."""
    if req.expert_slots is not None:
        return min(req.expert_slots, inp.experts_total)
    if req.expert_rate is not None:
        from fractions import Fraction
        exact = Fraction(req.expert_rate) * inp.experts_total
        return max(1, math.ceil(exact - Fraction(1, 10**6)))  # floating noise below 1e-6 is not a slot
    return None


def with_kv(req: PlanRequest, tokens: int, page_size: int) -> PlanRequest:
    """`req` with its KV flag set to `tokens` (a whole number of pages)."""
    if req.kv_pages is not None:
        return PlanRequest(**{**vars(req), "kv_pages": tokens // page_size})
    if req.kv_reserve_tokens is not None:
        return PlanRequest(**{**vars(req), "kv_reserve_tokens": tokens})
    return PlanRequest(**{**vars(req), "kv_tokens": tokens})


def with_slots(req: PlanRequest, slots: int) -> PlanRequest:
    return PlanRequest(**{**vars(req), "expert_slots": slots, "expert_rate": None, "expert_auto": False})


def check_plan(plan: MemoryPlan, inp: PlanInputs, req: PlanRequest):
    terms = plan.terms()
    assert all(isinstance(t.bytes, int) and t.bytes >= 0 for t in terms.values())
    assert plan.total() == sum(t.bytes for t in terms.values()) <= inp.usable.bytes
    assert plan.free == inp.usable.bytes - plan.total() >= 0
    assert plan.total() == (fixed_bytes(inp) + plan.expert_slots * inp.expert_slot_bytes * (not req.resident_experts)
                            + plan.kv_pages * inp.page_size * inp.kv_bytes_per_token)
    for name in FIXED:
        assert terms[name] == getattr(inp, name)
    assert plan.kv_tokens == plan.kv_pages * plan.page_size
    assert plan.context_limit == min(inp.context_tokens, plan.kv_tokens)
    floor = kv_floor_pages(inp, req)
    if req.explicit_kv or not req.auto_experts:
        assert plan.kv_pages == floor  # exact, or the floor/default with nothing grown
    else:
        assert plan.kv_pages >= floor
    if req.resident_experts:
        assert plan.expert_slots == 0 and plan.experts.bytes == 0
    elif req.auto_experts:
        assert inp.min_expert_slots <= plan.expert_slots <= inp.experts_total
        if plan.expert_slots < inp.experts_total:  # one more slot would not fit, and KV did not grow
            assert plan.free < inp.expert_slot_bytes and plan.kv_pages == floor
        elif not req.explicit_kv and inp.kv_bytes_per_token:  # every expert fits: KV took the rest
            assert plan.free < inp.page_size * inp.kv_bytes_per_token
    else:
        assert plan.expert_slots == asked_slots(inp, req)
    json.loads(json.dumps(plan.to_dict()))
    table = plan.table()
    for name in list(terms) + ["usable", "free", "total"]:
        assert f"  {name} " in table


def check_refusal(err: PlanRefused, inp: PlanInputs, req: PlanRequest):
    msg = str(err)
    room = inp.usable.bytes - fixed_bytes(inp)
    kv_bytes = kv_floor_pages(inp, req) * inp.page_size * inp.kv_bytes_per_token
    slots = asked_slots(inp, req)
    expert_bytes = 0 if req.resident_experts else (slots or inp.min_expert_slots) * inp.expert_slot_bytes
    assert room < 0 or kv_bytes + expert_bytes > room  # the refusal is justified
    for n in ("usable",) + FIXED:  # every term's numbers
        assert str(getattr(inp, n).bytes) in msg and human_bytes(getattr(inp, n).bytes) in msg
    assert str(inp.state_slots * inp.state_bytes_per_slot) in msg
    assert str(kv_bytes) in msg  # the pools as asked (resident: the experts are in the weights, no term)
    if not req.resident_experts:
        assert str(expert_bytes) in msg
    assert str(fixed_bytes(inp) + kv_bytes + expert_bytes) in msg  # and the total they come to
    if err.largest_expert_slots is not None:
        assert f"--moe-cache-size {err.largest_expert_slots} " in msg
        assert slots is not None
        fits = make_plan(inp, with_slots(req, err.largest_expert_slots))  # it really fits ...
        assert fits.expert_slots == err.largest_expert_slots
        if err.largest_expert_slots < inp.experts_total:  # ... and it is the largest
            with pytest.raises(PlanRefused):
                make_plan(inp, with_slots(req, err.largest_expert_slots + 1))
    if err.largest_kv_tokens is not None:
        tokens = err.largest_kv_tokens
        assert tokens % inp.page_size == 0 and tokens >= inp.page_size
        value = tokens // inp.page_size if req.kv_pages is not None else tokens
        assert f"{req.kv_flag} {value} " in msg
        fits = make_plan(inp, with_kv(req, tokens, inp.page_size))
        assert fits.kv_tokens >= tokens and (slots is None or fits.expert_slots == slots)
        with pytest.raises(PlanRefused):
            make_plan(inp, with_kv(req, tokens + inp.page_size, inp.page_size))
    if err.largest_expert_slots is None and err.largest_kv_tokens is None:
        assert "largest sizes that fit" not in msg
        assert ("no pool size fits" if room < 0 else "no one pool can shrink enough") in msg


@settings(max_examples=1000, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_plan_invariant_over_random_inputs(scenario):
    inp, req = scenario
    slots = asked_slots(inp, req)
    if slots is not None and slots < inp.min_expert_slots:
        with pytest.raises(ValueError, match="below the"):
            make_plan(inp, req)
        return
    try:
        plan = make_plan(inp, req)
    except PlanRefused as err:
        event(f"refused; fixed alone {'fixed terms alone' in str(err)}, largest slots "
              f"{err.largest_expert_slots is not None}, kv {err.largest_kv_tokens is not None}")
        check_refusal(err, inp, req)
        return
    event(f"plan; kv grown {plan.kv_pages > kv_floor_pages(inp, req)}")
    check_plan(plan, inp, req)
    if not req.resident_experts:  # the OOM guard's shrink keeps the invariant
        for smaller in {inp.min_expert_slots, (inp.min_expert_slots + plan.expert_slots) // 2, plan.expert_slots}:
            shrunk = plan.shrink_experts(smaller, reason="test")
            assert shrunk.expert_slots == smaller and shrunk.total() <= inp.usable.bytes
            assert shrunk.free == plan.free + (plan.expert_slots - smaller) * inp.expert_slot_bytes
            assert {k: v for k, v in shrunk.terms().items() if k != "experts"} == \
                   {k: v for k, v in plan.terms().items() if k != "experts"}
        with pytest.raises(ValueError):
            plan.shrink_experts(inp.min_expert_slots - 1)
    check_account_held(plan, inp)


def check_account_held(plan: MemoryPlan, inp: PlanInputs) -> None:
    """Bytes held beyond the plan (after the warm-up): the slack absorbs them first, then the
    fewest expert slots; the reserves and every other term stay; refused below the minimum."""
    slot = inp.expert_slot_bytes if not plan.resident_experts else 0
    for extra in {1, plan.free, plan.free + 1, plan.free + 3 * slot + 1, inp.usable.bytes}:
        try:
            held = plan.account_held(extra, "test")
        except PlanRefused:
            assert plan.resident_experts or not slot or \
                plan.expert_slots - plan.slots_freeing(extra - plan.free) < plan.min_expert_slots
            continue
        assert held.total() <= inp.usable.bytes and held.weights.bytes == plan.weights.bytes + extra
        freed = (plan.expert_slots - held.expert_slots) * slot
        assert freed >= extra - plan.free > freed - slot or (freed == 0 and extra <= plan.free)
        assert {k: v for k, v in held.terms().items() if k not in ("weights", "experts")} == \
               {k: v for k, v in plan.terms().items() if k not in ("weights", "experts")}
    assert plan.account_held(0, "test") is plan


@settings(max_examples=300, deadline=None, database=None, derandomize=True)
@given(scenarios(), st.integers(0, 64 * MiB))
def test_slots_freeing_covers_the_deficit(scenario, deficit):
    inp, req = scenario
    if req.resident_experts or (asked_slots(inp, req) or inp.min_expert_slots) < inp.min_expert_slots:
        return
    try:
        plan = make_plan(inp, req)
    except PlanRefused:
        return
    n = plan.slots_freeing(deficit)
    assert n * inp.expert_slot_bytes >= deficit > (n - 1) * inp.expert_slot_bytes or n == deficit == 0


# ---------------------------------------------------------------- hand-computed examples


def seed_inputs(usable: Term) -> PlanInputs:
    """Qwen3.6-35B-A3B mixed_nvfp4 shape: 40 layers x 256 experts of ~6.5 MiB; 10 full-attention layers
    (2 KV heads x 256, bf16): 20480 B/token; 30 GDN layers (2 MiB recurrent + 48 KiB conv each);
    prefix cache at --max-running-requests 1: 2 x 1 + 8 = 10 state slots; staging two whole layers."""
    return PlanInputs(
        usable=usable, weights=Term(3328 * MiB, "measured: after load"),
        expert_slot_bytes=6815744, experts_total=40 * 256, staging=Term(2 * 256 * 6815744, "derived: 2 layers"),
        kv_bytes_per_token=20480, page_size=1, state_bytes_per_slot=30 * (2 * MiB + 48 * 1024), state_slots=10,
        transient=Term(1536 * MiB, "measured: probe"), graphs=Term(256 * MiB, "measured"),
        margin=Term(512 * MiB, "measured"), context_tokens=131072, min_expert_slots=8)


def test_seed_scenario_auto_with_kv_reserve():
    inp = seed_inputs(usable_memory(free=14950 * MiB, ratio=0.9))  # 14.6 GiB free
    assert inp.usable.bytes == 13455 * MiB and "--memory-ratio 0.9" in inp.usable.source
    plan = make_plan(inp, PlanRequest(expert_auto=True, kv_reserve_tokens=131072))
    # 13455 MiB - 3328 - 3328 - 614.0625 (states) - 1536 - 256 - 512 - 2560 (KV) = 1320.9375 MiB -> 203 slots
    assert plan.states.bytes == 643891200 and plan.kv.bytes == 2560 * MiB
    assert plan.expert_slots == 203 and plan.free == 1507328
    assert plan.kv_tokens == plan.context_limit == 131072
    table = plan.table()
    assert "203 of 10240 slots x 6.50 MiB" in table and "--moe-cache-auto" in table
    assert "13.14 GiB" in table and "--kv-reserve-tokens 131072" in table
    d = plan.to_dict()
    assert d["expert_slots"] == 203 and d["terms"]["kv"]["bytes"] == 2560 * MiB and d["free_bytes"] == 1507328
    assert d["usable"]["bytes"] == 13455 * MiB


def test_seed_scenario_refused_with_the_largest_kv_reserve():
    inp = seed_inputs(usable_memory(free=None, limit=12000 * MiB))
    with pytest.raises(PlanRefused) as info:
        make_plan(inp, PlanRequest(expert_auto=True, kv_reserve_tokens=131072))
    # room 2543779840 B; minus 8 slots x 6815744 B, / 20480 B per token = 121545 tokens
    assert info.value.largest_kv_tokens == 121545 and info.value.largest_expert_slots is None
    msg = str(info.value)
    assert "--kv-reserve-tokens 121545 " in msg and "fewer than the 8 the backend needs" in msg
    assert "2560.00 MiB" not in msg and "2.50 GiB" in msg and str(2560 * MiB) in msg
    plan = make_plan(inp, PlanRequest(expert_auto=True, kv_reserve_tokens=121545))
    assert plan.expert_slots == 8 and plan.context_limit == 121545


def test_fixed_terms_alone_refused():
    inp = seed_inputs(usable_memory(free=10 * GiB, ratio=0.9))  # 9216 MiB < 9574.0625 MiB of fixed terms
    with pytest.raises(PlanRefused) as info:
        make_plan(inp, PlanRequest(expert_auto=True, kv_reserve_tokens=131072))
    msg = str(info.value)
    assert "the fixed terms alone need 9.35 GiB (10039132160 bytes)" in msg and "no pool size fits" in msg
    assert info.value.largest_expert_slots is None and info.value.largest_kv_tokens is None


def test_resident_default_kv_is_the_context_and_the_rest_stays_free():
    plan = make_plan(inputs(kv_bytes_per_token=2, page_size=16, context_tokens=100, expert_slot_bytes=0),
                     PlanRequest(resident_experts=True))
    assert plan.kv_pages == 7 and plan.kv_tokens == 112 and plan.kv.bytes == 224  # ceil(100 / 16) pages
    assert plan.free == 1000 - 100 - 224 and plan.expert_slots == 0 and plan.context_limit == 100
    assert "resident" in plan.experts.source
    with pytest.raises(ValueError, match="no expert cache"):
        plan.shrink_experts(0)


def test_auto_fills_experts_then_kv():
    inp = inputs(experts_total=4, expert_slot_bytes=10, kv_bytes_per_token=1, page_size=10, context_tokens=50)
    plan = make_plan(inp, PlanRequest(expert_auto=True))
    # 1000 - 100 weights - 50 KV floor = 850; 4 experts x 10 = 40; 810 more bytes -> 81 pages of KV
    assert plan.expert_slots == 4 and plan.kv_pages == 86 and plan.kv_tokens == 860 and plan.free == 0
    assert "what is left once every expert has a slot" in plan.kv.source
    explicit = make_plan(inp, PlanRequest(expert_auto=True, kv_tokens=50))
    assert explicit.kv_tokens == 50 and explicit.free == 810  # an explicit KV size never grows
    sized = make_plan(inp, PlanRequest(expert_slots=2))
    assert sized.kv_tokens == 50 and sized.free == 830  # only auto fills the device


def test_offload_without_cache_flag_is_auto():
    plan = make_plan(inputs(), PlanRequest())
    assert plan.expert_slots == 8 and plan.free == 50 and "auto (no --moe-cache-* flag)" in plan.experts.source


def test_explicit_slots_refused_with_largest_fit():
    with pytest.raises(PlanRefused) as info:
        make_plan(inputs(), PlanRequest(expert_slots=9))  # 100 + 900 + 50 KV > 1000
    assert info.value.largest_expert_slots == 8 and info.value.largest_kv_tokens is None
    msg = str(info.value)
    assert "--moe-cache-size 8 (with the KV pool at 50 tokens)" in msg and "over by 50 B (50 bytes)" in msg
    with pytest.raises(PlanRefused) as info:
        make_plan(inputs(), PlanRequest(expert_slots=8, kv_pages=120))
    assert info.value.largest_kv_tokens == 100 and "--num-pages 100 " in str(info.value)
    assert info.value.largest_expert_slots == 7


def test_explicit_sizes_are_exact():
    plan = make_plan(inputs(page_size=16), PlanRequest(expert_slots=3, kv_tokens=100))
    assert plan.expert_slots == 3 and plan.kv_tokens == 112 and plan.context_limit == 50
    big = make_plan(inputs(usable=10_000), PlanRequest(expert_slots=5000))
    assert big.expert_slots == 50 and "capped at the model's 50" in big.experts.source
    assert make_plan(inputs(experts_total=10240, expert_slot_bytes=1, usable=20_000),
                     PlanRequest(expert_rate=0.1)).expert_slots == 1024
    assert make_plan(inputs(experts_total=100, expert_slot_bytes=1),
                     PlanRequest(expert_rate=0.07)).expert_slots == 7  # 0.07 x 100 is 7.000000000000001
    assert make_plan(inputs(), PlanRequest(expert_rate=0.0001)).expert_slots == 1


def test_small_kv_limits_the_context():
    plan = make_plan(inputs(), PlanRequest(expert_slots=1, kv_tokens=20))
    assert plan.context_limit == 20 and "context limited to 20 tokens by the KV pool (asked 50)" in plan.table()


def test_shrink_and_slots_freeing():
    plan = make_plan(inputs(), PlanRequest(expert_auto=True))
    assert plan.slots_freeing(1) == 1 and plan.slots_freeing(100) == 1 and plan.slots_freeing(101) == 2
    shrunk = plan.shrink_experts(plan.expert_slots - plan.slots_freeing(250), reason="boot self-test")
    assert shrunk.expert_slots == 5 and shrunk.free == plan.free + 300
    assert shrunk.experts.source == "derived: shrunk from 8 to 5 of 50 slots x 100 B (boot self-test)"
    assert plan.expert_slots == 8  # frozen: the old plan is unchanged
    with pytest.raises(ValueError, match="cannot shrink"):
        plan.shrink_experts(9)  # a shrink never grows the cache


def test_account_held_takes_the_slack_then_expert_slots():
    plan = make_plan(inputs(), PlanRequest(expert_auto=True))
    assert plan.account_held(-5, "test") is plan
    same = plan.account_held(plan.free, "after the warm-up")
    assert same.expert_slots == plan.expert_slots and same.free == 0
    assert same.weights.source.endswith(f"; +{human_bytes(plan.free)} after the warm-up")
    fewer = plan.account_held(plan.free + 150, "after the warm-up")
    assert fewer.expert_slots == plan.expert_slots - 2 and fewer.transient == plan.transient
    assert fewer.experts.source.startswith(f"derived: {plan.expert_slots - 2} of 50 slots")
    with pytest.raises(PlanRefused, match="cannot shrink enough"):
        plan.account_held(plan.free + plan.experts.bytes, "after the warm-up")


def test_invalid_requests():
    with pytest.raises(ValueError, match="give one"):
        PlanRequest(kv_tokens=10, kv_reserve_tokens=10)
    with pytest.raises(ValueError, match="give one"):
        PlanRequest(expert_slots=3, expert_auto=True)
    with pytest.raises(ValueError, match="resident"):
        PlanRequest(resident_experts=True, expert_auto=True)
    with pytest.raises(ValueError, match="--moe-cache-rate"):
        PlanRequest(expert_rate=1.5)
    with pytest.raises(ValueError, match="below the 4 expert slots"):
        make_plan(inputs(min_expert_slots=4), PlanRequest(expert_slots=2))
    with pytest.raises(ValueError, match="non-negative"):
        Term(-1, "given")
    with pytest.raises(ValueError, match="page_size"):
        inputs(page_size=0)


def test_usable_memory():
    assert usable_memory(free=1000).bytes == 1000
    assert usable_memory(free=1000, ratio=0.5).bytes == 500
    capped = usable_memory(free=1000, ratio=0.5, limit=300)
    assert capped.bytes == 300 and capped.source.startswith("flag --gpu-memory-limit")
    assert usable_memory(free=1000, limit=4000).bytes == 1000  # a cap never exceeds the free memory
    assert usable_memory(free=None, limit=4000).bytes == 4000
    host = usable_memory(free=None, ratio=0.5, limit=4000)  # CPU mode: the ratio applies to the limit
    assert host.bytes == 2000 and "--memory-ratio 0.5" in host.source
    with pytest.raises(ValueError, match="--gpu-memory-limit"):
        usable_memory(free=None)


def test_human_bytes():
    assert human_bytes(int(14.6 * GiB)) == "14.60 GiB"
    assert human_bytes(6815744) == "6.50 MiB"
    assert human_bytes(1536) == "1.50 KiB" and human_bytes(12) == "12 B"


def test_worst_prefill_counts_the_attention_gather_the_moe_peak_hides():
    """The probe's prefill peaks at depth 0 and D1 are equal when the MoE layers' peak hides the
    attention layer's (its flash context gather grows with depth): the worst chunk is still
    counted at least at D1's peak plus the gather's growth to the deepest start; without a
    gather (CPU, the paged kernel) the plain extrapolation stands, and it wins when larger."""
    import torch

    from moeferry.memory.probe import worst_prefill
    from moeferry.ops.attention import context_gather_bytes

    per_token = context_gather_bytes(2, 256, torch.bfloat16, torch.device("cuda"))
    assert per_token == 2 * 2 * 256 * 2
    assert context_gather_bytes(2, 256, torch.bfloat16, torch.device("cpu")) == 0
    assert context_gather_bytes(2, 256, torch.float8_e4m3fn, torch.device("cuda")) == 0
    moe_peak = 600 * MiB
    assert worst_prefill(moe_peak, moe_peak, 8192, 8192, per_token) == moe_peak  # no deeper start
    assert worst_prefill(moe_peak, moe_peak, 8192, 253952, 0) == moe_peak
    assert worst_prefill(moe_peak, moe_peak, 8192, 253952, per_token) == moe_peak + per_token * (253952 - 8192)
    steep = worst_prefill(100 * MiB, 600 * MiB, 8192, 253952, 1)  # measured growth beyond the gather's
    assert steep == 600 * MiB + 500 * MiB * (253952 - 8192) // 8192
