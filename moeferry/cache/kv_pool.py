"""Paged KV pool: one K and one V buffer per full-attention layer, shared page allocator."""
from __future__ import annotations

import torch


class PoolExhausted(RuntimeError):
    """A pool has fewer free entries than asked for."""


class IdAllocator:
    """Free-list allocator of ids 0..num_pages-1 (KV pages, GDN state slots)."""

    def __init__(self, num_pages: int, what: str = "KV pages"):
        self.num_pages = num_pages
        self.what = what
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def free_ids(self) -> tuple[int, ...]:
        return tuple(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise PoolExhausted(f"{self.what} exhausted: asked for {n}, {len(self._free)} of {self.num_pages} free")
        return [self._free.pop() for _ in range(n)]

    def free(self, ids: list[int]) -> None:
        self._free.extend(reversed(ids))


class KVPool:
    """k[layer], v[layer]: [num_pages * page_size, num_kv_heads, head_dim]."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.page_size = page_size
        self.pages = IdAllocator(num_pages)
        shape = (num_pages * page_size, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def num_tokens(self) -> int:
        return self.pages.num_pages * self.page_size

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one token in every full-attention layer (the memory plan's KV term)."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
