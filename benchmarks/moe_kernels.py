"""Fused MoE Triton kernels on the GPU: decode bandwidth and prefill throughput per format.

    python benchmarks/moe_kernels.py [--out DIR] [--sweep] [--quick]

Qwen3.6-35B-A3B MoE layer shapes: E=256 experts, top-8, H=2048, I=512. Weights are random
device-form tensors of each kernel (bf16, fp8 per-row, fp8 128-block, nvfp4, int4 g128);
routing is random (softmax of Gaussian logits, top-8).

Ceilings measured in the same run: HBM copy bandwidth (device-to-device copy, bytes read +
written) and the bf16 matmul rate (8192^3 torch.matmul on random data).

- decode T = 1, 4, 16: bytes = (distinct experts selected) x (bytes per slot); time of a CUDA
  graph replaying 32 calls with 32 different routings (so the 60 MB L2 does not serve
  repeated experts). `gemm` = the two grouped GEMM kernels alone (routing prepared
  outside the graph), `moe` = the whole call (prep + 2 GEMMs + top-k reduce).
- prefill T = 2048, 8192: useful FLOPs = 2 * T * k * 3 * H * I over the time of the whole call.
- baseline: plain PyTorch, per selected expert: dequantize (the registry's reference) +
  torch.matmul (`moeferry.ops.moe.experts_reference`), same routing.
--sweep times a few tile configs per format first (decode T=1 and 16, prefill T=2048 and
8192) and uses the fastest for the table. Writes moe_kernels.md / .json under --out.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moeferry.checkpoint.formats import DenseWeight, Fp4Weight, Fp8BlockWeight, Fp8Weight, Int4Weight, fp4  # noqa: E402
from moeferry.moe.slots import SlotBuffer  # noqa: E402
from moeferry.ops.moe import experts_reference  # noqa: E402
from moeferry.ops.triton import moe_gemm as G  # noqa: E402
from moeferry.ops.triton.moe_prep import prepare_routing  # noqa: E402

E, K, H, I = 256, 8, 2048, 512
FORMS = {"bf16": "bf16", "fp8_tensor": "fp8_tensor", "fp8_block": "fp8_block",
         "nvfp4": "nvfp4", "int4 (awq/ct)": "int4_awq"}
DEV = torch.device("cuda")


def logger(path: Path):
    """log(line): printed and appended to `path` (flushed: a cut-off run keeps what it logged)."""
    f = open(path, "w")

    def log(s: str) -> None:
        print(s, flush=True)
        f.write(s + "\n")
        f.flush()
    return log


def random_experts(fmt, n, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=g, device=DEV)

    def uni(*s):
        return torch.rand(*s, generator=g, device=DEV)

    def u8(*s):
        return torch.randint(0, 256, s, generator=g, device=DEV, dtype=torch.uint8)

    def one(o, i):
        if fmt == "bf16":
            return DenseWeight(o, i, (rnd(o, i) * 0.03).bfloat16())
        if fmt == "fp8_tensor":
            return Fp8Weight(o, i, (rnd(o, i) * 64).clamp(-448, 448).to(torch.float8_e4m3fn),
                             (uni(1) * 5e-4 + 2e-4).expand(o).contiguous())
        if fmt == "fp8_block":
            return Fp8BlockWeight(o, i, (rnd(o, i) * 64).clamp(-448, 448).to(torch.float8_e4m3fn),
                                  uni(o // 128, i // 128) * 5e-4 + 2e-4, (128, 128))
        if fmt == "nvfp4":
            return Fp4Weight(o, i, u8(o, i // 2), (uni(o, i // 16) * 3 + 0.5).to(torch.float8_e4m3fn), uni(1) * 4e-3 + 2e-3)
        return Int4Weight(o, i, u8(o, i // 2), (uni(o, i // 128) * 4e-3 + 1e-3).half(),
                          torch.randint(0, 16, (o, i // 128), generator=g, device=DEV, dtype=torch.uint8), 128)

    return [(one(I, H), one(I, H), one(H, I)) for _ in range(n)]


def routings(t, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        w, ids = torch.topk(torch.softmax(torch.randn(t, E, generator=g), -1), K)
        out.append(((w / w.sum(-1, keepdim=True)).bfloat16().to(DEV), ids.to(DEV)))
    return out


def ev_time(fn, iters=20, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def captured(fns) -> torch.cuda.CUDAGraph:
    """One CUDA graph that calls every fn once (each run once eagerly first: compiles, allocations)."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    gr = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gr):
        for f in fns:
            f()
    return gr


def graph_time(fns, reps=10):
    """Median seconds per fn over replays of one CUDA graph that calls every fn once."""
    return ev_time(captured(fns).replay, iters=reps) / len(fns)


def hbm_bandwidth():
    src = torch.randn(1 << 29, device=DEV)  # 2 GiB
    dst = torch.empty_like(src)
    t = ev_time(lambda: dst.copy_(src), iters=10)
    del src, dst
    return 2 * (1 << 29) * 4 / t


