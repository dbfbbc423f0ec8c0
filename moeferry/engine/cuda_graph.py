"""CUDA graphs of the decode step (one token per sequence), one per padded batch size.

Each graph reads its inputs from static buffers: token ids, positions, KV slots of the new
tokens, the page table, and the int32 metadata (cu_seqlens, kv_lens, state slots) that the
kernels take as device tensors. A step of B sequences runs the graph of the smallest
captured size >= B; rows past B are padding: KV slot -1 and state slot -1 (the kernels skip
their writes) and kv_len 0 (attention returns zeros), so padding never touches a pool.

A batch the graphs cannot serve (prefill, too many sequences, a longer page table) or a
model that cannot be captured runs eagerly. Capture is lazy, per size, on first use (or all
at once with `capture_all`). Before capturing, one eager warm-up runs with PyTorch's sync
debug mode set to error: an op that synchronises with the host (e.g. the reference MoE loop's
`.tolist()`) cannot live in a graph, and then graphs are switched off for good with the
reason in `disabled` (a first warm-up without the check compiles and autotunes kernels, whose
benchmarking may synchronise legitimately). Graphs hold raw pointers into the KV/state pools and weights: call
`invalidate()` after any of them is reallocated.

The expert backend's `before_graph(size)` runs before a graph of that size is checked,
captured or replayed (an offload cache managed on the device during graph steps takes its state
from the host there). A step whose expert backend must act on the host between two kernels (an
offload cache that can miss and is managed on the host: each MoE layer reads its router's
choices and fetches the misses) is captured piecewise (`StepGraphs`): the backend cuts the capture at each such point, and a replay runs
the graphs in order with the host work between them. The check run calls each cut's host
work at once, with the sync check off for it alone.
"""
from __future__ import annotations

import logging
import os
import traceback
from contextlib import contextmanager
from typing import Callable

import torch

from moeferry.model.batch import ForwardBatch, SeqChunk, feed_tokens, int32_tensor
from moeferry.transfer import staged, to_device

log = logging.getLogger(__name__)

SCATTER_PAGES = 64  # a row with more new pages than this is copied as one slice, not scattered


def default_sizes(max_batch: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256) if s < max_batch]
    return sizes + [max_batch]


def sync_site(e: BaseException) -> str:
    """' at FILE:LINE in FUNC: `code`' for the innermost moeferry frame of an exception's
    traceback: the op that synchronised (or failed) during warm-up or capture."""
    frames = [(f, f.filename.replace("\\", "/")) for f in traceback.extract_tb(e.__traceback__)]
    frames = [(f, p) for f, p in frames if "moeferry/" in p and "site-packages" not in p]
    if not frames:
        return ""
    f, path = frames[-1]
    path = path[path.rfind("moeferry/"):]
    return f" at {path}:{f.lineno} in {f.name}: `{(f.line or '').strip()}`"


HostWork = Callable[[int], None]  # a cut's host work, given the number of real (unpadded) rows


class StepGraphs:
    """One decode step as a chain of CUDA graphs, cut where the host must act (`cut(work)`
    while capturing); `replay(rows)` runs graph 0, work 0, graph 1, ... The graphs share one
    memory pool, which is safe because they always replay in the order they were captured."""

    def __init__(self, pool=None):
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.work: list[HostWork] = []
        self.pool = pool

    def begin(self) -> None:
        self.graphs.append(torch.cuda.CUDAGraph())
        self.graphs[-1].capture_begin(pool=self.pool)

    def end(self) -> None:
        self.graphs[-1].capture_end()
        if self.pool is None:
            self.pool = self.graphs[-1].pool()

    def cut(self, work: HostWork) -> None:
        """End the graph being captured; `work` runs after it at replay, before the next graph."""
        self.end()
        self.work.append(work)
        self.begin()

    def abort(self) -> None:
        """Leave capture mode after a failure (the partial graph is dropped)."""
        try:
            self.graphs[-1].capture_end()
        except RuntimeError:
            pass
        self.graphs.clear()

    def replay(self, rows: int) -> None:
        for i, graph in enumerate(self.graphs):
            graph.replay()
            if i < len(self.work):
                self.work[i](rows)


