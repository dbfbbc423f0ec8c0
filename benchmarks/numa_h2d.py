"""Host-to-device copy rate from page-locked memory on each NUMA node (issue 11: what a miss costs).

    python benchmarks/numa_h2d.py [--mib 256] [--out DIR]

A miss reads its expert from the host bank (the gather kernel, or a DMA copy). On a host with
several NUMA nodes, a bank whose pages sit on a node away from the GPU's PCIe root reaches the
GPU through the socket link. Prints the nodes (their CPUs), the GPU's node (sysfs, by its PCI bus
id), and, for page-locked buffers placed different ways, where their pages landed
(`/proc/self/numa_maps`) and their copy rate to the GPU: one DMA of --mib MiB, copies of 1.7 MiB
(an NVFP4 expert), the gather kernel moving 1.7 MiB experts from the buffer, and moving 8
experts laid out as NVFP4 slot tensors (six parts), also by the kernel as it was before its work
items became (part, block) pieces (a copy of that kernel here: the baseline of that change):
  engine pinned   `torch.empty(pin_memory=True)` under the engine's allocator settings
                  (`configure_allocator`: malloc, then cudaHostRegister from 16 threads), as the
                  expert banks are made
  node N          malloc, every page first touched by a thread bound to node N's CPUs, then
                  cudaHostRegister
  (--prefer)      engine pinned after `memory.numa.prefer_gpu_node`, set first (the engine's
                  policy; a host with one node: unchanged)
Writes numa_h2d.md under --out.
"""
from __future__ import annotations

import argparse
import ctypes
import re
import sys
import threading
import time
from pathlib import Path

import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moeferry.memory.allocator import configure_allocator  # noqa: E402
from moeferry.memory.numa import gpu_node, prefer_gpu_node  # noqa: E402

EXPERT = int(1.7 * 2**20) // 16 * 16


def nodes() -> dict[int, list[int]]:
    """NUMA node -> its CPUs (sysfs); one node 0 with every CPU where sysfs has none."""
    import os
    out = {}
    for d in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        cpus = []
        for part in (d / "cpulist").read_text().strip().split(","):
            if part:
                lo, _, hi = part.partition("-")
                cpus += list(range(int(lo), int(hi or lo) + 1))
        out[int(d.name[4:])] = cpus
    return out or {0: sorted(os.sched_getaffinity(0))}


def pages_by_node(ptr: int) -> str:
    """N0=.. N1=.. pages of the mapping that holds `ptr`: /proc/self/numa_maps lists each mapping
    by its start, so the one starting last at or below ptr."""
    best, text = -1, "?"
    for line in Path("/proc/self/numa_maps").read_text().splitlines():
        start = int(line.split()[0], 16)
        if best < start <= ptr:
            best, text = start, " ".join(f"N{n}={c}" for n, c in re.findall(r"N(\d+)=(\d+)", line)) or "?"
    return text


def touched_on(n: int, cpus: list[int], torch):
    """n bytes of malloc'd memory, first touched by a thread bound to `cpus`, then registered."""
    import os
    buf = torch.empty(n, dtype=torch.uint8)

    def touch():
        os.sched_setaffinity(0, cpus)
        ctypes.memset(buf.data_ptr(), 1, n)
    t = threading.Thread(target=touch)
    t.start()
    t.join()
    err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), n, 0)
    assert int(err) == 0, f"cudaHostRegister: {err}"
    return buf


# an NVFP4 expert's slot tensors at Qwen3.6-35B-A3B's geometry, bytes (weights, block scales, row
# scales of gate_up, then down): the gather kernel's work items come from these parts
EXPERT_PARTS = (1 << 20, 1 << 16, 4096, 1 << 19, 1 << 15, 8192)


@triton.jit(do_not_specialize=["items"])
def _gather_before(desc_ptr, src_ptr, dst_ptr, src_base, dst_base, items, parts, blocks, BLOCK: tl.constexpr):
    """The gather kernel before its work items became a table of (part, block) pieces (vec path
    only): items (expert, part, block) over the widest part's block count, a hit's items masked."""
    for w in range(tl.program_id(0), items, tl.num_programs(0)):
        i, part, blk = w // (parts * blocks), (w // blocks) % parts, w % blocks
        s = tl.load(src_ptr + i).to(tl.int64)
        d = tl.load(dst_ptr + i).to(tl.int64)
        field = desc_ptr + part * 5
        src = src_base + (tl.load(field) + s * tl.load(field + 2)) * 4
        dst = dst_base + (tl.load(field + 1) + tl.maximum(d, 0) * tl.load(field + 3)) * 4
        n = tl.load(field + 4) * 4
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        m = (offs < n) & (d >= 0)
        tl.store(dst + offs, tl.load(src + offs, mask=m), mask=m)