def bf16_matmul_rate():
    a = torch.randn(8192, 8192, device=DEV).bfloat16()
    b = torch.randn(8192, 8192, device=DEV).bfloat16()
    t = ev_time(lambda: a @ b, iters=10)
    return 2 * 8192 ** 3 / t


class Case:
    def __init__(self, fmt):
        self.fmt = fmt
        self.experts = random_experts(fmt, E)
        self.buf = SlotBuffer.from_experts(fmt, self.experts, DEV)
        self.table = torch.arange(E, dtype=torch.int32, device=DEV)
        self.cfg_override = {}

    def config(self, t):
        return self.cfg_override.get(t) or G.choose_config(t, self.buf.gate_up, self.buf.down)

    def moe(self, x, ids, w, cfg=None):
        return self.buf.run(x, ids, w, self.table, config=cfg or self.config(x.shape[0]))

    def gemm_fns(self, x, rts, cfg):
        out = []
        for w, ids in rts:
            r = prepare_routing(ids, w, self.table, self.buf.scratch, cfg.block_m)
            out.append(lambda r=r: G.down_weighted(G.gate_up_silu(x, self.buf.gate_up, r, cfg), self.buf.down, r, cfg))
        return out

    def decode(self, t, n=32, cfg=None):
        cfg = cfg or self.config(t)
        x = torch.randn(t, H, device=DEV).bfloat16()
        rts = routings(t, n, seed=t)
        nbytes = sum(len(torch.unique(ids)) for _, ids in rts) / n * self.buf.bytes_per_slot
        t_gemm = graph_time(self.gemm_fns(x, rts, cfg))
        t_moe = graph_time([lambda w=w, ids=ids: self.moe(x, ids, w, cfg) for w, ids in rts])
        return nbytes, t_gemm, t_moe

    def prefill(self, t, cfg=None):
        x = torch.randn(t, H, device=DEV).bfloat16()
        w, ids = routings(t, 1, seed=t)[0]
        return 2 * t * K * 3 * H * I, ev_time(lambda: self.moe(x, ids, w, cfg), iters=10)

    def baseline(self, t, iters=5):
        x = torch.randn(t, H, device=DEV).bfloat16()
        rts = routings(t, iters + 1, seed=t + 1)

        def weights(e):
            g, u, d = self.experts[e]
            return torch.cat([g.dequantize(torch.bfloat16), u.dequantize(torch.bfloat16)]), d.dequantize(torch.bfloat16)

        fp4.E2M1_VALUES = fp4.E2M1_VALUES.to(DEV)  # the registry's table is a CPU tensor
        experts_reference(x, rts[0][1], rts[0][0], weights)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for w, ids in rts[1:]:
            experts_reference(x, ids, w, weights)
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / iters

    def check(self, t, cfg, ref_cfg):
        """A swept config gives the same result as one the GPU tests validated."""
        x = torch.randn(t, H, device=DEV).bfloat16()
        w, ids = routings(t, 1, seed=99)[0]
        a = self.moe(x, ids, w, cfg).float()
        b = self.moe(x, ids, w, ref_cfg).float()
        return ((a - b).norm() / b.norm()).item()


def _cfg(case, bm, gu, dn):
    return G.MoEConfig(bm, G._fit(G.GemmConfig(*gu), case.buf.gate_up), G._fit(G.GemmConfig(*dn), case.buf.down))


# (bn, bk, warps, stages, group_m, swap)
DECODE = [(16, (16, 256, 4, 4, 1, False), (32, 256, 4, 4, 1, False)),   # the first run's configs
          (16, (32, 128, 4, 4, 1, True), (64, 128, 4, 4, 1, True)),
          (16, (64, 128, 4, 4, 1, True), (64, 128, 4, 4, 1, True)),
          (16, (32, 256, 4, 4, 1, True), (128, 128, 4, 4, 1, True)),
          (16, (16, 128, 4, 4, 1, True), (32, 128, 4, 4, 1, True))]
PREFILL = [(128, (64, 64, 8, 3, 8, False), (128, 64, 8, 3, 8, False)),
           (128, (64, 64, 8, 3, 8, True), (128, 64, 8, 3, 8, True)),
           (128, (128, 64, 8, 3, 8, True), (128, 64, 8, 3, 8, True)),
           (64, (128, 64, 8, 3, 8, True), (128, 64, 8, 3, 8, True))]


