"""How fast a quantized checkpoint's experts load (issues 11, 13): seconds per MoE layer and GB/s.

    python benchmarks/load_speed.py --model DIR [--device cpu|cuda] [--layers N] [--threads T]

Rows, per MoE layer (the mean over the first `--layers` MoE layers but the first, which pays
one-time costs: staging buffers, the placement's template), all from the page cache (the files
are read once first):
  raw read          the layer's expert bytes read from the files with plain reads (the bound)
  bank before       per-expert reads (`get`), `pack` (a copy), then the slot write (runs first: its
                    pinned memory comes from cudaHostAlloc, as before)
  bank after        the loader's path (pinned by malloc + cudaHostRegister from several threads:
                    `configure_allocator`): one `moe.placement.Placement` for all timed layers, so
                    the first layer is placed from views of the mapped files (each part copied once
                    into the bank) and the next ones from its template (no views)
  pinned alloc only the bank's pinned allocation alone, as `bank after` makes it
  resident before   per-expert reads, `pack`, one write per expert into the device slots
  resident after    one `HostStaging` for all timed layers (its buffers allocated at the first
                    layers, its placement's template from the second): every layer staged on the host
Banks are pinned with `--device cuda` (as the offload backends build them); resident slots go
to `--device` (on the CPU the resident backend keeps the packed experts: no copy at all, so its
row times only the read). `--load-model` also times a whole `load_model` per backend (with the cycle
collector paused, as `Engine.build` runs it; 1 and
--threads threads), and with `--compare BF16_DIR` a bf16 checkpoint's resident load: the per-byte
ratio. `--compare` also times the resident placement alone per layer in steady state for both
checkpoints (no dense weights, no first-layer costs): the per-byte ratio of the experts' path.
"""
from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

import torch

from moeferry.checkpoint.reader import CheckpointReader
from moeferry.model.loader import _layer_experts
from moeferry.model.registry import resolve_spec
from moeferry.model.weights import WeightLoader
from moeferry.memory import collector
from moeferry.memory.allocator import configure_allocator
from moeferry.moe.bank import build_bank
from moeferry.moe.placement import Placement
from moeferry.moe.slots import HostStaging, SlotBuffer


def expert_ranges(reader: CheckpointReader, layer: int) -> list[tuple[str, int, int]]:
    """(file, start, end) of every routed-expert tensor of `layer`, in file order."""
    prefix = f"model.layers.{layer}.mlp.experts."
    return sorted((str(i.file), i.start, i.end) for n, i in reader.tensors.items() if n.startswith(prefix))


def raw_read(ranges) -> int:
    """Read the ranges into one buffer with pread; the bytes read."""
    total = sum(b - a for _, a, b in ranges)
    buf = memoryview(bytearray(total))
    fds, pos = {}, 0
    try:
        for path, a, b in ranges:
            fd = fds.get(path) or fds.setdefault(path, os.open(path, os.O_RDONLY))
            pos += os.preadv(fd, [buf[pos:pos + b - a]], a)
    finally:
        for fd in fds.values():
            os.close(fd)
    return pos


def per_expert_slots(experts, device, pin: bool, threads: int) -> SlotBuffer:
    """The path before: `pack` each expert (a copy), then write the packed tensors into its slot."""
    buf = SlotBuffer.allocate(experts.format, experts.num_experts, experts.experts[0], device, pin=pin)

    def put(e: int) -> None:
        buf.write_packed(e, buf.pack(experts.experts[e]))
    if threads > 1:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(put, range(experts.num_experts)))
    else:
        for e in range(experts.num_experts):
            put(e)
    return buf


def resident_slots(experts, device, staging: HostStaging) -> SlotBuffer:
    return staging.to_device(experts, [], device)


def pinned_bank(experts) -> SlotBuffer:
    configure_allocator(torch.device("cuda"))
    return SlotBuffer.allocate(experts.format, experts.num_experts, experts.experts[0], "cpu", pin=True)


def empty_host_cache(device: torch.device) -> None:
    """Free cached pinned blocks, so every case allocates its bank anew (as loading does)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch._C._host_emptyCache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device) -> tuple[float, object]:
    sync(device)
    t = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t, out


def open_layers(model: str, layers: int) -> tuple[CheckpointReader, object, WeightLoader, list[int]]:
    """The checkpoint's reader, spec, a host WeightLoader and its first `layers` MoE layers."""
    reader = CheckpointReader(model)
    spec = resolve_spec(reader)
    moe = [i for i in range(spec.num_layers) if spec.is_moe_layer(i)][:layers]
    return reader, spec, WeightLoader(reader, torch.bfloat16, "cpu"), moe