class CheckedCuts:
    """The sync-check run's cuts: the host work runs at once, with the sync check off for it."""

    def __init__(self, rows: int):
        self.rows = rows

    def cut(self, work: HostWork) -> None:
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)
        try:
            work(self.rows)
        finally:
            torch.cuda.set_sync_debug_mode(mode)


class PageRows:
    """Keeps the graphs' device page table in step with the batch's page lists, moving only
    what changed. A decode step appends a token, so a row gains at most a page a step, while
    rebuilding the whole [batch, pages] table from the lists cost 1.8 ms of host time a step at
    32k tokens of context (page size 1), 7.5 ms at 128k, 11.6 ms at batch 4 and 32k
    (`benchmarks/graph_inputs.py`, 2-core CPU box). Each row remembers the list it was
    written from (the cache manager grows a sequence's list in place), how many pages it
    wrote and the last of them; a row whose list is another, shorter, or changed under it is
    written whole. The new pages of every row then move in one scatter."""

    def __init__(self, table: torch.Tensor):
        self.table, self.width = table, table.shape[1]
        self.rows: list[tuple[list[int] | None, int, int]] = [(None, 0, -1)] * table.shape[0]

    def load(self, page_lists: list[list[int]]) -> None:
        at, values = [], []
        for b, pages in enumerate(page_lists):
            held, done, last = self.rows[b]
            n = len(pages)
            if held is not pages or done > n or (done and pages[done - 1] != last):
                done = 0  # another sequence in this row (or its list changed): write it whole
            if n - done > SCATTER_PAGES:
                self.table[b, done:n].copy_(staged(int32_tensor(pages[done:]), self.table.device), non_blocking=True)
            else:
                at += range(b * self.width + done, b * self.width + n)
                values += pages[done:]
            self.rows[b] = (pages, n, pages[-1] if n else -1)
        if values:
            moved = to_device(torch.tensor([at, values], dtype=torch.int64), self.table.device)
            self.table.view(-1).index_copy_(0, moved[0], moved[1].to(torch.int32))


class _Staging:
    """One set of host staging for the static inputs (pinned on CUDA) and the event of its last
    copies to the device."""

    def __init__(self, n: int, device: torch.device):
        self.tokens = staged(torch.zeros(3, n, dtype=torch.long), device)  # ids, positions, KV slots
        self.meta = staged(torch.zeros(3 * n + 1, dtype=torch.int32), device)  # cu | kv_lens | state slots
        self.cuda = device.type == "cuda"
        self.done: torch.cuda.Event | None = None

    def copied(self) -> None:
        """Copies from this set were just queued."""
        if self.cuda:
            self.done = torch.cuda.current_stream().record_event()

    def wait(self) -> None:
        """Until those copies have run (two steps back: at once, in practice)."""
        if self.done is not None:
            self.done.synchronize()
            self.done = None