def sweep(case, log):
    """Fastest candidate per token count: decode by the GEMMs' time, prefill by the call's."""
    best = {}
    for t in (1, 16):
        res = []
        for c in dict.fromkeys(_cfg(case, *d) for d in DECODE[:3 if t == 16 else 5]):
            _, tg, _ = case.decode(t, n=16, cfg=c)
            res.append((tg, c))
            log(f"  sweep {case.fmt} T={t} {c}: {tg * 1e6:.1f} us gemm")
        best[t] = min(res, key=lambda r: r[0])
    for t in (8192, 2048):
        cands = [_cfg(case, *p) for p in PREFILL] if t == 8192 else [best[8192][1], _cfg(case, *PREFILL[3])]
        res = []
        for c in dict.fromkeys(cands):
            flops, tt = case.prefill(t, cfg=c)
            res.append((tt, c))
            log(f"  sweep {case.fmt} T={t} {c}: {flops / tt / 1e12:.0f} TFLOP/s")
        best[t] = min(res, key=lambda r: r[0])
    ref = {1: _cfg(case, *DECODE[0]), 16: _cfg(case, *DECODE[0]), 2048: _cfg(case, *PREFILL[0]), 8192: _cfg(case, *PREFILL[0])}
    out = {}
    for t, (tt, c) in best.items():
        diff = case.check(min(t, 256), c, ref[t])
        log(f"  best T={t}: {c}  (vs first-run config: rel diff {diff:.1e})")
        out[t] = c if diff < 2e-2 else ref[t]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--quick", action="store_true", help="bf16 and nvfp4 only")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = logger(out / "moe_kernels.log")

    torch.manual_seed(0)
    bw, mm = hbm_bandwidth(), bf16_matmul_rate()
    log(f"{torch.cuda.get_device_name()}: HBM copy {bw / 1e12:.2f} TB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s")
    rows, swept = [], {}
    forms = {k: v for k, v in FORMS.items() if not args.quick or v in ("bf16", "nvfp4")}
    for label, fmt in forms.items():
        case = Case(fmt)
        log(f"{label}: {case.buf.bytes_per_slot / 2**20:.2f} MiB per expert slot")
        if args.sweep:
            best = sweep(case, log)
            swept[fmt] = {t: asdict(c) for t, c in best.items()}
            case.cfg_override = {1: best[1], 4: best[1], 16: best[16], 2048: best[2048], 8192: best[8192]}
        for t in (1, 4, 16):
            nbytes, tg, tm = case.decode(t)
            tb = case.baseline(t)
            rows.append(dict(format=label, regime="decode", T=t, bytes=nbytes, t_gemm=tg, t_moe=tm, t_base=tb,
                             gemm_frac=nbytes / tg / bw, moe_frac=nbytes / tm / bw, base_frac=nbytes / tb / bw))
            log(f"  decode T={t:5d}: {nbytes / 2**20:6.1f} MiB  gemm {tg * 1e6:7.1f} us ({nbytes / tg / 1e12:.2f} TB/s, "
                f"{100 * nbytes / tg / bw:.0f}%)  moe {tm * 1e6:7.1f} us ({100 * nbytes / tm / bw:.0f}%)  "
                f"torch {tb * 1e6:8.0f} us ({100 * nbytes / tb / bw:.1f}%)")
        for t in (2048, 8192):
            flops, tm = case.prefill(t)
            tb = case.baseline(t, iters=2)
            rows.append(dict(format=label, regime="prefill", T=t, flops=flops, t_moe=tm, t_base=tb,
                             moe_frac=flops / tm / mm, base_frac=flops / tb / mm))
            log(f"  prefill T={t:5d}: moe {tm * 1e3:7.2f} ms ({flops / tm / 1e12:.0f} TFLOP/s, {100 * flops / tm / mm:.0f}%)  "
                f"torch {tb * 1e3:7.2f} ms ({flops / tb / 1e12:.0f} TFLOP/s)")
        del case
        torch.cuda.empty_cache()
    (out / "moe_kernels.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(), hbm_Bps=bw,
                                                          bf16_flops=mm, rows=rows, swept=swept), indent=1))
    md = [f"Device: {torch.cuda.get_device_name()}; measured HBM copy {bw / 1e12:.2f} TB/s, bf16 matmul "
          f"{mm / 1e12:.0f} TFLOP/s. E={E}, top-{K}, H={H}, I={I}.", "",
          "| format | T | bytes/call | fused GEMMs | % HBM | whole MoE call | % HBM | torch baseline | % HBM |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["regime"] == "decode":
            md.append(f"| {r['format']} | {r['T']} | {r['bytes'] / 2**20:.1f} MiB | {r['t_gemm'] * 1e6:.1f} us | "
                      f"{100 * r['gemm_frac']:.0f}% | {r['t_moe'] * 1e6:.1f} us | {100 * r['moe_frac']:.0f}% | "
                      f"{r['t_base'] * 1e6:.0f} us | {100 * r['base_frac']:.1f}% |")
    md += ["", "| format | T | whole MoE call | TFLOP/s | % bf16 matmul | torch baseline | TFLOP/s | speedup |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["regime"] == "prefill":
            md.append(f"| {r['format']} | {r['T']} | {r['t_moe'] * 1e3:.2f} ms | {r['flops'] / r['t_moe'] / 1e12:.0f} | "
                      f"{100 * r['moe_frac']:.0f}% | {r['t_base'] * 1e3:.2f} ms | {r['flops'] / r['t_base'] / 1e12:.0f} | "
                      f"{r['t_base'] / r['t_moe']:.1f}x |")
    (out / "moe_kernels.md").write_text("\n".join(md) + "\n")
    log("\n".join(md))


if __name__ == "__main__":
    main()
