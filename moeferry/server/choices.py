"""`n` choices of one request: n generations started together, their streams merged.

Each choice is its own engine request (they share the prompt's KV through the prefix cache). A
seeded request gives choice i the seed `seed + i`, so the choices differ and the whole answer is
still reproducible. If starting any choice fails, the ones already started are aborted.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator

from moeferry.scheduler.sampling import SamplingParams
from moeferry.server.protocol import bad_request

MAX_CHOICES = 16


async def start_choices(frontend, prompt_ids: list[int], params: SamplingParams, prefix: str, n: int) -> list:
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request(f"n must be at least 1 and at most {MAX_CHOICES}, got {n}", param="n", code="invalid_value")
    gens = []
    try:
        for i in range(n):
            p = params if params.seed is None or i == 0 else params.replace(seed=(params.seed + i) % 2**64)
            gens.append(await frontend.start(prompt_ids, p, prefix))
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
