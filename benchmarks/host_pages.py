"""Gather and copy rates from page-locked host memory by how its pages are backed (issue 11: what a miss costs).

    python benchmarks/host_pages.py [--gib 2] [--out DIR]

A decode step's misses read experts scattered over host banks of many GiB, and the device
translates every host address it reads through its own page tables. The boot's gather timing
reads the same 16 experts again and again; decode does not. This times, for host buffers of
--gib GiB made three ways,

  torch pinned    `torch.empty(pin_memory=True)` under the engine's allocator settings
                  (`configure_allocator`: malloc, pages touched, cudaHostRegister), as the banks are made
  huge pages      `memory.pinned.pinned_tensors`: an anonymous mapping advised MADV_HUGEPAGE
                  (transparent 2 MiB pages), touched, then cudaHostRegister
  small pages     the same advised MADV_NOHUGEPAGE (4 KiB pages only)

one 256 MiB DMA copy, 16 experts of 1.7 MiB a launch by the gather kernel (each of its configs, the
best kept): the same 16 every launch (as the boot times it) and 16 random ones of the whole buffer
every launch (as decode misses land), and the random ones by one DMA copy each; with the
buffer's share in huge pages (`/proc/self/smaps`, AnonHugePages) and the host's THP setting.
Writes host_pages.md under --out.
"""
from __future__ import annotations

import argparse
import mmap
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moeferry.memory.allocator import configure_allocator  # noqa: E402
from moeferry.memory.pinned import pinned_tensors  # noqa: E402
from moeferry.ops.triton.slot_gather import CONFIGS, SlotGather  # noqa: E402

EXPERT = int(1.7 * 2**20) // 16 * 16
SLOTS, LAUNCHES = 16, 40


def thp_setting() -> str:
    try:
        return Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        return "?"


def huge_share(ptr: int, n: int) -> str:
    """MiB of the mapping holding `ptr` that sit in transparent huge pages (smaps), of n bytes."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if lo <= ptr < hi:
                for field in lines[i + 1:i + 30]:
                    if field.startswith("AnonHugePages:"):
                        return f"{int(field.split()[1]) // 1024} of {n >> 20} MiB"
    return "?"


def small_pages(n: int) -> tuple[torch.Tensor, mmap.mmap]:
    """n bytes of an anonymous mapping in 4 KiB pages, touched, registered with CUDA (a host tensor)."""
    mm = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_NOHUGEPAGE)
    t = torch.frombuffer(mm, dtype=torch.uint8)
    t.fill_(1)
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), n, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister failed: {err}")
    return t, mm


def device_time(fn, reps: int) -> float:
    """Seconds per call of fn(r), by CUDA events over r = 0 .. reps - 1 after an untimed fn(reps)."""
    fn(reps)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for r in range(reps):
        fn(r)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def rates(host: torch.Tensor) -> dict:
    k = host.numel() // EXPERT
    src = host[:k * EXPERT].view(k, EXPERT)
    dst = torch.empty(SLOTS, EXPERT, dtype=torch.uint8, device="cuda")
    big = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    out = {"dma 256 MiB": (256 << 20) / device_time(lambda r: big.copy_(host[:256 << 20], non_blocking=True), 5)}
    gen = torch.Generator().manual_seed(0)
    picks = [torch.randperm(k, generator=gen)[:SLOTS] for _ in range(LAUNCHES + 1)]  # the last: the warm-up's
    ids = {"same 16": [torch.arange(SLOTS, dtype=torch.int32, device="cuda")] * (LAUNCHES + 1),
           "random 16": [p.to(torch.int32).cuda() for p in picks]}
    to = torch.arange(SLOTS, dtype=torch.int32, device="cuda")
    nbytes = SLOTS * EXPERT
    for pattern, lists in ids.items():
        best = None
        for config in CONFIGS:
            g = SlotGather([(src.view(torch.int32), dst.view(torch.int32))], config)
            rate = nbytes / device_time(lambda r: g.indexed(lists[r], to), LAUNCHES)
            if best is None or rate > best[0]:
                best = (rate, config)
        out[f"gather, {pattern}"] = best[0]
        out[f"gather, {pattern}: config"] = best[1]

    def dma_random(r):
        for i, e in enumerate(picks[r].tolist()):
            dst[i].copy_(src[e], non_blocking=True)
    out["dma, random 16"] = nbytes / device_time(dma_random, LAUNCHES)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    configure_allocator(torch.device("cuda"))
    n = int(args.gib * 2**30) // (2 << 20) * (2 << 20)
    lines = [f"{torch.cuda.get_device_name()}; host THP setting: {thp_setting()}; buffers of {n >> 20} MiB, "
             f"experts of {EXPERT / 2**20:.2f} MiB, {SLOTS} a launch", "",
             "| host buffer | in huge pages | DMA 256 MiB GB/s | gather, same 16 GB/s | gather, random 16 GB/s "
             "| DMA, random 16 (one copy each) GB/s | gather configs (same / random) |", "|---|---|---|---|---|---|---|"]
    keep = []
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    pinned.fill_(1)
    bufs = {"torch pinned": pinned}
    try:
        bufs["huge pages"] = pinned_tensors({"bank": ((n,), torch.uint8)})["bank"]
        bufs["small pages"], mm = small_pages(n)
        keep.append(mm)
    except (RuntimeError, OSError, ValueError) as e:
        lines.append(f"(not measured: {e})")
    for name, buf in bufs.items():
        r = rates(buf)
        label = name if buf.is_pinned() else f"{name} (torch: not pinned)"
        lines.append(f"| {label} | {huge_share(buf.data_ptr(), n)} | {r['dma 256 MiB'] / 1e9:.1f} "
                     f"| {r['gather, same 16'] / 1e9:.1f} | {r['gather, random 16'] / 1e9:.1f} "
                     f"| {r['dma, random 16'] / 1e9:.1f} | {r['gather, same 16: config']} / "
                     f"{r['gather, random 16: config']} |")
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host_pages.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