class DecodeGraphs:
    def __init__(self, model, kv_pool, state_pool, max_batch: int, max_pages: int, page_size: int,
                 device: torch.device, sizes: list[int] | None = None, experts=None):
        """`experts`: the expert backend; its `capturing` is set to the step being captured, so
        that a layer which must act on the host can cut it (None: nothing cuts)."""
        self.model, self.kv_pool, self.state_pool, self.experts = model, kv_pool, state_pool, experts
        self.sizes = sorted(set(sizes or default_sizes(max_batch)))
        self.max_batch, self.max_pages, self.page_size = self.sizes[-1], max_pages, page_size
        self.device = device
        n = self.max_batch
        self.tokens = torch.zeros(3, n, dtype=torch.long, device=device)  # ids, positions, KV slots
        self.meta = torch.zeros(3 * n + 1, dtype=torch.int32, device=device)  # cu | kv_lens | state slots
        self.page_table = torch.zeros(n, max_pages, dtype=torch.int32, device=device)
        self.page_rows = PageRows(self.page_table)
        self.rows = torch.arange(n, dtype=torch.long, device=device)
        # Host staging, two sets used in turn (`_load`): pinned on CUDA, so a step's input copies are
        # queued behind the step in flight (from pageable memory a copy synchronises the stream:
        # with overlapped steps the host waited for the whole previous step before launching the
        # next); a set is refilled only once its copies of two steps back have run.
        self._staging = [_Staging(n, device) for _ in range(2)]
        self._turn = 0
        self.graphs: dict[int, tuple[StepGraphs, torch.Tensor]] = {}
        self.pool = None
        # one side stream for every capture: the allocator keeps a stream's freed blocks for
        # that stream, so a new stream per (re)capture left its own mapped pages behind each
        # time (the H200's seed boot: 20-35 MiB more "reserved but unallocated" per recapture
        # after a shrink, until an 8192-token chunk's 256 MiB no longer fitted)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.disabled: str | None = None
        if os.environ.get("MOEFERRY_CUDA_GRAPHS", "1") == "0":
            self.disabled = "MOEFERRY_CUDA_GRAPHS=0"
        for _ in self._staging:
            self._next_staging()
            self._fill_padding(0, n)

    # -- static batch ---------------------------------------------------------------------
    def _batch(self, n: int) -> ForwardBatch:
        """The ForwardBatch a graph of size n is captured over: views of the static buffers."""
        m = self.max_batch
        return ForwardBatch(
            input_ids=self.tokens[0, :n], positions=self.tokens[1, :n], q_lens=[1] * n, kv_lens=[0] * n,
            cu_seqlens=list(range(n + 1)), page_table=self.page_table[:n], out_slots=self.tokens[2, :n],
            state_slots=[-1] * n, logit_rows=self.rows[:n], page_size=self.page_size,
            cu_seqlens_t=self.meta[: n + 1], kv_lens_t=self.meta[m + 1: m + 1 + n],
            state_slots_t=self.meta[2 * m + 1: 2 * m + 1 + n], max_q_len=1)

    def _next_staging(self) -> "_Staging":
        """The other staging set, once the copies from it (two steps back) have run."""
        self._turn ^= 1
        staging = self._staging[self._turn]
        staging.wait()
        return staging

    def _fill_padding(self, start: int, end: int) -> None:
        """The current staging set's rows start..end-1 as padding (no KV or state writes, empty context)."""
        m = self.max_batch
        ht, hm = self._staging[self._turn].tokens, self._staging[self._turn].meta
        ht[:2, start:end] = 0
        ht[2, start:end] = -1
        hm[: m + 1] = torch.arange(m + 1, dtype=torch.int32)
        hm[m + 1 + start: m + 1 + end] = 0
        hm[2 * m + 1 + start: 2 * m + 1 + end] = -1

    def _load(self, chunks: list[SeqChunk], size: int, feed: torch.Tensor | None = None) -> None:
        m, ps = self.max_batch, self.page_size
        staging = self._next_staging()
        ht, hm = staging.tokens, staging.meta
        for b, c in enumerate(chunks):
            p = c.start
            ht[0, b], ht[1, b], ht[2, b] = c.tokens[0], p, c.pages[p // ps] * ps + p % ps
            hm[m + 1 + b], hm[2 * m + 1 + b] = p + 1, c.state_slot
        self._fill_padding(len(chunks), size)
        self.tokens.copy_(ht, non_blocking=True)
        feed_tokens(self.tokens[0], chunks, range(1, len(chunks) + 1), feed)
        self.meta.copy_(hm, non_blocking=True)
        staging.copied()
        self.page_rows.load([c.pages for c in chunks])

    # -- capture / replay -----------------------------------------------------------------
    def can_run(self, chunks: list[SeqChunk]) -> bool:
        return (self.disabled is None and 0 < len(chunks) <= self.max_batch
                and all(len(c.tokens) == 1 and len(c.pages) <= self.max_pages for c in chunks))

    @contextmanager
    def _cuts(self, cuts):
        """The expert backend sees `cuts` as the step being captured (if it can cut one)."""
        if self.experts is None:
            yield
            return
        self.experts.capturing = cuts
        try:
            yield
        finally:
            self.experts.capturing = None

    def _capture(self, size: int) -> bool:
        staging = self._next_staging()
        self._fill_padding(0, self.max_batch)
        self.tokens.copy_(staging.tokens)
        self.meta.copy_(staging.meta)
        batch = self._batch(size)
        stream = self.stream
        stream.wait_stream(torch.cuda.current_stream())
        step = StepGraphs(self.pool)
        try:
            with torch.cuda.stream(stream):
                self.model.forward(batch, self.kv_pool, self.state_pool)  # compiles / autotunes kernels
                self._before(size)
                prev = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    with self._cuts(CheckedCuts(size)):
                        self.model.forward(batch, self.kv_pool, self.state_pool)  # finds host syncs
                finally:
                    torch.cuda.set_sync_debug_mode(prev)
            torch.cuda.synchronize(self.device)
            self._before(size)
            with torch.cuda.stream(stream), self._cuts(step):
                step.begin()
                out = self.model.forward(batch, self.kv_pool, self.state_pool)
                step.end()
        except Exception as e:  # (any failure: decode then runs eagerly, the log says why; never a dead boot)
            if step.graphs:
                step.abort()
            torch.cuda.synchronize()
            if self.experts is not None:
                self.experts.graph_failed()
            if isinstance(e, torch.OutOfMemoryError):  # not the step's fault: tried again on the next use
                log.warning("decode x%d not captured (out of memory); runs eagerly until a capture fits", size)
                return False
            self.disable(f"decode step cannot be captured ({str(e).splitlines()[0]}){sync_site(e)}")
            return False
        self.pool = step.pool
        self.graphs[size] = (step, out)
        if len(step.graphs) > 1:
            log.info("decode x%d captured in %d graphs (cut at %d host steps)", size, len(step.graphs),
                     len(step.work))
        return True

    def _before(self, size: int) -> None:
        if self.experts is not None:
            self.experts.before_graph(size)

    def capture_all(self) -> bool:
        for size in reversed(self.sizes):
            if size not in self.graphs and not self._capture(size):
                return False
        return True

    def capture_missing(self) -> None:
        """Capture every size not captured yet (after `invalidate`), then hand the warm-up
        passes' freed blocks back to the device: a step right after runs in the memory layout
        serving will have (the boot self-test retries its prefill chunk after a shrink so)."""
        if self.disabled is None:
            self.capture_all()
            torch.cuda.empty_cache()

    def run(self, chunks: list[SeqChunk], feed: torch.Tensor | None = None) -> torch.Tensor | None:
        """fp32 logits [len(chunks), vocab], or None when this batch must run eagerly (`feed`:
        the previous step's tokens, for the chunks whose token is `fed`)."""
        if not self.can_run(chunks):
            return None
        size = next(s for s in self.sizes if s >= len(chunks))
        if size not in self.graphs and not self._capture(size):
            return None
        self._load(chunks, size, feed)
        self._before(size)
        step, out = self.graphs[size]
        step.replay(len(chunks))
        return out[: len(chunks)].clone()

    def disable(self, reason: str) -> None:
        """Decode runs eagerly from now on; the log says why."""
        self.disabled = reason
        log.warning("CUDA graphs off: %s", reason)

    def invalidate(self) -> None:
        """Drop every graph (after pools or weights were reallocated); they recapture on use."""
        self.graphs.clear()
        self.pool = None
