"""`n` choices of each prompt of one request: the generations started together, their streams merged.

Each choice is its own engine request (a prompt's choices share its KV through the prefix cache).
A seeded request gives choice j of a prompt the seed `seed + j`, so the choices differ and the
whole answer is still reproducible. Choice i * n + j is prompt i's j-th (a completions request may
list several prompts). If starting any choice fails, the ones already started are aborted.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from moeferry.scheduler.sampling import SamplingParams
from moeferry.server.protocol import bad_request

MAX_CHOICES = 16
MAX_GENERATIONS = 64  # prompts x n in one request (a completions request may list prompts)


async def start_choices(frontend, prompts: list[list[int]], params: SamplingParams, prefix: str, n: int) -> list:
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"n must be at least 1 and at most {MAX_CHOICES}, got {n}", param="n", code="invalid_value")
    if len(prompts) * n > MAX_GENERATIONS:
        raise bad_request(f"at most {MAX_GENERATIONS} generations (prompts x n) in one request, got "
                          f"{len(prompts)} x {n}", param="prompt", code="invalid_value")
    gens = []
    try:
        for ids in prompts:
            for i in range(n):
                p = params if params.seed is None or i == 0 else params.replace(seed=(params.seed + i) % 2**64)
                gens.append(await frontend.start(ids, p, prefix))
    except BaseException:
        for gen in gens:
            gen.close()
        raise
    return gens


async def merge(streams: list[AsyncIterator]) -> AsyncIterator:
    """Items of all streams as they come; the first stream's error is raised."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream):
        try:
            async for item in stream:
                await queue.put(item)
            await queue.put(done)
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await queue.put(e)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        left = len(streams)
        while left:
            item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
