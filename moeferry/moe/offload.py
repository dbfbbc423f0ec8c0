"""Offloaded experts: pinned host banks, a device cache of expert slots, and three ways to
serve a miss.

    offload   copy the miss host -> slot (LRU or LFU eviction); big prefill chunks stream the layer's
              non-cached experts through a double-buffered staging area instead, so prefill
              never flushes the decode cache
    cpu       compute the miss on the CPU from its bank (the cache holds what the boot fill put there;
              a prefill chunk's misses stream through the staging area)
    hybrid    per decode step, fetch some misses and compute the rest on the CPU, split so both lanes
              finish together (bandwidths measured at boot, `moeferry.moe.bandwidth`); prefill
              chunks fetch or stream every miss, as offload's

The CPU lane is `SlotBuffer.run_host` (the C kernel of `moeferry.ops.cpu`). `--moe-cpu-layers`
(offload, cpu) gives layers no device slots: they decode on the CPU and stream their prefill.

Per layer and step: the router's expert ids come to the host (one sync: the cache is managed
on the host), hits run from their slots in place, misses go to their lane, and the layer's MoE
kernel waits only for its own copies. Decode prefetch (offload, hybrid on CUDA): the next MoE layer's
router applied to this layer's input predicts its experts (read back in the same sync), and the
predicted misses are copied on a copy stream while this layer computes; the next layer waits
for those copies before it touches the cache. On a CPU-only machine the "device" is the CPU too:
copies are memcpy and the kernels are the CPU references, so CI runs the same cache logic.

CUDA graphs: a cache holding every expert reads nothing on the host, so decode is captured
whole. A partial cache of the offload lane is managed on the device during decode graphs
where it can be (`graph_mode` "device": the gather kernel works and every cache holds two steps'
experts, three for LFU): each layer's lookup, eviction and table update is one kernel
(`moeferry.moe.device_policy`), its misses one gather launch from the pinned bank, the next layer's
predicted experts are resolved the same way and gathered on the copy stream while this layer
computes; the whole step is one graph and the host only replays it. Otherwise the step is
captured piecewise: while `capturing` is set (`moeferry.engine.cuda_graph`), each layer cuts
the step after its router, and its host part (read the ids, fetch the misses, start the
prefetch) runs between two graphs at replay. cpu and the slotless layers are captured
piecewise at any cache size, cut twice a layer: the host computes the CPU lane at the second
cut, while the graph between the two (queued, not waited for) runs the cached experts. hybrid
is too from the decode batch its split is expected to pay at (`lanes_from`, from the lanes
measured at boot and `bandwidth.CUT_S`); smaller batches fetch every miss, as offload does.
"""
from __future__ import annotations

import logging
import math
from typing import Callable, NamedTuple

import torch

from moeferry.moe.bank import build_bank, pinnable, plan_loading
from moeferry.moe.cpu_lane import CpuLane
from moeferry.moe.cpu_layers import resolve as resolve_cpu_layers
from moeferry.moe.expert_cache import ExpertCache, LayerCounters
from moeferry.moe.layer_experts import LayerExperts
from moeferry.moe.placement import Placement
from moeferry.moe.resident import use_kernels
from moeferry.moe.slots import SlotBuffer
from moeferry.ops.cpu.experts import kernel as cpu_kernel
from moeferry.ops.moe import route_topk
from moeferry.ops.triton import num_sms
from moeferry.ops.triton.specialization import kernel_signature
from moeferry.transfer import staged, to_device

log = logging.getLogger("moeferry.moe")

STAGING_SLOTS = 32  # slots per staging half (prefill streams a layer's misses in chunks of this)
LANE_ROWS = 8  # hybrid decode graphs of up to this many sequences split on the device (`cpu_lane`)
RETUNE_EXPERTS = 1024  # experts the CPU lane computes between two retunings of its split (`_retune_lane`)


def choices(ids: torch.Tensor, guess: torch.Tensor | None) -> torch.Tensor:
    """A step's expert ids and the guess for the next layer's, flattened one after the other
    (read back in one copy)."""
    return ids.reshape(-1) if guess is None else torch.cat([ids.reshape(-1), guess.reshape(-1)])


def split_choices(flat: list[int], first: int, each: int, guessed: int, width: int) -> tuple[list[int], list[int]]:
    """(the sorted distinct ids among the step's first `first` choices, the distinct ids among
    the guess's first `guessed`, rank-major: every row's best guess first (rows of `width`, which
    may be wider or narrower than the step's top-k: `prefetch_width`)), from `choices` read back
    (the step's `each` choices first)."""
    first, rows = min(first, each), min(guessed, len(flat) - each) // width if width else 0
    guess = [flat[each + r * width + j] for j in range(width) for r in range(rows)]
    return sorted(set(flat[:first])), list(dict.fromkeys(guess))


def distinct_experts(ids: torch.Tensor, guess: torch.Tensor | None = None) -> tuple[list[int], list[int]]:
    """The sorted distinct expert ids of a step and of a guess for the next layer (one host sync):
    a decode step's few ids are read back as they are (cheaper than a unique kernel), a prefill
    chunk's are made unique first."""
    if guess is not None:
        return split_choices(choices(ids, guess).tolist(), ids.numel(), ids.numel(), guess.numel(), guess.shape[-1])
    if ids.numel() <= 256:
        return sorted(set(ids.reshape(-1).tolist())), []
    return torch.unique(ids).tolist(), []


def prefetch_programs(device: torch.device) -> int | None:
    """The device-managed prefetch gather's grid: a quarter of the SMs (None off CUDA)."""
    if device.type != "cuda":
        return None
    return max(1, num_sms(device) // 4)


class Landing(NamedTuple):
    """A device-managed prefetch in flight: its gather's event on the copy stream and the
    tensors that gather reads (kept alive until the compute stream has waited for it)."""
    copies: torch.cuda.Event
    reads: tuple


def _join(landing: Landing | None) -> None:
    """The compute stream waits for a prefetch's gather on the copy stream."""
    if landing is not None:
        torch.cuda.current_stream().wait_event(landing.copies)


Beside = Callable[[], tuple]  # the shared expert's gated term: (gate, value), added as out + gate * value


def _with_shared(out: torch.Tensor, shared: tuple | None) -> torch.Tensor:
    return out if shared is None else torch.addcmul(out, *shared)


class SideWork:
    """Work forked from the compute stream onto a side stream (None: in line), joined by the
    compute stream (`join`) before it uses the results or frees what the work reads."""

    def __init__(self, stream: "torch.cuda.Stream | None"):
        self.stream, self._scope = stream, None

    def __enter__(self) -> "SideWork":
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())
            self._scope = torch.cuda.stream(self.stream)
            self._scope.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._scope is not None:
            self._scope.__exit__(*exc)
            self._scope = None

    def before(self, stream: "torch.cuda.Stream") -> None:
        """`stream` waits for the side work queued so far."""
        if self.stream is not None:
            stream.wait_stream(self.stream)

    def join(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)