def measure(model: str, device: torch.device, layers: int, threads: int) -> list[tuple[str, float, int]]:
    reader, spec, w, moe = open_layers(model, layers)
    pin = device.type == "cuda"
    placement, staging = Placement(), HostStaging(pin=pin, depth=2)  # kept from layer to layer, as loading keeps them
    rows: dict[str, list[float]] = {}
    nbytes = 0
    for layer in moe:
        p = f"model.layers.{layer}.mlp."
        ranges = expert_ranges(reader, layer)
        raw_read(ranges)  # into the page cache
        t, n = timed(lambda: raw_read(ranges), device)
        nbytes += n
        rows.setdefault("raw read", []).append(t)
        cases = {
            "bank before": lambda: per_expert_slots(_layer_experts(w, spec, p, threads, mapped=False), "cpu", pin,
                                                    threads),
            "bank after": lambda: build_bank(_layer_experts(w, spec, p, threads), pin, placement),
        }
        if pin:
            cases["pinned alloc only"] = lambda: pinned_bank(_layer_experts(w, spec, p, threads))
        if device.type == "cpu":
            cases["resident after (read only)"] = lambda: list(_layer_experts(w, spec, p, threads).experts)
        else:
            cases["resident before"] = lambda: per_expert_slots(_layer_experts(w, spec, p, threads, mapped=False),
                                                                device, False, threads)
            cases["resident after"] = lambda: resident_slots(_layer_experts(w, spec, p, threads), device, staging)
        for name, fn in cases.items():
            t, out = timed(fn, device)
            rows.setdefault(name, []).append(t)
            del out
            empty_host_cache(device)
    per_layer = nbytes / len(moe)
    steady = [ts[1:] or ts for ts in rows.values()]  # the first layer pays one-time costs (buffers, templates)
    return [(name, sum(ts) / len(ts), per_layer) for name, ts in zip(rows, steady)]


def resident_steady(model: str, device: torch.device, layers: int, threads: int) -> tuple[float, int]:
    """The resident backend's placement of one MoE layer (the loader's read, the staging, the
    copy to `device`): seconds, the mean over `layers` layers but the first; the
    layer's expert bytes."""
    reader, spec, w, moe = open_layers(model, max(2, layers))
    staging = HostStaging(pin=device.type == "cuda", depth=2)  # as the resident backend
    times, nbytes = [], 0
    for layer in moe:
        ranges = expert_ranges(reader, layer)
        nbytes = raw_read(ranges)  # into the page cache
        p = f"model.layers.{layer}.mlp."
        times.append(timed(lambda: resident_slots(_layer_experts(w, spec, p, threads), device, staging), device)[0])
    steady = times[1:] or times
    return sum(steady) / len(steady), nbytes


def steady_rows(model: str, compare: str, device: torch.device, layers: int, threads: int) -> list[str]:
    """Per-byte rates of the resident placement alone, in steady state (no dense weights, no
    first-layer costs): the quantized checkpoint against the bf16 one."""
    rows, rate = [], {}
    for name, path in (("quantized", model), ("bf16", compare)):
        t, n = resident_steady(path, device, layers, threads)
        rate[name] = n / t
        rows.append(f"| {name} | {n / 1e9:.3f} | {t:.3f} | {n / t / 1e9:.2f} |")
    return ["| checkpoint | expert GB per layer | s per layer | GB/s |", "|---|---|---|---|", *rows,
            f"\nsteady-state resident placement: quantized at {rate['quantized'] / rate['bf16']:.2f}x bf16's rate per byte"]


