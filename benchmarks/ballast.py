"""GPU ballast: take all but `--leave-gib` GiB of the device's free memory and hold it.

Makes a big GPU look like the seed's card (14.59 GiB free) to a server started after it.
The memory is plain cudaMalloc memory (PyTorch's caching allocator, one block per request,
no expandable segments), touched once so it is really backed. With `--h2d` it first measures
pinned host->device copy bandwidth (the PCIe bound of the offload benchmarks) while the card
is still empty. It prints one line `BALLAST {json}` (free memory left, bytes held, the
bandwidths), then sleeps until it is killed; the memory goes back when the process ends.

    python benchmarks/ballast.py --leave-gib 14.6 --h2d      # hold; print BALLAST {...}
    python benchmarks/ballast.py --h2d                       # only measure, then exit

Without CUDA it prints `BALLAST {"error": ...}` and exits 3.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

GIB = 2**30
MIB = 2**20
GRAIN = 2 * MIB  # the caching allocator rounds large blocks to 2 MiB


def report(info: dict) -> None:
    print("BALLAST " + json.dumps(info), flush=True)


def h2d_bandwidth(torch, sizes: list[int], total: int = 2 * GIB) -> dict[str, float]:
    """Pinned host->device copy bandwidth (bytes/s) per copy size: `total` bytes moved per
    timing as back-to-back copies of `size` bytes from a pinned buffer, median of 5 timings."""
    dev = torch.device("cuda")
    src = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    src.fill_(7)  # DMA speed does not depend on the bytes; this just backs the pages
    dst = torch.empty(total, dtype=torch.uint8, device=dev)
    out = {}
    for size in sizes:
        n = max(1, total // size)
        stream = torch.cuda.Stream()
        times = []
        for rep in range(6):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record()
                for i in range(n):
                    dst[i * size:(i + 1) * size].copy_(src[i * size:(i + 1) * size], non_blocking=True)
                end.record()
            end.synchronize()
            if rep:  # the first is a warm-up
                times.append(start.elapsed_time(end) / 1e3)
        out[str(size)] = n * size / sorted(times)[len(times) // 2]
    del src, dst
    torch.cuda.empty_cache()
    return out


def hold(torch, leave: int) -> tuple[list, int]:
    """Allocate until `leave` bytes (to 2 MiB) are free; returns the blocks and bytes held."""
    blocks, held = [], 0
    for _ in range(64):  # a few rounds: the first allocation can move the context's own usage
        free, _ = torch.cuda.mem_get_info()
        want = (free - leave) // GRAIN * GRAIN
        if want < GRAIN:
            break
        chunk = min(want, 16 * GIB)  # chunks: a fragmented card may lack one huge free range
        try:
            blocks.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
        except RuntimeError:  # out of memory at this size: try a smaller one
            torch.cuda.empty_cache()
            if chunk <= GRAIN:
                break
            blocks.append(torch.empty(chunk // 2 // GRAIN * GRAIN, dtype=torch.uint8, device="cuda"))
        blocks[-1].fill_(1)  # back every page
        held += blocks[-1].numel()
    torch.cuda.synchronize()
    return blocks, held


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--leave-gib", type=float, default=None, help="GiB to leave free (omit: allocate nothing)")
    ap.add_argument("--h2d", action="store_true", help="measure pinned host->device bandwidth first")
    ap.add_argument("--h2d-sizes", default="2,64", help="copy sizes in MiB for --h2d (default: 2,64)")
    args = ap.parse_args()
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # plain cudaMalloc blocks (must precede CUDA init)
    import torch

    if not torch.cuda.is_available():
        report({"error": "no CUDA device"})
        return 3
    info: dict = {"pid": os.getpid(), "device": torch.cuda.get_device_name()}
    if args.h2d:
        sizes = [int(float(s) * MIB) for s in args.h2d_sizes.split(",") if s]
        info["h2d_bytes_per_s"] = h2d_bandwidth(torch, sizes)
    free0, total = torch.cuda.mem_get_info()
    info.update(total_gib=round(total / GIB, 3), free_before_gib=round(free0 / GIB, 3))
    if args.leave_gib is None:
        report(info)
        return 0
    blocks, held = hold(torch, int(args.leave_gib * GIB))
    free, _ = torch.cuda.mem_get_info()
    info.update(leave_gib=args.leave_gib, held_gib=round(held / GIB, 3), free_gib=round(free / GIB, 3))
    report(info)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
