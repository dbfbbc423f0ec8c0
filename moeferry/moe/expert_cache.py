"""The device cache of expert slots: which (layer, expert) sits in which slot, and what to evict.

One cache spans every MoE layer of one slot layout (a checkpoint with several expert formats
gets one cache per format). The host keeps the mapping; the device `SlotTable` [layers,
experts] mirrors it and is all the MoE kernels read. A replacement policy is one class:
`LRUPolicy` (the default) evicts the least recently used expert, `LFUPolicy` the least
frequently used with dynamic aging; neither evicts an expert the current step needs.

Decode steps inside a CUDA graph manage the cache on the device instead (`DevicePolicy`, the
same policy at a layer step's granularity): `on_device()` hands the state over before a graph
replays, `on_host()` takes it back before any host work, which every host-side method here does
first.

Counters per layer: hits, misses (experts a step needed and the cache lacked), bytes fetched
into slots, and of the decode prefetch: experts prefetched and how many of them a step then hit.
"""
from __future__ import annotations

import gc
import heapq
from collections import OrderedDict

import torch

from moeferry.moe.device_policy import DevicePolicy, Entry
from moeferry.moe.slots import SlotBuffer, SlotTable

Key = tuple[int, int]  # (layer, expert)
# the columns of `device_counts`: "misses" are those copied into slots, "on_lane" those a hybrid
# decode graph computed on the CPU lane instead (`moeferry.moe.cpu_lane`: misses too, not copied)
DEVICE_COUNTS = ("hits", "misses", "prefetch_hits", "prefetched", "on_lane")


class LRUPolicy:
    """Least recently used first."""

    name = "lru"
    age = 0  # (LFU's; handed over with the state)
    graph_steps = 2  # decode steps' experts a cache must hold to be managed on the device (`cache_resolve`)

    def __init__(self):
        self.order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key, prefetched: bool = False) -> None:
        self.order[key] = None

    def remove(self, key: Key) -> None:
        del self.order[key]

    def touch(self, keys: list[Key]) -> None:
        for k in keys:
            self.order.move_to_end(k)

    def victims(self, n: int, keep: set[Key]) -> list[Key]:
        """Up to n cached keys to evict, none of them in `keep`."""
        out = []
        for k in self.order:
            if len(out) == n:
                break
            if k not in keep:
                out.append(k)
        return out

    def ranked(self) -> list[Key]:
        """Every cached key, the first to evict first."""
        return list(self.order)

    def entries(self) -> list[tuple[Key, int, int]]:
        """(key, priority, uses) of every cached key, least recently used first (the hand-over)."""
        return [(k, 0, 0) for k in self.order]

    def restore(self, entries: list[tuple[Key, int, int]], age: int) -> None:
        """Load `entries` (as `entries()` gives them) into this empty policy."""
        for key, _, _ in entries:
            self.insert(key)