class OffloadBackend:
    """Expert backends `offload`, `cpu` and `hybrid` (the `name` says which lane misses take)."""

    takes_shared = False  # the shared expert stays a dense MLP (a cache slot would be evictable)
    capturing = None  # the decode step being captured (set by DecodeGraphs): layers cut it at their host part

    def __init__(self, cfg, spec, device: torch.device, dtype: torch.dtype, name: str = "offload"):
        self.cfg, self.spec, self.device, self.dtype, self.name = cfg, spec, device, dtype, name
        self.kernels = use_kernels(device)
        self.banks: dict[int, SlotBuffer] = {}
        self.placement: Placement | None = Placement()  # while loading: the banks' copy templates
        self.groups: dict[tuple, list[int]] = {}      # slot layout -> layers
        self.caches: dict[int, ExpertCache] = {}      # layer -> its group's cache
        self.staging: dict[tuple, SlotBuffer] = {}
        self.executors: dict[int, OffloadExperts] = {}
        self.load_threads = 1
        self.split = None                             # hybrid: MissSplit, measured in finish()
        self.gather: tuple | None = None              # host-managed misses by the gather kernel in this config (when faster)
        self.gather_kernel: tuple | None = None       # the gather kernel's config if it works here (device-managed steps)
        self.gather_kernel_s: float | None = None     # its device seconds an expert on a full grid (boot-timed)
        self.gathers_ready = False                    # every (bank, cache) pair has its gather made (`_bind`)
        self.device_managed = True                    # graphs manage a partial cache on the device where they can
        self.prefetch_join: Landing | None = None     # a device-managed prefetch in flight, joined by the next layer
        # device-managed prefetch: its gather's grid capped (the copies need few programs in
        # flight to fill the link; a full grid would hold every SM from the compute it
        # overlaps), and joined only before the layer's MoE runs (its own misses gathered first)
        self.prefetch_programs = prefetch_programs(device)
        self._prefetch_gather: tuple | None = None  # the prefetch gather's own config (None: gather_kernel's)
        # The decode prefetch guesses the next layer's `prefetch_width` best experts a row (by default
        # the top-k: --moe-prefetch-width) and copies at most `prefetch_budget` of them a row, the best
        # ranked of those not cached (by default a quarter of the top-k: --moe-prefetch-budget): a wrong
        # guess is link time, a missed one is gathered with its layer. Measured (H100, full-depth
        # mixed_nvfp4, 3600 of 10240 slots, uniform routing, back-to-back decode graphs): the best 4
        # copied whole 130.5 / 144.3 tok/s at b1 / b4, the best 8 copied 2 a row 137.4 / 155.2 with 2%
        # fewer bytes a token; the best 8 copied whole 85.8 / 98.6 against the best 4's 91.4 / 115.7
        # in an earlier sync-loop run (benchmarks/README.md)
        self.prefetch_width: int = cfg.moe_prefetch_width or spec.top_k
        self.prefetch_budget: int = cfg.moe_prefetch_budget or max(1, spec.top_k // 4)
        self.join_late = True
        self.prefetch_first = False  # device-managed: the next layer's prefetch started before this layer's own gather
        self.transfer_chosen = False
        # --moe-cpu-layers as model layer ids, resolved now: a spec the model cannot take fails before loading
        moe_layers = [i for i in range(spec.num_layers) if spec.is_moe_layer(i)]
        self.cpu_layers = {moe_layers[i] for i in resolve_cpu_layers(cfg.moe_cpu_layers, len(moe_layers))}
        if self.cpu_layers:
            log.info("MoE layers on the CPU (no device slots; decode experts computed on the CPU): %s",
                     sorted(self.cpu_layers))
        self.streamed = LayerCounters()               # prefill chunks of the layers without slots, through staging
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # device-managed steps: the next layer's guess and placement and the shared expert run on
        # a side stream while the layer's own misses are gathered on the compute stream. Measured
        # (H100, full-depth mixed_nvfp4, 3600 of 10240 slots, uniform routing): b1 92.3 -> 99.2
        # tok/s, b4 119.4 -> 121.7 against the same work in line
        self.side_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.work_aside = True
        self.own_programs: int | None = None  # device-managed: the own gather's grid cap (None: full)
        # decode prefetch: the lanes that fetch (offload, hybrid), and only where copies can overlap compute
        self.prefetch = cfg.moe_decode_prefetch and name in ("offload", "hybrid") and device.type == "cuda"
        # the smallest decode batch whose misses may take the CPU lane (hybrid: measured in finish())
        self.lanes_from: float = math.inf if name == "offload" else 1
        # hybrid on CUDA: the CPU lane of decode graphs that stay whole (`open_lane`), and its table
        # of fetches per miss count for each batch up to its rows ([rows + 1, rows * top_k + 1])
        self.lane: CpuLane | None = None
        self.lane_fetches: torch.Tensor | None = None
        self.lane_batches: frozenset[int] = frozenset()  # the decode batches the lane takes
        self._lane_seen = None     # the lane's counters at its last retuning
        self._lane_staged = None   # the table last written: (it, its copy's event, its pinned staging)
        self._lane_retuned = False  # (the first retuning is logged at info, later ones at debug)
        self.prefetch_done: torch.cuda.Event | None = None  # the copies of the prefetch in flight
        if cfg.moe_cpu_threads:
            torch.set_num_threads(cfg.moe_cpu_threads)

    # -- loading ----------------------------------------------------------------------------
    def prepare(self, bank_bytes: int, layer_bytes: int) -> None:
        """Before the first layer: refuse if the banks cannot fit in host RAM; pick readers."""
        self.load_threads = plan_loading(bank_bytes, layer_bytes, self.cfg.expert_load)

    def add_layer(self, layer: int, experts: LayerExperts):
        self.banks[layer] = build_bank(experts, pinnable(self.device), self.placement)
        self.groups.setdefault(self._layout(self.banks[layer]), []).append(layer)
        self.executors[layer] = OffloadExperts(self, layer)
        return self.executors[layer]

    def decode_targets(self) -> list:
        """Each device cache's slot buffer with one of its layers' rows, for the warm-up's choice
        of MoE path (`moe.path_choice`); the staging area serves prefill chunks, not decode."""
        from moeferry.moe.path_choice import DecodeTarget
        if not self.kernels:
            return []
        first = {id(c): layer for layer, c in sorted(self.caches.items(), reverse=True)}
        return [DecodeTarget(c.buffer, c.row(first[id(c)])) for c in self.distinct_caches]

    def link_routers(self, routers: dict) -> None:
        """Each MoE layer's executor gets the next MoE layer's router (to predict its experts)."""
        order = sorted(routers)
        for layer, nxt in zip(order, order[1:]):
            self.executors[layer].next_router = routers[nxt]
            self.executors[layer].next = self.executors[nxt]

    @property
    def complete(self) -> bool:
        """Every layer's cache holds all its experts: then no step reads expert ids on the host
        and CUDA graphs can capture decode, as with resident experts."""
        return len(self.caches) == len(self.banks) > 0 and all(c.complete for c in self.distinct_caches)

    def graph_mode(self, max_batch: int) -> str | None:
        """How CUDA graphs can capture a decode step of up to `max_batch` sequences: "whole"
        when every expert is cached; for the offload lane on CUDA, "device" when the device can
        manage the cache (`steps_on_device`), else "piecewise" when every cache holds a step's
        whole working set (max_batch x top_k experts: nothing is left over to stream, which a
        graph could not); "piecewise" for cpu and hybrid on CUDA (their CPU lane runs at each MoE
        layer's cut, which also takes the misses no slot is left for); None otherwise."""
        if self.complete:
            return "whole"
        if self.device.type != "cuda":
            return None
        if self.steps_on_device(max_batch):
            return "device"
        if max_batch >= self.lanes_from:
            return "piecewise"
        if not self.caches:
            return None
        return "piecewise" if self.name != "offload" or self._holds(max_batch, lambda c: 1) else None

    def steps_on_device(self, rows: int) -> bool:
        """Whether decode steps of `rows` sequences in a graph manage the cache on the device:
        the offload lane (hybrid: below its `lanes_from`, or with its CPU lane in the graph:
        `lane_takes`), the gather kernel working here (or the CPU, in tests), and every cache
        holding its policy's `graph_steps` decode steps' experts: two for LRU (a step's own are
        never victims then, nor, while its prefetch places the next layer's, this layer's),
        three for LFU (its victims may be any slot outside the two calls it keeps: `cache_resolve`)."""
        kernel = self.gathers_ready or self.device.type == "cpu"
        return (self.device_managed and (rows < self.lanes_from or self.lane_takes(rows)) and kernel
                and bool(self.caches) and self._holds(rows, lambda c: c.policy.graph_steps))

    def lane_takes(self, rows: int) -> bool:
        """Whether a device-managed decode step of `rows` sequences splits its misses with the
        CPU lane in the graph (`moeferry.moe.cpu_lane`): the batches whose expected misses the
        split saves more time on than the lane costs a layer (`open_lane`)."""
        return rows in self.lane_batches

    def open_lane(self, rows: int = LANE_ROWS) -> None:
        """hybrid: start the CPU lane of decode graphs of up to `rows` sequences (once) and make its
        table of fetches for this cache: for each batch, the split's choice for every count of
        misses, each miss of the batch's expected tokens, the link also carrying the decode
        prefetch's expected copies (the next layer waits for them)."""
        if self.lane is None:
            banks = {layer: self.banks[layer] for layer in sorted(self.caches)}
            self.lane = CpuLane(banks, rows, self.spec.top_k, self.device, self.lane_threads())
            log.info("CPU lane in the decode graphs: a host thread serves %d layers' boxes of up to %d rows "
                     "with %d OpenMP threads", len(banks), rows, self.lane.threads)
        from moeferry.moe.bandwidth import LANE_S
        batches = {b for b in range(1, self.lane.rows + 1) if self.split.saving(*self._rounded(b)) > LANE_S}
        self.lane_batches = frozenset(batches)
        table = self._lane_table()
        self.lane_fetches = table.to(self.device)
        self._lane_staged = (table, None, None)
        self._lane_seen = self.lane.counts()

    def _rounded(self, batch: int) -> tuple[int, float]:
        misses, tokens = self._expected_misses(batch)
        return round(misses), tokens

    def _lane_table(self) -> torch.Tensor:
        """The lane's fetches for each batch and count of misses ([rows + 1, rows * top_k + 1]): the
        split's choice, each miss of the batch's expected tokens, the link also carrying the decode
        prefetch's expected copies."""
        table = torch.zeros(self.lane.rows + 1, self.lane.rows * self.spec.top_k + 1, dtype=torch.int32)
        for batch in range(1, self.lane.rows + 1):
            queued = self.prefetch_budget * batch * (1 - self._cached_share()) if self.prefetch else 0.0
            table[batch] = torch.tensor(self.split.fetch_table(table.shape[1] - 1, self._rounded(batch)[1],
                                                               round(queued)))
        return table

    def _retune_lane(self) -> None:
        """Every `RETUNE_EXPERTS` experts the lane computed: the split's CPU time an expert from what
        the lane's thread was seen to take (the boot's timing runs beside the boot's other work, and
        in a graph the lane competes with the link for host memory), and its table rewritten where
        that changes it (copied on the stream, after the graph in flight)."""
        now, seen = self.lane.counts(), self._lane_seen
        experts = now.experts - seen.experts
        if experts < RETUNE_EXPERTS:
            return
        self._lane_seen = now
        self.split = self.split.with_cpu_observed(now.busy_s - seen.busy_s, experts, now.pairs - seen.pairs)
        table, (last, copied, _) = self._lane_table(), self._lane_staged
        if torch.equal(table, last):
            return
        if copied is not None:
            copied.synchronize()  # (long done: the last table's staging buffer is free again)
        if self.device.type == "cuda":
            staging = table.pin_memory()
            self.lane_fetches.copy_(staging, non_blocking=True)
            self._lane_staged = (table, torch.cuda.current_stream().record_event(), staging)
        else:
            self.lane_fetches.copy_(table)
            self._lane_staged = (table, None, None)
        (log.debug if self._lane_retuned else log.info)(
            "hybrid lanes retuned from the CPU lane's work (%d experts in %.1f ms): %s", experts,
            (now.busy_s - seen.busy_s) * 1e3, self.split.describe())
        self._lane_retuned = True

    def _try_lane(self) -> None:
        """`open_lane`, or the reason it cannot open in the log (no C expert kernel, or its C
        thread could not be built or started): decode graphs then split at the CPU lane's cuts."""
        try:
            self.open_lane()
        except OSError as e:
            log.warning("CPU lane inside the decode graphs unavailable (%s); hybrid decode graphs split their "
                        "misses at the cuts instead", e)

    def lane_threads(self) -> int:
        """The CPU lane's OpenMP threads: --moe-cpu-threads, else all but one of PyTorch's (the
        main thread waits on the device meanwhile, spinning)."""
        return self.cfg.moe_cpu_threads or max(1, torch.get_num_threads() - 1)

    def _holds(self, rows: int, steps: Callable[[ExpertCache], int]) -> bool:
        """Every cache has slots for `steps(cache)` decode steps' experts of `rows` sequences."""
        per_row = max(self.spec.top_k, self.prefetch_width)  # a wider guess places (stamps) more a step
        return all(c.num_slots >= steps(c) * rows * per_row for c in self.distinct_caches)

    def before_graph(self, rows: int) -> None:
        """Before a decode graph of `rows` sequences runs (or is captured): hand each cache's
        state to the device if the graph manages it there."""
        self.prefetch_join = None  # (an event of an earlier, failed capture is never waited for)
        if self.lane is not None:
            self.lane.check()
            if self.lane_batches:
                self._retune_lane()
        if not self.complete and self.steps_on_device(rows):
            self.settle()
            for c in self.distinct_caches:
                c.on_device()

    def settle(self) -> None:
        """Wait (host) for the prefetch in flight: its table copy reads the host table."""
        if self.prefetch_done is not None:
            self.prefetch_done.synchronize()
            self.prefetch_done = None

    def graph_failed(self) -> None:
        """A decode graph's check run or capture failed part-way: a device-managed layer may
        have placed experts whose copies never ran, so every cached expert is copied again
        from its bank (the state back on the host first)."""
        self.prefetch_join = None
        for c in self.distinct_caches:
            if c.on_device_state is not None:
                c.reload(self.banks)

    def place_ahead(self, nxt: "OffloadExperts", guess: torch.Tensor) -> tuple:
        """Device-managed: `nxt`'s predicted experts ([rows, width], best first) placed in its
        cache (on the stream the cache's state is ordered on: the compute stream, or the side
        stream forked from it after this layer's own placement), at most `prefetch_budget` misses
        a row, best ranked first over the rows; (guess, their slots) for `gather_ahead`."""
        flat = guess.t().reshape(-1)  # rank-major: every row's best guess first
        return flat, nxt.cache.resolve(nxt.layer, flat, prefetch=True, budget=self.prefetch_budget * guess.shape[0])

    def gather_ahead(self, nxt: "OffloadExperts", placed: tuple, side: "SideWork") -> None:
        """Device-managed: gather `placed` on the copy stream, after what the compute stream and
        the side stream have queued so far; the next layer joins them (`take_prefetch`)."""
        stream = self.copy_stream
        if stream is None:  # in line (the CPU in tests): nothing to leave SMs to
            nxt.cache.buffer.copy_indexed(nxt.bank, *placed, self.prefetch_gather)
            return
        stream.wait_stream(torch.cuda.current_stream())
        side.before(stream)
        with torch.cuda.stream(stream):
            nxt.cache.buffer.copy_indexed(nxt.bank, *placed, self.prefetch_gather, self.prefetch_programs)
            # the slot lists stay referenced until the join: the copy stream reads them all along,
            # and memory freed earlier could be handed to the compute stream's next tensors
            self.prefetch_join = Landing(stream.record_event(), placed)

    def side_work(self) -> "SideWork":
        """Work of a device-managed layer that its own gather need not wait for, on the side
        stream where there is one and `work_aside` is on (else in line)."""
        return SideWork(self.side_stream if self.work_aside else None)

    def take_prefetch(self) -> "Landing | None":
        """The prefetch in flight for the layer about to run, now this layer's to join."""
        landed, self.prefetch_join = self.prefetch_join, None
        return landed

    @staticmethod
    def _layout(buf: SlotBuffer) -> tuple:
        return (buf.kernel.name,) + tuple((k, tuple(t.shape[1:]), t.dtype) for k, t in buf.named_tensors())

    # -- sizing -----------------------------------------------------------------------------
    @property
    def experts_total(self) -> int:
        return sum(b.num_slots for b in self.banks.values())

    @property
    def slot_bytes(self) -> int:
        """Bytes of one device slot (the largest layout when formats are mixed)."""
        return max(b.bytes_per_slot for b in self.banks.values())

    @property
    def staging_bytes(self) -> int:
        """The prefill staging area: two halves of STAGING_SLOTS slots per slot layout."""
        return sum(2 * STAGING_SLOTS * self.banks[layers[0]].bytes_per_slot for layers in self.groups.values())

    def requested_slots(self) -> int | None:
        """Slots the flags ask for (None: the memory plan decides, --moe-cache-auto)."""
        if self.cfg.moe_cache_size is not None:
            return min(self.cfg.moe_cache_size, self.experts_total)
        if self.cfg.moe_cache_rate is not None:
            return max(1, math.ceil(round(self.cfg.moe_cache_rate * self.experts_total, 6)))
        return None

    def probe_slots(self) -> int:
        """A small cache (one slot per layer) for the memory probe, before the plan sizes it."""
        return len(self.banks)

    def finish(self, expert_slots: int | None = None) -> None:
        """Allocate the device cache (`expert_slots` in all, split over layout groups by layer
        count; the `--moe-cpu-layers` get none), the staging area, fill the cache evenly, and
        (hybrid) measure the lanes."""
        total = expert_slots if expert_slots is not None else self.requested_slots()
        if total is None:
            raise ValueError("the offload backend needs an expert slot count (--moe-cache-size / -rate / -auto)")
        self.placement = None  # loading is over (its templates hold the checkpoint's index)
        self.settle()
        self._release_device()
        if not self.transfer_chosen:  # before the cache takes the device's memory
            self._choose_transfer()
        cached_layers = {k: [x for x in v if x not in self.cpu_layers] for k, v in self.groups.items()}
        n_layers = sum(len(v) for v in cached_layers.values()) or 1
        for key, layers in self.groups.items():
            first = self.banks[layers[0]]
            self.staging[key] = SlotBuffer.allocate_like(first, 2 * STAGING_SLOTS, device=self.device)
            if not cached_layers[key]:
                continue
            slots = max(1, total * len(cached_layers[key]) // n_layers)
            cache = ExpertCache(SlotBuffer.allocate_like(first, slots, device=self.device), cached_layers[key],
                                first.num_slots, self.cfg.moe_cache_policy)
            cache.gather = self.gather if self.name != "cpu" else None
            cache.fill(self.banks)
            for layer in cached_layers[key]:
                self.caches[layer] = cache
        self._bind()
        if self.complete:
            log.info("expert cache holds every expert: steps read nothing on the host (decode graphs allowed)")
        if self.name in ("cpu", "hybrid") or self.cpu_layers:
            cpu_kernel()  # built (or found) at boot, not in a request; its log line says what computes the lane
        if self.name == "hybrid":
            from moeferry.moe.bandwidth import MissSplit
            cuda = self.device.type == "cuda"
            split = MissSplit.measure(self, self.cfg.moe_hybrid_max_fetch, self.lane_threads() if cuda else None)
            self.split = split if self.split is None else self.split.fastest(split)  # (finish() runs more than once)
            self.lanes_from = self.split.lanes_from(self._expected_misses)
            if cuda and self.caches:
                self._try_lane()
            log.info("hybrid lanes: %s; %s", self.split.describe(), self._lanes_said())

    def _expected_misses(self, batch: int) -> tuple[float, float]:
        """A MoE layer's expected (misses, tokens each) in a decode step of `batch` rows, its
        cache's share of slots hit (uniform routing: the decode prefetch's hits come on top)."""
        from moeferry.moe.bandwidth import expected_misses
        return expected_misses(batch, self.spec.top_k, self.spec.num_experts, self._cached_share())

    def _cached_share(self) -> float:
        """The share of a layer's experts its cache has slots for (the first cache's)."""
        caches = self.distinct_caches
        if not caches:
            return 1.0
        return caches[0].num_slots / len(caches[0].layers) / self.spec.num_experts

    def _lanes_said(self) -> str:
        """Which decode steps split their misses: the graphs of the batches the CPU lane takes on
        the device (`lane_batches`); the other graphs by `lanes_from` (a CPU lane at the cuts cuts a
        graph at every MoE layer); a step run eagerly reads its choices on the host anyway and
        splits at any batch."""
        if self.device.type != "cuda":
            return "every decode step splits its misses (no graphs here)"
        lane = (f"decode graphs of {', '.join(map(str, sorted(self.lane_batches)))} sequences split their misses "
                "on the device, the CPU lane's thread computing its share while the graph runs; other decode "
                "graphs: ") if self.lane_batches else ""
        if self.lanes_from == 1:
            cuts = "every decode graph splits its misses at the CPU lane's cuts"
        elif math.isinf(self.lanes_from):
            cuts = ("no decode graph's batch is expected to save more than the CPU lane's cuts cost: graphs fetch "
                    "every miss, as offload does; eager steps split")
        else:
            cuts = (f"decode graphs of fewer than {self.lanes_from} sequences fetch every miss, as offload does (the "
                    "split's expected saving there is below what the CPU lane's cuts cost); larger ones and eager "
                    "steps split")
        return lane + cuts

    def _choose_transfer(self) -> None:
        """Decode misses move by the one-launch gather kernel or by copies: measured, the faster kept."""
        from moeferry.moe.bandwidth import choose_gather
        self.gather_kernel, faster, what, device_s = choose_gather(next(iter(self.banks.values())), self.device,
                                                                   self.prefetch_programs)
        self.gather_kernel_s = device_s[0] if device_s else None
        self.gather = self.gather_kernel if faster else None
        self.transfer_chosen = True
        log.info("expert fetches: %s", what)

    def _release_device(self) -> None:
        """Drop an earlier cache and staging area (finish() called again, e.g. after the probe)."""
        if not self.caches and not self.staging:
            return
        self.caches.clear()
        self.staging.clear()
        for ex in self.executors.values():
            ex.cache = ex.staging = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def distinct_caches(self) -> list[ExpertCache]:
        """One cache per slot layout (`caches` maps each layer to its layout's cache)."""
        return list(dict.fromkeys(self.caches.values()))

    @property
    def expert_slots(self) -> int:
        return sum(c.num_slots for c in self.distinct_caches)

    @property
    def device_bytes(self) -> int:
        caches = sum(c.buffer.nbytes for c in self.distinct_caches)
        return caches + sum(b.nbytes for b in self.staging.values())

    @property
    def host_bytes(self) -> int:
        return sum(b.nbytes for b in self.banks.values())

    def refill(self) -> None:
        """Every cache back to its boot contents (`ExpertCache.refill`)."""
        self.settle()
        for c in self.distinct_caches:
            c.refill(self.banks)

    def shrink(self, num_slots: int) -> int:
        """Elastic shrink (the OOM guard): keep `num_slots` slots in all; returns bytes freed."""
        self.settle()
        caches = self.distinct_caches
        have = sum(c.num_slots for c in caches)
        freed = 0
        for c in caches:
            freed += c.shrink(max(1, num_slots * c.num_slots // max(have, 1)), self.banks)
        self._bind()
        return freed

    @property
    def prefetch_gather(self) -> tuple | None:
        """The device-managed prefetch's gather config: the boot's choice (`gather_kernel`) unless
        set apart. It shares the SMs with the compute it overlaps, which the boot's timing of the
        gather alone does not see (`quant_decode.py --orders` times configs in whole steps)."""
        return self._prefetch_gather or self.gather_kernel

    @prefetch_gather.setter
    def prefetch_gather(self, config: tuple | None) -> None:
        self._prefetch_gather = config
        self._bind()  # its gathers made now, not inside the next capture

    def _bind(self) -> None:
        """Executors to the current caches; each (bank, cache) gather made now, not inside a
        graph capture (it copies its descriptor to the device); `gathers_ready` if all could be."""
        ready = self.gather_kernel is not None
        configs = {self.gather_kernel, self.prefetch_gather} - {None}
        for ex in self.executors.values():
            ex.bind()
            if ex.cache is not None:
                ready &= all(ex.cache.buffer.gather_launch(ex.bank, c) is not None for c in configs)
        self.gathers_ready = ready

    def stats(self) -> dict:
        caches = self.distinct_caches
        total = LayerCounters()
        total.add(self.streamed)
        for c in caches:
            total.add(c.totals())  # once per cache: it folds the device's hit counts into the layers'
        policy = caches[0].policy.name if caches else self.cfg.moe_cache_policy
        return {"backend": self.name, "policy": policy, "slots": self.expert_slots,
                "slots_used": sum(c.slots_used for c in caches),
                "device_bytes": self.device_bytes, "host_bytes": self.host_bytes, **total.as_dict(),
                "cpu_experts": sum(ex.cpu_experts for ex in self.executors.values()) + total.on_lane,
                "layers": self._layer_stats(caches)}

    def _layer_stats(self, caches: list[ExpertCache]) -> dict:
        """Per layer: its cache counters (layers with slots) and the experts it computed on the CPU."""
        layers = {k: v for c in caches for k, v in c.layer_stats().items()}
        for layer, ex in sorted(self.executors.items()):
            lane = ex.cache.counters[layer].on_lane if ex.cache is not None else 0
            layers.setdefault(str(layer), {})["cpu_experts"] = ex.cpu_experts + lane
        return layers


class OffloadExperts:
    """One MoE layer's executor over the backend's bank, cache and staging area."""

    takes_beside = True  # the shared expert's term comes in (`__call__`'s `beside`), to run beside the gather

    def __init__(self, backend: OffloadBackend, layer: int):
        self.b, self.layer = backend, layer
        self.bank = backend.banks[layer]
        self.cache: ExpertCache | None = None
        self.staging: SlotBuffer | None = None
        self.cpu_experts = 0  # experts computed on the CPU so far
        self.next_router = self.next = None  # the next MoE layer's router and executor (link_routers)

    def bind(self) -> None:
        self.cache = self.b.caches.get(self.layer)
        key = OffloadBackend._layout(self.bank)
        self.staging = self.b.staging.get(key)

    @property
    def nbytes(self) -> int:
        return self.bank.nbytes

    def kernel_signature(self) -> tuple:
        """What this layer's launches depend on (`specialization.kernel_signature`): the backend's
        lanes, its bank's slot layout (its cache and staging area, when it has them, share it),
        its cache row (None: no cache) and staging area's presence, and the next layer it
        prefetches for (its router's shape and format; none, or one without slots: no prefetch)."""
        row = None if self.cache is None else kernel_signature(self.cache.row(self.layer))
        nxt = None if self.next is None or self.next.cache is None else kernel_signature(self.next_router)
        return "offload", self.b.name, OffloadBackend._layout(self.bank), row, self.staging is not None, nxt

    # -- the step ---------------------------------------------------------------------------
    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 beside: Beside | None = None) -> torch.Tensor:
        """The layer's experts for the step: from a complete cache (nothing can miss, nothing is
        read on the host), in a decode step whose cache the device manages (`_on_device`), in
        another captured one (`_captured`), or eagerly (`_eager`). `beside`: the shared expert's
        gated term, added to the experts' output (computed after them, or beside the layer's
        own gather where the device manages the cache)."""
        if self.cache is not None and self.cache.complete:
            self.cache.count_on_device(self.layer, ids)
            out = self._run_cached(x, ids, weights)
        else:
            ahead = self.b.prefetch and self.next is not None and x.shape[0] <= STAGING_SLOTS
            if self.b.capturing is None:
                out = self._eager(x, ids, weights, ahead)
            elif self.cache is not None and self.b.steps_on_device(x.shape[0]):  # (below hybrid's `lanes_from`)
                return self._on_device(x, ids, weights, ahead, beside)
            elif self.cache is None or self.b.name != "offload":
                out = self._cut_lanes(x, ids, weights, ahead)
            else:
                out = self._captured(x, ids, weights, ahead)
        return _with_shared(out, beside() if beside is not None else None)

    def _captured(self, x, ids, weights, ahead: bool) -> torch.Tensor:
        """A decode step being captured whose cache the host manages: one cut, whose host part
        reads the choices and fetches the misses (`_place`)."""
        guess = self._guess(x, ids) if ahead else None
        flat = choices(ids, guess)  # concatenated in the graph
        k, w = ids.shape[-1], guess.shape[-1] if guess is not None else 0
        self.b.capturing.cut(lambda rows: self._place(flat, rows, k, ids.numel(), w))
        return self._run_cached(x, ids, weights)

    def _eager(self, x, ids, weights, ahead: bool) -> torch.Tensor:
        """A step run eagerly: the host reads the choices (the layer's one sync) and acts on the
        misses by the backend (`_divide`); a prefill chunk too big for the CPU or for the cache
        streams them through the staging area instead."""
        needed, predicted = distinct_experts(ids, self._guess(x, ids) if ahead else None)
        self.b.settle()  # the previous layer's prefetch has landed (table and slots)
        prefill = self.staging is not None and x.shape[0] > STAGING_SLOTS  # a chunk the CPU would take long over
        if self.cache is None:  # a --moe-cpu-layers layer: no device slots
            if prefill:
                return self._streamed(x, ids, weights, needed)
            self.cpu_experts += len(needed)
            return self._on_cpu(x, ids, weights, needed)
        misses, rows = self._lookup(needed), x.shape[0]
        if not misses:
            self._fetch([], needed, predicted, rows)
            return self._run_cached(x, ids, weights)
        if self.b.name == "cpu" and prefill:  # the cache keeps what the boot placed; the misses stream
            return self._run_cached(x, ids, weights) + self._streamed(x, ids, weights, misses)
        fetch, on_cpu = self._divide(misses, ids, prefill, predicted, rows)
        inputs = self._to_host(x, ids, weights) if on_cpu else None  # before the GPU work is queued
        # a prefill-sized chunk (more tokens than a staging half) missing more experts than a half holds
        streaming = self.staging is not None and len(fetch) > STAGING_SLOTS and x.shape[0] > STAGING_SLOTS
        if streaming:  # a big prefill chunk: hits in place, misses through staging, the cache untouched
            out = self._run_cached(x, ids, weights)
            leftover = fetch
            self._count_streamed(len(fetch))
        else:
            leftover = self._fetch(fetch, needed, predicted, rows)
            out = self._run_cached(x, ids, weights)
            self._count_streamed(len(leftover))
        if leftover:
            out = out + self._stream(x, ids, weights, leftover)
        if on_cpu:  # the CPU computes while the device runs what was queued above
            self.cpu_experts += len(on_cpu)
            out = out + self._on_cpu(x, ids, weights, on_cpu, inputs)
        return out

    def _divide(self, misses: list[int], ids: torch.Tensor, prefill: bool = False, predicted: list[int] = (),
                rows: int = 0) -> tuple[list[int], list[int]]:
        """(fetched over the link, computed on the CPU): offload fetches every miss, cpu computes
        them, hybrid splits a decode step's (`MissSplit`, the link also carrying the prefetch
        copies of the next layer's `predicted` experts for `rows` rows that follow) and fetches a
        prefill chunk's: the CPU lane's time for an expert's many tokens is not what its one- and
        four-token timing predicts (measured: prefill 8192 tokens 1.28 s split, 0.75 s fetched,
        bf16 experts on an H100 host)."""
        if self.b.name == "hybrid" and misses and not prefill:
            return self.b.split.divide(misses, ids, self._prefetch_count(predicted, rows))
        return ([], misses) if self.b.name == "cpu" else (misses, [])

    def _prefetch_count(self, predicted: list[int], rows: int) -> int:
        """How many of the next layer's `predicted` experts the prefetch after this layer's
        fetches will copy (`_prefetch`): the next layer's host part waits for them (`settle`),
        so the split counts them on the link's side."""
        nxt = self.next
        if not predicted or nxt is None or nxt.cache is None:
            return 0
        return len(nxt.cache.to_prefetch(nxt.layer, predicted, self.b.prefetch_budget * rows))

    def _streamed(self, x, ids, weights, experts: list[int]) -> torch.Tensor:
        """`experts` through the staging area (none of them is placed in the cache)."""
        self._count_streamed(len(experts))
        return self._stream(x, ids, weights, experts)

    def _count_streamed(self, experts: int) -> None:
        """Bytes of experts copied through the staging area (a layer without slots: the backend's)."""
        counters = self.cache.counters[self.layer] if self.cache is not None else self.b.streamed
        counters.bytes_fetched += experts * self.bank.bytes_per_slot

    def _cut_lanes(self, x, ids, weights, ahead: bool) -> torch.Tensor:
        """A captured decode step of the cpu and hybrid backends, or of a layer without slots
        (`--moe-cpu-layers`), cut twice. At the first cut, after the router, the host reads the
        choices (and, `ahead`, the guess of the next layer's) and queues the fetches and the
        prefetch (`_lanes`); the next graph runs the cached experts; at the second cut the host
        computes the CPU lane while that graph runs (a replay only queues it) and copies the
        lane's output into `lane`, which the graph after adds."""
        lane = torch.empty_like(x)
        guess = self._guess(x, ids) if ahead and self.cache is not None else None
        pending: dict = {}  # "lane": the CPU lane's inputs between the two cuts (None: nothing for it)
        self.b.capturing.cut(lambda rows: pending.update(lane=self._lanes(x, ids, weights, guess, rows)))
        out = self._run_cached(x, ids, weights) if self.cache is not None else torch.zeros_like(x)
        self.b.capturing.cut(lambda rows: self._run_lane(pending.pop("lane", None), lane))
        return out + lane

    def _lanes(self, x, ids, weights, guess: torch.Tensor | None, rows: int) -> tuple | None:
        """Read the real rows (the first `rows`: one wait for their copies to the host, the
        layer's one sync), fetch what the hybrid split sends over the link (queued on the
        stream), start the prefetch of the next layer's `guess`, and return the CPU lane's
        inputs: the other misses, and any expert that found no cache slot (a graph cannot stream
        it through the staging area). None: no CPU lane."""
        rows = min(rows, x.shape[0])
        real = (x[:rows], ids[:rows], weights[:rows]) + ((guess[:rows],) if guess is not None else ())
        hx, hids, hw, *hguess = self._landed(self._to_host(*real))
        needed, predicted = distinct_experts(hids, *hguess)
        on_cpu = needed
        if self.cache is not None:
            self.b.settle()  # the previous layer's prefetch has landed (table and slots)
            fetch, on_cpu = self._divide(self._lookup(needed), hids, predicted=predicted, rows=rows)
            on_cpu = on_cpu + self._fetch(fetch, needed, predicted, rows)
        self.cpu_experts += len(on_cpu)
        return (hx, hids, hw, on_cpu) if on_cpu else None

    def _run_lane(self, inputs: tuple | None, lane: torch.Tensor) -> None:
        """The CPU lane's output into `lane` (zeros where it had nothing)."""
        lane.zero_()
        if inputs is not None:
            out = self.bank.run_host(*inputs, torch.get_num_threads())
            lane[:out.shape[0]].copy_(staged(out.to(lane.dtype), lane.device), non_blocking=True)

    def _guess(self, x, ids) -> torch.Tensor:
        """The next MoE layer's experts predicted: its router applied to this layer's input (one
        kernel on CUDA), its `prefetch_width` best a row, best first."""
        return route_topk(self.next_router(x), self.b.prefetch_width, False)[1]

    def _on_device(self, x, ids, weights, ahead: bool, beside: Beside | None) -> torch.Tensor:
        """A decode step in a graph, the cache managed on the device (`before_graph` handed it
        over): no host work. This layer's misses are resolved and gathered on the compute
        stream (the critical path: while the previous layer's prefetch of this layer's experts
        may still be landing on the copy stream; `join_late`). Beside that gather, on the side
        stream (`side_work`), the next layer's experts are guessed and placed (`ahead`) and the
        shared expert computed (`beside`); the guessed experts are gathered on the copy stream
        after this layer's own (`prefetch_first`: before them) while this layer computes. The
        prefetch of this layer's experts is joined just before its MoE runs. Neither gather's
        victims are slots the other writes or this layer reads: those carry the newest stamps,
        and every cache holds its policy's `graph_steps` steps' experts (`steps_on_device`)."""
        landed = self.b.take_prefetch()
        if not self.b.join_late:
            _join(landed)
            landed = None
        flat, lane = ids.reshape(-1), self.b.lane if self.b.lane_takes(x.shape[0]) else None
        if lane is not None:  # hybrid: the misses split on the device, the lane's share posted to the host thread
            flat = lane.post(self.layer, x, ids, weights, self.cache.row(self.layer), self.b.lane_fetches[x.shape[0]],
                             self.cache.lane_counter(self.layer))
        own = self.cache.resolve(self.layer, flat)
        ahead = ahead and self.next.cache is not None
        with self.b.side_work() as side:  # forked after this layer's placement (the cache state's order)
            placed = self.b.place_ahead(self.next, self._guess(x, ids)) if ahead else None
            shared = beside() if beside is not None else None
        if placed is not None and self.b.prefetch_first:
            self.b.gather_ahead(self.next, placed, side)
        self.cache.buffer.copy_indexed(self.bank, flat, own, self.b.gather_kernel, self.b.own_programs)
        if placed is not None and not self.b.prefetch_first:
            self.b.gather_ahead(self.next, placed, side)
        side.join()
        _join(landed)
        out = self._run_cached(x, ids, weights)
        if lane is not None:
            lane.collect(self.layer, out)
        return _with_shared(out, shared)

    def _lookup(self, needed: list[int]) -> list[int]:
        """The misses among the step's experts (hits counted and touched)."""
        hits, misses = self.cache.cached(self.layer, needed)
        self.cache.record(self.layer, hits, misses)
        return misses

    def _fetch(self, experts: list[int], needed: list[int], predicted: list[int], rows: int) -> list[int]:
        """Copy `experts` into cache slots, then start the prefetch of the next layer's
        `predicted` experts (guessed for `rows` rows); returns the experts left without a slot
        (the cache is smaller than this step's working set)."""
        placed = self.cache.fetch(self.layer, experts, self.bank, keep=set(needed))
        if predicted:
            self._prefetch(predicted, needed, self.b.prefetch_budget * rows)
        return experts[len(placed):]

    def _place(self, flat: torch.Tensor, rows: int, k: int, each: int, width: int) -> None:
        """A captured step's host part (at its cut, between two graphs): read the router's
        choices of the `rows` real rows (top-`k` each, of the step's `each` choices, and of the
        guess of `width` a row; `flat` from `choices`), fetch the misses, start the prefetch.
        `graph_mode` made sure they all fit."""
        rows = min(rows, each // k)  # (the graph's batch at most)
        needed, predicted = split_choices(flat.tolist(), rows * k, each, rows * width, width)
        self.b.settle()
        left = self._fetch(self._lookup(needed), needed, predicted, rows)
        if left:
            raise RuntimeError(f"layer {self.layer}: {len(left)} experts got no cache slot inside a CUDA graph")

    def _prefetch(self, predicted: list[int], needed: list[int], budget: int) -> None:
        """Copy the next layer's predicted misses (at most `budget`, the first in `predicted`'s
        order: best ranked first) on the copy stream, after this layer's own
        fetches (queued on the compute stream since the layer's sync: they are on the critical
        path, and both would share the link), overlapping the compute that follows; nothing this
        step uses is evicted. The next layer waits for them (`settle`) before it reads or
        changes the cache."""
        nxt, stream = self.next, self.b.copy_stream
        if nxt.cache is None or not nxt.cache.to_prefetch(nxt.layer, predicted, budget):
            return  # (nothing to copy: no stream work at all)
        keep = {(self.layer, e) for e in needed}
        if stream is None:  # no copy stream: in line (tests run the bookkeeping on the CPU)
            nxt.cache.prefetch(nxt.layer, predicted, nxt.bank, keep, budget)
            return
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            if nxt.cache.prefetch(nxt.layer, predicted, nxt.bank, keep, budget):
                self.b.prefetch_done = stream.record_event()

    def _run_cached(self, x, ids, weights) -> torch.Tensor:
        """The experts this layer has in the cache (its table row: others read as absent)."""
        return self._run(self.cache.buffer, x, ids, weights, self.cache.row(self.layer))

    def _run(self, buf: SlotBuffer, x, ids, weights, row: torch.Tensor) -> torch.Tensor:
        if self.b.kernels:
            return buf.run(x, ids, weights, row)
        return buf.run_reference(x, ids, weights, row)

    def _row(self, mapping: dict[int, int], device) -> torch.Tensor:
        """A table row with only `mapping` (expert -> slot) present, on `device` (from pinned
        memory, asynchronously: a host sync here would stall the staging overlap)."""
        pin = torch.device(device).type == "cuda"
        row = torch.full((self.bank.num_slots,), -1, dtype=torch.int32, pin_memory=pin)
        row[list(mapping)] = torch.tensor(list(mapping.values()), dtype=torch.int32)
        return row.to(device, non_blocking=True)

    def _stream(self, x, ids, weights, experts: list[int]) -> torch.Tensor:
        """Experts that get no cache slot, in chunks through the two staging halves: the copy of
        chunk i+1 (copy stream) overlaps the compute of chunk i."""
        half = self.staging.num_slots // 2
        chunks = [experts[i:i + half] for i in range(0, len(experts), half)]
        out = None
        stream = self.b.copy_stream if self.b.cfg.moe_prefill_overlap else None
        freed = [None, None]  # per half: event after the last kernel that read it
        ready = self._copy_chunk(chunks[0], 0, stream, freed)
        for i, chunk in enumerate(chunks):
            nxt = self._copy_chunk(chunks[i + 1], (i + 1) % 2, stream, freed) if i + 1 < len(chunks) else None
            if ready is not None:
                torch.cuda.current_stream().wait_event(ready)
            base = (i % 2) * half
            row = self._row({e: base + j for j, e in enumerate(chunk)}, self.b.device)
            part = self._run(self.staging, x, ids, weights, row)
            out = part if out is None else out + part
            if stream is not None:
                freed[i % 2] = torch.cuda.current_stream().record_event()
            ready = nxt
        return out

    def _copy_chunk(self, chunk: list[int], half: int, stream, freed):
        """Copy a chunk of experts into a staging half (by the gather kernel when the boot chose
        it: one launch instead of a copy per tensor per expert, which bound a short prompt's
        prefill on the host); on `stream` after the half's last readers, returning its event."""
        base = half * (self.staging.num_slots // 2)
        dst = list(range(base, base + len(chunk)))
        if stream is None:
            self.staging.copy_slots(dst, self.bank, chunk, gather=self.b.gather)
            return None
        compute = torch.cuda.current_stream()
        with torch.cuda.stream(stream):
            if freed[half] is None:  # the half's last readers are earlier work of the compute stream
                stream.wait_stream(compute)
            else:
                stream.wait_event(freed[half])
            self.staging.copy_slots(dst, self.bank, chunk, gather=self.b.gather)
            return stream.record_event()

    @staticmethod
    def _to_host(x, ids, weights, *more) -> tuple:
        """(x, ids, weights, *more) on the host, copied on the current stream; with an event to
        wait for on CUDA, so that work queued after the copies runs on while the CPU computes."""
        if x.device.type != "cuda":
            return x.float(), ids, weights.float(), *more, None
        host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                     for t in (x, ids, weights, *more))
        return (*host, torch.cuda.current_stream().record_event())

    @staticmethod
    def _landed(inputs: tuple) -> tuple:
        """`_to_host`'s (x, ids, weights) once they are on the host: only the copies are waited
        for, not the device's work queued after them."""
        *host, copied = inputs
        if copied is not None:
            copied.synchronize()
        return tuple(host)

    def _on_cpu(self, x, ids, weights, experts: list[int], inputs: tuple | None = None) -> torch.Tensor:
        """Experts computed on the CPU from the bank (fp32), added on x's device."""
        hx, hids, hw = self._landed(inputs or self._to_host(x, ids, weights))
        out = self.bank.run_host(hx, hids, hw, experts, torch.get_num_threads())
        return to_device(out.to(x.dtype), x.device)
