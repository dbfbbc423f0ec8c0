"""Quantized checkpoints on the GPU (issue 13): dense-layer kernels, MoE decode split-K, and
whole-model decode.

    python benchmarks/quant_decode.py dense [--out DIR] [--forms fp4,fp8_row] [--rows 1,4]  # QuantLinear kernels
    python benchmarks/quant_decode.py moe [--out DIR]        # MoE decode: grouped GEMM vs decode GEMV path
    python benchmarks/quant_decode.py e2e CKPT [--out DIR]   # decode tok/s b1/b4, graphs on/off

dense: Qwen3.6-35B-A3B dense shapes [N, K] (in_proj_qkv / q_proj 8192x2048, o_proj / out_proj
2048x4096, shared expert 512x2048, NVFP4 lm_head 248320x2048) at M = 1, 4, 16 (decode) and
M = 4096 (prefill); at M = 1 a sweep of tiles and split-K (GEMV tiles for forms that have one,
and the one-row GEMV's ROW_GRID). Random device-form weights, rotated over enough copies that L2 (50 MB)
serves none of them; each time is the median replay of a CUDA graph calling every copy once.
Bytes = the packed weight and its scales; the bound is bytes over the measured HBM copy
bandwidth. Baselines in the same run: bf16 cuBLAS (F.linear) on a bf16 weight of the same
shape, and for FP8 torch._scaled_mm with per-token activation scales (W8A8: its relative
error against the weight-only fp32 reference is reported too).

moe: E=256, top-8, H=2048, I=512 (benchmarks/moe_kernels.py's cases), decode T = 1, 2, 4, 8, 16,
per format: the grouped-GEMM path (its default config) against the decode GEMV path
(moe_decode.py, DECODE_SWEEP of its block sizes), each timed as a CUDA graph of 16 calls with
16 routings, its kernel launches per call counted, its output checked against the fp32
reference (`SlotBuffer.run_reference`); prints which wins per format and T.

e2e: the moeferry on PYTHONPATH (so the same script times main and this branch), the
checkpoint loaded on cuda, prompts of 64 tokens, greedy decode timed over 24 steps after 4
warm-up steps, batch 1 and 4; prints whether decode runs in CUDA graphs (or why not).
"""
from __future__ import annotations

import argparse
from dataclasses import replace
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling benchmark modules
import moe_kernels as MK  # noqa: E402  (its timing helpers and MoE cases)
from moeferry.moe.path_choice import DecodeTarget, choose_decode_tokens, graph_seconds, host_seconds  # noqa: E402

DEV = torch.device("cuda")
SMOKE = False  # --smoke: tiny shapes on the CPU under MOEFERRY_TRITON_INTERPRET=1 (checks the script)


def ev_time(fn, iters=20, warmup=3):
    """Median seconds of fn (`moe_kernels.ev_time`; one host-timed call under --smoke)."""
    if SMOKE:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    return MK.ev_time(fn, iters, warmup)


def graph_time(fns, reps=10):
    """Median seconds per fn over replays of one CUDA graph that calls every fn once."""
    if SMOKE:
        return ev_time(lambda: [f() for f in fns]) / len(fns)
    return MK.graph_time(fns, reps)


def hbm_bandwidth():
    return 1e10 if SMOKE else MK.hbm_bandwidth()


# -- dense ----------------------------------------------------------------------------------
SHAPES = {"qkv 8192x2048": (8192, 2048), "o_proj 2048x4096": (2048, 4096), "shared 512x2048": (512, 2048)}
FORMS = ("fp8_row", "fp4", "int4", "fp8_block", "dense")  # most used first (a time limit may cut the run)
# M = 1: the one-row GEMV's (BN, BK, warps) swept (quant_linear.ROW_TILES takes the winners)
ROW_GRID = [(bn, bk, w) for bn in (2, 4, 8, 16) for bk in (512, 1024, 2048) for w in (4, 8)]


