"""Prefill and decode throughput of moeferry against transformers, same weights, same GPU.

Model: Qwen3.6-35B-A3B geometry at full depth (40 layers: 30 Gated DeltaNet + 10 gated
attention, 256 experts top-8 + shared expert, vocab 248320), random bf16 weights with all
experts resident (~70 GB), built once on the GPU and shared by both engines (inmemory.py).

Prefill: one prompt of 2k / 8k / 32k tokens in one step (moeferry: one chunk; transformers:
one forward with logits_to_keep=1). Decode: B = 1 / 4 / 16 sequences with 256-token
prompts, greedy, timed over steady-state steps including the host round trip of every step
(moeferry: CUDA-graph replay; transformers: its eager decode with its cache).
HBM bound for decode: bytes a step must read (every dense weight incl. the LM head, the
experts the step's routing touches, measured per layer, the GDN states read and written and
the KV read) over the measured device-to-device copy bandwidth (bytes read + written / time).

    python benchmarks/decode_prefill.py --out DIR          # on the GPU machine
    python benchmarks/decode_prefill.py --small --device cpu   # wiring check on a CPU
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from inmemory import build_hf, moe_path, moeferry_engine, qwen36_config  # noqa: E402

from moeferry.model.batch import SeqChunk  # noqa: E402


def sync(device):
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device, nbytes=4 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    a = torch.randn(nbytes // 4, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    sync(device)
    times = []
    for _ in range(10):
        t = time.perf_counter()
        b.copy_(a)
        sync(device)
        times.append(time.perf_counter() - t)
    del a, b
    return 2 * nbytes / sorted(times)[len(times) // 2]


# -- moeferry -------------------------------------------------------------------------------
def ours_prefill(engine, n: int, gen) -> float:
    prompt = torch.randint(0, engine.spec.vocab_size, (n,), generator=gen).tolist()
    with engine.cache.sequences([n]) as (seq,):
        sync(engine.device)
        t = time.perf_counter()
        engine.forward([SeqChunk(prompt, 0, seq.pages, seq.state_slot)])
        sync(engine.device)
        return n / (time.perf_counter() - t)


def ours_decode(engine, batch: int, prompt_len: int, steps: int, gen, warmup: int = 3, around=None):
    """(tok/s, distinct experts per layer in one step, KV bytes read per step); `around` (a context
    manager, e.g. a profiler) wraps only the timed steps."""
    total = prompt_len + warmup + steps + 1
    with engine.cache.sequences([total] * batch) as held:
        pages, slots = [b.pages for b in held], [b.state_slot for b in held]
        prompts = [torch.randint(0, engine.spec.vocab_size, (prompt_len,), generator=gen).tolist()
                   for _ in range(batch)]
        logits = engine.forward([SeqChunk(p, 0, pages[i], slots[i]) for i, p in enumerate(prompts)])
        toks = logits.argmax(-1).tolist()
        pos = prompt_len

        def step():
            nonlocal toks, pos
            out = engine.forward([SeqChunk([toks[i]], pos, pages[i], slots[i]) for i in range(batch)])
            toks = out.argmax(-1).tolist()
            pos += 1

        for _ in range(warmup):
            step()
        sync(engine.device)
        with around or contextlib.nullcontext():
            t = time.perf_counter()
            for _ in range(steps):
                step()
            sync(engine.device)
            rate = batch * steps / (time.perf_counter() - t)
        experts = count_experts(engine, [SeqChunk([toks[i]], pos, pages[i], slots[i]) for i in range(batch)])
        return rate, experts, pos


def count_experts(engine, chunks) -> list[int]:
    """Distinct experts each MoE layer routes this decode step to (one eager step, recorded)."""
    counts, wrapped = [], []
    for layer in engine.model.layers:
        moe = layer.mlp
        if not hasattr(moe, "experts"):
            continue
        orig = moe.experts

        def rec(x, ids, weights, *a, _orig=orig, **k):
            counts.append(int(ids.unique().numel()))
            return _orig(x, ids, weights, *a, **k)
        moe.experts = rec
        wrapped.append((moe, orig))
    graphs, engine.graphs = engine.graphs, None
    try:
        engine.forward(chunks)  # writes the same KV/state slots the next step would: results unused
    finally:
        engine.graphs = graphs
        for moe, orig in wrapped:
            moe.experts = orig
    return counts


def profile_decode(engine, gen, steps: int = 3) -> None:
    """Kernel time of eager batch-1 decode steps by kernel name (graphs off, so launches show)."""
    from torch.profiler import ProfilerActivity, profile
    graphs, engine.graphs = engine.graphs, None
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            ours_decode(engine, 1, 256, steps, gen, warmup=0)
    finally:
        engine.graphs = graphs
    print("eager decode, batch 1 (%d steps + prefill + expert count): kernel time by name" % steps)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))


# -- transformers ---------------------------------------------------------------------------
def hf_prefill(model, n: int, gen, device) -> float:
    ids = torch.randint(0, model.config.vocab_size, (1, n), generator=gen).to(device)
    with torch.no_grad():
        sync(device)
        t = time.perf_counter()
        model(input_ids=ids, use_cache=True, logits_to_keep=1)
        sync(device)
    return n / (time.perf_counter() - t)


def hf_decode(model, batch: int, prompt_len: int, steps: int, gen, device, warmup: int = 2) -> float:
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt_len), generator=gen).to(device)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        tok = out.logits[:, -1].argmax(-1).tolist()
        for i in range(warmup + steps):
            if i == warmup:
                sync(device)
                t = time.perf_counter()
            out = model(input_ids=torch.tensor(tok, device=device)[:, None], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            tok = out.logits[:, -1].argmax(-1).tolist()
        sync(device)
    return batch * steps / (time.perf_counter() - t)


# -- bytes a decode step reads ---------------------------------------------------------------
def step_bytes(hf, spec, batch: int, experts_per_layer: list[int], context: int) -> int:
    """Bytes one decode step must read: dense weights (all but the routed experts and the
    embedding table, of which B rows), the experts routed to, GDN states (read + write), KV."""
    dense = sum(p.numel() * p.element_size() for n, p in hf.named_parameters()
                if "experts." not in n and "embed_tokens" not in n)
    per_expert = 3 * spec.moe_intermediate_size * spec.hidden_size * 2
    gdn_state = 2 * batch * len(spec.linear_layers) * spec.linear_num_v_heads * spec.linear_k_head_dim \
        * spec.linear_v_head_dim * 4
    kv = batch * len(spec.attention_layers) * context * 2 * spec.num_kv_heads * spec.head_dim * 2
    return dense + sum(experts_per_layer) * per_expert + gdn_state + kv


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    ap.add_argument("--small", action="store_true", help="4 layers, 16 experts, 32k vocab (wiring check)")
    ap.add_argument("--prefill", default="2048,8192,32768")
    ap.add_argument("--decode", default="1,4,16")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    dev = args.device
    prefill_lens = [int(x) for x in args.prefill.split(",") if x]
    batches = [int(x) for x in args.decode.split(",") if x]
    cfg = qwen36_config(num_layers=4, num_experts=16, vocab_size=32000) if args.small else qwen36_config()
    t0 = time.perf_counter()
    hf = build_hf(cfg, dev, torch.bfloat16, seed=0)
    engine = moeferry_engine(cfg, hf, dev, torch.bfloat16, num_tokens=max(prefill_lens) + max(batches) * 320 + 64,
                             max_seqs=max(batches))
    moe = moe_path(engine)
    info = {"date": date.today().isoformat(), "machine": torch.cuda.get_device_name() if dev.startswith("cuda")
            else platform.processor() or "cpu", "torch": torch.__version__, "moeferry_moe": moe,
            "layers": cfg["num_hidden_layers"], "build_s": round(time.perf_counter() - t0, 1)}
    try:
        import transformers
        info["transformers"] = transformers.__version__
        info["hf_experts_implementation"] = getattr(hf.config, "_experts_implementation", None)
    except Exception:
        pass
    params = sum(p.numel() for p in hf.parameters())
    info["params_b"] = round(params / 1e9, 2)
    print(json.dumps(info), flush=True)
    bw = copy_bandwidth(dev) if dev.startswith("cuda") else None
    info["copy_bw_tb_s"] = None if bw is None else round(bw / 1e12, 2)
    gen = torch.Generator().manual_seed(0)
    rows = []

    # warm-up: compile kernels, first-use allocations (not timed)
    ours_prefill(engine, 300, gen)
    if not args.skip_hf:
        hf_prefill(hf, 300, gen, dev)
    def prefill_row(n):  # each engine runs every size twice and keeps the faster (kernel variants
        # for new shapes compile, and the MoE kernels pick their configs, on first use)
        r = {"phase": "prefill", "size": n, "ours_tok_s": max(ours_prefill(engine, n, gen) for _ in range(2))}
        print(json.dumps(r), flush=True)
        if not args.skip_hf:
            r["hf_tok_s"] = max(hf_prefill(hf, n, gen, dev) for _ in range(2))
            r["ratio"] = r["ours_tok_s"] / r["hf_tok_s"]
        rows.append(r)
        print(json.dumps(r), flush=True)

    for n in prefill_lens:  # the longest prompt last (slowest, riskiest for the time limit)
        if n <= 8192 or len(prefill_lens) == 1:
            prefill_row(n)
    prompt_len = 256
    for b in batches:
        rate, experts, ctx = ours_decode(engine, b, prompt_len, args.steps, gen)
        r = {"phase": "decode", "size": b, "ours_tok_s": rate, "experts_per_layer": sum(experts) / max(len(experts), 1),
             "graphs": "off" if engine.graphs is None else (engine.graphs.disabled or "on")}
        nbytes = step_bytes(hf, engine.spec, b, experts, ctx)
        r["bytes_per_step_gb"] = nbytes / 1e9
        if bw:
            r["bound_tok_s"] = b * bw / nbytes
            r["frac_of_bound"] = rate / r["bound_tok_s"]
        if not args.skip_hf:
            r["hf_tok_s"] = hf_decode(hf, b, prompt_len, max(4, args.steps // 2), gen, dev)
            r["ratio"] = rate / r["hf_tok_s"]
        rows.append(r)
        print(json.dumps(r), flush=True)
        save(args.out, info, rows)
        if b == 1 and dev.startswith("cuda"):
            profile_decode(engine, gen)
    for n in prefill_lens:
        if n > 8192 and len(prefill_lens) > 1:
            prefill_row(n)
    table = save(args.out, info, rows)
    print(table)


def save(out_dir, info, rows) -> str:
    table = render(info, rows)
    if out_dir:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1))
        (out / "bench_table.md").write_text(table)
    return table


def render(info: dict, rows: list[dict]) -> str:
    def f(x, nd=0):
        return "-" if x is None else f"{x:,.{nd}f}"
    lines = [f"{info['date']}, {info['machine']}, torch {info['torch']}, transformers {info.get('transformers')}; "
             f"{info['layers']} layers, {info['params_b']}B params bf16; moeferry MoE: {info['moeferry_moe']}; "
             f"transformers experts: {info.get('hf_experts_implementation')}; copy bandwidth "
             f"{info.get('copy_bw_tb_s')} TB/s (read + write)", "",
             "| phase | size | moeferry tok/s | transformers tok/s | ratio | HBM bound tok/s | moeferry / bound |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        size = f"{r['size']} tokens" if r["phase"] == "prefill" else f"batch {r['size']}"
        lines.append(f"| {r['phase']} | {size} | {f(r['ours_tok_s'])} | {f(r.get('hf_tok_s'))} | "
                     f"{f(r.get('ratio'), 2)} | {f(r.get('bound_tok_s'))} | {f(r.get('frac_of_bound'), 2)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
