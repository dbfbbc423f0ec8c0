"""The device cache of expert slots: which (layer, expert) sits in which slot, and what to evict.

One cache spans every MoE layer of one slot layout (a checkpoint with several expert formats
gets one cache per format). The host keeps the mapping; the device `SlotTable` [layers,
experts] mirrors it and is all the MoE kernels read. A replacement policy is one class:
`LRUPolicy` (the default) orders slots by last use and never evicts an expert the current
step needs.

Decode steps inside a CUDA graph manage the cache on the device instead (`DeviceLRU`, the same
LRU at a layer step's granularity): `on_device()` hands the state over before a graph replays,
`on_host()` takes it back before any host work, which every host-side method here does first.

Counters per layer: hits, misses (experts a step needed and the cache lacked), bytes fetched
into slots, and of the decode prefetch: experts prefetched and how many of them a step then hit.
"""
from __future__ import annotations

import gc
from collections import OrderedDict

import torch

from moeferry.moe.device_lru import DeviceLRU
from moeferry.moe.slots import SlotBuffer, SlotTable

Key = tuple[int, int]  # (layer, expert)
DEVICE_COUNTS = ("hits", "misses", "prefetch_hits", "prefetched")  # the columns of `device_counts`


class LRUPolicy:
    """Least recently used first."""

    name = "lru"

    def __init__(self):
        self.order: OrderedDict[Key, None] = OrderedDict()

    def insert(self, key: Key) -> None:
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


POLICIES = {"lru": LRUPolicy}


class LayerCounters:
    __slots__ = ("hits", "misses", "bytes_fetched", "prefetched", "prefetch_hits")

    def __init__(self):
        self.hits = self.misses = self.bytes_fetched = self.prefetched = self.prefetch_hits = 0

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
        # `count_on_device`; `DeviceLRU` steps): per layer, DEVICE_COUNTS in order
        self.device_counts = torch.zeros(len(self.layers), 4, dtype=torch.int64, device=device)
        self.lru_on_device: DeviceLRU | None = None
        self.device_owned = False  # the device's LRU state is the current one (the host's is stale)
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
        if self.lru_on_device is None:
            self.lru_on_device = DeviceLRU(self.num_slots, self.device_counts)
        e = self.num_experts
        order = [(self.slot_of(layer, x), self.row_of[layer] * e + x) for layer, x in self.policy.order]
        self.table.table.copy_(self.host_table)
        self.lru_on_device.push(order, [self.slot_of(*k) for k in self.prefetched])
        self.device_owned = True

    def on_host(self) -> None:
        """Take the state back from the device after steps that managed it there (one sync)."""
        if not self.device_owned:
            return
        self.device_owned = False
        order, prefetched = self.lru_on_device.pull()
        self.host_table.copy_(self.table.table.cpu())
        e = self.num_experts
        self.owner = [None] * self.num_slots
        self.policy = POLICIES[self.policy.name]()
        for s, key in order:
            self.owner[s] = (self.layers[key // e], key % e)
            self.policy.insert(self.owner[s])
        self.free_slots = [s for s in range(self.num_slots - 1, -1, -1) if self.owner[s] is None]
        self.prefetched = {self.owner[s] for s in prefetched}

    def resolve(self, layer: int, ids: torch.Tensor, prefetch: bool = False) -> torch.Tensor:
        """A step's (or, `prefetch`, the next layer's predicted) experts placed by the device
        (`DeviceLRU.resolve`); the slot each id must be copied into, -1 for none."""
        if not self.device_owned:
            raise RuntimeError("expert cache: resolve() on the device before on_device()")
        return self.lru_on_device.resolve(self.table.table, self.row_of[layer], ids, prefetch)

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

    def prefetch(self, layer: int, experts: list[int], bank: SlotBuffer, protect: set[Key]) -> list[int]:
        """Fetch the predicted `experts` of `layer` that are not cached, evicting nothing in
        `protect` (keys the step in flight uses) or predicted; returns the experts placed."""
        _, misses = self.cached(layer, experts)
        placed = self.fetch(layer, misses, bank, keep=set(experts), protect=protect)
        self.counters[layer].prefetched += len(placed)
        self.prefetched.update((layer, e) for e in placed)
        return placed

    def fetch(self, layer: int, experts: list[int], bank: SlotBuffer, keep: set[int],
              protect: set[Key] = frozenset()) -> list[int]:
        """Copy `experts` of `layer` from their host `bank` into slots, evicting least recently
        used experts outside `keep` (experts of this layer the step needs) and `protect` (keys of
        other layers in use). Returns the experts
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
            self.policy.insert((layer, e))
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

    def shrink(self, num_slots: int, banks: dict[int, SlotBuffer]) -> int:
        """Keep `num_slots` slots, holding the most recently used experts; returns the bytes freed.
        The old slots are released before the smaller buffer is allocated and the survivors are
        copied back from their host banks, so shrinking needs no device memory beyond the result
        (it runs when the device is out of memory)."""
        if num_slots >= self.num_slots:
            return 0
        self.on_host()
        self.lru_on_device = None  # sized for the old slots: made again on use
        survivors = list(self.policy.order)[-num_slots:] if num_slots else []
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
        self.policy = POLICIES[self.policy.name]()
        self.prefetched = set()
        for i, (layer, e) in enumerate(survivors):
            self.buffer.copy_slots([i], banks[layer], [e])
            self.slot_at[self.row_of[layer], e] = i
            self.owner[i] = (layer, e)
            self.policy.insert((layer, e))
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
            c.bytes_fetched += (counts["misses"] + counts["prefetched"]) * per_slot  # each one was copied
        self.device_counts.zero_()
        total = LayerCounters()
        for c in self.counters.values():
            total.add(c)
        return total

    @property
    def slots_used(self) -> int:
        if self.device_owned:  # counted there: /v1/stats during decode takes nothing back
            return int((self.lru_on_device.owner >= 0).sum())
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
        assert set(self.policy.order) == {self.owner[s] for s in seen}
        assert torch.equal(self.table.table.cpu(), self.host_table)
