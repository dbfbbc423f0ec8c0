"""The two lanes a miss can take, measured: pinned host->device copies of an expert slot, and
an expert computed on the CPU from its bank. `moeferry bench bw` prints them; the hybrid
backend splits each step's misses with them (`MissSplit`)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from moeferry.moe.slots import SlotBuffer


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def spread(num_slots: int, n: int, batches: int) -> list[torch.Tensor]:
    """`batches` lists of n of a bank's `num_slots` slots, each batch others (while the bank has
    them), spread over it by a seeded permutation: as decode misses land, not the same few read
    again (whose host pages' translations the device would find cached)."""
    order = torch.randperm(num_slots, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    return [order.roll(-i * n)[:n] for i in range(batches)]


def time_fetch(bank: SlotBuffer, device: torch.device, experts: int = 8, repeats: int = 3,
               gather: tuple[int, int] | None = None) -> float:
    """Seconds to copy one expert bank -> device slot (median over `repeats` batches of `experts`
    spread over the bank, host time included); `gather`: by the one-launch gather kernel in that
    config, else one copy per tensor."""
    n = min(experts, bank.num_slots)
    dst = SlotBuffer.allocate_like(bank, n, device=device)
    times = []
    for src in spread(bank.num_slots, n, repeats):
        _sync(device)
        t = time.perf_counter()
        dst.copy_slots(list(range(n)), bank, src.tolist(), gather=gather)
        _sync(device)
        times.append((time.perf_counter() - t) / n)
    del dst
    return sorted(times)[len(times) // 2]


def time_gather(bank: SlotBuffer, device: torch.device, config: tuple, programs: int | None = None,
                experts: int = 16, repeats: int = 3, hits: int = 0) -> float:
    """Device seconds per expert moved for the gather kernel in `config` (CUDA events, the fastest
    of `repeats` launches after one untimed launch), from slot lists on the device as decode steps
    give them, its grid capped at `programs` as the prefetch's is (None: a full grid). `hits`: that
    many of the `experts` listed are hits (a negative destination: nothing moved), as in a decode
    step's gather of every chosen expert. Each launch reads other experts (`spread`)."""
    n = min(experts, bank.num_slots)
    dst = SlotBuffer.allocate_like(bank, n, device=device)
    src_lists = [s.to(device) for s in spread(bank.num_slots, n, repeats + 1)]
    dst_slots = torch.arange(n, dtype=torch.int32, device=device)
    dst_slots[:hits] = -1
    times = []
    for i, src_slots in enumerate(src_lists):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_indexed(bank, src_slots, dst_slots, config, programs)
        end.record()
        end.synchronize()
        if i:
            times.append(start.elapsed_time(end) / 1e3 / max(1, n - hits))
    del dst
    return min(times)


class GatherChoice(NamedTuple):
    config: tuple | None           # the gather kernel's launch shape (None: the kernel is unavailable)
    faster: bool                   # it beats one copy per tensor, host time included
    what: str                      # what was measured, for the log
    device_s: tuple[float, float] | None = None  # the config's device seconds per expert: full / prefetch grid


def choose_gather(bank: SlotBuffer, device: torch.device, prefetch_programs: int | None = None) -> GatherChoice:
    """How misses move: the gather kernel (`moeferry.ops.triton.slot_gather`) in the config
    that moves 16 experts soonest on a full grid (a step's own misses) plus on the prefetch's
    capped grid (`prefetch_programs`), among the configs that move the bytes exactly (a config
    that fails or moves them wrong is left out, and the log says so). Device time, by CUDA
    events: a single host-timed batch of 8 picked a slow config on one H200 boot (54 us an
    expert where the best moves one in 43 us; that server's decode reached 30 GB/s against 41 in
    the others). The host-managed path uses the config only where it is `faster` than one copy
    per tensor; steps that manage the cache on the device always need it."""
    from moeferry.ops.triton.slot_gather import CONFIGS
    if device.type != "cuda":
        return GatherChoice(None, False, "per-tensor copies (no CUDA)")
    timed, failed = {}, []
    for config in CONFIGS:
        problem = _gather_problem(bank, device, config)
        if problem:
            failed.append(f"{_name(config)}: {problem}")
            continue
        timed[config] = (time_gather(bank, device, config), time_gather(bank, device, config, prefetch_programs))
    if not timed:
        return GatherChoice(None, False, f"per-tensor copies (gather kernel unavailable: {'; '.join(failed)})")
    best = min(timed, key=lambda c: sum(timed[c]))
    gather_s = min(time_fetch(bank, device, gather=best) for _ in range(2))
    copy_s = min(time_fetch(bank, device) for _ in range(2))
    mib = bank.bytes_per_slot / 2**20
    grids = f"full grid / {prefetch_programs or 'full'} programs"
    what = (f"an expert ({mib:.2f} MiB) arrives in {_us(timed[best])} us ({grids}) by the gather kernel "
            f"({_name(best)}; " + ", ".join(f"{_name(c)} {_us(t)} us" for c, t in timed.items() if c != best)
            + f"); host-timed batches of 8: {gather_s * 1e6:.0f} us by the gather kernel, {copy_s * 1e6:.0f} us by "
            f"per-tensor copies" + (f"; left out: {'; '.join(failed)}" if failed else ""))
    use = gather_s < copy_s
    return GatherChoice(best, use, f"{'gather kernel' if use else 'per-tensor copies'}: {what}", timed[best])


def _us(times: tuple[float, float]) -> str:
    return " / ".join(f"{t * 1e6:.0f}" for t in times)


def _name(config: tuple) -> str:
    return f"{config[0]} words x {config[1]} warps{' (16-byte accesses)' if config[2] else ''}"


def _gather_problem(bank: SlotBuffer, device: torch.device, config: tuple) -> str | None:
    """Why the gather kernel in `config` cannot be used here (None: it moves 8 experts exactly)."""
    src = list(range(min(8, bank.num_slots)))[::-1]
    try:
        dst = SlotBuffer.allocate_like(bank, len(src), device=device)
        if dst.gather_launch(bank, config) is None:
            return "a slot tensor is not whole 32-bit words"
        dst.copy_slots(list(range(len(src))), bank, src, gather=config)
        _sync(device)
    except Exception as e:  # e.g. a device that cannot read pinned host memory from a kernel
        return f"{type(e).__name__}: {str(e)[:120]}"
    for m in ("gate_up", "down"):
        for name, t in getattr(dst, m).tensors().items():
            want = getattr(getattr(bank, m), name)[src]
            if not torch.equal(t.cpu().view(torch.uint8), want.view(torch.uint8)):
                return f"moved {m}.{name} wrong"
    return None


def time_cpu_expert(bank: SlotBuffer, tokens: int = 1, repeats: int = 3, experts: int = 8,
                    threads: int | None = None) -> float:
    """Seconds per expert to compute `experts` experts, each for `tokens` tokens, on the CPU from
    the bank in one call of the host lane (`SlotBuffer.run_host`, `threads` threads: PyTorch's by
    default), as a step does. Each call takes the next experts of the bank, so that their weights
    come from memory as a miss's do."""
    experts = min(experts, bank.num_slots)
    x = torch.randn(tokens, bank.hidden)
    w = torch.full((tokens, experts), 1.0 / experts)
    times = []
    for call in range(repeats + 1):  # the first call builds or loads the kernel
        chosen = [(call * experts + j) % bank.num_slots for j in range(experts)]
        ids = torch.tensor(chosen).expand(tokens, experts)
        t = time.perf_counter()
        bank.run_host(x, ids, w, chosen, threads or torch.get_num_threads())
        times.append(time.perf_counter() - t)
    return sorted(times[1:])[repeats // 2] / experts


# What running a decode step's MoE layer through the CPU lane costs beyond the split itself: the
# piecewise step's two cuts (the host waits for the router's choices, launches three graphs where
# the device-managed step launches one) and the host-managed cache's waits for the prefetch.
# Measured (H100, 24-layer bf16 checkpoint, 1200 slots, hybrid against offload in one run): b1
# 27.6 ms a step piecewise against 21.45 device-managed, 256 us a layer more although the split was
# expected to save ~200 us a layer: ~450 us a layer (benchmarks/README.md, twenty-sixth session).
# Another H100 host (twenty-eighth session, gather kernel 203 us an expert): b1 19.0 ms a step split
# against 32.2 unsplit, 550 us a layer saved where `saving` expects 920 (CPU 74 us): ~370 us a layer.
CUT_S = 450e-6
# What the CPU lane inside a decode graph costs a layer beyond the split itself (`moeferry.moe.cpu_lane`):
# its split and collect kernels and the host thread's round trip over the link's words, a few us each.
LANE_S = 20e-6


def expected_misses(batch: int, top_k: int, experts: int, cached: float) -> tuple[float, float]:
    """(misses, tokens each) of one MoE layer's decode step of `batch` rows under uniform routing:
    the distinct experts of batch * top_k picks among `experts`, of which a fraction `cached` hit."""
    distinct = experts * (1 - (1 - 1 / experts) ** (batch * top_k))
    return distinct * (1 - min(1.0, cached)), batch * top_k / distinct


@dataclass(frozen=True)
class MissSplit:
    """Fetch n of a step's M misses and compute the rest on the CPU, with n chosen so both
    lanes finish together: n * fetch_s ~ (M - n) * cpu_s (the experts with most tokens are
    fetched first: they cost the CPU most)."""
    fetch_s: float       # one expert over PCIe
    cpu_s: float         # one expert for one token on the CPU
    max_fetch: int | None = None
    cpu_token_s: float | None = None  # each further token of an expert on the CPU (None: cpu_s)
    # one expert as a decode graph that does not split fetches it: the gather kernel's device time
    # where the device manages the cache (on some hosts it reads pinned memory at ~30 GB/s where
    # copies run at ~50); None: fetch_s
    graph_fetch_s: float | None = None

    @classmethod
    def measure(cls, backend, max_fetch: int | None, threads: int | None = None) -> "MissSplit":
        """The lanes as the backend runs them: a fetch the way its caches fetch (the gather kernel
        where the boot chose it, `backend.gather`, else one copy per tensor); and a fetch the way
        device-managed decode graphs make it (`backend.gather_kernel_s`, timed by the boot); the
        CPU lane with `threads` threads (PyTorch's by default)."""
        bank = next(iter(backend.banks.values()))
        one, four = time_cpu_expert(bank, 1, threads=threads), time_cpu_expert(bank, 4, threads=threads)
        graph = backend.gather_kernel_s if backend.device_managed else None
        return cls(time_fetch(bank, backend.device, gather=backend.gather), one, max_fetch,
                   max(0.0, (four - one) / 3), graph)

    def fastest(self, other: "MissSplit") -> "MissSplit":
        """Each lane's faster time of two measurements of the same machine (the boot measures at
        each `finish`): other work at boot only slows a lane (measured: the CPU lane at 1363 us an
        expert while the boot's kernels compiled, 130-160 us before and after)."""
        def least(a, b):
            return b if a is None else a if b is None else min(a, b)
        return MissSplit(min(self.fetch_s, other.fetch_s), min(self.cpu_s, other.cpu_s), other.max_fetch,
                         least(self.cpu_token_s, other.cpu_token_s), least(self.graph_fetch_s, other.graph_fetch_s))

    @property
    def further_token_s(self) -> float:
        """Each token of an expert after its first, on the CPU."""
        return self.cpu_s if self.cpu_token_s is None else self.cpu_token_s

    def cpu_cost(self, tokens: int) -> float:
        """Seconds for one expert of `tokens` tokens on the CPU (the weights are read once)."""
        return self.cpu_s + max(0, tokens - 1) * self.further_token_s

    def fetch_count(self, cpu_costs: list[float], queued: int = 0) -> int:
        """How many of the misses (CPU cost of each, most expensive first) to fetch, the link
        also carrying `queued` other experts before the next layer can use it (the decode
        prefetch's copies, which the next layer waits for)."""
        m = len(cpu_costs)
        best_n, best_t = m, math.inf  # (of equal times, the fewest fetches)
        rest = sum(cpu_costs)
        for n in range(m + 1):
            t = max((queued + n) * self.fetch_s, rest)
            if t < best_t:
                best_n, best_t = n, t
            if n < m:
                rest -= cpu_costs[n]
        if self.max_fetch is not None:
            best_n = min(best_n, self.max_fetch)
        return best_n

    def fetch_table(self, most: int, tokens: float = 1.0, queued: int = 0) -> list[int]:
        """`fetch_count` for each count of misses from 0 to `most`, each miss of `tokens` tokens:
        the table a decode graph's split reads on the device (`moeferry.moe.cpu_lane`). All counts
        at once (the lane retunes it while serving): the later lane's time for n of m fetched, the first
        minimum of each row (the fewest fetches among equal times)."""
        cost = self.cpu_cost(round(tokens))
        m = torch.arange(most + 1, dtype=torch.float64)
        n = m[None, :]
        lasts = torch.maximum((queued + n) * self.fetch_s, (m[:, None] - n) * cost)  # the later lane's time
        best = torch.where(n <= m[:, None], lasts, math.inf).argmin(dim=1)
        if self.max_fetch is not None:
            best = best.clamp(max=self.max_fetch)
        return best.tolist()

    def with_cpu_observed(self, busy_s: float, experts: int, pairs: int) -> "MissSplit":
        """This split with the CPU lane's time an expert taken from what the lane was seen to do:
        `busy_s` computing `experts` experts of `pairs` (token, expert) pairs, each further token at
        `further_token_s` (the time a call costs beyond its experts, e.g. its threads' start, spread
        over them)."""
        cpu_s = (busy_s - (pairs - experts) * self.further_token_s) / experts
        return replace(self, cpu_s=max(cpu_s, 1e-7))

    def saving(self, misses: int, tokens: float = 1.0) -> float:
        """Seconds the split saves a layer against fetching all its `misses` (`tokens` each) as
        a graph that does not split does (`graph_fetch_s`)."""
        costs = [self.cpu_cost(round(tokens))] * misses
        n = self.fetch_count(costs)
        alone = self.fetch_s if self.graph_fetch_s is None else self.graph_fetch_s
        return misses * alone - max(n * self.fetch_s, sum(costs[n:]))

    def lanes_from(self, misses, cut_s: float = CUT_S, most: int = 1024) -> float:
        """The smallest decode batch whose expected misses a layer (`misses(batch)`: (misses,
        tokens each), `expected_misses`) the split saves more time on than its cuts cost (`cut_s`
        a layer); smaller batches fetch every miss, as offload does. inf when none up to `most`."""
        for batch in range(1, most + 1):
            m, tokens = misses(batch)
            if self.saving(round(m), tokens) > cut_s:
                return batch
        return math.inf

    def divide(self, misses: list[int], ids: torch.Tensor, queued: int = 0) -> tuple[list[int], list[int]]:
        """(experts to fetch, experts for the CPU); `queued`: see `fetch_count`."""
        counts = torch.bincount(ids.reshape(-1).cpu(), minlength=max(misses) + 1)
        order = sorted(misses, key=lambda e: -int(counts[e]))
        n = self.fetch_count([self.cpu_cost(int(counts[e])) for e in order], queued)
        return order[:n], order[n:]

    def describe(self) -> str:
        ratio = self.fetch_s / self.cpu_s if self.cpu_s else math.inf
        cap = f", at most {self.max_fetch} fetches per layer" if self.max_fetch is not None else ""
        return (f"fetch {self.fetch_s * 1e6:.0f} us/expert, CPU {self.cpu_s * 1e6:.0f} us/expert "
                f"+ {self.further_token_s * 1e6:.0f} us a further token "
                f"(a fetch costs {ratio:.2f} CPU experts){cap}"
                + (f"; a graph that does not split fetches one in {self.graph_fetch_s * 1e6:.0f} us (gather kernel)"
                   if self.graph_fetch_s is not None else ""))