def gather_rates(host, torch) -> tuple[float, float]:
    """GB/s of the gather kernel now and before its work-item change, 8 experts a launch in
    EXPERT_PARTS' layout carved from `host` (one [experts, part] tensor a part), 16384 words x 16 warps."""
    from moeferry.ops.triton.slot_gather import SlotGather
    per = sum(EXPERT_PARTS)
    k = min(64, host.numel() // per)
    pairs, at = [], 0
    for size in EXPERT_PARTS:
        src = host[at:at + k * size].view(k, size).view(torch.int32)
        pairs.append((src, torch.empty_like(src, device="cuda")))
        at += k * size
    g = SlotGather(pairs, (16384, 16, True))
    assert g.vec
    ids = torch.arange(8, device="cuda", dtype=torch.int32)
    blocks = max(triton.cdiv(a.shape[1], g.block) for a, _ in pairs)
    items = 8 * len(pairs) * blocks

    def before():
        _gather_before[(items,)](g.desc, ids, ids, *g.base, items, len(pairs), blocks, BLOCK=g.block, num_warps=16)
    return tuple(_timed(fn, 8 * per, torch) for fn in (lambda: g.indexed(ids, ids), before))


def _timed(fn, nbytes, torch, reps=7):
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def rates(host, torch) -> tuple[float, float, float]:
    """GB/s: one DMA of the whole buffer, 1.7 MiB DMA copies, the gather kernel's 1.7 MiB experts."""
    from moeferry.ops.triton.slot_gather import SlotGather
    n = host.numel()
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")

    def timed(fn, nbytes):
        return _timed(fn, nbytes, torch)
    whole = timed(lambda: dev.copy_(host, non_blocking=True), n)
    k = n // EXPERT
    src, dst = host[:k * EXPERT].view(k, EXPERT), dev[:k * EXPERT].view(k, EXPERT)
    pieces = timed(lambda: [dst[i].copy_(src[i], non_blocking=True) for i in range(k)], k * EXPERT)
    gather = SlotGather([(src.view(torch.int32), dst.view(torch.int32))], (16384, 16, True))
    ids = torch.arange(k, device="cuda", dtype=torch.int32)
    kernel = timed(lambda: gather.indexed(ids, ids), k * EXPERT)
    return whole, pieces, kernel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--prefer", action="store_true", help="only the engine's pinned memory, the GPU's node preferred "
                    "first (`prefer_gpu_node`, as the engine sets it before any bank)")
    args = ap.parse_args()
    import torch
    configure_allocator(torch.device("cuda"))
    n = args.mib << 20
    topo = nodes()
    lines = [f"{torch.cuda.get_device_name()}; NUMA nodes: " + "; ".join(
        f"node {k}: {len(v)} CPUs ({v[0]}-{v[-1]})" for k, v in topo.items()) + f"; the GPU's node: {gpu_node(torch.device('cuda'))}",
        "", "| host buffer | its pages | DMA, one copy GB/s | DMA, 1.7 MiB copies GB/s | gather kernel GB/s "
        "| gather, NVFP4 layout, 8 experts GB/s | the same, kernel before the work-item change GB/s |",
        "|---|---|---|---|---|---|---|"]
    preferred = prefer_gpu_node(torch.device("cuda")) if args.prefer else None  # before any pinned memory
    name = "engine pinned" + (f", node {preferred} preferred (the engine's policy)" if args.prefer else "")
    bufs = {name: torch.empty(n, dtype=torch.uint8, pin_memory=True)}
    bufs[name].fill_(1)
    for node, cpus in topo.items() if not args.prefer else ():
        bufs[f"node {node}"] = touched_on(n, cpus, torch)
    for name, buf in bufs.items():
        whole, pieces, kernel = rates(buf, torch)
        now, before = gather_rates(buf, torch)
        lines.append(f"| {name} | {pages_by_node(buf.data_ptr())} | {whole:.1f} | {pieces:.1f} | {kernel:.1f} "
                     f"| {now:.1f} | {before:.1f} |")
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"numa_h2d{'_prefer' if args.prefer else ''}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