class LFUPolicy:
    """Least frequently used, with dynamic aging (LFU-DA): a key's priority is the cache's age
    plus its uses; the lowest priority goes first (ties: the least recently used), and the age
    rises to each victim's priority, so experts that were popular once fade out. A key enters
    with one use (a prefetched one with none: a wrong guess is the next victim). With skewed
    expert popularity it keeps the popular experts that LRU lets a burst of rare ones push out.

    The order is a heap of (priority, last use, key) entries, stale ones skipped (an entry is
    current while its key's last use is its own)."""

    name = "lfu"
    graph_steps = 3

    def __init__(self):
        self.age = 0
        self.prio: dict[Key, int] = {}
        self.uses: dict[Key, int] = {}
        self.last: dict[Key, int] = {}
        self.heap: list[tuple[int, int, Key]] = []
        self.clock = 0

    def _push(self, key: Key) -> None:
        self.clock += 1
        self.last[key] = self.clock
        self.prio[key] = self.age + self.uses[key]
        heapq.heappush(self.heap, (self.prio[key], self.clock, key))
        if len(self.heap) > 4 * len(self.last) + 64:  # drop the stale entries
            self.heap = [(self.prio[k], t, k) for k, t in self.last.items()]
            heapq.heapify(self.heap)

    def insert(self, key: Key, prefetched: bool = False) -> None:
        self.uses[key] = 0 if prefetched else 1
        self._push(key)

    def remove(self, key: Key) -> None:
        """An evicted key leaves; the age rises to its priority."""
        self.age = max(self.age, self.prio.pop(key))
        del self.uses[key], self.last[key]

    def touch(self, keys: list[Key]) -> None:
        for k in keys:
            self.uses[k] += 1
            self._push(k)

    def victims(self, n: int, keep: set[Key]) -> list[Key]:
        out, seen = [], []
        while self.heap and len(out) < n:
            entry = heapq.heappop(self.heap)
            if self.last.get(entry[2]) != entry[1]:
                continue  # stale: dropped
            seen.append(entry)
            if entry[2] not in keep:
                out.append(entry[2])
        for entry in seen:
            heapq.heappush(self.heap, entry)
        return out

    def ranked(self) -> list[Key]:
        return sorted(self.last, key=lambda k: (self.prio[k], self.last[k]))

    def entries(self) -> list[tuple[Key, int, int]]:
        return [(k, self.prio[k], self.uses[k]) for k in sorted(self.last, key=self.last.__getitem__)]

    def restore(self, entries: list[tuple[Key, int, int]], age: int) -> None:
        self.age = age
        for key, prio, uses in entries:  # priorities as handed over (the age may have moved since)
            self.clock += 1
            self.uses[key], self.prio[key], self.last[key] = uses, prio, self.clock
        self.heap = [(self.prio[k], t, k) for k, t in self.last.items()]
        heapq.heapify(self.heap)


POLICIES = {"lru": LRUPolicy, "lfu": LFUPolicy}


class LayerCounters:
    __slots__ = ("hits", "misses", "bytes_fetched", "prefetched", "prefetch_hits", "on_lane")

    def __init__(self):
        self.hits = self.misses = self.bytes_fetched = self.prefetched = self.prefetch_hits = 0
        self.on_lane = 0  # misses computed on the CPU lane of a hybrid decode graph (served as the layer's CPU experts)

    def add(self, other: "LayerCounters") -> None:
        for name in self.__slots__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def as_dict(self) -> dict:
        total = self.hits + self.misses
        return {"hits": self.hits, "misses": self.misses, "bytes_fetched": self.bytes_fetched,
                "hit_rate": round(self.hits / total, 4) if total else None,
                "prefetched": self.prefetched, "prefetch_hits": self.prefetch_hits}


