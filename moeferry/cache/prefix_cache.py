"""Prefix cache: a radix tree over token ids shared by all requests.

Edges hold whole KV pages (keys are multiples of page_size tokens). For models with Gated
DeltaNet layers a prefix can only be resumed where a recurrent+conv state checkpoint was
saved: such checkpoints hang on the node that ends at their position. Unused nodes are
evicted least-recently-used first.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from moeferry.common_prefix import common_prefix_length


@dataclass(eq=False)
class Node:
    key: tuple[int, ...] = ()
    pages: list[int] = field(default_factory=list)
    parent: "Node | None" = None
    children: dict[tuple[int, ...], "Node"] = field(default_factory=dict)
    snapshot: int | None = None  # state slot holding the state after this node's last token
    lock: int = 0
    last_use: int = 0

    @property
    def depth_end(self) -> int:
        n, total = self, 0
        while n is not None:
            total += len(n.key)
            n = n.parent
        return total


@dataclass
class PrefixMatch:
    length: int  # tokens reusable
    pages: list[int]
    node: Node  # deepest node used (pinned while the request runs)
    snapshot: int | None  # state slot to copy (models with linear attention)


class PrefixCache:
    def __init__(self, page_size: int, needs_state: bool, free_pages, free_state):
        self.page_size, self.needs_state = page_size, needs_state
        self._free_pages, self._free_state = free_pages, free_state
        self.root = Node()
        self._clock = itertools.count(1)
        self.hit_tokens = 0

    # --- lookup -------------------------------------------------------------------------
    def match(self, tokens: list[int]) -> PrefixMatch:
        """Longest reusable prefix of tokens[:-1] (the last token is always computed)."""
        limit = (len(tokens) - 1) // self.page_size * self.page_size
        node, depth, pages = self.root, 0, []
        best = PrefixMatch(0, [], self.root, None)
        now = next(self._clock)
        while depth < limit:
            child = node.children.get(self._page(tokens, depth))
            if child is None:
                break
            n = self._common(child.key, tokens, depth, limit)
            if n < len(child.key):
                if not self.needs_state:  # a partial edge still gives reusable KV pages
                    best = PrefixMatch(depth + n, pages + child.pages[: n // self.page_size], child, None)
                break
            node, depth = child, depth + n
            node.last_use = now
            pages = pages + node.pages
            if not self.needs_state or node.snapshot is not None:
                best = PrefixMatch(depth, pages, node, node.snapshot)
        return best

    def lock(self, node: Node, delta: int) -> None:
        while node is not None:
            node.lock += delta
            node = node.parent

    # --- insertion ----------------------------------------------------------------------
    def insert(self, tokens: list[int], pages: list[int], snapshots: list[tuple[int, int]]) -> None:
        """Give the tree the KV pages of tokens (page aligned) and state checkpoints.

        Pages and snapshot slots the tree already has are freed; the rest become the tree's.
        """
        ps = self.page_size
        n_tok = len(tokens) // ps * ps
        node, depth = self.root, 0
        now = next(self._clock)
        while depth < n_tok:
            child = node.children.get(self._page(tokens, depth))
            if child is None:
                child = Node(tuple(tokens[depth:n_tok]), list(pages[depth // ps: n_tok // ps]), node)
                node.children[child.key[:ps]] = child
                child.last_use = now
                depth = n_tok
                node = child
                break
            n = self._common(child.key, tokens, depth, n_tok)
            if n < len(child.key):
                child = self._split(child, n)
            mine = pages[depth // ps:(depth + n) // ps]
            if mine != child.pages:  # (a request that resumed from this edge holds its very pages)
                self._free_pages([p for p, q in zip(mine, child.pages) if p != q])
            child.last_use = now
            node, depth = child, depth + n
        self._free_pages(pages[n_tok // ps:])
        for pos, slot in snapshots:
            self._attach(tokens, pos, slot)

    def _attach(self, tokens: list[int], pos: int, slot: int) -> None:
        node = self._node_ending_at(tokens, pos)
        if node is None or node.snapshot is not None:
            self._free_state(slot)
        else:
            node.snapshot = slot

    def _node_ending_at(self, tokens: list[int], pos: int) -> Node | None:
        if pos == 0 or pos % self.page_size:
            return None
        node, depth = self.root, 0
        while depth < pos:
            child = node.children.get(self._page(tokens, depth))
            if child is None:
                return None
            n = self._common(child.key, tokens, depth, pos)
            if n < len(child.key):
                if depth + n < pos:
                    return None
                child = self._split(child, n)
            node, depth = child, depth + n
        return node

    def _split(self, child: Node, n: int) -> Node:
        """Split child's edge after n tokens; returns the new upper node."""
        ps = self.page_size
        upper = Node(child.key[:n], child.pages[: n // ps], child.parent, lock=child.lock, last_use=child.last_use)
        child.parent.children[upper.key[:ps]] = upper
        child.key, child.pages, child.parent = child.key[n:], child.pages[n // ps:], upper
        upper.children[child.key[:ps]] = child
        return upper

    # --- eviction -----------------------------------------------------------------------
    def evict_pages(self, needed: int) -> int:
        """Free at least `needed` pages from unpinned leaves, LRU first; returns pages freed."""
        freed = 0
        while freed < needed:
            leaf = self._lru(lambda n: not n.children)
            if leaf is None:
                break
            freed += len(leaf.pages)
            self._free_pages(leaf.pages)
            if leaf.snapshot is not None:
                self._free_state(leaf.snapshot)
            del leaf.parent.children[leaf.key[: self.page_size]]
        return freed

    def evict_state(self) -> bool:
        """Drop the least recently used unpinned state checkpoint."""
        node = self._lru(lambda n: n.snapshot is not None)
        if node is None:
            return False
        self._free_state(node.snapshot)
        node.snapshot = None
        return True

    def _lru(self, pred) -> Node | None:
        best = None
        for n in self.nodes():
            if n.lock == 0 and pred(n) and (best is None or n.last_use < best.last_use):
                best = n
        return best

    def nodes(self):
        """Every node below the root."""
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            yield n

    @property
    def num_pages(self) -> int:
        return sum(len(n.pages) for n in self.nodes())

    # --- helpers ------------------------------------------------------------------------
    def _page(self, tokens: list[int], start: int) -> tuple[int, ...]:
        return tuple(tokens[start:start + self.page_size])

    def _common(self, key: tuple[int, ...], tokens: list[int], start: int, limit: int) -> int:
        """Length (whole pages) of the common prefix of key and tokens[start:limit]."""
        n = common_prefix_length(key, tuple(tokens[start:min(limit, start + len(key))]))
        return n // self.page_size * self.page_size
