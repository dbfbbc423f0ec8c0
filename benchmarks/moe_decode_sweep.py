"""The MoE decode path's block sizes, swept kernel by kernel on the GPU (issue 13, item 3).

    python benchmarks/moe_decode_sweep.py [--out DIR] [--forms fp4,int4,...] [--jobs N]

`moe_decode.py` runs two launches per MoE call: gate_up (grid pairs x I/BN, a k-loop of BK
over H) and down (grid T x H/BN, every pair and all of I unrolled). Their block sizes decide
how many bytes each program has in flight, which is what a GEMV at T = 1 lives on. This
script times every (BN, BK, warps) of GATE_UP_GRID and (BN, BK, warps, pairs per program) of
DOWN_GRID for each kernel alone (down's pair chunks include the launch that sums them), at
T = 1 and 4, on Qwen3.6-35B-A3B's MoE layer (E=256, top-8 plus a shared expert in a slot,
H=2048, I=512; random weights in each format's slot form, `moe_kernels.Case`): each time is
the median replay of a CUDA graph of 16 calls over 16 routings (the touched experts change
call to call, so L2 serves little). The pair of winners (fewest summed time relative to the
best at T = 1 and at T = 4) is then checked against the fp32 reference
(`SlotBuffer.run_reference`) and timed as a whole call against `DecodeConfig()` and against
the form's current entry in `DECODE_CONFIGS`, at T = 1, 2, 4, 8. % HBM = bytes of the
distinct touched slots / time / the measured device-to-device copy bandwidth.

Compiling a few hundred kernel variants dominates the run, so first `--jobs` processes (one
per form) compile every variant into Triton's on-disk cache; the timing process then loads
them. Prints a table and the `DECODE_CONFIGS` entries to paste; writes moe_decode_sweep.md /
.json under --out. `--variants`: no sweep; each form's entry timed as a whole call against
the block-size variants of `variants`, with each kernel's device time at T = 1 (torch.profiler
over graph replays), and once with every call on one routing (its weights stay in L2: what is
left is the kernels' own work and latency); `--only` names the variants to time.
`--smoke`: tiny shapes on the CPU (MOEFERRY_TRITON_INTERPRET=1), a check
of the script only.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import moe_kernels as MK  # noqa: E402
from moeferry.ops.triton import moe_decode as D  # noqa: E402

FORMS = {"fp4": "nvfp4", "int4": "int4_awq", "fp8_row": "fp8_tensor", "fp8_block": "fp8_block", "dense": "bf16"}
GATE_UP_GRID = [(bn, bk, w) for bn in (2, 4, 8, 16, 32) for bk in (256, 512, 1024, 2048) for w in (4, 8)]
DOWN_GRID = [(bn, bk, w, p) for bn in (2, 4, 8, 16, 32) for bk in (256, 512) for w in (2, 4, 8) for p in (0, 1, 3)]
TOKENS = (1, 4)         # the kernels alone
WHOLE_TOKENS = (1, 2, 4, 8)  # the whole call
CALLS = 16


def bytes_per_weight(m) -> float:
    """Bytes a slot matrix holds per weight (packed values and their scales)."""
    return m.bytes_per_slot / (m.n * m.k)


# kernel -> (its grid, the --smoke points, weight bytes per k-step (gate_up: gate and up each) or per
# pair (down: all pairs are in flight together) kept, the DecodeConfig fields of a grid point: (BN,
# BK, warps), and for down the pairs per program (0: all; else chunks of pairs and a summing launch))
GRIDS = {"gate_up": (GATE_UP_GRID, ((32, 64, 4), (64, 128, 2)), (1024, 32768), ("gate_up_bn", "gate_up_bk", "num_warps")),
         "down": (DOWN_GRID, ((64, 32, 4, 0), (128, 64, 2, 2)), (256, 16384),
                  ("down_bn", "down_bk", "down_warps", "down_pairs"))}


def configs(kernel: str, buf, smoke=False) -> list[D.DecodeConfig]:
    """The grid points of one kernel, as DecodeConfigs (the other kernel's fields at their defaults)."""
    grid, smoke_points, (lo, hi), fields = GRIDS[kernel]
    b, k = bytes_per_weight(buf.gate_up), getattr(buf, kernel).k
    points = smoke_points if smoke else [p for p in grid if p[1] <= k and lo <= p[0] * p[1] * b <= hi]
    return [D.DecodeConfig(**dict(zip(fields, p))) for p in points]


class Layer:
    """One MoE layer's slots (a FORMS key), a shared expert in the last slot, inputs for T tokens."""

    def __init__(self, label: str):
        self.label = label
        self.case = MK.Case(FORMS[label])
        self.buf, self.table = self.case.buf, self.case.table
        self.shared = MK.E - 1
        self.current = D.DECODE_CONFIGS.get(self.buf.gate_up.kernel.name, D.DecodeConfig())  # the entry in use

    def inputs(self, t: int, n: int, seed: int):
        x = torch.randn(t, MK.H, device=MK.DEV).bfloat16()
        gate = torch.randn(t, device=MK.DEV).bfloat16()
        return x, gate, MK.routings(t, n, seed=seed)

    def touched_bytes(self, rts) -> float:
        per = [len(torch.unique(torch.cat([ids.reshape(-1), ids.new_tensor([self.shared])]))) for _, ids in rts]
        return sum(per) / len(per) * self.buf.bytes_per_slot

    def gate_up_fns(self, x, gate, rts, cfg):
        return [lambda w=w, ids=ids: D.decode_gate_up(x, ids, w, self.buf.gate_up, self.table, self.shared, gate, cfg,
                                                      self.buf.scratch.arrivals)
                for w, ids in rts]

    def down_fns(self, inters, gate, rts, cfg):
        out = torch.empty(inters[0].shape[0] // (MK.K + 1), MK.H, device=MK.DEV, dtype=torch.bfloat16)
        return [lambda w=w, ids=ids, a=a: D.decode_down(a, out, ids, w, self.buf.down, self.table, self.shared, gate,
                                                         cfg, self.buf.scratch.arrivals) for (w, ids), a in zip(rts, inters)]

    def whole_fns(self, x, gate, rts, cfg):
        return [lambda w=w, ids=ids: D.decode_moe(x, ids, w, self.buf.gate_up, self.buf.down, self.table, self.shared,
                                                  gate, cfg, self.buf.scratch.arrivals) for w, ids in rts]

    def rel_error(self, cfg, t: int = 4) -> float:
        x, gate, rts = self.inputs(t, 1, seed=99)
        w, ids = rts[0]
        ref = self.buf.run_reference(x.float(), ids, w.float(), self.table, self.shared, gate.float()).float()
        out = D.decode_moe(x, ids, w, self.buf.gate_up, self.buf.down, self.table, self.shared, gate, cfg,
                           self.buf.scratch.arrivals).float()
        return ((out - ref).norm() / ref.norm()).item()


def _timed(fns, log, what):
    try:
        return MK.graph_time(fns)
    except Exception as e:  # a variant that does not build (registers, shared memory): skipped
        log(f"    {what}: failed: {type(e).__name__}: {str(e)[:160]}")
        return float("inf")


def _pick(times: dict) -> D.DecodeConfig:
    """The config with the least summed time relative to the best at each T."""
    best = {t: min(v[t] for v in times.values()) for t in TOKENS}
    return min(times, key=lambda c: sum(times[c][t] / best[t] for t in TOKENS))


def compile_only(label: str, smoke: bool, kernels) -> None:
    """Run every variant once (Triton compiles it into its on-disk cache)."""
    layer = Layer(label)
    x, gate, rts = layer.inputs(1, 1, seed=0)
    w, ids = rts[0]
    inter = D.decode_gate_up(x, ids, w, layer.buf.gate_up, layer.table, layer.shared, gate, layer.current)
    for kernel in kernels:
        for cfg in configs(kernel, layer.buf, smoke):
            try:
                (layer.gate_up_fns(x, gate, rts, cfg) if kernel == "gate_up" else layer.down_fns([inter], gate, rts, cfg))[0]()
            except Exception:  # noqa: BLE001 (reported by the timing pass)
                pass
    if MK.DEV.type == "cuda":
        torch.cuda.synchronize()


def sweep_form(label: str, bw: float, smoke: bool, log, kernels=("gate_up", "down")) -> dict:
    layer = Layer(label)
    log(f"{label}: {layer.buf.bytes_per_slot / 2**20:.2f} MiB per slot")
    gu_times, dn_times, data = {}, {}, {}
    current = layer.current
    for t in TOKENS:
        x, gate, rts = layer.inputs(t, CALLS, seed=t)
        inters = [D.decode_gate_up(x, ids, w, layer.buf.gate_up, layer.table, layer.shared, gate, current)
                  for w, ids in rts]
        data[t] = (x, gate, rts, layer.touched_bytes(rts))
        for cfg in configs("gate_up", layer.buf, smoke) if "gate_up" in kernels else [current]:
            gu_times.setdefault(cfg, {})[t] = _timed(layer.gate_up_fns(x, gate, rts, cfg), log, f"gate_up {cfg}")
        for cfg in configs("down", layer.buf, smoke) if "down" in kernels else [current]:
            dn_times.setdefault(cfg, {})[t] = _timed(layer.down_fns(inters, gate, rts, cfg), log, f"down {cfg}")
    gu, dn = _pick(gu_times), _pick(dn_times)
    for name, times in (("gate_up", gu_times), ("down", dn_times)):
        ranked = sorted(times.items(), key=lambda kv: kv[1][TOKENS[0]])[:5]
        log(f"  {name} fastest at T=1: " + "; ".join(
            f"{_short(c, name)} {v[TOKENS[0]] * 1e6:.1f}/{v[TOKENS[1]] * 1e6:.1f} us" for c, v in ranked))
    best = D.DecodeConfig(gu.gate_up_bn, gu.gate_up_bk, dn.down_bn, dn.down_bk, gu.num_warps, False, dn.down_warps,
                          dn.down_pairs)
    rows = _whole_rows(layer, dict(default=D.DecodeConfig(), current=current, swept=best), bw, log, data)
    err = layer.rel_error(best)
    log(f"  swept config {best}: rel error vs fp32 reference {err:.1e}")
    return dict(label=label, form=layer.buf.gate_up.kernel.name, config=asdict(best), rel_error=err, rows=rows,
                gate_up={repr(c): v for c, v in gu_times.items()}, down={repr(c): v for c, v in dn_times.items()})


def _whole_rows(layer: "Layer", cfgs: dict, bw: float, log, data=None) -> list[dict]:
    """The whole call at WHOLE_TOKENS for each named config: time and share of HBM (inputs of
    the kernel timing in `data` reused where it has them)."""
    rows = []
    for t in WHOLE_TOKENS:
        x, gate, rts, nbytes = (data or {}).get(t) or (*layer.inputs(t, CALLS, seed=t), None)
        nbytes = nbytes or layer.touched_bytes(rts)
        times = {name: MK.graph_time(layer.whole_fns(x, gate, rts, cfg)) for name, cfg in cfgs.items()}
        rows.append(dict(format=layer.label, T=t, bytes=nbytes, **{f"t_{k}": v for k, v in times.items()},
                         **{f"hbm_{k}": nbytes / v / bw for k, v in times.items()}))
        log(f"  {layer.label} T={t}: {nbytes / 2**20:5.1f} MiB  " + "  ".join(
            f"{k} {v * 1e6:6.1f} us ({100 * nbytes / v / bw:3.0f}%)" for k, v in times.items()))
    return rows


def whole_form(label: str, bw: float, log) -> dict:
    """--whole-only: the form's current DECODE_CONFIGS entry as a whole call, no sweep."""
    layer = Layer(label)
    rows = _whole_rows(layer, dict(current=layer.current), bw, log)
    err = layer.rel_error(layer.current)
    log(f"  {label} {layer.current}: rel error vs fp32 reference {err:.1e}")
    return dict(label=label, config=asdict(layer.current), rel_error=err, rows=rows)


def variants(current: D.DecodeConfig) -> dict[str, D.DecodeConfig]:
    """--variants: the form's entry; it with down launched plainly after gate_up (`down_pdl` off);
    down as one program per token's pairs holding every pair's weights before it reads inter
    (`down_preload`: the 4-bit forms) at 4, 8 or 16 rows a program (16 with 8 warps too), and at 8
    rows without `down_pdl`; gate_up's last wave in up to 4 k slices (`gate_up_split`), alone and with
    the preloaded down at 8 rows."""
    preload = replace(current, down_pairs=0, down_arrive=False, down_preload=True)
    return {"current": current, "no pdl": replace(current, down_pdl=False),
            "preload bn 4": replace(preload, down_bn=4), "preload bn 8": replace(preload, down_bn=8),
            "preload bn 16": replace(preload, down_bn=16),
            "preload bn 16 (8 warps)": replace(preload, down_bn=16, down_warps=8),
            "preload bn 8 (no pdl)": replace(preload, down_bn=8, down_pdl=False),
            "split 4": replace(current, gate_up_split=4),
            "split 4 + preload bn 8": replace(preload, down_bn=8, gate_up_split=4)}


def kernel_times(fns) -> dict[str, float]:
    """Device seconds per call of each kernel in `fns`' graph (torch.profiler over 10 replays)."""
    from torch.profiler import ProfilerActivity, profile
    gr = MK.captured(fns)
    gr.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            gr.replay()
        torch.cuda.synchronize()
    calls = 10 * len(fns)
    return {e.key: e.device_time_total * 1e-6 / calls for e in prof.key_averages() if e.device_time_total > 0}


def _kernels_said(times: dict[str, float]) -> str:
    """`kernel_times`' result as one line: each kernel's name (shortened) and microseconds."""
    return ", ".join(f"{k.strip('_')[:24]} {v * 1e6:.1f} us" for k, v in times.items())


def variants_form(label: str, bw: float, log, only=()) -> dict:
    """--variants: whole calls of each `variants` config (those named in `only`, if any), their
    error, and at T = 1 the kernels' device time per call beside the whole call's (the rest: launch
    gaps and tails)."""
    layer = Layer(label)
    cfgs = variants(layer.current)
    unknown = set(only) - set(cfgs)
    if unknown:
        raise SystemExit(f"--only: no variant named {sorted(unknown)}; the variants: {list(cfgs)}")
    cfgs = {k: v for k, v in cfgs.items() if not only or k in only}
    rows = _whole_rows(layer, cfgs, bw, log)
    errors = {name: layer.rel_error(cfg) for name, cfg in cfgs.items()}
    log(f"  {label} rel error vs fp32 reference: " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    x, gate, rts = layer.inputs(1, CALLS, seed=1)
    kernels = {}
    for name, cfg in cfgs.items() if MK.DEV.type == "cuda" else ():
        kernels[name] = kernel_times(layer.whole_fns(x, gate, rts, cfg))
        log(f"  {label} T=1 {name}: kernels {_kernels_said(kernels[name])}; "
            f"sum {sum(kernels[name].values()) * 1e6:.1f} us")
    if MK.DEV.type == "cuda":  # one routing in every call: the weights stay in L2 (left: compute, latency)
        hot = rts[:1] * CALLS
        kernels["current, L2-hot"] = kernel_times(layer.whole_fns(x, gate, hot, layer.current))
        whole = MK.graph_time(layer.whole_fns(x, gate, hot, layer.current))
        log(f"  {label} T=1 current, one routing (weights in L2): kernels "
            f"{_kernels_said(kernels['current, L2-hot'])}; whole call {whole * 1e6:.1f} us")
    return dict(label=label, configs={k: asdict(v) for k, v in cfgs.items()}, rel_error=errors, rows=rows,
                kernels=kernels)


def _short(c: D.DecodeConfig, kernel: str) -> str:
    return "(" + ", ".join(f"{f.split('_')[-1]} {getattr(c, f)}" for f in GRIDS[kernel][3]) + ")"


def _host_time(fns, reps=1):
    """--smoke: seconds per fn, host-timed once (checks the script, times nothing real)."""
    t0 = time.perf_counter()
    for f in fns:
        f()
    return (time.perf_counter() - t0) / len(fns)


def _table(results: list[dict], base: tuple[str, str], new: tuple[str, str], entries: str) -> str:
    """Markdown: each form's whole-call rows, `base` against `new` (row key, column title), then
    the entries to paste."""
    (b, b_title), (n, n_title) = base, new
    md = [f"| form | T | bytes | {b_title} | % HBM | {n_title} | % HBM |", "|---|---|---|---|---|---|---|"]
    md += [f"| {r['label']} | {w['T']} | {w['bytes'] / 2**20:.1f} MiB | {w[f't_{b}'] * 1e6:.1f} us | "
           f"{100 * w[f'hbm_{b}']:.0f}% | {w[f't_{n}'] * 1e6:.1f} us | {100 * w[f'hbm_{n}']:.0f}% |"
           for r in results for w in r["rows"]]
    md += ["", f"{entries} (rel error vs the fp32 reference):"]
    md += [f"    {r['form']!r}: DecodeConfig(**{r['config']}),  # {r['label']}: {r['rel_error']:.1e}" for r in results]
    return "\n".join(md) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--forms", default=",".join(FORMS))
    ap.add_argument("--jobs", type=int, default=4, help="processes compiling the variants first (0: none)")
    ap.add_argument("--compile-only", metavar="FORM")
    ap.add_argument("--kernels", default="gate_up,down", help="the kernels swept (others keep the current entry)")
    ap.add_argument("--whole-only", action="store_true", help="time the current entries as whole calls, no sweep")
    ap.add_argument("--variants", action="store_true",
                    help="time each form's entry against its block-size variants, no sweep")
    ap.add_argument("--only", default="", metavar="NAMES",
                    help="with --variants: time only these variants (comma-separated names, e.g. 'current,split 4')")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        MK.DEV, MK.E, MK.K, MK.H, MK.I = torch.device("cpu"), 16, 4, 256, 128
        MK.graph_time = _host_time
        global CALLS, TOKENS, WHOLE_TOKENS
        CALLS, TOKENS, WHOLE_TOKENS = 2, (1, 2), (1, 2)
    forms = [f for f in args.forms.split(",") if f]
    if args.compile_only:
        compile_only(args.compile_only, args.smoke, args.kernels.split(","))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = MK.logger(out / "moe_decode_sweep.log")
    bw = 1e10 if args.smoke else MK.hbm_bandwidth()
    log(f"{'cpu' if args.smoke else torch.cuda.get_device_name()}: HBM copy {bw / 1e12:.2f} TB/s; E={MK.E} "
        f"top-{MK.K} + shared, H={MK.H} I={MK.I}")

    if args.whole_only:
        results = [whole_form(f, bw, log) for f in forms]
        (out / "moe_decode_whole.json").write_text(json.dumps(dict(hbm_Bps=bw, forms=results), indent=1))
        return
    if args.variants:
        only = [n.strip() for n in args.only.split(",") if n.strip()]
        results = [variants_form(f, bw, log, only) for f in forms]
        (out / "moe_decode_variants.json").write_text(json.dumps(dict(hbm_Bps=bw, forms=results), indent=1))
        return
    if args.jobs:
        cmd = [sys.executable, __file__, "--kernels", args.kernels] + (["--smoke"] if args.smoke else [])
        for i in range(0, len(forms), args.jobs):
            procs = [subprocess.Popen(cmd + ["--compile-only", f]) for f in forms[i:i + args.jobs]]
            log(f"compiled {forms[i:i + args.jobs]}: exit codes {[p.wait() for p in procs]}")
    torch.manual_seed(0)
    results = [sweep_form(f, bw, args.smoke, log, args.kernels.split(",")) for f in forms]
    (out / "moe_decode_sweep.json").write_text(json.dumps(dict(hbm_Bps=bw, forms=results), indent=1))
    md = _table(results, ("default", "DecodeConfig()"), ("swept", "swept"), "DECODE_CONFIGS entries")
    (out / "moe_decode_sweep.md").write_text(md)
    log(md)


if __name__ == "__main__":
    main()
