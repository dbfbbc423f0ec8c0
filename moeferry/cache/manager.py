"""CacheManager: the one owner of the KV page pool, the GDN state pool and the prefix cache.

A sequence's holdings are a `SeqBlocks`. The scheduler (and `LLM.logits`) only go through
these operations:

    admit(tokens)            a state slot + the longest cached prefix    -> SeqBlocks | None
    grow(blocks, n)          KV pages for n tokens (evicting cached pages) -> bool
    checkpoint(blocks, pos)  save the GDN state at pos for later requests
    release(blocks, tokens)  give everything back (to the prefix cache when tokens are given)
    check()                  integrity: every page / slot is owned exactly once
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from moeferry.cache.kv_pool import KVPool, PoolExhausted
from moeferry.cache.prefix_cache import Node, PrefixCache
from moeferry.cache.state_pool import StatePool


@dataclass(eq=False)
class SeqBlocks:
    """What one sequence holds in the pools."""
    state_slot: int | None
    pages: list[int] = field(default_factory=list)
    num_shared_pages: int = 0          # leading pages owned by the prefix cache
    prefix_node: Node | None = None    # prefix-cache node this sequence pins
    snapshots: list[tuple[int, int]] = field(default_factory=list)  # (position, state slot) checkpoints
    matched: int = 0                   # tokens served from the prefix cache at admission


class CacheManager:
    def __init__(self, kv: KVPool, states: StatePool, needs_state: bool, prefix_cache: bool):
        self.kv, self.states, self.needs_state = kv, states, needs_state
        self.page_size = kv.page_size
        self.prefix = (PrefixCache(self.page_size, needs_state, kv.pages.free, states.free)
                       if prefix_cache else None)
        self.live: set[SeqBlocks] = set()
        self.hit_tokens = 0

    @classmethod
    def build(cls, spec, num_pages: int, page_size: int, num_state_slots: int, prefix_cache: bool,
              dtype: torch.dtype, device) -> "CacheManager":
        kv = KVPool(len(spec.attention_layers), num_pages, page_size, spec.num_kv_heads, spec.head_dim, dtype, device)
        states = StatePool(len(spec.linear_layers), num_state_slots, max(spec.conv_dim, 1), max(spec.conv_kernel, 2),
                           max(spec.linear_num_v_heads, 1), max(spec.linear_k_head_dim, 1),
                           max(spec.linear_v_head_dim, 1), dtype, device)
        return cls(kv, states, bool(spec.linear_layers), prefix_cache)

    # --- sizes ----------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return self.kv.num_tokens

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + self.states.nbytes

    def pages_for(self, num_tokens: int) -> int:
        return self.kv.pages_for(num_tokens)

    # --- operations -----------------------------------------------------------------------
    def admit(self, tokens: list[int] | None = None) -> SeqBlocks | None:
        """A state slot (evicting cached checkpoints if needed) and, when `tokens` are given,
        the longest prefix the cache holds for them; None when no state slot can be had."""
        slot = self._alloc_state()
        if slot is None:
            return None
        blocks = SeqBlocks(slot)
        self.live.add(blocks)
        if self.prefix is None or not tokens:
            return blocks
        m = self.prefix.match(tokens)
        if m.length:
            blocks.pages, blocks.num_shared_pages, blocks.matched = list(m.pages), len(m.pages), m.length
            blocks.prefix_node = m.node
            self.prefix.lock(m.node, +1)
            if m.snapshot is not None:
                self.states.copy(m.snapshot, slot)
            self.hit_tokens += m.length
        return blocks

    def grow(self, blocks: SeqBlocks, total_tokens: int) -> bool:
        """Make `blocks` hold KV pages for `total_tokens`, evicting unused cached pages if short."""
        need = self.kv.pages_for(total_tokens) - len(blocks.pages)
        if need <= 0:
            return True
        short = need - self.kv.pages.num_free
        if short > 0 and self.prefix is not None:
            self.prefix.evict_pages(short)
        try:
            blocks.pages.extend(self.kv.pages.alloc(need))  # in place: the decode graphs move only new pages
        except PoolExhausted:
            return False
        return True

    def checkpoint(self, blocks: SeqBlocks, position: int, keep_free: int) -> None:
        """Save the GDN state at `position` so later requests can resume there (the position page
        aligned), keeping `keep_free` state slots free. Room comes first from the least recently
        used cached checkpoints (else, once the cache held every spare slot, no new prompt would
        be saved), then, when one slot is all that is missing, from the sequence's own (`_thin`):
        a long prompt's chunk checkpoints alone can outnumber the slots, and skipping the newest
        lost the very position a next turn resumes from."""
        if self.prefix is None or not self.needs_state or position == 0 or position % self.page_size:
            return
        if blocks.snapshots and blocks.snapshots[-1][0] == position:
            return  # already saved here (e.g. a request finishing right after its prompt)
        while self.states.slots.num_free <= keep_free:
            if self.prefix.evict_state():
                continue
            if self.states.slots.num_free < keep_free or not self._thin(blocks, position):
                return  # (one of its own makes room for this one, never more: others' places need theirs)
        slot = self.states.slots.alloc(1)[0]
        self.states.copy(blocks.state_slot, slot)
        blocks.snapshots.append((position, slot))

    def _thin(self, blocks: SeqBlocks, position: int) -> bool:
        """Free one of the sequence's own checkpoints: of those after its first (the one most
        prompts that share a beginning can resume from), the one whose loss leaves the smallest
        gap between its neighbours (the last's reaches to `position`, the one being saved), so
        the kept ones stay spread out; its only one if it has one. False when it has none."""
        if not blocks.snapshots:
            return False
        at = [p for p, _ in blocks.snapshots] + [position]
        candidates = range(1, len(blocks.snapshots)) if len(blocks.snapshots) > 1 else range(1)
        drop = min(candidates, key=lambda i: at[i + 1] - at[i - 1] if i else 0)
        self.states.free(blocks.snapshots.pop(drop)[1])
        return True

    def release(self, blocks: SeqBlocks, computed_tokens: list[int] | None = None,
                state_position: int | None = None) -> None:
        """Give back a sequence's pages and slots; with `computed_tokens` (the tokens whose KV is
        in its pages) they go to the prefix cache, its own state slot too as the checkpoint at
        their end (no copy, and no spare slot needed: the position a next turn resumes from) when
        the state is there (`state_position`, the tokens it has taken in, when it may be past
        them: a step in flight may be computing a token not read yet)."""
        if blocks not in self.live:
            return
        self.live.discard(blocks)
        if blocks.prefix_node is not None:
            self.prefix.lock(blocks.prefix_node, -1)
            blocks.prefix_node = None
        if self.prefix is not None and computed_tokens is not None:
            if state_position in (None, len(computed_tokens)):
                self._hand_over_state(blocks, len(computed_tokens))
            self.prefix.insert(computed_tokens, blocks.pages, blocks.snapshots)
        else:
            self.kv.pages.free(blocks.pages[blocks.num_shared_pages:])
            for _, slot in blocks.snapshots:
                self.states.free(slot)
        if blocks.state_slot is not None:
            self.states.free(blocks.state_slot)
        blocks.pages, blocks.snapshots, blocks.state_slot, blocks.num_shared_pages = [], [], None, 0

    def _hand_over_state(self, blocks: SeqBlocks, position: int) -> None:
        """The sequence's state slot becomes its checkpoint at `position` (its end), where one
        can be saved and none is yet. (A step still in flight writes the slot before any later
        step reads it: the same stream.)"""
        if (not self.needs_state or blocks.state_slot is None or position == 0 or position % self.page_size
                or (blocks.snapshots and blocks.snapshots[-1][0] == position)):
            return
        blocks.snapshots.append((position, blocks.state_slot))
        blocks.state_slot = None

    @contextlib.contextmanager
    def sequences(self, lengths: list[int]):
        """Fresh sequences holding KV pages for `lengths` tokens each (scoring, benchmarks,
        warm-up): yields their SeqBlocks, releases them on exit."""
        held: list[SeqBlocks] = []
        try:
            for n in lengths:
                blocks = self.admit()
                if blocks is None or not self.grow(blocks, n):
                    raise PoolExhausted(f"the pools cannot hold {len(lengths)} sequences of up to {max(lengths)} "
                                        f"tokens ({self.kv.num_tokens} KV tokens, {self.states.num_slots} state slots)")
                held.append(blocks)
            yield held
        finally:
            for blocks in held:
                self.release(blocks)

    def _alloc_state(self) -> int | None:
        while self.states.slots.num_free == 0:
            if self.prefix is None or not self.prefix.evict_state():
                return None
        return self.states.alloc()

    # --- reporting ------------------------------------------------------------------------
    def stats(self) -> dict:
        ps = self.page_size
        return {
            "kv_tokens_total": self.kv.num_tokens,
            "kv_tokens_used": (self.kv.pages.num_pages - self.kv.pages.num_free) * ps,
            "prefix_cache_tokens": (self.prefix.num_pages * ps) if self.prefix else 0,
            "state_slots_total": self.states.num_slots,
            "state_slots_used": self.states.num_slots - self.states.slots.num_free,
            "prefix_cache_reused_tokens": self.hit_tokens,  # matched at admissions, re-admissions included
        }

    def check(self) -> None:
        """Raise AssertionError unless every KV page and state slot is owned exactly once: free,
        by a live sequence, or by the prefix cache."""
        pages = list(self.kv.pages.free_ids)
        slots = list(self.states.slots.free_ids)
        for b in self.live:
            pages += b.pages[b.num_shared_pages:]
            slots += ([b.state_slot] if b.state_slot is not None else []) + [s for _, s in b.snapshots]
        if self.prefix is not None:
            for node in self.prefix.nodes():
                pages += node.pages
                slots += [node.snapshot] if node.snapshot is not None else []
        for what, ids, total in (("KV pages", pages, self.kv.pages.num_pages),
                                 ("state slots", slots, self.states.num_slots)):
            if sorted(ids) != list(range(total)):
                dup = sorted({i for i in ids if ids.count(i) > 1})
                lost = sorted(set(range(total)) - set(ids))
                raise AssertionError(f"{what}: duplicated {dup[:10]}, lost {lost[:10]} (of {total})")