class ExpertCache:
    """`buffer.num_slots` device slots over the experts of `layers` (layer ids, each with
    `num_experts` experts)."""

    def __init__(self, buffer: SlotBuffer, layers: list[int], num_experts: int, policy: str = "lru"):
        self.buffer, self.layers, self.num_experts = buffer, list(layers), num_experts
        device = buffer.gate_up.w.device
        self.row_of = {layer: i for i, layer in enumerate(self.layers)}
        self.table = SlotTable(len(self.layers), num_experts, device)
        self.host_table = torch.full((len(self.layers), num_experts), -1, dtype=torch.int32,
                                     pin_memory=device.type == "cuda")
        self.slot_at = self.host_table.numpy()  # the same memory: cheap scalar reads and writes
        self.owner: list[Key | None] = [None] * buffer.num_slots
        self.free_slots = list(range(buffer.num_slots - 1, -1, -1))
        self.policy = POLICIES[policy]()
        self.counters = {layer: LayerCounters() for layer in self.layers}
        self.prefetched: set[Key] = set()  # fetched ahead of their layer's step, not yet used by it
        # counters of steps that never leave the device (a cache holding every expert:
        # `count_on_device`; `DevicePolicy` steps): per layer, DEVICE_COUNTS in order
        self.device_counts = torch.zeros(len(self.layers), len(DEVICE_COUNTS), dtype=torch.int64, device=device)
        self.on_device_state: DevicePolicy | None = None
        self.device_owned = False  # the device's policy state is the current one (the host's is stale)
        self._seen = torch.zeros(len(self.layers), num_experts, dtype=torch.int32, device=device)
        self.gather = None  # fetch by the one-launch gather kernel in this config (set by the backend when it wins)

    @property
    def num_slots(self) -> int:
        return self.buffer.num_slots

    def row(self, layer: int) -> torch.Tensor:
        """The device table row the kernels read for `layer`."""
        return self.table.row(self.row_of[layer])

    def slot_of(self, layer: int, expert: int) -> int:
        return int(self.slot_at[self.row_of[layer], expert])

    # -- the owner of the state: host or device --------------------------------------------
    def on_device(self) -> None:
        """Hand the state to the device (before decode steps that manage it there; not inside a
        graph capture: this copies from the host)."""
        if self.device_owned:
            return
        if self.on_device_state is None:
            self.on_device_state = DevicePolicy(self.num_slots, self.device_counts, self.policy.name == "lfu")
        e = self.num_experts
        entries = [Entry(self.slot_of(*key), self.row_of[key[0]] * e + key[1], prio, uses)
                   for key, prio, uses in self.policy.entries()]
        self.table.table.copy_(self.host_table)
        self.on_device_state.push(entries, [self.slot_of(*k) for k in self.prefetched], self.policy.age)
        self.device_owned = True

    def on_host(self) -> None:
        """Take the state back from the device after steps that managed it there (one sync)."""
        if not self.device_owned:
            return
        self.device_owned = False
        entries, prefetched, age = self.on_device_state.pull()
        self.host_table.copy_(self.table.table.cpu())
        e = self.num_experts
        self.owner = [None] * self.num_slots
        for x in entries:
            self.owner[x.slot] = (self.layers[x.key // e], x.key % e)
        self.policy = POLICIES[self.policy.name]()
        self.policy.restore([(self.owner[x.slot], x.prio, x.uses) for x in entries], age)
        self.free_slots = [s for s in range(self.num_slots - 1, -1, -1) if self.owner[s] is None]
        self.prefetched = {self.owner[s] for s in prefetched}

    def resolve(self, layer: int, ids: torch.Tensor, prefetch: bool = False, budget: int | None = None) -> torch.Tensor:
        """A step's (or, `prefetch`, the next layer's predicted, at most `budget` of them copied)
        experts placed by the device (`DevicePolicy.resolve`); the slot each id must be copied
        into, -1 for none."""
        if not self.device_owned:
            raise RuntimeError("expert cache: resolve() on the device before on_device()")
        return self.on_device_state.resolve(self.table.table, self.row_of[layer], ids, prefetch, budget)

    def set_policy(self, name: str) -> None:
        """Evict by policy `name` from now on; the cached experts stay, handed over in the old
        policy's recency order (LFU's priorities and uses start again). Decode graphs captured
        before hold the old device state's tensors: the caller drops them (`DecodeGraphs.invalidate`)."""
        self.on_host()
        self.on_device_state = None  # made again, for the new policy, on use
        keys = [k for k, _, _ in self.policy.entries()]
        self.policy = POLICIES[name]()
        self.policy.restore([(k, 1, 1) for k in keys], 0)

    # -- host-side management -----------------------------------------------------------------
    def cached(self, layer: int, experts: list[int]) -> tuple[list[int], list[int]]:
        """(hits, misses) among `experts` of `layer`."""
        self.on_host()
        row = self.slot_at[self.row_of[layer]]
        hits = [e for e in experts if row[e] >= 0]
        return hits, [e for e in experts if row[e] < 0]

    def record(self, layer: int, hits: list[int], misses: list[int]) -> None:
        c = self.counters[layer]
        c.hits += len(hits)
        c.misses += len(misses)
        keys = [(layer, e) for e in hits]
        if self.prefetched:
            c.prefetch_hits += sum(k in self.prefetched for k in keys)
            self.prefetched = {k for k in self.prefetched if k[0] != layer}
        self.policy.touch(keys)

    @property
    def complete(self) -> bool:
        """Every expert of every layer is cached (nothing can miss or be evicted)."""
        return len(self.free_slots) == self.num_slots - len(self.layers) * self.num_experts

    def count_on_device(self, layer: int, ids: torch.Tensor) -> None:
        """A step's hits (its distinct experts) counted without a host sync, so that the step
        can run inside a CUDA graph; `totals` folds them in. Only for a complete cache (nothing
        can be evicted, so the LRU order is not kept: a shrink keeps the last-filled experts)."""
        r = self.row_of[layer]
        seen = self._seen[r]
        seen.zero_()
        seen.index_fill_(0, ids.reshape(-1), 1)
        self.device_counts[r, 0] += seen.sum()

    def lane_counter(self, layer: int) -> torch.Tensor:
        """`layer`'s device counter of misses a hybrid decode graph computed on the CPU lane (a [1]
        view of `device_counts`, which the lane's split kernel adds to)."""
        column = DEVICE_COUNTS.index("on_lane")
        return self.device_counts[self.row_of[layer], column:column + 1]

    def to_prefetch(self, layer: int, experts: list[int], budget: int | None = None) -> list[int]:
        """The predicted `experts` of `layer` a prefetch copies: those not cached, at most
        `budget` of them, the first in `experts`' order."""
        _, misses = self.cached(layer, experts)
        return misses if budget is None else misses[:budget]

    def prefetch(self, layer: int, experts: list[int], bank: SlotBuffer, protect: set[Key],
                 budget: int | None = None) -> list[int]:
        """Fetch `to_prefetch`'s experts, evicting nothing in `protect` (keys the step in flight
        uses) or predicted; returns the experts placed."""
        misses = self.to_prefetch(layer, experts, budget)
        placed = self.fetch(layer, misses, bank, keep=set(experts), protect=protect, prefetched=True)
        self.counters[layer].prefetched += len(placed)
        self.prefetched.update((layer, e) for e in placed)
        return placed

    def fetch(self, layer: int, experts: list[int], bank: SlotBuffer, keep: set[int],
              protect: set[Key] = frozenset(), prefetched: bool = False) -> list[int]:
        """Copy `experts` of `layer` from their host `bank` into slots, evicting the policy's
        victims outside `keep` (experts of this layer the step needs) and `protect` (keys of
        other layers in use); `prefetched`: predicted, not yet used. Returns the experts
        that got a slot (a prefix of `experts`: fewer when the cache is smaller than the step's
        working set). Copies are enqueued on the current stream; the device table row is updated
        after them, in order."""
        if not experts:
            return []
        self.on_host()
        r = self.row_of[layer]
        protected = {(layer, e) for e in keep} | protect
        need = len(experts) - len(self.free_slots)
        for key in self.policy.victims(max(need, 0), protected):
            self._evict(key)
        n = min(len(experts), len(self.free_slots))
        placed, slots = experts[:n], [self.free_slots.pop() for _ in range(n)]
        if not placed:
            return []
        moved = self.buffer.copy_slots(slots, bank, placed, gather=self.gather)
        for e, s in zip(placed, slots):
            self.slot_at[r, e] = s
            self.owner[s] = (layer, e)
            self.policy.insert((layer, e), prefetched)
        self.counters[layer].bytes_fetched += moved
        self._sync_table()  # the evicted rows and this one, in one copy after the slot copies
        return placed

    def reload(self, banks: dict[int, SlotBuffer]) -> None:
        """Copy every cached expert into its slot again from its host bank (its contents are
        in doubt, e.g. after a failed graph capture); the mapping stays."""
        self.on_host()
        by_layer: dict[int, list[tuple[int, int]]] = {}
        for s, key in enumerate(self.owner):
            if key is not None:
                by_layer.setdefault(key[0], []).append((s, key[1]))
        for layer, pairs in by_layer.items():
            self.buffer.copy_slots([s for s, _ in pairs], banks[layer], [e for _, e in pairs], gather=self.gather)

    def _evict(self, key: Key) -> None:
        layer, e = key
        r = self.row_of[layer]
        s = int(self.slot_at[r, e])
        self.slot_at[r, e] = -1
        self.owner[s] = None
        self.free_slots.append(s)
        self.policy.remove(key)
        self.prefetched.discard(key)

    def _sync_table(self) -> None:
        """The device table from the host's (pinned: an asynchronous copy, in stream order)."""
        self.table.table.copy_(self.host_table, non_blocking=True)

    def fill(self, banks: dict[int, SlotBuffer]) -> None:
        """Initial contents: slots spread evenly over the layers (experts 0, 1, ... of each)."""
        per, extra = divmod(self.num_slots, len(self.layers))
        for i, layer in enumerate(self.layers):
            n = min(per + (i < extra), self.num_experts)
            self.fetch(layer, list(range(n)), banks[layer], keep=set())
            self.counters[layer].bytes_fetched = 0  # boot fill is not traffic

    def refill(self, banks: dict[int, SlotBuffer]) -> None:
        """The boot's contents again (every expert evicted, the policy's state new, then `fill`):
        runs that must start from one state, e.g. hybrid's graph and eager steps compared (which
        experts its CPU lane takes depends on what the cache holds)."""
        self.on_host()
        for key in self.policy.ranked():
            self._evict(key)
        self.free_slots = list(range(self.num_slots - 1, -1, -1))  # the boot's order: the same slots again
        self.policy = POLICIES[self.policy.name]()
        self.fill(banks)

    def shrink(self, num_slots: int, banks: dict[int, SlotBuffer]) -> int:
        """Keep `num_slots` slots, holding the experts the policy would evict last (LRU: the most
        recently used); returns the bytes freed.
        The old slots are released before the smaller buffer is allocated and the survivors are
        copied back from their host banks, so shrinking needs no device memory beyond the result
        (it runs when the device is out of memory)."""
        if num_slots >= self.num_slots:
            return 0
        self.on_host()
        self.on_device_state = None  # sized for the old slots: made again on use
        keep = set(self.policy.ranked()[-num_slots:] if num_slots else [])
        survivors = [x for x in self.policy.entries() if x[0] in keep]  # least recently used first
        device = self.buffer.gate_up.w.device
        before = self.buffer.nbytes
        layout = SlotBuffer.allocate_like(self.buffer, 1, device="meta")
        self.buffer = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        self.buffer = SlotBuffer.allocate_like(layout, num_slots, device=device)
        self.host_table.fill_(-1)
        self.owner = [None] * num_slots
        age = self.policy.age
        self.policy = POLICIES[self.policy.name]()
        self.policy.restore(survivors, age)
        self.prefetched = set()
        for i, ((layer, e), _, _) in enumerate(survivors):
            self.buffer.copy_slots([i], banks[layer], [e])
            self.slot_at[self.row_of[layer], e] = i
            self.owner[i] = (layer, e)
        self.free_slots = list(range(num_slots - 1, len(survivors) - 1, -1))
        self.table.table.copy_(self.host_table)
        return before - self.buffer.nbytes

    def totals(self) -> LayerCounters:
        """The counters summed over the layers (the device's counts folded in first)."""
        per_slot = self.buffer.bytes_per_slot
        for layer, row in zip(self.layers, self.device_counts.tolist()):
            c, counts = self.counters[layer], dict(zip(DEVICE_COUNTS, row))
            for name, n in counts.items():
                setattr(c, name, getattr(c, name) + n)
            c.misses += counts["on_lane"]
            c.bytes_fetched += (counts["misses"] + counts["prefetched"]) * per_slot  # each one was copied
        self.device_counts.zero_()
        total = LayerCounters()
        for c in self.counters.values():
            total.add(c)
        return total

    @property
    def slots_used(self) -> int:
        if self.device_owned:  # counted there: /v1/stats during decode takes nothing back
            return int((self.on_device_state.owner >= 0).sum())
        return self.num_slots - len(self.free_slots)

    def layer_stats(self) -> dict:
        """Each layer's counters as served (call `totals` first: it folds the device's hit counts in)."""
        return {str(layer): c.as_dict() for layer, c in self.counters.items()}

    def check(self) -> None:
        """Integrity (tests): host table, owners, free list and device table agree."""
        self.on_host()
        seen = set()
        for r, layer in enumerate(self.layers):
            for e in range(self.num_experts):
                s = int(self.host_table[r, e])
                if s >= 0:
                    assert self.owner[s] == (layer, e), (layer, e, s, self.owner[s])
                    assert s not in seen
                    seen.add(s)
        assert seen.isdisjoint(self.free_slots) and len(seen) + len(self.free_slots) == self.num_slots
        assert set(self.policy.ranked()) == {self.owner[s] for s in seen}
        assert torch.equal(self.table.table.cpu(), self.host_table)