def random_packed(form, n, k, g):
    from moeferry.checkpoint.formats import DenseWeight, Fp4Weight, Fp8BlockWeight, Fp8Weight, Int4Weight

    def uni(*s):
        return torch.rand(*s, generator=g, device=DEV)

    def u8(*s):
        return torch.randint(0, 256, s, generator=g, device=DEV, dtype=torch.uint8)

    def e4m3(*s):
        return (torch.randn(*s, generator=g, device=DEV) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)

    if form == "dense":
        return DenseWeight(n, k, (torch.randn(n, k, generator=g, device=DEV) * 0.03).bfloat16())
    if form == "fp8_row":
        return Fp8Weight(n, k, e4m3(n, k), uni(1).expand(n).contiguous() * 5e-4 + 2e-4)
    if form == "fp8_block":
        return Fp8BlockWeight(n, k, e4m3(n, k), uni(math.ceil(n / 128), k // 128) * 5e-4 + 2e-4, (128, 128))
    if form == "fp4":
        return Fp4Weight(n, k, u8(n, k // 2), (uni(n, k // 16) * 3 + 0.5).to(torch.float8_e4m3fn), uni(1) * 4e-3 + 2e-3)
    return Int4Weight(n, k, u8(n, k // 2), (uni(n, k // 128) * 4e-3 + 1e-3).half(),
                      torch.randint(0, 16, (n, k // 128), generator=g, device=DEV, dtype=torch.uint8), 128)


def dense_candidates(form, m):
    from moeferry.ops.triton import quant_linear as Q
    if m > Q.DECODE_MAX_M:
        bm, bn, bk, swap = Q.PREFILL_TILES[form]
        return [Q.DenseConfig(128, 64, bk, 1, swap, 4, 3)]
    from moeferry.ops.triton.gemv_formats import GEMV_STEPS
    rows = [Q.DenseConfig(1, bn, bk, num_warps=w, row=True) for bn, bk, w in ROW_GRID] if m == 1 else []
    dot = [(bn, Q.DECODE_TILES[form][1], waves, False) for bn in (32, 64) for waves in (0, 4)]
    if form not in GEMV_STEPS or m > Q.GEMV_MAX_M:
        return rows + (dot if m == 1 else dot[-1:])
    return rows + dot[-1:] + [(bn, bk, waves, True) for bn, bk in ((16, 512), (32, 256), (32, 512), (64, 512), (32, 1024))
                       for waves in (0, 2, 4)][:None if m == 1 else 3]


def resolve(cand, op, m):
    """A sweep candidate as a DenseConfig for this operand (decode: waves -> split)."""
    import triton

    from moeferry.ops.triton import num_sms, quant_linear as Q
    if isinstance(cand, Q.DenseConfig) and cand.row:
        from moeferry.ops.triton.moe_decode import gemv_bk
        return replace(cand, bk=gemv_bk(cand.bk, op.kernel, op.group, op.k)[0])
    if isinstance(cand, Q.DenseConfig):
        return Q.DenseConfig(min(cand.bm, max(16, triton.next_power_of_2(m))), cand.bn, Q._fit_bk(cand.bk, op),
                             1, cand.swap, cand.num_warps, cand.num_stages)
    bn, bk, waves, gemv = cand
    bn = min(bn, max(16, triton.next_power_of_2(op.n)))
    bk = min(bk, max(32, triton.next_power_of_2(op.k))) if gemv else Q._fit_bk(bk, op)
    tiles, steps = triton.cdiv(op.n, bn), triton.cdiv(op.k, bk)
    sms = 4 if SMOKE else num_sms(DEV)
    split = 1 if waves == 0 else max(1, min(steps, triton.cdiv(waves * sms, tiles)))
    return Q.DenseConfig(triton.next_power_of_2(m) if gemv else 16, bn, bk, split, True, gemv=gemv)


def bench_dense(args, log):
    import torch.nn.functional as F

    from moeferry.ops.triton import num_sms, quant_linear as Q
    bw = hbm_bandwidth()
    log(f"{'cpu' if SMOKE else torch.cuda.get_device_name()}: HBM copy {bw / 1e12:.2f} TB/s; SMs {4 if SMOKE else num_sms(DEV)}")
    g = torch.Generator(device=DEV).manual_seed(0)
    rows = []
    shapes = {"smoke 48x256": (48, 256)} if SMOKE else dict(SHAPES)
    for form in (("fp4",) if SMOKE else args.forms.split(",") if args.forms else FORMS):
        fshapes = dict(shapes, **({"lm_head 248320x2048": (248320, 2048)} if form == "fp4" and not SMOKE else {}))
        for label, (n, k) in fshapes.items():
            one = random_packed(form, n, k, g)
            nbytes = one.nbytes
            copies = max(1, min(24, math.ceil(300e6 / nbytes)))
            ops = [Q.dense_operands(one, form)] + [Q.dense_operands(random_packed(form, n, k, g), form)
                                                  for _ in range(copies - 1)]
            ref_w = one.dequantize(torch.float32)
            bf16_ws = [torch.randn(n, k, generator=g, device=DEV).bfloat16() for _ in range(max(1, min(24, math.ceil(300e6 / (2 * n * k)))))]
            for m in map(int, args.rows.split(",")):
                if (m == 4096 and n > 8192) or (SMOKE and m == 4096):
                    continue
                x = torch.randn(m, k, generator=g, device=DEV).bfloat16()
                ref = x.float() @ ref_w.t()
                default = Q.choose_config(m, ops[0], DEV)
                res = []
                for cand in [default] + dense_candidates(form, m):
                    cfg = cand if cand is default else resolve(cand, ops[0], m)
                    try:
                        out = Q.quant_linear(x, ops[0], cfg)
                        err = ((out.float() - ref).norm() / ref.norm()).item()
                        t = graph_time([lambda o=o, c=cfg: Q.quant_linear(x, o, c) for o in ops])
                    except Exception as e:  # a config that does not compile: report, keep going
                        log(f"  {form} {label} M={m} {cfg}: FAILED {type(e).__name__}: {str(e)[:200]}")
                        continue
                    res.append((t, cfg, err))
                    if args.verbose:
                        log(f"    {form} {label} M={m} {cfg}: {t * 1e6:.1f} us err {err:.2e}")
                t_def, _, err_def = res[0]
                t_best, c_best, err_best = min(res, key=lambda r: r[0])
                t_cublas = graph_time([lambda w=w: F.linear(x, w) for w in bf16_ws])
                row = dict(form=form, shape=label, M=m, bytes=nbytes, t_default=t_def, err_default=err_def,
                           t_best=t_best, best=repr(c_best), err_best=err_best, t_cublas_bf16=t_cublas,
                           frac_default=nbytes / t_def / bw, frac_best=nbytes / t_best / bw)
                if form == "fp8_row" and m in (1, 4096):
                    row.update(scaled_mm(x, one, ref))
                rows.append(row)
                extra = f" scaled_mm {row['t_scaled_mm'] * 1e6:.1f} us err {row['err_scaled_mm']:.1e}" if "t_scaled_mm" in row else ""
                if m <= 16:
                    log(f"  {form:9s} {label:20s} M={m:4d}: default {t_def * 1e6:7.1f} us ({100 * row['frac_default']:3.0f}% HBM)"
                        f" best {t_best * 1e6:7.1f} us ({100 * row['frac_best']:3.0f}%) {c_best}  err {err_def:.1e} / best {err_best:.1e}"
                        f"  cuBLAS-bf16 {t_cublas * 1e6:.1f} us{extra}")
                else:
                    fl = 2 * m * n * k
                    log(f"  {form:9s} {label:20s} M={m:4d}: default {fl / t_def / 1e12:5.0f} TFLOP/s best {fl / t_best / 1e12:5.0f}"
                        f" {c_best} err {err_def:.1e}  cuBLAS-bf16 {fl / t_cublas / 1e12:.0f}{extra}")
            del ops, bf16_ws
            torch.cuda.empty_cache()
    return dict(hbm_Bps=bw, rows=rows)


def scaled_mm(x, w, ref):
    """W8A8 through torch._scaled_mm: x quantized per token (amax / 448), W per row."""
    wt = w.weight.t()  # [K, N] column-major view, as _scaled_mm wants

    def run():
        sa = (x.float().abs().amax(-1, keepdim=True) / 448.0).clamp(min=1e-12)
        xq = (x.float() / sa).to(torch.float8_e4m3fn)
        return torch._scaled_mm(xq, wt, scale_a=sa, scale_b=w.scale.float()[None, :], out_dtype=torch.bfloat16)

    try:
        out = run()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        return dict(t_scaled_mm=ev_time(run), err_scaled_mm=err)
    except Exception as e:
        return dict(scaled_mm_error=f"{type(e).__name__}: {str(e)[:200]}")


# -- moe ------------------------------------------------------------------------------------
# decode path configs swept per format and T: (gate_up BN, gate_up BK, down BN, down BK, warps, unroll)
DECODE_SWEEP = [(16, 256, 8, 512, 4, False), (8, 512, 8, 512, 4, False), (32, 256, 8, 512, 4, False),
                (16, 512, 4, 512, 4, False), (16, 256, 16, 256, 4, False), (8, 256, 4, 512, 2, False),
                (32, 128, 16, 512, 8, False), (16, 256, 8, 512, 8, False), (16, 256, 8, 512, 4, True),
                (8, 512, 4, 512, 4, True), (4, 512, 8, 512, 2, True)]
MOE_FORMS = (("nvfp4", "nvfp4"), ("int4", "int4_awq"), ("fp8_tensor", "fp8_tensor"), ("fp8_block", "fp8_block"),
             ("bf16", "bf16"))


def kernel_launches(fn):
    """GPU kernels one call of fn launches (torch profiler; None where it is unavailable)."""
    if SMOKE:
        return None
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def bench_moe(args, log):
    """Old (grouped-GEMM, its default config) vs new (decode GEMV, DECODE_SWEEP) path per format and T."""
    from moeferry.ops.triton import moe_gemm as G
    from moeferry.ops.triton.moe_decode import DecodeConfig

    if SMOKE:  # tiny layer on the CPU under the interpreter: checks the script, times nothing real
        MK.DEV, MK.E, MK.K, MK.H, MK.I = DEV, 16, 4, 256, 128
    bw = hbm_bandwidth()
    log(f"HBM copy {bw / 1e12:.2f} TB/s; MoE E={MK.E} top-{MK.K} H={MK.H} I={MK.I}; time = median replay of a CUDA "
        f"graph of 16 calls with 16 routings; % HBM = bytes of the distinct touched experts / time / HBM copy")
    sweep = [DecodeConfig(*c) for c in (DECODE_SWEEP[-3:-1] if SMOKE else DECODE_SWEEP)]
    rows = []
    for label, fmt in MOE_FORMS[:2] if SMOKE else MOE_FORMS:
        case = MK.Case(fmt)
        # what the engine's warm-up would choose on this device (`moe.path_choice`)
        chose = choose_decode_tokens(DecodeTarget(case.buf, case.table), MK.K, 16, torch.bfloat16,
                                     host_seconds if SMOKE else graph_seconds)[0]
        for t in (1, 2, 4) if SMOKE else (1, 2, 4, 8, 16):
            x = torch.randn(t, MK.H, device=DEV).bfloat16()
            rts = MK.routings(t, 2 if SMOKE else 16, seed=t)
            nbytes = sum(len(torch.unique(ids)) for _, ids in rts) / len(rts) * case.buf.bytes_per_slot
            w0, ids0 = MK.routings(t, 1, seed=99)[0]
            ref = case.buf.run_reference(x.float(), ids0, w0.float(), case.table).float()

            def timed(cfg):
                tm = graph_time([lambda w=w, ids=ids: case.moe(x, ids, w, cfg) for w, ids in rts])
                out = case.moe(x, ids0, w0, cfg).float()
                return tm, ((out - ref).norm() / ref.norm()).item()

            old_cfg = G.choose_config(t, case.buf.gate_up, case.buf.down)
            t_old, e_old = timed(old_cfg)
            new = []
            for c in sweep:  # a config that fails to build (e.g. out of resources) is reported and skipped
                try:
                    new.append((*timed(c), c))
                except Exception as exc:  # noqa: BLE001
                    log(f"    new {tuple(vars(c).values())}: failed: {type(exc).__name__}: {str(exc)[:160]}")
            if not new:
                log(f"  {label:10s} T={t:2d}: old {t_old * 1e6:6.1f} us; every decode config failed")
                continue
            t_new, e_new, best = min(new, key=lambda r: r[0])
            n_old = kernel_launches(lambda: case.moe(x, ids0, w0, old_cfg))
            n_new = kernel_launches(lambda: case.moe(x, ids0, w0, best))
            win = "new" if t_new < t_old else "old"
            rows.append(dict(format=label, T=t, bytes=nbytes, t_old=t_old, rel_old=e_old, launches_old=n_old,
                             t_new=t_new, rel_new=e_new, launches_new=n_new, best_new=best, winner=win,
                             default="new" if t <= chose else "old",
                             sweep=[(c, tm, e) for tm, e, c in new]))
            log(f"  {label:10s} T={t:2d} {nbytes / 2**20:6.1f} MiB  old {t_old * 1e6:6.1f} us ({100 * nbytes / t_old / bw:3.0f}%,"
                f" {n_old} launches, rel {e_old:.1e})  new {t_new * 1e6:6.1f} us ({100 * nbytes / t_new / bw:3.0f}%,"
                f" {n_new} launches, rel {e_new:.1e}) {tuple(vars(best).values())}  wins: {win}"
                f" (default now: {rows[-1]['default']})")
            for tm, e, c in new:
                if args.verbose or e > 2e-2:
                    log(f"    new {tuple(vars(c).values())}: {tm * 1e6:6.1f} us ({100 * nbytes / tm / bw:3.0f}%) rel {e:.1e}"
                        + ("  OUTSIDE bf16 tolerance" if e > 2e-2 else ""))
        del case
        if not SMOKE:
            torch.cuda.empty_cache()
    log("winners (the warm-up chooses between the grouped GEMM and DecodeConfig() by timing; a better\n"
        "block size here goes into DecodeConfig's defaults):")
    for label, _ in MOE_FORMS:
        got = [r for r in rows if r["format"] == label]
        if got:
            log(f"  {label:10s} " + "  ".join(f"T={r['T']}: {r['winner']} {tuple(vars(r['best_new']).values())}"
                                               if r["winner"] == "new" else f"T={r['T']}: old" for r in got))
    return dict(hbm_Bps=bw, rows=rows)


# -- whole model ----------------------------------------------------------------------------
def sync():
    if DEV.type == "cuda":
        torch.cuda.synchronize()


def decode_rate(engine, batch, prompt_len=64, steps=24, warmup=4, around=None):
    """tok/s of greedy decode steps after `warmup` steps (`decode_prefill.ours_decode`); `around`
    (a context manager, e.g. a profiler) wraps only the timed steps."""
    from decode_prefill import ours_decode
    return ours_decode(engine, batch, prompt_len, steps, torch.Generator().manual_seed(batch), warmup, around)[0]


def scheduler_rate(engine, batch, params, prompt_len=8, steps=64, warmup=8, overlap=True) -> float:
    """tok/s of decode through the server's Scheduler (what the worker loop runs each step:
    schedule, graph replay, sampling with `params`, bookkeeping), in this process, with the
    steps overlapped or each step's tokens read first (`overlap`): the gap to `decode_rate` is
    the scheduler's and sampler's share of a server's step, the rest of the gap to the server's
    rate is IPC and the API process."""
    from moeferry.scheduler.request import Request
    from moeferry.scheduler.scheduler import Scheduler
    sched = Scheduler(engine)
    sched.cfg = replace(sched.cfg, overlap_schedule=overlap)
    gen = torch.Generator().manual_seed(batch)
    for i in range(batch):
        prompt = torch.randint(0, engine.spec.vocab_size, (prompt_len,), generator=gen).tolist()
        sched.add(Request(f"bench-{i}", prompt, replace(params, max_tokens=steps + warmup + 2, ignore_eos=True)))
    for _ in range(warmup + 1):  # the prefill step, then decode
        sched.step()
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        sched.step()
    sync()
    rate = batch * steps / (time.perf_counter() - t)
    while sched.has_work:
        sched.step()
    return rate


def scheduler_rates(engine, out: dict, log) -> None:
    """b1 / b4 decode through the Scheduler, greedy and with Qwen3.6's default sampling, the
    steps overlapped and each step's tokens read first (what the overlap is worth)."""
    from moeferry.scheduler.sampling import SamplingParams
    for name, params in (("greedy", SamplingParams(temperature=0.0)),
                         ("sampled", SamplingParams(temperature=0.7, top_p=0.8, top_k=20))):
        for overlap, how in ((True, "overlapped"), (False, "read first")):
            rates = out[f"scheduler_{name}" + ("" if overlap else "_read_first")] = {
                b: scheduler_rate(engine, b, params, overlap=overlap) for b in (1, 4)}
            log(f"  through the scheduler, {name}, {how}: b1 {rates[1]:.1f} tok/s  b4 {rates[4]:.1f} tok/s")


def profile_step(engine, log, top=15):
    """Kernel time of two eager batch-1 decode steps by kernel name (graphs off)."""
    from torch.profiler import ProfilerActivity, profile
    graphs, engine.graphs = engine.graphs, None
    prof = profile(activities=[ProfilerActivity.CUDA])
    try:
        decode_rate(engine, 1, steps=2, warmup=2, around=prof)
    finally:
        engine.graphs = graphs
    ev = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in ev)
    log(f"  eager b1 profile: {total / 2:.0f} us kernel time per step")
    for e in ev[:top]:
        log(f"    {e.device_time_total / 2:8.1f} us  x{e.count // 2:4d}  {e.key[:90]}")


def profile_prefill(engine, log, tokens: int, top=15) -> dict:
    """One `tokens`-token prefill: its time (best of three after one warm run) and its kernel
    time by kernel name (what an 8192-token server prefill is made of, in chunks of this size)."""
    from decode_prefill import ours_prefill
    from torch.profiler import ProfilerActivity, profile
    gen = torch.Generator().manual_seed(0)
    ours_prefill(engine, tokens, gen)
    rate = max(ours_prefill(engine, tokens, gen) for _ in range(3))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        ours_prefill(engine, tokens, gen)
    ev = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in ev)
    log(f"  prefill {tokens} tokens: {tokens / rate * 1e3:.1f} ms ({rate:.0f} tok/s), "
        f"{total / 1e3:.1f} ms of kernel time profiled")
    for e in ev[:top]:
        log(f"    {e.device_time_total / 1e3:8.2f} ms  x{e.count:5d}  {e.key[:90]}")
    return dict(tokens=tokens, ms=tokens / rate * 1e3, kernel_ms=total / 1e3,
                kernels={e.key[:90]: e.device_time_total / 1e3 for e in ev[:top]})


def piecewise_breakdown(engine, log, batch=1, steps=12) -> dict:
    """Where a piecewise-captured decode step's time goes (offload, partial cache): launching
    the graphs, waiting for the device at each cut (the graphs' GPU time), and the host's cache
    work at the cuts (ids, lookups, fetch and prefetch launches), in ms per step."""
    from moeferry.engine import cuda_graph as CG
    acc = dict(launch=0.0, wait=0.0, host=0.0, prefetch_wait=0.0)
    plain = CG.StepGraphs.replay
    backend, settle = engine.experts, engine.experts.settle

    def timed_settle():  # waiting for the previous layer's prefetch copies (counted inside host work)
        t = time.perf_counter()
        settle()
        acc["prefetch_wait"] += time.perf_counter() - t

    def timed(self, rows):
        for i, graph in enumerate(self.graphs):
            t0 = time.perf_counter()
            graph.replay()
            t1 = time.perf_counter()
            acc["launch"] += t1 - t0
            if i < len(self.work):
                torch.cuda.current_stream().synchronize()
                t2 = time.perf_counter()
                acc["wait"] += t2 - t1
                self.work[i](rows)
                acc["host"] += time.perf_counter() - t2

    decode_rate(engine, batch, steps=2, warmup=2)
    CG.StepGraphs.replay, backend.settle = timed, timed_settle
    try:
        rate = decode_rate(engine, batch, steps=steps, warmup=0)  # (its prompt's prefill is timed too)
    finally:
        CG.StepGraphs.replay = plain
        del backend.settle
    per = {k: round(v * 1e3 / steps, 3) for k, v in acc.items()}
    log(f"  piecewise b{batch}: {rate:.1f} tok/s (timed: each cut synchronised first); per step ms: "
        f"graph launches {per['launch']}, device wait {per['wait']}, host cache work {per['host']} "
        f"(of which waiting for the prefetch copies {per['prefetch_wait']})")
    if batch == 1:  # the host work by function (cProfile over a few plain steps)
        import cProfile
        import io
        import pstats
        prof = cProfile.Profile()
        decode_rate(engine, 1, steps=4, warmup=0, around=prof)  # the decode steps alone
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        log(text.getvalue())
    return dict(tok_s=rate, **per)


def graphs_state(g) -> str:
    """The decode graphs as a benchmark reports them: off, the reason they are off, or the sizes captured."""
    return "off" if g is None else (g.disabled or f"on (sizes {sorted(g.graphs)})")


def offload_rates(engine, out: dict, tag: str, log, **steps) -> None:
    """Decode b1/b4 in the engine's current mode (`steps`: decode_rate's steps and warmup), and
    the cache's counters over those steps."""
    before = {k: v for k, v in engine.stats()["experts"].items() if isinstance(v, int)}  # (device counts folded in)
    for b in (1, 4):
        out[f"{tag}_b{b}"] = decode_rate(engine, b, **steps)
    after = engine.stats()["experts"]
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
    out[f"{tag}_hit_rate"] = round(hits / max(hits + misses, 1), 4)
    out[f"{tag}_prefetched"] = after["prefetched"] - before["prefetched"]
    out[f"{tag}_prefetch_hits"] = after["prefetch_hits"] - before["prefetch_hits"]  # guesses a step then used
    out[f"{tag}_misses"] = misses
    out[f"{tag}_graphs"] = graphs_state(engine.graphs)
    log(f"  {tag}: decode b1 {out[f'{tag}_b1']:.1f} tok/s  b4 {out[f'{tag}_b4']:.1f}  hit rate "
        f"{out[f'{tag}_hit_rate']}  misses {misses}  prefetched {out[f'{tag}_prefetched']} (used "
        f"{out[f'{tag}_prefetch_hits']})  graphs {out[f'{tag}_graphs']}")


def variant_rates(engine, log, row: str, **steps) -> dict:
    """Device-managed decode b1/b4 and the cache's counters (`offload_rates`, `steps`: decode_rate's),
    logged as `row`, keyed without it."""
    counted = {}
    offload_rates(engine, counted, f"device-managed, {row}", log, **steps)  # (logs the row)
    return {k.removeprefix(f"device-managed, {row}_"): round(v, 4) if isinstance(v, float) else v
            for k, v in counted.items()}


def backend_variants(engine, log, names: tuple[str, ...], combos, tag, measure=None, **steps) -> dict:
    """`measure(row)` (default: `variant_rates` with `steps`) with the offload backend's attributes
    `names` set to each combination of `combos` in turn, graphs recaptured for each, the
    attributes restored after; `tag(*combination)` names its row."""
    backend, rates = engine.experts, {}
    measure = measure or (lambda row: variant_rates(engine, log, row, **steps))
    default = tuple(getattr(backend, n) for n in names)
    try:
        for combo in combos:
            for n, v in zip(names, combo):
                setattr(backend, n, v)
            engine.graphs.invalidate()
            row = tag(*combo)
            rates[row] = measure(row)
    finally:
        for n, v in zip(names, default):
            setattr(backend, n, v)
        engine.graphs.invalidate()
    return rates


def device_variants(engine, log) -> dict:
    """Device-managed decode with the prefetch joined before or after the layer's own misses
    are gathered, and its gather's grid capped or full (the defaults first: late, a quarter of
    the SMs)."""
    late, grid = engine.experts.join_late, engine.experts.prefetch_programs
    combos = ((late, grid), (False, None), (True, None), (False, grid), (True, max(1, (grid or 4) // 2)))
    return backend_variants(engine, log, ("join_late", "prefetch_programs"), combos,
                            lambda late, programs: f"join {'late' if late else 'early'}, "
                            f"prefetch grid {programs or 'full'}")


def device_timeline(engine, log, batch: int, steps: int = 4, top: int = 12) -> dict:
    """Where a device-managed decode step's GPU time goes: the kernels of `steps` graph replays
    (the profiler sees the kernels inside a graph) by name, each stream's busy time, the time
    no kernel ran, per step; the gather kernels' busy time on each stream."""
    from torch.profiler import ProfilerActivity, profile
    prof = profile(activities=[ProfilerActivity.CUDA])
    decode_rate(engine, batch, steps=2, warmup=2)
    rate = decode_rate(engine, batch, steps=steps, warmup=2, around=prof)
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA" and e.time_range.elapsed_us() > 0]
    if not kernels:
        log(f"  device-managed b{batch} timeline: no kernels seen by the profiler")
        return {"tok_s": rate}
    spans: dict = {}
    by_name: dict = {}
    gathers: dict = {}
    by_stream: dict = {}  # kernel name -> stream -> us (a side stream's kernels may wait for SMs the gathers hold)
    for e in kernels:
        stream, us = getattr(e, "device_resource_id", 0), e.time_range.elapsed_us()
        spans.setdefault(stream, []).append((e.time_range.start, e.time_range.end))
        t, n = by_name.get(e.name, (0.0, 0))
        by_name[e.name] = (t + us, n + 1)
        per = by_stream.setdefault(e.name, {})
        per[stream] = per.get(stream, 0.0) + us / steps
        if "gather" in e.name:
            gathers[stream] = gathers.get(stream, 0.0) + us / steps
    wall = max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)
    busy = {stream: _union(v) / steps for stream, v in spans.items()}
    idle = (wall - _union([x for v in spans.values() for x in v])) / steps
    out = {"tok_s": round(rate, 1), "step_us": round(wall / steps), "idle_us": round(idle),
           "busy_us_by_stream": {str(k): round(v) for k, v in busy.items()},
           "gather_us_by_stream": {str(k): round(v) for k, v in gathers.items()},
           "kernels": {k: [round(t / steps, 1), n // steps] for k, (t, n) in
                       sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]}}
    log(f"  device-managed b{batch} timeline ({rate:.1f} tok/s profiled): step {out['step_us']} us, no kernel "
        f"running {out['idle_us']} us; busy by stream {out['busy_us_by_stream']}; gathers by stream "
        f"{out['gather_us_by_stream']}")
    out["kernels_by_stream"] = {k: {str(st): round(us, 1) for st, us in by_stream[k].items()} for k in out["kernels"]}
    out["events"] = kernel_events(kernels)
    for k, (t, n) in out["kernels"].items():
        log(f"    {t:8.1f} us  x{n:4d}  {k[:90]}  by stream {out['kernels_by_stream'][k]}")
    return out


def back_to_back(engine, batch: int, n: int) -> tuple[float, list[float]]:
    """n replays of the captured decode step of `batch` rows with no host read between (a random
    token written on the device before each, so the routing changes as in decoding): ms a step by
    CUDA events, and each `replay` call's host ms. What a server's overlapped steps approach."""
    graphs = engine.graphs
    step, _ = graphs.graphs[next(s for s in graphs.sizes if s >= batch)]
    tok = graphs.tokens[0, :batch]
    start, end, host = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True), []
    sync()
    start.record()
    for _ in range(n):
        tok.random_(0, engine.spec.vocab_size)
        t = time.perf_counter()
        step.replay(batch)
        host.append((time.perf_counter() - t) * 1e3)
    end.record()
    sync()
    return start.elapsed_time(end) / n, host


def budget_variants(engine, log, combos=((4, 4), (8, 2), (8, 3), (6, 2), (8, 8))) -> dict:
    """Device-managed decode with the prefetch guessing `width` experts a row and copying at most
    `budget` of them a row (the best ranked not cached): the sync loop's b1/b4 (`offload_rates`)
    and back-to-back replays' b1/b4 (`back_to_back`: the host's share taken out, as a server's
    overlapped steps do)."""
    def measure(name: str) -> dict:
        row = variant_rates(engine, log, name, steps=64, warmup=32)
        for b in (1, 4):
            back_to_back(engine, b, 8)
            ms, _ = back_to_back(engine, b, 48)
            row[f"back_to_back_b{b}"] = round(b * 1e3 / ms, 1)
        log(f"    back to back: b1 {row['back_to_back_b1']} tok/s  b4 {row['back_to_back_b4']} tok/s")
        return row

    return backend_variants(engine, log, ("prefetch_width", "prefetch_budget"), combos,
                            lambda width, budget: f"guess {width}, budget {budget}", measure)


def launch_gaps(engine, log, batch: int = 1, steps: int = 16) -> dict:
    """Where a graph-replayed decode step's time outside its kernels goes. Three ways of running
    the captured step of `batch` rows: the benchmark's loop (each step's tokens read on the host
    before the next step's inputs are written: `decode_rate`); replays back to back with no host
    read between (a random token written on the device before each, so the routing changes as in
    decoding), timed by CUDA events, and each `replay` call's host time; and, under the profiler
    (CPU and CUDA), each graph launch's host call and the time from its start to the graph's
    first kernel, and between one replay's last kernel and the next one's first."""
    from torch.profiler import ProfilerActivity, profile
    out = {"loop_tok_s": round(decode_rate(engine, batch, steps=steps, warmup=4), 1)}
    back_to_back(engine, batch, 4)
    ms, host = back_to_back(engine, batch, steps)
    host.sort()
    out.update(back_to_back_ms=round(ms, 3), back_to_back_tok_s=round(batch * 1e3 / ms, 1),
               replay_host_ms_median=round(host[len(host) // 2], 3), replay_host_ms_max=round(host[-1], 3))
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    with prof:
        decode_rate(engine, batch, steps=3, warmup=0)
        back_to_back(engine, batch, 3)
    ev = prof.events()
    launches = sorted((e.time_range.start, e.time_range.elapsed_us()) for e in ev
                      if e.name.startswith("cudaGraphLaunch"))
    kernels = sorted((e.time_range.start, e.time_range.end) for e in ev
                     if e.device_type.name == "CUDA" and "Memcpy" not in e.name and "Memset" not in e.name)
    rows = []
    for i, (t0, dur) in enumerate(launches):
        t1 = launches[i + 1][0] if i + 1 < len(launches) else float("inf")
        mine = [k for k in kernels if t0 <= k[0] < t1]
        before = [k[1] for k in kernels if k[0] < t0]
        if mine:
            idle_before = mine[0][0] - max(before[-1] if before else t0, t0)
            rows.append([round(dur, 1), round(mine[0][0] - t0, 1), round(max(idle_before, 0.0), 1)])
    out["launches"] = rows  # [host us of cudaGraphLaunch, its start to the first kernel, GPU idle before that kernel]
    log(f"  launch gaps b{batch}: loop {out['loop_tok_s']} tok/s; back to back {out['back_to_back_ms']} ms a step "
        f"({out['back_to_back_tok_s']} tok/s), replay() host {out['replay_host_ms_median']} ms median, "
        f"{out['replay_host_ms_max']} max; profiled launches [host us, to first kernel us, GPU idle before it us]: {rows}")
    return out


def launch_variants(engine, log) -> dict:
    """`launch_gaps` at b1 with the step's streams as configured, with its side work in line, and with
    neither side work nor prefetch (one stream): whether the graph's branches cost its start."""
    backend = engine.experts
    combos = ((backend.work_aside, backend.prefetch), (False, backend.prefetch), (False, False))

    def measure(name: str) -> dict:
        log(f"  {name}:")
        return attempt(log, launch_gaps, engine, log)

    return backend_variants(engine, log, ("work_aside", "prefetch"), combos,
                            lambda aside, prefetch: "one stream" if not (aside or prefetch) else
                            "side work " + ("on the side stream" if aside else "in line"), measure)


def kernel_events(kernels) -> dict:
    """Every profiled kernel as [stream, start us, duration us, name index] (start from the first
    kernel's), in start order, with the names they index: the timeline itself, to read offline
    where the link and the SMs wait."""
    t0 = min(e.time_range.start for e in kernels)
    names: dict = {}
    rows = [[getattr(e, "device_resource_id", 0), round(e.time_range.start - t0, 1), round(e.time_range.elapsed_us(), 1),
             names.setdefault(e.name, len(names))] for e in sorted(kernels, key=lambda e: e.time_range.start)]
    return {"names": list(names), "rows": rows}


def attempt(log, fn, *args):
    """fn(*args), or its error logged (one measurement failing leaves the others)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - a benchmark reports and goes on
        log(f"  {fn.__name__} failed: {type(e).__name__}: {e}")
        return {"error": f"{type(e).__name__}: {e}"}


def _union(spans: list) -> float:
    """Total length of the union of (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def policy_rates(engine, policies: list[str], out: dict, log) -> None:
    """Decode b1/b4 and the hit rate under each eviction policy in turn (the cached experts
    carried over from one to the next, graphs recaptured), and where a b1 step's time goes."""
    for name in policies:
        for c in engine.experts.distinct_caches:
            c.set_policy(name)
        engine.graphs.invalidate()
        mode = engine.experts.graph_mode(engine.graphs.max_batch)
        offload_rates(engine, out, f"{mode or 'eager'}_{name}", log, steps=64, warmup=32)  # the policy settles first
        if mode == "device":
            out[f"timeline_{name}"] = attempt(log, device_timeline, engine, log, 1)


def order_variants(engine, log) -> dict:
    """Device-managed decode with the next layer's prefetch started after this layer's own
    gather (the default) or before it, on the default prefetch grid and on twice that."""
    grid = engine.experts.prefetch_programs
    combos = ((False, grid), (True, grid), (True, 2 * grid), (False, 2 * grid))
    return backend_variants(engine, log, ("prefetch_first", "prefetch_programs"), combos,
                            lambda first, programs: f"prefetch {'before' if first else 'after'} the own gather, "
                            f"grid {programs}", steps=64, warmup=32)


def gather_variants(engine, log) -> dict:
    """Device-managed decode with the prefetch's gather in each launch shape of `slot_gather.CONFIGS`
    (words a program, warps) on half the default grid, on it and on twice it: the boot picks the
    shape that moves an expert soonest alone, a step wants the one that slows the overlapped
    compute least (at a high hit rate the step is compute-bound, and fewer programs may win)."""
    from moeferry.ops.triton.slot_gather import CONFIGS
    grid = engine.experts.prefetch_programs
    combos = [(c, g) for c in CONFIGS for g in (max(1, grid // 2), grid, 2 * grid)]
    return backend_variants(engine, log, ("prefetch_gather", "prefetch_programs"), combos,
                            lambda c, programs: f"prefetch gather {c[0]} words x {c[1]} warps, grid {programs}",
                            steps=64, warmup=32)


def aside_variants(engine, log) -> dict:
    """Device-managed decode with a layer's side work (the next layer's guess and placement, the
    shared expert) on the side stream beside its own gather (the default), and in line; then the
    own gather's grid capped at the prefetch's and twice it (a full grid may hold the SMs the side
    work wants while the gather waits on the link)."""
    grid = engine.experts.prefetch_programs
    combos = ((True, None), (False, None), (True, grid), (True, 2 * grid))
    return backend_variants(engine, log, ("work_aside", "own_programs"), combos,
                            lambda aside, own: "side work " + ("on the side stream" if aside else "in line")
                            + f", own gather grid {own or 'full'}", steps=64, warmup=32)


def width_variants(engine, log, widths: list[int] | None = None) -> dict:
    """Device-managed decode with the prefetch guessing `widths` experts a row and copying every
    one not cached (default: the top-k, 1.5x and 2x as many): a wider guess catches more of the
    layer's own misses (gathered on the critical path), a narrower one copies fewer wrong guesses
    (bytes on a busy link)."""
    k = engine.spec.top_k
    combos = [(w, w) for w in (widths or [k, k * 3 // 2, 2 * k])]
    return backend_variants(engine, log, ("prefetch_width", "prefetch_budget"), combos,
                            lambda w, _: f"prefetch guessing {w} a row, copying all", steps=64, warmup=32)


def bench_offload(engine, slots: int, out: dict, log, policies: list[str], orders: bool = False,
                  widths: list[int] | None = None, aside: bool = False, launch: bool = False,
                  budgets: list | None = None) -> dict:
    """Offload decode through a partial cache three ways: graphs with the cache managed on the
    device (the default where it can be), piecewise graphs (host-managed), eager; then where a
    piecewise step's time goes. `policies`: instead, the default mode under each eviction policy
    (then `orders`: the prefetch's variants; `widths`: the prefetch guessing each width a row;
    `aside`: the side stream on and off)."""
    backend = engine.experts
    mode = backend.graph_mode(engine.graphs.max_batch) if engine.graphs is not None else None
    out["graph_mode"] = mode
    log(f"  offload {slots} slots: load {out['load_s']:.1f} s  graph mode {mode}")
    if policies and engine.graphs is not None:
        policy_rates(engine, policies, out, log)
        if orders and backend.graph_mode(engine.graphs.max_batch) == "device":
            out["orders"] = attempt(log, order_variants, engine, log)
            out["prefetch_gathers"] = attempt(log, gather_variants, engine, log)
            out["prefetch_widths"] = attempt(log, width_variants, engine, log)
        elif widths and backend.graph_mode(engine.graphs.max_batch) == "device":
            out["prefetch_widths"] = attempt(log, width_variants, engine, log, widths)
        if aside and backend.graph_mode(engine.graphs.max_batch) == "device":
            out["aside"] = attempt(log, aside_variants, engine, log)
        if launch and backend.graph_mode(engine.graphs.max_batch) == "device":
            out["launch"] = attempt(log, launch_variants, engine, log)
        if budgets and backend.graph_mode(engine.graphs.max_batch) == "device":
            out["budgets"] = attempt(log, budget_variants, engine, log, budgets)
        attempt(log, scheduler_rates, engine, out, log)  # under the last policy
        return out
    offload_rates(engine, out, mode or "eager", log)
    out["b1"], out["b4"] = out[f"{mode or 'eager'}_b1"], out[f"{mode or 'eager'}_b4"]
    if engine.graphs is None:
        return out
    if mode == "device":
        out["timeline"] = {b: attempt(log, device_timeline, engine, log, b) for b in (1, 4)}
        out["variants"] = attempt(log, device_variants, engine, log)
        backend.device_managed = False
        engine.graphs.invalidate()
        offload_rates(engine, out, "piecewise", log)
    graphs, engine.graphs = engine.graphs, None
    out["eager_b1"] = decode_rate(engine, 1)
    engine.graphs = graphs
    out["cache"] = {k: v for k, v in engine.stats()["experts"].items() if k != "layers"}
    log(f"  eager b1 {out['eager_b1']:.1f} tok/s  cache {out['cache']}")
    if graphs.disabled is None and backend.graph_mode(graphs.max_batch) == "piecewise":
        out["breakdown"] = {b: piecewise_breakdown(engine, log, b) for b in (1, 4)}
    return out


def bench_e2e(args, log):
    import moeferry
    from moeferry.engine.config import EngineConfig
    from moeferry.engine.engine import Engine
    log(f"moeferry from {Path(moeferry.__file__).parent}")
    t0 = time.perf_counter()
    extra = (dict(moe_backend="offload", moe_cache_size=args.offload, num_state_slots=4) if args.offload
             else dict(num_state_slots=40, max_running_requests=40))
    kv = 8192 + 64 if args.profile else 4096  # the prefill profile's 8192-token chunk needs its KV
    engine = Engine.build(EngineConfig(args.checkpoint, DEV.type, "bfloat16", num_tokens=kv, **extra))
    load_s = time.perf_counter() - t0
    out = dict(load_s=load_s, checkpoint=args.checkpoint)
    if args.offload:  # decode through a partial cache: device-managed graphs, piecewise, eager; the breakdown
        return bench_offload(engine, args.offload, out, log, [p for p in args.policies.split(",") if p], args.orders,
                             [int(w) for w in args.widths.split(",") if w], args.aside, args.launch,
                             [tuple(int(v) for v in c.split(":")) for c in args.budgets.split(",") if c])
    for b in (1, 4, 16):
        out[f"b{b}"] = decode_rate(engine, b)
    out["graphs"] = graphs_state(engine.graphs)
    log(f"  load {load_s:.1f} s  decode b1 {out['b1']:.1f} tok/s  b4 {out['b4']:.1f} tok/s  "
        f"b16 {out['b16']:.1f} tok/s  graphs: {out['graphs']}")
    scheduler_rates(engine, out, log)
    if args.profile:
        profile_step(engine, log)
        out["prefill_profile"] = profile_prefill(engine, log, min(8192, engine.cfg.max_extend_tokens))
    out["decode_path"] = decode_path_rates(engine, log)
    return out


def decode_path_rates(engine, log, upto=(1, 2, 4)):
    """Whole-model decode with the MoE decode path on for T <= t (each t of `upto`), the graphs
    recaptured: whether the warm-up's per-kernel choice (`moe.path_choice`) holds on the model."""
    buffers = [t.buffer for t in engine.experts.decode_targets()]
    saved, rates = [b.decode_tokens for b in buffers], {}
    try:
        for t in upto:
            for b in buffers:
                b.decode_tokens = t
            if engine.graphs is not None:
                engine.graphs.invalidate()
            rates[t] = {b: decode_rate(engine, b) for b in (1, 4)}
            log(f"  MoE decode path for T <= {t}: decode b1 {rates[t][1]:.1f} tok/s  b4 {rates[t][4]:.1f} tok/s")
    finally:
        for b, n in zip(buffers, saved):
            b.decode_tokens = n
        if engine.graphs is not None:
            engine.graphs.invalidate()
    return rates


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("dense", "moe", "e2e"))
    ap.add_argument("checkpoint", nargs="?")
    ap.add_argument("--out", default=".")
    ap.add_argument("--tag", default="")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--profile", action="store_true", help="e2e: kernel time by name of an eager b1 decode step "
                    "and of an 8192-token prefill")
    ap.add_argument("--offload", type=int, default=0, metavar="SLOTS",
                    help="e2e: the offload backend with this many cache slots (device-managed graphs, piecewise, eager; breakdown)")
    ap.add_argument("--policies", default="", help="e2e --offload: device-managed decode under each of these "
                    "eviction policies in turn (e.g. lru,lfu), instead of the modes and the breakdown")
    ap.add_argument("--orders", action="store_true", help="e2e --offload --policies: then the prefetch's gather "
                    "in each launch shape, its guess 1-2x the top-k wide, and the prefetch started "
                    "before or after the layer's own gather, on two grids (the last policy)")
    ap.add_argument("--widths", default="", help="e2e --offload --policies (without --orders): then the "
                    "decode prefetch guessing each of these many experts a row (e.g. 4,6,8)")
    ap.add_argument("--aside", action="store_true", help="e2e --offload --policies: then device-managed decode "
                    "with the side stream on and off (a layer's guess, placement and shared expert beside its gather)")
    ap.add_argument("--launch", action="store_true", help="e2e --offload --policies: then where a device-managed "
                    "b1 step's time outside its kernels goes (graph launches), with the step's streams as configured, "
                    "its side work in line, and one stream")
    ap.add_argument("--budgets", default="", metavar="W:B,...", help="e2e --offload --policies: then device-managed "
                    "decode with the prefetch guessing W a row and copying at most B of them, for each pair (sync loop "
                    "and back to back)")
    ap.add_argument("--forms", default="", help="dense: device forms to run (default all)")
    ap.add_argument("--rows", default="1,4,16,4096", help="dense: values of M")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (set MOEFERRY_TRITON_INTERPRET=1)")
    args = ap.parse_args()
    global DEV, SMOKE
    if args.smoke:
        DEV, SMOKE = torch.device("cpu"), True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"quant_{args.what}{args.tag}"
    log = MK.logger(out / f"{name}.log")

    res = {"dense": bench_dense, "moe": bench_moe, "e2e": bench_e2e}[args.what](args, log)
    (out / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