def copy_rows(model: str, threads: int, repeats: int = 15) -> list[str]:
    """A templated layer's byte copies into a reused host buffer (steady state, no allocation):
    one C call (`memory.spans`, the loader's path) against `ctypes.memmove` over Python threads
    (the path without a compiler, the loader's before), and one copy of as many contiguous bytes
    (the bound); interleaved, the best of `repeats` each."""
    from moeferry.memory.spans import copy_spans

    reader, spec, w, moe = open_layers(model, 2)
    first, second = (_layer_experts(w, spec, f"model.layers.{i}.mlp.") for i in moe)
    buf = SlotBuffer.allocate(first.format, first.num_experts, first.experts[0], "cpu")
    placement = Placement(threads)
    placement.fill(buf, first)  # the plain path: it keeps the template
    template = next(iter(placement._templates.values()))
    copies = template.instantiate(reader, second.source.prefix, buf) if template is not None else None
    if copies is None:
        return [f"{model}: no copy template for this format (every layer takes the plain path)"]
    n = sum(m[2] for m in copies.moves)
    src, dst = torch.ones(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    cases = {"one C call (memory.spans)": lambda: copy_spans(copies.moves, threads),
             "memmove over Python threads": lambda: copy_spans(copies.moves, threads, use_c=False),
             "one contiguous copy (bound)": lambda: dst.copy_(src)}
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(repeats):
        for name, fn in cases.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    bound = best["one contiguous copy (bound)"]
    return [f"templated copies of one layer: {len(copies.moves)} copies, {n / 1e6:.0f} MB, {threads} threads", "",
            "| path | ms | GB/s | bound / path |", "|---|---|---|---|",
            *[f"| {name} | {t * 1e3:.1f} | {n / t / 1e9:.2f} | {bound / t:.2f} |" for name, t in best.items()]]


def time_load_model(model: str, device: torch.device, backend: str, threads: int) -> float:
    from moeferry.engine.config import EngineConfig
    from moeferry.model.loader import load_model
    from moeferry.moe import make_backend

    reader = CheckpointReader(model)
    spec = resolve_spec(reader)
    cfg = EngineConfig(model_dir=model, device=str(device), dtype="bfloat16", moe_backend=backend,
                       expert_load="parallel" if threads > 1 else "serial")
    dtype = torch.bfloat16
    with collector.paused():  # as `Engine.build` loads
        t, _ = timed(lambda: load_model(reader, spec, dtype, device, make_backend(cfg, spec, device, dtype),
                                        progress=False), device)
    return t


def checkpoint_bytes(model: str) -> int:
    """The checkpoint's weight files, read once (into the page cache)."""
    files = sorted(Path(model).glob("*.safetensors"))
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(1 << 26):
                pass
    return sum(f.stat().st_size for f in files)


def load_model_rows(model: str, compare: str | None, device: torch.device, threads: int) -> list[str]:
    """A whole load_model per backend and thread count, seconds and GB/s of checkpoint; with
    `compare` (a bf16 checkpoint of the same geometry) its resident load, and the per-byte ratio."""
    rows, rate = [], {}
    for name, path, backends in (("quantized", model, ("resident", "offload")),
                                 ("bf16", compare, ("resident",))):
        if path is None:
            continue
        n = checkpoint_bytes(path)
        for backend in backends:
            for t_count in sorted({1, threads}):
                t = time_load_model(path, device, backend, t_count)
                rate[(name, backend, t_count)] = n / t
                rows.append(f"| {name} | {backend} | {t_count} | {n / 1e9:.2f} | {t:.2f} | {n / t / 1e9:.2f} |")
    if compare is not None:
        q, b = rate[("quantized", "resident", threads)], rate[("bf16", "resident", threads)]
        rows.append(f"\nquantized resident loading at {q / b:.2f}x bf16's rate per byte ({threads} threads)")
    return ["| checkpoint | backend | threads | GB | load_model s | GB/s |", "|---|---|---|---|---|---|"] + rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="a quantized checkpoint (make-model --quant ...)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (pinned banks, resident slots on the GPU)")
    ap.add_argument("--layers", type=int, default=2, help="MoE layers to time (default 2; 0: only --load-model)")
    ap.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1),
                    help="reader/copy threads, as --expert-load parallel uses (default min(8, cores))")
    ap.add_argument("--load-model", action="store_true", help="also time a whole load_model per backend")
    ap.add_argument("--compare", help="a bf16 checkpoint of the same geometry: its resident placement per layer in "
                    "steady state and (with --load-model) its whole resident load (the per-byte rates to match)")
    ap.add_argument("--copies", action="store_true", help="also time a templated layer's byte copies into a "
                    "reused host buffer: one C call against memmoves over Python threads and one contiguous copy")
    ap.add_argument("--out", type=Path, help="also write the tables to DIR/load_speed.md")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # load_model's phase times
    device = torch.device(args.device)
    lines = []
    if args.layers > 0:
        rows = measure(args.model, device, args.layers, args.threads)
        lines += [f"{args.model}: device {device}, {args.threads} threads, "
                  f"{rows[0][2] / 1e9:.3f} GB of experts per layer", "",
                  "| path | s/layer | GB/s | s per 20 GB |", "|---|---|---|---|"]
        lines += [f"| {name} | {t:.3f} | {n / t / 1e9:.2f} | {20e9 / (n / t):.1f} |" for name, t, n in rows]
    if args.load_model:
        lines += [""] + load_model_rows(args.model, args.compare, device, args.threads)
    if args.copies:
        lines += [""] + copy_rows(args.model, args.threads)
    if args.compare:
        lines += [""] + steady_rows(args.model, args.compare, device, max(args.layers, 3), args.threads)
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "load_speed.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
