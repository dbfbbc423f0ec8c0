"""The memory plan: how the usable device memory is split, in bytes, with where each number came from.

Pure arithmetic (no torch). The engine measures the inputs at boot and calls `make_plan`; the
result is a frozen `MemoryPlan` whose `total()` never exceeds the usable memory, or `PlanRefused`
with every term's numbers and the largest sizes that would fit.

    usable = usable_memory(free=free_at_start, ratio=args.memory_ratio, limit=args.gpu_memory_limit)
    plan = make_plan(PlanInputs(usable=usable, weights=Term(w, "measured: after load"), ...),
                     PlanRequest(expert_auto=True, kv_reserve_tokens=131072))
    print(plan.table())                       # the boot table
    status = plan.to_dict()                   # /v1/cache/status
    smaller = plan.shrink_experts(plan.expert_slots - plan.slots_freeing(deficit))   # self-test, guard

Interface
    Term(bytes, source)              one byte count and where it came from: "measured: ...",
                                     "flag --x ...", "default: ...", "derived: ..."
    PlanInputs                       measured / given sizes (see the class)
    PlanRequest                      what the user asked for (see the class)
    MemoryPlan                       the plan; `total()`, `free`, `table()`, `to_dict()`,
                                     `shrink_experts(slots, reason="")`, `slots_freeing(nbytes)`
    PlanRefused(ValueError)          the sizes asked for do not fit; `.largest_expert_slots`,
                                     `.largest_kv_tokens` (None when no such value fits)
    make_plan(inputs, request)       -> MemoryPlan, or raises PlanRefused (sizes do not fit)
                                     or ValueError (contradictory or invalid request/inputs)
    usable_memory(free, ratio, limit) -> Term: the usable budget from the flags
    human_bytes(n)                   "14.60 GiB", "6.50 MiB"

Rules
    1. Fixed terms first: weights, staging, states (state_slots x state_bytes_per_slot), transient,
       graphs, margin. If they alone exceed usable memory, the plan is refused.
    2. KV size: --num-tokens / --num-pages is exact (tokens rounded up to whole pages). Else
       --kv-reserve-tokens is a floor. Else the default is the context length (one full-length
       sequence always fits). An explicit KV size and --kv-reserve-tokens together are a
       contradiction (ValueError). A KV pool smaller than the context lowers the context:
       `context_limit = min(context_tokens, kv_tokens)`, shown in the table.
    3. Experts (offload backends): --moe-cache-size is exact (capped at experts_total);
       --moe-cache-rate is ceil(rate x experts_total), at least 1. Either one below
       `min_expert_slots` is a ValueError. If the slots and the KV size do not fit together, the
       plan is refused with the largest slot count that fits beside the KV size asked and the
       largest KV size that fits beside the slots asked.
       --moe-cache-auto (also the default for an offload backend given no cache flag):
       slots = min(experts_total, what is left after the fixed terms and the KV floor // slot bytes);
       fewer than `min_expert_slots` is refused with the largest KV floor that leaves that many.
    4. What is left: only auto fills the device. Auto gives the rest to expert slots; once every
       expert has a slot, the rest goes to the KV pool in whole pages unless the KV size is
       explicit. In every other case (explicit slots, resident, or an explicit KV size) the
       pools are exactly the sizes asked for or defaulted, and the rest stays free (shown as
       `free`: more headroom on top of the margin).
    5. Resident: experts are inside `weights`; no expert term, no cache flags (ValueError).
    6. Invariant: every term is a non-negative integer and `total() <= usable` for every plan,
       including every `shrink_experts` result (checked when a plan is built).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def human_bytes(n: int) -> str:
    """14.60 GiB, 6.50 MiB, 1.50 KiB, 12 B (two decimals above a KiB)."""
    for unit, size in _UNITS:
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class Term:
    """One byte count of the plan and where it came from."""

    bytes: int
    source: str  # "measured: ...", "flag --x ...", "default: ...", "derived: ..."

    def __post_init__(self):
        if not isinstance(self.bytes, int) or isinstance(self.bytes, bool) or self.bytes < 0:
            raise ValueError(f"a memory term is a non-negative integer byte count, got {self.bytes!r}"
                             f" ({self.source})")


def usable_memory(free: int | None, ratio: float | None = None, limit: int | None = None) -> Term:
    """The budget: free memory at start x --memory-ratio (all of it when no ratio is given: the
    margin term is the safety), capped by --gpu-memory-limit; the limit alone when the free
    memory is unknown (`free=None`, e.g. host memory in CPU mode), times the ratio if one is given."""
    if ratio is not None and not 0.0 < ratio <= 1.0:
        raise ValueError(f"--memory-ratio must be in (0, 1], got {ratio}")
    if free is None:
        if limit is None:
            raise ValueError("the free memory is unknown: give --gpu-memory-limit")
        if ratio is None:
            return Term(limit, f"flag --gpu-memory-limit {human_bytes(limit)}")
        return Term(int(limit * ratio), f"flag --gpu-memory-limit {human_bytes(limit)} x --memory-ratio {ratio:g}")
    if ratio is None:
        share = Term(free, f"measured: free at start {human_bytes(free)}")
    else:
        share = Term(int(free * ratio), f"measured: free at start {human_bytes(free)} x --memory-ratio {ratio:g}")
    if limit is None or limit >= share.bytes:
        return share if limit is None else Term(share.bytes, f"{share.source} (below --gpu-memory-limit "
                                                              f"{human_bytes(limit)})")
    return Term(limit, f"flag --gpu-memory-limit {human_bytes(limit)} (below {share.source})")


@dataclass(frozen=True)
class PlanInputs:
    """Every size the plan splits the memory between, measured at boot or given."""

    usable: Term  # usable_memory(...)
    weights: Term  # resident weights (dense layers, shared experts, embeddings, lm_head; all experts if resident)
    expert_slot_bytes: int  # one expert slot (0 when the backend keeps no cache)
    experts_total: int  # routed experts (layers x experts): the most slots that can be useful
    staging: Term  # offload prefill staging area (0 for resident)
    kv_bytes_per_token: int  # all full-attention layers, K and V
    page_size: int
    state_bytes_per_slot: int  # GDN conv + recurrent state per sequence slot (0 without linear attention)
    state_slots: int
    transient: Term  # measured peak of the worst step beyond the pools
    graphs: Term  # CUDA graph pools (0 on the CPU)
    margin: Term  # safety margin, justified by the caller's measurements
    context_tokens: int  # longest context a sequence may use (max_seq_len)
    min_expert_slots: int = 1  # fewest slots the expert backend can run with (e.g. top_k)

    def __post_init__(self):
        for name in ("expert_slot_bytes", "experts_total", "kv_bytes_per_token", "state_bytes_per_slot",
                     "state_slots"):
            _check_int(name, getattr(self, name), 0)
        for name in ("page_size", "context_tokens", "min_expert_slots"):
            _check_int(name, getattr(self, name), 1)

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.kv_bytes_per_token

    def fixed_terms(self) -> dict[str, Term]:
        """The terms that do not depend on the pool sizes asked for."""
        states = Term(self.state_slots * self.state_bytes_per_slot,
                      f"derived: {self.state_slots} slots x {human_bytes(self.state_bytes_per_slot)}")
        return {"weights": self.weights, "staging": self.staging, "states": states,
                "transient": self.transient, "graphs": self.graphs, "margin": self.margin}


@dataclass(frozen=True)
class PlanRequest:
    """What the user asked for. At most one expert flag, at most one KV size flag."""

    expert_slots: int | None = None  # --moe-cache-size
    expert_rate: float | None = None  # --moe-cache-rate: ceil(rate x experts_total), at least 1
    expert_auto: bool = False  # --moe-cache-auto (also what an offload backend gets with no cache flag)
    resident_experts: bool = False  # resident backend: experts are in `weights`, no cache
    kv_tokens: int | None = None  # --num-tokens (exact, rounded up to pages)
    kv_pages: int | None = None  # --num-pages (exact)
    kv_reserve_tokens: int | None = None  # --kv-reserve-tokens: KV floor before experts get the rest

    def __post_init__(self):
        asked = [f for f, on in (("--moe-cache-size", self.expert_slots is not None),
                                 ("--moe-cache-rate", self.expert_rate is not None),
                                 ("--moe-cache-auto", self.expert_auto)) if on]
        if len(asked) > 1:
            raise ValueError(f"{' and '.join(asked)} both size the expert cache: give one")
        if self.resident_experts and asked:
            raise ValueError(f"{asked[0]} sizes the expert cache of an offload backend; the resident "
                             "backend keeps every expert on the device")
        if self.kv_tokens is not None and self.kv_pages is not None:
            raise ValueError("--num-tokens and --num-pages both size the KV pool: give one")
        if self.kv_reserve_tokens is not None and self.explicit_kv:
            raise ValueError(f"{self.kv_flag} sizes the KV pool exactly and --kv-reserve-tokens gives it a "
                             "floor: give one")
        for name in ("expert_slots", "kv_tokens", "kv_pages", "kv_reserve_tokens"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 1)
        if self.expert_rate is not None and not 0.0 < self.expert_rate <= 1.0:
            raise ValueError(f"--moe-cache-rate must be in (0, 1], got {self.expert_rate}")

    @property
    def explicit_kv(self) -> bool:
        return self.kv_tokens is not None or self.kv_pages is not None

    @property
    def auto_experts(self) -> bool:
        return not self.resident_experts and self.expert_slots is None and self.expert_rate is None

    @property
    def kv_flag(self) -> str:
        """The flag that sets the KV size (what a refusal tells the user to change)."""
        if self.kv_pages is not None:
            return "--num-pages"
        return "--kv-reserve-tokens" if self.kv_reserve_tokens is not None else "--num-tokens"


class PlanRefused(ValueError):
    """The sizes asked for do not fit. The message lists every term and the largest sizes that fit;
    `largest_expert_slots` fits beside the KV size asked, `largest_kv_tokens` (whole pages) beside
    the expert slots asked (None where no such value fits)."""

    def __init__(self, message: str, largest_expert_slots: int | None = None,
                 largest_kv_tokens: int | None = None):
        super().__init__(message)
        self.largest_expert_slots = largest_expert_slots
        self.largest_kv_tokens = largest_kv_tokens


_TERMS = ("weights", "experts", "staging", "kv", "states", "transient", "graphs", "margin")


@dataclass(frozen=True)
class MemoryPlan:
    """The split of the usable memory. Frozen; `shrink_experts` returns a new plan."""

    usable: Term
    weights: Term
    experts: Term  # expert_slots x expert_slot_bytes (0 for resident: experts are in weights)
    staging: Term
    kv: Term  # kv_pages x page_size x kv_bytes_per_token
    states: Term  # state_slots x state_bytes_per_slot
    transient: Term
    graphs: Term
    margin: Term
    expert_slots: int
    expert_slot_bytes: int
    experts_total: int
    min_expert_slots: int
    resident_experts: bool
    kv_pages: int
    page_size: int
    kv_bytes_per_token: int
    state_slots: int
    context_tokens: int  # the context asked for (max_seq_len)

    def __post_init__(self):
        if self.experts.bytes != self.expert_slots * self.expert_slot_bytes:
            raise ValueError(f"expert term {self.experts.bytes} != {self.expert_slots} slots x "
                             f"{self.expert_slot_bytes} bytes")
        if self.kv.bytes != self.kv_tokens * self.kv_bytes_per_token:
            raise ValueError(f"KV term {self.kv.bytes} != {self.kv_tokens} tokens x {self.kv_bytes_per_token} bytes")
        if self.total() > self.usable.bytes:
            raise ValueError(f"memory plan over budget: {self.total()} > usable {self.usable.bytes}\n"
                             + _rows(self.terms(), self.usable))

    @property
    def kv_tokens(self) -> int:
        return self.kv_pages * self.page_size

    @property
    def context_limit(self) -> int:
        """Longest sequence the plan admits: the context asked, or less if the KV pool is smaller."""
        return min(self.context_tokens, self.kv_tokens)

    @property
    def free(self) -> int:
        """Usable bytes no term takes."""
        return self.usable.bytes - self.total()

    def terms(self) -> dict[str, Term]:
        return {name: getattr(self, name) for name in _TERMS}

    def total(self) -> int:
        return sum(t.bytes for t in self.terms().values())

    def slots_freeing(self, nbytes: int) -> int:
        """The fewest expert slots whose release frees at least `nbytes` (the self-test's deficit)."""
        if self.expert_slot_bytes == 0:
            raise ValueError("this plan has no expert cache to shrink")
        return -(-max(nbytes, 0) // self.expert_slot_bytes)

    def shrink_experts(self, slots: int, reason: str = "") -> "MemoryPlan":
        """The same plan with `slots` expert slots (at most the current count, at least
        min_expert_slots); the bytes freed become `free`."""
        if self.resident_experts or self.expert_slot_bytes == 0:
            raise ValueError("this plan has no expert cache to shrink")
        _check_int("slots", slots, 0)
        if not self.min_expert_slots <= slots <= self.expert_slots:
            raise ValueError(f"cannot shrink the expert cache from {self.expert_slots} to {slots} slots "
                             f"(the backend needs at least {self.min_expert_slots})")
        source = (f"derived: shrunk from {self.expert_slots} to {slots} of {self.experts_total} slots"
                  f" x {human_bytes(self.expert_slot_bytes)}" + (f" ({reason})" if reason else ""))
        return replace(self, expert_slots=slots, experts=Term(slots * self.expert_slot_bytes, source))

    def account_held(self, extra: int, reason: str) -> "MemoryPlan":
        """The same plan with `extra` bytes more held for good than it counted (measured once the
        pools, the decode graphs and the warm-up's kernels exist: graph executables and kernel
        modules live outside the allocator, after the probe) added to the weights term. What no
        term took absorbs it first; then the expert cache gives up the fewest slots that keep
        the total within the usable memory, so the transient and margin reserves stay whole.
        Raises PlanRefused when that would take the cache below min_expert_slots (or there is
        no cache to shrink)."""
        if extra <= 0:
            return self
        weights = Term(self.weights.bytes + extra, f"{self.weights.source}; +{human_bytes(extra)} {reason}")
        over = self.total() + extra - self.usable.bytes
        slots = self.expert_slots - (self.slots_freeing(over) if over > 0 and self.expert_slot_bytes else 0)
        if over > 0 and (self.resident_experts or not self.expert_slot_bytes or slots < self.min_expert_slots):
            raise PlanRefused(f"{human_bytes(extra)} held beyond the memory plan ({reason}) leaves "
                              f"{human_bytes(over)} too little for the transient and margin reserves, and the "
                              f"expert cache cannot shrink enough\n" + _rows(self.terms(), self.usable))
        experts = self.experts if slots == self.expert_slots else Term(
            slots * self.expert_slot_bytes,
            f"derived: {slots} of {self.experts_total} slots x {human_bytes(self.expert_slot_bytes)} "
            f"({self.expert_slots} planned, less what was held beyond the plan)")
        return replace(self, weights=weights, experts=experts, expert_slots=slots)

    def table(self) -> str:
        """The boot table: each term, its bytes and where it came from."""
        lines = [_rows(self.terms(), self.usable, free=self.free, header=True)]
        if self.context_limit < self.context_tokens:
            lines.append(f"  context limited to {self.context_limit} tokens by the KV pool "
                         f"(asked {self.context_tokens})")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """JSON-ready: every term (bytes, source) and the sizes (for /v1/cache/status)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if not isinstance(getattr(self, f.name), Term)}
        out.update(usable={"bytes": self.usable.bytes, "source": self.usable.source},
                   terms={name: {"bytes": t.bytes, "source": t.source} for name, t in self.terms().items()},
                   total_bytes=self.total(), free_bytes=self.free, kv_tokens=self.kv_tokens,
                   context_limit=self.context_limit)
        return out


def make_plan(inputs: PlanInputs, request: PlanRequest) -> MemoryPlan:
    """Split `inputs.usable` by the rules in the module docstring, or raise PlanRefused."""
    fixed = inputs.fixed_terms()
    room = inputs.usable.bytes - sum(t.bytes for t in fixed.values())  # for experts + KV
    kv_pages = _kv_pages_asked(inputs, request)
    if not request.resident_experts:
        _check_cache_inputs(inputs)
    slots = 0 if request.resident_experts or request.auto_experts else _explicit_slots(inputs, request)
    if room < 0:
        raise PlanRefused(_refusal(inputs, fixed, _pool_terms(inputs, request, slots, kv_pages),
                                   f"the fixed terms alone need {_bytes(inputs.usable.bytes - room)}, "
                                   "more than the usable memory"))
    if request.auto_experts:
        slots = _auto_slots(inputs, request, fixed, room, kv_pages)
    expert_bytes = slots * inputs.expert_slot_bytes
    if expert_bytes + kv_pages * inputs.page_bytes > room:
        _refuse_pools(inputs, request, fixed, room, slots, kv_pages)
    grown = 0
    if slots == inputs.experts_total and request.auto_experts and not request.explicit_kv and inputs.page_bytes:
        grown = (room - expert_bytes - kv_pages * inputs.page_bytes) // inputs.page_bytes
    return MemoryPlan(
        usable=inputs.usable, weights=inputs.weights, experts=_expert_term(inputs, request, slots),
        staging=inputs.staging, kv=_kv_term(inputs, request, kv_pages, grown), states=fixed["states"],
        transient=inputs.transient, graphs=inputs.graphs, margin=inputs.margin, expert_slots=slots,
        expert_slot_bytes=0 if request.resident_experts else inputs.expert_slot_bytes,
        experts_total=inputs.experts_total, min_expert_slots=inputs.min_expert_slots,
        resident_experts=request.resident_experts, kv_pages=kv_pages + grown, page_size=inputs.page_size,
        kv_bytes_per_token=inputs.kv_bytes_per_token, state_slots=inputs.state_slots,
        context_tokens=inputs.context_tokens)


# ---------------------------------------------------------------- sizes asked for


def _kv_pages_asked(inputs: PlanInputs, request: PlanRequest) -> int:
    """The KV size asked (exact) or its floor, in pages."""
    if request.kv_pages is not None:
        return request.kv_pages
    tokens = request.kv_tokens or request.kv_reserve_tokens or inputs.context_tokens
    return -(-tokens // inputs.page_size)


def _explicit_slots(inputs: PlanInputs, request: PlanRequest) -> int:
    if request.expert_slots is not None:
        slots, flag = min(request.expert_slots, inputs.experts_total), f"--moe-cache-size {request.expert_slots}"
    else:
        # round() first: 0.07 x 100 is 7.000000000000001 in floating point, and means 7
        slots = max(1, math.ceil(round(request.expert_rate * inputs.experts_total, 6)))
        flag = f"--moe-cache-rate {request.expert_rate:g} ({slots} slots)"
    if slots < inputs.min_expert_slots:
        raise ValueError(f"{flag} is below the {inputs.min_expert_slots} expert slots the backend needs")
    return slots


def _auto_slots(inputs: PlanInputs, request: PlanRequest, fixed: dict[str, Term], room: int,
                kv_pages: int) -> int:
    """What is left after the fixed terms and the KV floor, in slots (at most every expert)."""
    left = room - kv_pages * inputs.page_bytes
    slots = min(inputs.experts_total, max(left, 0) // inputs.expert_slot_bytes)
    if slots >= inputs.min_expert_slots:
        return slots
    kv_fit = _fitting_kv_tokens(inputs, room - inputs.min_expert_slots * inputs.expert_slot_bytes)
    raise PlanRefused(
        _refusal(inputs, fixed, _pool_terms(inputs, request, inputs.min_expert_slots, kv_pages),
                 f"after the fixed terms and the KV pool, {_bytes(max(left, 0))} is left: room for {slots} "
                 f"expert slots of {human_bytes(inputs.expert_slot_bytes)}, fewer than the "
                 f"{inputs.min_expert_slots} the backend needs",
                 largest_kv=(kv_fit, request, f"{inputs.min_expert_slots} expert slots")),
        largest_kv_tokens=kv_fit)


def _refuse_pools(inputs: PlanInputs, request: PlanRequest, fixed: dict[str, Term], room: int,
                  slots: int, kv_pages: int):
    """Explicit experts and/or KV that do not fit beside each other: the largest of each that would."""
    kv_bytes, expert_bytes = kv_pages * inputs.page_bytes, slots * inputs.expert_slot_bytes
    kv_fit = _fitting_kv_tokens(inputs, room - expert_bytes)
    slots_fit = None
    if not request.resident_experts and room - kv_bytes >= 0:
        fit = min(inputs.experts_total, (room - kv_bytes) // inputs.expert_slot_bytes)
        slots_fit = fit if fit >= inputs.min_expert_slots else None
    raise PlanRefused(
        _refusal(inputs, fixed, _pool_terms(inputs, request, slots, kv_pages),
                 f"the pools need {_bytes(kv_bytes + expert_bytes)}; {_bytes(room)} is left after the fixed terms",
                 largest_kv=(kv_fit, request, "the resident experts" if request.resident_experts
                             else f"{slots} expert slots"),
                 largest_slots=(slots_fit, f"the KV pool at {kv_pages * inputs.page_size} tokens")),
        largest_expert_slots=slots_fit, largest_kv_tokens=kv_fit)


def _fitting_kv_tokens(inputs: PlanInputs, nbytes: int) -> int | None:
    """The largest whole-page KV size in `nbytes` (None if not one page fits)."""
    if nbytes < 0:
        return None
    if inputs.page_bytes == 0:
        return None  # KV costs nothing; it is never what does not fit
    pages = nbytes // inputs.page_bytes
    return pages * inputs.page_size if pages >= 1 else None


def _check_cache_inputs(inputs: PlanInputs):
    if inputs.expert_slot_bytes < 1 or inputs.experts_total < 1:
        raise ValueError(f"an expert cache needs expert_slot_bytes >= 1 and experts_total >= 1, got "
                         f"{inputs.expert_slot_bytes} and {inputs.experts_total}")
    if inputs.min_expert_slots > inputs.experts_total:
        raise ValueError(f"min_expert_slots {inputs.min_expert_slots} > experts_total {inputs.experts_total}")


# ---------------------------------------------------------------- terms and text


def _pool_terms(inputs: PlanInputs, request: PlanRequest, slots: int, kv_pages: int) -> dict[str, Term]:
    """The pools as asked, for a refusal (auto: the fewest slots the backend needs)."""
    kv = {"kv": Term(kv_pages * inputs.page_bytes, _kv_source(inputs, request, kv_pages))}
    if request.resident_experts:
        return kv
    if request.auto_experts:
        slots = inputs.min_expert_slots
        return {"experts": Term(slots * inputs.expert_slot_bytes, f"the fewest the backend needs: {slots} slots"
                                f" x {human_bytes(inputs.expert_slot_bytes)}"), **kv}
    return {"experts": _expert_term(inputs, request, slots), **kv}


def _expert_term(inputs: PlanInputs, request: PlanRequest, slots: int) -> Term:
    if request.resident_experts:
        return Term(0, "resident: every expert is in the weights")
    if request.expert_slots is not None:
        capped = f" (capped at the model's {inputs.experts_total})" if request.expert_slots > slots else ""
        how = f"flag --moe-cache-size {request.expert_slots}{capped}"
    elif request.expert_rate is not None:
        how = f"flag --moe-cache-rate {request.expert_rate:g}"
    else:
        how = ("derived: --moe-cache-auto" if request.expert_auto else "derived: auto (no --moe-cache-* flag)"
               ) + ", what is left"
    return Term(slots * inputs.expert_slot_bytes,
                f"{how}: {slots} of {inputs.experts_total} slots x {human_bytes(inputs.expert_slot_bytes)}")


def _kv_source(inputs: PlanInputs, request: PlanRequest, pages: int) -> str:
    if request.kv_pages is not None:
        how = f"flag --num-pages {request.kv_pages}"
    elif request.kv_tokens is not None:
        how = f"flag --num-tokens {request.kv_tokens}"
    elif request.kv_reserve_tokens is not None:
        how = f"flag --kv-reserve-tokens {request.kv_reserve_tokens} (floor)"
    else:
        how = f"default: the context, {inputs.context_tokens} tokens"
    return (f"{how}: {pages * inputs.page_size} tokens = {pages} pages x {inputs.page_size}"
            f" x {human_bytes(inputs.kv_bytes_per_token)}")


def _kv_term(inputs: PlanInputs, request: PlanRequest, pages: int, grown: int) -> Term:
    source = _kv_source(inputs, request, pages)
    if grown:
        source = (f"derived: {(pages + grown) * inputs.page_size} tokens, what is left once every expert "
                  f"has a slot; {source}")
    return Term((pages + grown) * inputs.page_bytes, source)


def _bytes(n: int) -> str:
    return f"{human_bytes(n)} ({n} bytes)"


def _rows(terms: dict[str, Term], usable: Term, free: int | None = None, header: bool = False) -> str:
    total = sum(t.bytes for t in terms.values())
    rows = [("usable", usable.bytes, usable.source)] + [(k, t.bytes, t.source) for k, t in terms.items()]
    rows.append(("total", total, "sum of the terms" + ("" if total <= usable.bytes
                                                       else f", over by {_bytes(total - usable.bytes)}")))
    if free is not None:
        rows.append(("free", free, "what is left"))
    width = max(len(str(b)) for _, b, _ in rows)
    lines = [f"  {name:<9} {human_bytes(b):>10}  {b:>{width}}  {src}" for name, b, src in rows]
    if header:
        lines.insert(0, f"  {'term':<9} {'size':>10}  {'bytes':>{width}}  source")
    return "\n".join(lines)


def _refusal(inputs: PlanInputs, fixed: dict[str, Term], pools: dict[str, Term], reason: str,
             largest_kv=None, largest_slots=None) -> str:
    """The refusal text: the reason, every term, and the largest sizes that fit."""
    terms = {k: {**fixed, **pools}[k] for k in _TERMS if k in fixed or k in pools}
    over_fixed = sum(t.bytes for t in fixed.values()) > inputs.usable.bytes
    lines = [f"memory plan refused: {reason}", _rows(terms, inputs.usable)]
    fits = []
    if largest_slots is not None and largest_slots[0] is not None:
        fits.append(f"--moe-cache-size {largest_slots[0]} (with {largest_slots[1]})")
    if largest_kv is not None and largest_kv[0] is not None:
        tokens, request, beside = largest_kv
        value = tokens // inputs.page_size if request.kv_pages is not None else tokens
        fits.append(f"{request.kv_flag} {value} (with {beside}; the context is then at most "
                    f"{min(tokens, inputs.context_tokens)} tokens)")
    if fits:
        lines.append("largest sizes that fit: " + "; or ".join(fits))
    elif not over_fixed:
        lines.append("no one pool can shrink enough to fit beside the other: lower both, lower a fixed term "
                     "or give more usable memory")
    else:
        lines.append("no pool size fits: lower a fixed term (weights, staging, states, transient, graphs, "
                     "margin) or give more usable memory")
    return "\n".join(lines)


def _check_int(name: str, value, least: int):
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
