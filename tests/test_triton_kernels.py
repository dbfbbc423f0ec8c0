"""Triton kernels (attention, Gated DeltaNet, conv, norms, rotary) against their references.

Every case draws fresh random inputs (never zeros), poisons outputs and pools it does not
expect to change, and compares with the plain-PyTorch reference in `moeferry.ops`.
Interpreter: each case runs on small fp32 shapes in two worker subprocesses with
TRITON_INTERPRET=1 (the variable never reaches this process), each reported as a test.
On a CUDA machine the same cases also run compiled here (`-m gpu`), and further GPU cases
check the real Qwen3.6-35B-A3B shapes in bf16 against the reference on fp32 copies.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.interpreter_workers import assert_case_passed, report_cases, run_workers
import torch

pytest.importorskip("triton")

from moeferry.ops import attention as ref_attn  # noqa: E402
from moeferry.ops import conv as ref_conv  # noqa: E402
from moeferry.ops import gdn as ref_gdn  # noqa: E402
from moeferry.ops import norm as ref_norm  # noqa: E402
from moeferry.ops import rope as ref_rope  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORKERS = 2


def _rel(out, ref):
    assert torch.isfinite(out.float()).all(), "non-finite output"
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def _check(out, ref, tol, what=""):
    err = _rel(out, ref)
    assert err <= tol, f"{what}: rel err {err:.3g} > {tol:g}"
    return err


def _cu(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _dot_tol(device):
    """fp32 tl.dot runs as tf32 on the GPU, exactly under the interpreter."""
    return 3e-3 if device.startswith("cuda") else 2e-5


# -- cases: fn(device) -> worst relative error ------------------------------------------------
def case_rms_norm(device, rows=37, n=200, seed=0):
    from moeferry.ops.triton import norm as tn
    g = _gen(seed)
    worst = 0.0
    base = torch.randn(rows, 3, n, generator=g)
    for x in (base[:, 1], base.reshape(rows * 3, n)):  # strided row view and plain rows
        x = x.to(device)
        w = (torch.randn(n, generator=g) * 0.5).to(device)
        r = torch.randn(x.shape, generator=g).to(device)
        for zc in (False, True):
            worst = max(worst, _check(tn.rms_norm(x, w, 1e-6, zc), ref_norm.rms_norm_ref(x, w, 1e-6, zc), 1e-5, "rms"))
            out, summed = tn.add_rms_norm(x, r, w, 1e-6, zc)
            ref_out, ref_sum = ref_norm.add_rms_norm_ref(x, r, w, 1e-6, zc)
            worst = max(worst, _check(out, ref_out, 1e-5, "add_rms"), _check(summed, ref_sum, 1e-6, "sum"))
    x16 = torch.randn(9, 5, 64, generator=g).half().to(device)
    w16 = torch.randn(64, generator=g).half().to(device)
    worst = max(worst, _check(tn.rms_norm(x16, w16, 1e-6, False), ref_norm.rms_norm_ref(x16, w16, 1e-6, False),
                              2e-3, "fp16"))
    return worst


def case_route_topk(device, seed=11):
    """Fused softmax + top-k + renormalise against `route_topk_ref`: same experts in the same
    order, weights to fp32 rounding; 256 experts (Qwen3.6) and a non-power-of-2 count."""
    from moeferry.ops.moe import route_topk_ref
    from moeferry.ops.triton import router
    g = _gen(seed)
    worst = 0.0
    for t, e, k, renorm, dtype in ((1, 256, 8, True, torch.float32), (5, 256, 8, False, torch.float32),
                                    (7, 60, 4, True, torch.float32), (3, 128, 8, True, torch.bfloat16)):
        logits = (torch.randn(t, e, generator=g) * 3).to(dtype).to(device)
        w, ids = router.route_topk(logits, k, renorm)
        rw, rids = route_topk_ref(logits, k, renorm)
        assert ids.dtype == torch.int64 and w.dtype == dtype, (ids.dtype, w.dtype)
        picked, ref_picked = (logits.float().cpu().gather(1, i.cpu()) for i in (ids, rids))
        assert torch.equal(picked, ref_picked), (t, e, k)  # bf16 logits tie: equal values, either order
        assert all(len(set(r)) == k for r in ids.tolist())
        if dtype == torch.float32:
            assert torch.equal(ids.cpu(), rids.cpu()), (t, e, k)
        worst = max(worst, _check(w, rw, 1e-5 if dtype == torch.float32 else 1e-2, "weights"))
    bad = torch.full((2, 60), float("nan")).to(device)  # NaN logits still route to real experts
    _, bad_ids = router.route_topk(bad, 4, True)
    assert ((bad_ids >= 0) & (bad_ids < 60)).all() and all(len(set(r)) == 4 for r in bad_ids.tolist())
    empty_w, empty_ids = router.route_topk(torch.randn(0, 256).to(device), 8, True)
    assert empty_w.shape == (0, 8) and empty_ids.shape == (0, 8)
    return worst


def case_gated_rms_norm(device, seed=1):
    from moeferry.ops.triton import norm as tn
    g = _gen(seed)
    x = torch.randn(4 * 8, 128, generator=g).to(device)
    z = (torch.randn(4 * 8, 128, generator=g) * 2).to(device)
    w = torch.randn(128, generator=g).to(device)
    return _check(tn.gated_rms_norm(x, z, w, 1e-6), ref_norm.gated_rms_norm_ref(x, z, w, 1e-6), 1e-5, "gated")


def case_rope(device, seed=2):
    from moeferry.ops.triton import rope as tr
    g = _gen(seed)
    worst = 0.0
    for t, h, d, rot, gated in ((9, 5, 48, 16, True), (4, 3, 32, 32, False), (6, 16, 256, 64, True)):
        inv = ref_rope.rope_inv_freq(rot, 10000.0)
        pos = torch.randint(0, 4000, (t,), generator=g)
        cos, sin = ref_rope.rope_cos_sin(pos, inv, torch.float32)
        if gated:  # the query half of Qwen3.5's q_proj output: a strided view
            x = torch.randn(t, h, 2 * d, generator=g)[..., :d]
        else:
            x = torch.randn(t, h, d, generator=g)
        x, cos, sin = x.to(device), cos.to(device), sin.to(device)
        worst = max(worst, _check(tr.apply_rope(x, cos, sin), ref_rope.apply_rope_ref(x, cos, sin), 1e-6, "rope"))
    return worst



def case_qk_norm_rope(device, seed=12):
    """q/k RMSNorm + rotary in one launch against rms_norm_ref then apply_rope_ref: zero-centred
    and plain weights, partial and full rotary, q a strided view (Qwen3.5's gated q_proj), one k head."""
    from moeferry.ops.triton import rope as tr
    g = _gen(seed)
    worst = 0.0
    for t, hq, hk, d, rot, zc in ((9, 5, 1, 48, 16, True), (4, 3, 2, 32, 32, False), (6, 16, 2, 256, 64, True)):
        inv = ref_rope.rope_inv_freq(rot, 10000.0)
        cos, sin = ref_rope.rope_cos_sin(torch.randint(0, 4000, (t,), generator=g), inv, torch.float32)
        q = torch.randn(t, hq, 2 * d, generator=g)[..., :d] * 3.0
        k = torch.randn(t, hk, d, generator=g) + 0.5
        qw, kw = torch.randn(d, generator=g) * 0.2, torch.randn(d, generator=g) * 0.2 + (0.0 if zc else 1.0)
        q, k, qw, kw, cos, sin = (x.to(device) for x in (q, k, qw, kw, cos, sin))
        qo, ko = tr.qk_norm_rope(q, k, qw, kw, 1e-6, zc, cos, sin)
        for out, x, w, what in ((qo, q, qw, "q"), (ko, k, kw, "k")):
            ref = ref_rope.apply_rope_ref(ref_norm.rms_norm_ref(x, w, 1e-6, zc), cos, sin)
            assert out.shape == ref.shape and out.is_contiguous()
            worst = max(worst, _check(out, ref, 1e-5, f"qk_norm_rope {what}"))
    return worst

def case_store_kv(device, seed=3):
    from moeferry.ops.triton import attention as ta
    g = _gen(seed)
    kc = torch.randn(40, 2, 32, generator=g).to(device)
    vc = torch.randn(40, 2, 32, generator=g).to(device)
    k = torch.randn(6, 2, 32, generator=g).to(device)
    v = torch.randn(6, 2, 32, generator=g).to(device)
    slots = torch.tensor([5, 17, -1, 0, 39, -1], dtype=torch.int64, device=device)
    rk, rv = kc.clone(), vc.clone()
    keep = slots >= 0
    ref_attn.store_kv_ref(rk, rv, k[keep], v[keep], slots[keep])
    ta.store_kv(kc, vc, k, v, slots)
    assert torch.equal(kc, rk) and torch.equal(vc, rv)
    return 0.0


def case_conv(device, seed=4):
    """Ragged prefill (lengths below and above K-1) continuing from random states, then a
    decode step with a padded (negative) slot; states compared everywhere."""
    from moeferry.ops.triton import conv as tc
    g = _gen(seed)
    c, k, s = 80, 4, 7
    w = torch.randn(c, k, generator=g).to(device)
    state = torch.randn(s, c, k - 1, generator=g).to(device)
    ref_state = state.clone()
    worst = 0.0
    lens, slots = [1, 5, 70, 2], [4, 0, 2, 6]
    x = torch.randn(sum(lens), c, 2, generator=g)[..., 0].to(device)  # strided rows
    out = tc.causal_conv1d(x, w, state, _cu(lens), slots)
    ref = ref_conv.causal_conv1d_ref(x, w, ref_state, _cu(lens), slots)
    worst = max(worst, _check(out, ref, 1e-5, "conv prefill"), _check(state, ref_state, 0, "conv state"))
    x = torch.randn(5, c, generator=g).to(device)
    slots = [2, 0, 6, 4, -1]
    out = tc.causal_conv1d(x, w, state, list(range(6)), slots, max_q_len=1)
    ref = ref_conv.causal_conv1d_ref(x[:4], w, ref_state, list(range(5)), slots[:4])
    worst = max(worst, _check(out[:4], ref, 1e-5, "conv decode"), _check(state, ref_state, 0, "conv state"))
    assert torch.isfinite(out[4]).all()
    return worst


def _paged_kv(g, ctx, hkv, d, page_size, device):
    """A shuffled page pool holding len(ctx) sequences; returns (k_cache, v_cache, page_table)."""
    pages = [-(-c // page_size) for c in ctx]
    num_pages = sum(pages) + 3
    kc = torch.randn(num_pages * page_size, hkv, d, generator=g)
    vc = torch.randn(num_pages * page_size, hkv, d, generator=g)
    perm = torch.randperm(num_pages, generator=g).tolist()
    table = torch.zeros(len(ctx), max(pages), dtype=torch.int32)
    i = 0
    for b, n in enumerate(pages):
        table[b, :n] = torch.tensor(perm[i:i + n], dtype=torch.int32)
        i += n
    return kc.to(device), vc.to(device), table.to(device)


def case_attention_prefill(device, seed=5):
    """Ragged chunks over cached prefixes (incl. no prefix and a 1-token chunk), GQA and MHA,
    page sizes 1 and 4, head dims 64 and 256."""
    from moeferry.ops.triton import attention as ta
    g = _gen(seed)
    worst = 0.0
    for hq, hkv, d, ps, ctx, qlen in ((8, 2, 64, 4, [7, 40, 1, 90], [3, 40, 1, 17]),
                                      (2, 2, 256, 1, [70, 5], [66, 2])):
        kc, vc, table = _paged_kv(g, ctx, hkv, d, ps, device)
        cu = _cu(qlen)
        q = torch.randn(cu[-1], hq, d, generator=g).to(device)
        out = ta.paged_attention(q, kc, vc, cu, ctx, table, ps, d ** -0.5)
        ref = ref_attn.paged_attention_ref(q, kc, vc, cu, ctx, table, ps, d ** -0.5)
        worst = max(worst, _check(out, ref, _dot_tol(device), f"prefill d={d}"))
    return worst


def case_attention_decode(device, seed=6):
    """One token per sequence, split-K with 1 and 4 splits; a kv_len-0 row (graph padding) is zero."""
    from moeferry.ops.triton import attention as ta
    g = _gen(seed)
    worst = 0.0
    hq, hkv, d, ps = 8, 2, 64, 2
    ctx = [7, 200, 1, 33]
    kc, vc, table = _paged_kv(g, ctx, hkv, d, ps, device)
    q = torch.randn(len(ctx), hq, d, generator=g).to(device)
    ref = ref_attn.paged_attention_ref(q, kc, vc, list(range(len(ctx) + 1)), ctx, table, ps, d ** -0.5)
    for splits in (1, 4):
        kv = torch.tensor(ctx, dtype=torch.int32, device=device)
        out = ta.paged_attention_decode(q, kc, vc, kv, table, ps, d ** -0.5, splits)
        worst = max(worst, _check(out, ref, _dot_tol(device), f"decode splits={splits}"))
    kv = torch.tensor(ctx[:3] + [0], dtype=torch.int32, device=device)
    out = ta.paged_attention_decode(q, kc, vc, kv, table, ps, d ** -0.5, 4)
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    return worst


def _gdn_inputs(g, t, hk, hv, dk, dv, device):
    """q, k, v as views of one conv output (as in the model); gates from raw projections."""
    mixed = torch.randn(t, 2 * hk * dk + hv * dv, generator=g)
    q, k, v = torch.split(mixed.to(device), [hk * dk, hk * dk, hv * dv], dim=-1)
    a = torch.randn(t, hv, generator=g).to(device)
    b = torch.randn(t, hv, generator=g).to(device)
    a_log = (torch.rand(hv, generator=g) * 2 - 1).to(device)
    dt_bias = torch.randn(hv, generator=g).to(device)
    return q.reshape(t, hk, dk), k.reshape(t, hk, dk), v.reshape(t, hv, dv), a, b, a_log, dt_bias


def case_gdn_prefill(device, seed=7):
    """Ragged lengths (1, 64, 65, 130: partial and full chunks) from random pool states,
    GQA (Hv = 2 Hk); untouched slots must stay as they were. Every kernel variant
    (`PrefillTuning`: q k^T in either kernel, the scan's blocks)."""
    from moeferry.ops.triton import gdn as tg
    g = _gen(seed)
    hk, hv, dk, dv = 1, 2, 32, 16
    lens, slots = [1, 65, 130, 64], [3, 0, 5, 1]
    q, k, v, a, b, a_log, dt_bias = _gdn_inputs(g, sum(lens), hk, hv, dk, dv, device)
    gg, beta = ref_gdn.gdn_gates(a, b, a_log, dt_bias)
    init = (torch.randn(6, hv, dk, dv, generator=g) * 0.3).to(device)
    ref_pool = init.clone()
    ref = ref_gdn.gdn_prefill_ref(q, k, v, gg, beta, ref_pool, _cu(lens), slots)
    tol, err = 20 * _dot_tol(device), 0.0
    for tuning in (tg.PrefillTuning(), tg.PrefillTuning(attn_in_prep=False, scan_warps=8, scan_stages=1),
                   tg.PrefillTuning(scan_bv=16)):
        pool = init.clone()
        out = tg.gdn_prefill(q, k, v, gg, beta, pool, _cu(lens), slots, tuning=tuning)
        err = max(err, _check(out, ref, tol, f"gdn out {tuning}"), _check(pool, ref_pool, tol, f"gdn state {tuning}"))
    return err


def case_gdn_chunked_equals_one_pass(device, seed=8):
    """A 100-token sequence prefilled as 37 + 63 tokens through the pool equals one pass."""
    from moeferry.ops.triton import gdn as tg
    g = _gen(seed)
    hk, hv, dk, dv = 2, 2, 16, 32
    q, k, v, a, b, a_log, dt_bias = _gdn_inputs(g, 100, hk, hv, dk, dv, device)
    gg, beta = ref_gdn.gdn_gates(a, b, a_log, dt_bias)
    init = (torch.randn(2, hv, dk, dv, generator=g) * 0.3).to(device)
    whole, split = init.clone(), init.clone()
    one = tg.gdn_prefill(q, k, v, gg, beta, whole, [0, 100], [1])
    parts = [tg.gdn_prefill(q[s:e], k[s:e], v[s:e], gg[s:e], beta[s:e], split, [0, e - s], [1])
             for s, e in ((0, 37), (37, 100))]
    tol = 20 * _dot_tol(device)
    return max(_check(torch.cat(parts), one, tol, "chunked out"), _check(split, whole, tol, "chunked state"))


def case_gdn_decode(device, seed=9):
    """Fused gates + l2norm + update + output for 5 sequences; a padded slot (-1) writes nothing.
    The gates come as views of one [B, 2 Hv] output (b | a), as the model's fused projection gives them."""
    from moeferry.ops.triton import gdn as tg
    g = _gen(seed)
    hk, hv, dk, dv = 2, 4, 32, 64
    q, k, v, a, b, a_log, dt_bias = _gdn_inputs(g, 6, hk, hv, dk, dv, device)
    b, a = torch.cat([b, a], dim=-1).split([hv, hv], dim=-1)
    assert not a.is_contiguous() and a.stride(0) == b.stride(0) == 2 * hv
    pool = torch.randn(7, hv, dk, dv, generator=g).to(device)
    ref_pool = pool.clone()
    slots = torch.tensor([3, 0, 6, 1, 2, -1], dtype=torch.int32, device=device)
    out = tg.gdn_decode_gated(q, k, v, a, b, a_log, dt_bias, pool, slots)
    gg, beta = ref_gdn.gdn_gates(a[:5], b[:5], a_log, dt_bias)
    ref = ref_gdn.gdn_decode(q[:5], k[:5], v[:5], gg, beta, ref_pool, slots[:5])
    assert torch.isfinite(out[5]).all()
    return max(_check(out[:5], ref, 1e-5, "decode out"), _check(pool, ref_pool, 1e-5, "decode state"))


def case_dispatch(device, seed=10):
    """The public ops run the Triton kernel under MOEFERRY_TRITON_INTERPRET / on CUDA and the
    reference otherwise (checked by call counting), with equal results."""
    import moeferry.ops.triton.norm as tn
    g = _gen(seed)
    x = torch.randn(5, 64, generator=g).to(device)
    w = torch.randn(64, generator=g).to(device)
    calls = []
    orig = tn.rms_norm
    tn.rms_norm = lambda *a: calls.append(1) or orig(*a)
    try:
        out = ref_norm.rms_norm(x, w, 1e-6, True)
    finally:
        tn.rms_norm = orig
    expect = device.startswith("cuda") or os.environ.get("MOEFERRY_TRITON_INTERPRET") == "1"
    assert bool(calls) == expect, (calls, expect)
    return _check(out, ref_norm.rms_norm_ref(x, w, 1e-6, True), 1e-5, "dispatch")


def case_decode_graph_static_batch(device, seed=11):
    """The static, padded batch a decode CUDA graph replays gives the eager step's logits and
    pool contents: 3 sequences padded to 4 rows (tiny Qwen3.5 model, every op on the kernels),
    two of their tokens fed from the device (an overlapped step's `SeqChunk.fed`)."""
    import tempfile

    from moeferry.checkpoint.synthetic import make_model
    from moeferry.model.batch import SeqChunk
    from moeferry.engine.cuda_graph import DecodeGraphs
    from moeferry.engine.config import EngineConfig
    from moeferry.engine.engine import Engine
    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(tmp, "qwen3_5_moe", "tiny", seed=seed, dtype="float32", expert_layout="fused")
        eng = Engine.build(EngineConfig(str(path), device, "float32", num_tokens=256, page_size=4, num_state_slots=6,
                                        cuda_graphs=False))
    g = _gen(seed)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 9, 2)]
    held = [eng.cache.admit() for _ in prompts]
    for b in held:
        eng.cache.grow(b, 16)
    pages, slots = [b.pages for b in held], [b.state_slot for b in held]
    kv, states = eng.cache.kv, eng.cache.states
    eng.forward([SeqChunk(p, 0, pages[i], slots[i]) for i, p in enumerate(prompts)])
    step = [SeqChunk([7 + i], len(p), pages[i], slots[i]) for i, p in enumerate(prompts)]
    pools = lambda: [t.clone() for t in kv.k + kv.v + states.conv + states.recurrent]
    before = pools()
    eager = eng.forward(step)
    after_eager = pools()
    for t, b in zip(kv.k + kv.v + states.conv + states.recurrent, before):
        t.copy_(b)
    graphs = DecodeGraphs(eng.model, kv, states, 4, 8, 4, torch.device(device), sizes=[4])
    feed = torch.tensor([0, 8, 7], device=device)  # the tokens of sequences 1 and 0, as sampled
    fed = [SeqChunk([0], c.start, c.pages, c.state_slot, fed=r) if r >= 0 else c for c, r in zip(step, (2, 1, -1))]
    graphs._load(fed, 4, feed)
    with torch.inference_mode():
        static = eng.model.forward(graphs._batch(4), kv, states)
    worst = _check(static[:3], eager, 1e-5, "static batch logits")
    assert torch.isfinite(static[3]).all()
    for a, b in zip(pools(), after_eager):
        worst = max(worst, _check(a, b, 1e-6, "pools after the step"))
    return worst


def case_slot_gather(device, seed=11):
    """Expert slots gathered word by word from a host bank (pinned on CUDA) into device slots:
    tensors of different widths, one batch larger than a launch's index buffer, more launches
    than the index ring holds; slots not written keep their contents."""
    from moeferry.ops.triton.slot_gather import SlotGather
    g = _gen(seed)
    widths = (300, 17, 4101)
    src = [torch.randint(-2**31, 2**31 - 1, (40, w), generator=g, dtype=torch.int32) for w in widths]
    if device == "cuda":
        src = [t.pin_memory() for t in src]
    dst = [torch.randint(-2**31, 2**31 - 1, (70, w), generator=g, dtype=torch.int32).to(device) for w in widths]
    ref = [d.cpu().clone() for d in dst]
    gather = SlotGather(list(zip(src, dst)))
    for n in (1, 5, 66, 2, 7, 9):
        to = torch.randperm(70, generator=g)[:n].tolist()
        frm = torch.randint(0, 40, (n,), generator=g).tolist()
        gather(frm, to)
        for r, t in zip(ref, src):
            r[to] = t[frm]
    for d, r in zip(dst, ref):
        assert torch.equal(d.cpu(), r), "gathered slots differ"
    return 0.0


def case_slot_gather_indexed(device, seed=12):
    """The gather from slot lists on the device (as a CUDA graph runs it): a negative
    destination moves nothing; int64 sources (router ids) and int32 destinations; whole 16-byte
    units (the vec path: addressed from base pointers) and not; a full grid and grids capped
    below the work items (programs loop over them: the prefetch's grid)."""
    from moeferry.ops.triton.slot_gather import CONFIGS
    g = _gen(seed)
    for widths, vec in (((36, 2048), True), ((33, 2050), False)):
        for programs in (None, 3, 1):
            _gather_indexed_once(device, g, widths, vec, (16, 1, True), programs)
    _gather_indexed_once(device, g, (36, 2048), True, CONFIGS[0])
    return 0.0


def _gather_indexed_once(device, g, widths, vec, config, programs=None):
    from moeferry.ops.triton.slot_gather import SlotGather
    src = [torch.randint(-2**31, 2**31 - 1, (16, w), generator=g, dtype=torch.int32) for w in widths]
    if device == "cuda":
        src = [t.pin_memory() for t in src]
    dst = [torch.randint(-2**31, 2**31 - 1, (9, t.shape[1]), generator=g, dtype=torch.int32).to(device) for t in src]
    ref = [d.cpu().clone() for d in dst]
    frm = torch.tensor([3, 15, 0, 7, 7])
    to = torch.tensor([8, -1, 0, -1, 4], dtype=torch.int32)
    gather = SlotGather(list(zip(src, dst)), config)
    assert gather.vec == vec
    gather.indexed(frm.to(device), to.to(device), programs)
    for r, t in zip(ref, src):
        r[to[to >= 0].long()] = t[frm[to >= 0]]
    for d, r in zip(dst, ref):
        assert torch.equal(d.cpu(), r), f"gathered slots differ (vec {vec})"


def case_cache_resolve(device, seed=13):
    """The device cache's lookup + eviction kernel against its CPU reference, LRU and LFU, call
    after call on the same state (steps and prefetches, some with a budget of misses, repeated
    ids, ids of -1 to skip, a cache filling from empty, two table rows): the slots chosen, table, owners, stamps, flags, priorities, uses,
    clock, age and counters."""
    from moeferry.moe.device_policy import DevicePolicy, resolve_reference
    from moeferry.ops.triton.cache_resolve import resolve
    rows, experts, slots = 2, 24, 19
    for lfu in (False, True):
        g = _gen(seed)
        states = []
        for dev in ("cpu", device):
            policy = DevicePolicy(slots, torch.zeros(rows, 4, dtype=torch.int64, device=dev), lfu)
            states.append((policy, torch.full((rows, experts), -1, dtype=torch.int32, device=dev)))
        for step in range(40):
            n = int(torch.randint(1, 7, (1,), generator=g))  # at most slots // 3 distinct ids
            ids = torch.randint(0, 9 if step % 3 else experts, (n,), generator=g)
            if step % 5 == 4:  # pairs left alone (hybrid's CPU lane): never looked up, counted or copied
                ids[torch.rand(n, generator=g) < 0.4] = -1
            row, prefetch = step % rows, step % 4 == 3
            budget = (step // 4) % 3 if prefetch and step % 8 == 7 else None  # a prefetch placing at most 0-2
            (ref, ref_table), (dev_state, table) = states
            want = resolve_reference(ref, ref_table, row, ids, prefetch, budget)
            got = resolve(ids.to(device), table, dev_state, row, prefetch, budget)
            for name in ("owner", "stamps", "flags", "prio", "uses", "state", "counts"):
                a, b = getattr(dev_state, name).cpu(), getattr(ref, name)
                assert torch.equal(a, b), f"lfu {lfu} step {step}: {name} {a.tolist()} != {b.tolist()}"
            for a, b, what in ((got, want, "dst"), (table, ref_table, "table")):
                assert torch.equal(a.cpu(), b), f"lfu {lfu} step {step}: {what} {a.cpu().tolist()} != {b.tolist()}"
        (ref, ref_table), _ = states
        assert int(ref.counts[:, 1].sum()) > slots and int(ref.counts[:, 0].sum()) > 0  # it evicted, and hit
        assert (int(ref.state[1]) > 0) == lfu  # LFU's age rose with its victims
    return 0.0


def case_lane_signal(device, seed=14):
    """The CPU lane's two kernels (`lane_signal`). split: the ids to resolve, the lane's count,
    the box (ids, weights, x in fp32) and its posted words, the sequence and the cache's tally,
    against `split_reference`, step after step (batches of 1-4 rows, repeated experts, tables
    hitting some); nothing is posted when the lane gets no expert. collect: once the served word
    holds the sequence, out += the box's output rounded to out's dtype (fp32 exactly, bf16 within
    its rounding); nothing posted, out untouched; a word that never comes, or one saying the
    thread failed, the fault word set and out untouched."""
    from moeferry.moe.cpu_lane import WORDS, Box, split_reference
    from moeferry.ops.triton.lane_signal import collect, split
    g = _gen(seed)
    rows_max, top_k, experts, hidden = 4, 4, 16, 24
    pairs = rows_max * top_k

    def host(*shape, dtype=torch.float32, fill=-7):  # (poisoned: what is not written stays)
        return torch.full(shape, fill, dtype=dtype, pin_memory=device != "cpu")

    box = Box(host(pairs, dtype=torch.int64), host(pairs), host(rows_max * hidden), host(rows_max * hidden),
              host(WORDS, dtype=torch.int32, fill=0), host(WORDS, dtype=torch.int32, fill=0),
              torch.zeros(1, dtype=torch.int32, device=device), torch.zeros(1, dtype=torch.int32, device=device),
              host(1, dtype=torch.int32, fill=0))
    tally = torch.zeros(1, dtype=torch.int64, device=device)
    seq = posted_lanes = 0
    for step in range(12):
        rows = 1 + step % rows_max
        ids = torch.randint(0, experts if step % 2 else 6, (rows, top_k), generator=g)
        weights = torch.rand(rows, top_k, generator=g).to(torch.bfloat16)
        x = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
        table = torch.where(torch.rand(experts, generator=g) < 0.4, torch.arange(experts, dtype=torch.int32), -1)
        fetch_of = torch.tensor([min(m, step % 3) for m in range(pairs + 1)], dtype=torch.int32)
        want, lane = split_reference(ids, table, fetch_of.tolist())
        got = split(ids.to(device), weights.to(device), x.to(device), table.to(device), fetch_of.to(device), box, tally)
        assert torch.equal(got.cpu(), want), f"step {step}: {got.cpu().tolist()} != {want.tolist()}"
        assert int(box.lane[0]) == lane
        n = rows * top_k
        if lane:
            seq, posted_lanes = seq + 1, posted_lanes + lane
            assert box.posted[:2].tolist() == [seq, rows]
            assert torch.equal(box.ids[:n], torch.where(want < 0, ids.reshape(-1), -1))
            assert torch.equal(box.weights[:n], weights.reshape(-1).float())
            assert torch.equal(box.x[:rows * hidden], x.reshape(-1).float())
            dtype = (torch.float32, torch.bfloat16)[step % 2]
            out = torch.randn(rows, hidden, generator=g).to(dtype)
            box.out[:rows * hidden] = torch.randn(rows * hidden, generator=g)
            box.served[:2] = torch.tensor([seq, 0], dtype=torch.int32)
            expect = out + box.out[:rows * hidden].view(rows, hidden).to(dtype)
            out_dev = out.to(device)
            collect(out_dev, box)
            if dtype == torch.float32:
                assert torch.equal(out_dev.cpu(), expect)
            else:  # (the interpreter's rounding to bf16 is not always the nearest)
                _check(out_dev.cpu(), expect, 8e-3, "collect bf16")
        else:
            assert int(box.posted[0]) == seq  # nothing posted
            out = torch.randn(rows, hidden, generator=g).to(device)
            before = out.clone()
            collect(out, box, limit=1)
            assert torch.equal(out, before)
        assert int(box.seq[0]) == seq and int(tally[0]) == posted_lanes and int(box.fault[0]) == 0
    assert seq >= 3 and posted_lanes > seq  # posted several times, some with more than one expert
    box.lane.fill_(1)  # a post the host never serves
    box.seq.fill_(seq + 1)
    out = torch.randn(2, hidden, generator=g).to(device)
    before = out.clone()
    collect(out, box, limit=64)
    assert torch.equal(out, before) and int(box.fault[0]) == 1
    box.fault.zero_()
    box.served[:2] = torch.tensor([seq + 1, 1], dtype=torch.int32)  # served, but the thread's computation failed
    collect(out, box, limit=64)
    assert torch.equal(out, before) and int(box.fault[0]) == 1
    return 0.0


def case_model_kernel_path(device, seed=0):
    """The whole model through the kernels (the GPU path, here interpreted) against the plain-
    PyTorch path on the same tiny checkpoints: an 8-token prefill chunk, then three decode steps;
    Qwen3.5 `mixed_nvfp4` (Gated DeltaNet, gated attention, NVFP4 experts and shared expert
    in the experts' kernel) resident and through a 4-slot offload cache, Qwen3-MoE in bf16."""
    import tempfile

    import moeferry.moe.offload as offload
    import moeferry.moe.resident as resident
    from moeferry.checkpoint.synthetic import make_model
    from moeferry.llm import LLM
    if device != "cpu":
        pytest.skip("the GPU's own parity tests (test_gpu_parity.py) cover the compiled path")

    def logits(path, kernels: bool, **kw):
        env, orig = os.environ.get("MOEFERRY_TRITON_INTERPRET"), resident.use_kernels
        os.environ["MOEFERRY_TRITON_INTERPRET"] = "1" if kernels else "0"
        resident.use_kernels = offload.use_kernels = (lambda dev: True) if kernels else orig
        try:
            return LLM(str(path), device="cpu", dtype="float32", **kw).logits(list(range(3, 14)), chunk_size=[8, 1])
        finally:
            resident.use_kernels = offload.use_kernels = orig
            os.environ["MOEFERRY_TRITON_INTERPRET"] = env or ""

    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for arch, quant, backends in (("qwen3_5_moe", "mixed_nvfp4", ({}, {"moe_backend": "offload", "moe_cache_size": 4})),
                                      ("qwen3_moe", None, ({},))):
            path = make_model(Path(tmp) / arch, arch, "tiny", seed=seed, quant=quant, num_layers=4)
            ref = logits(path, False)
            for kw in backends:
                out = logits(path, True, **kw)
                assert torch.equal(out.argmax(-1), ref.argmax(-1)), (arch, kw)
                worst = max(worst, _check(out, ref, 1e-5, f"{arch} {quant} {kw}"))
    return worst

def case_warm_up_covers_prefill_shapes(device, seed=0):
    """Serving compiles nothing the warm-up did not: after `run_warm_steps` and an eager step at
    each decode-graph size (what capturing runs first), prefill chunks of every length 1..140
    and longer ones up to the 8192 chunk, alone and beside 1 or 3 decode rows, launch only
    kernel variants (Triton compile keys) the warm-up launched, with the configs a GPU picks
    (`tests/compile_keys.py`: recorded, not run). The H200 once took 0.93 s on the first 8-token
    prompt, 0.11 s on the second: its routing-prep and conv variants were compiled then."""
    import tempfile

    import moeferry.moe.resident as resident
    from tests.compile_keys import CompileKeys
    from moeferry.checkpoint.synthetic import make_model
    from moeferry.engine.cuda_graph import default_sizes
    from moeferry.llm import LLM
    from moeferry.model.batch import SeqChunk
    if device != "cpu":
        pytest.skip("records the interpreter's launches")

    def step(eng, prefill: int, decode_rows: int) -> None:
        tokens = [3 + i % 200 for i in range(prefill)]
        with eng.cache.sequences([5] * decode_rows + [prefill + 1]) as held:
            *rows, seq = held
            if rows:
                eng.forward([SeqChunk([1] * 4, 0, b.pages, b.state_slot) for b in rows])
            eng.forward([SeqChunk([1], 4, b.pages, b.state_slot) for b in rows]
                        + [SeqChunk(tokens, 0, seq.pages, seq.state_slot)])

    orig = resident.use_kernels
    resident.use_kernels = lambda dev: True
    try:
        with tempfile.TemporaryDirectory() as tmp, CompileKeys() as keys:
            for quant in ("mixed_nvfp4", None):
                path = make_model(Path(tmp) / str(quant), "qwen3_5_moe", "tiny", seed=seed, quant=quant, num_layers=4)
                eng = LLM(str(path), device="cpu", dtype="bfloat16", max_extend_tokens=8192, num_tokens=16384,
                          max_seq_len=8200).engine
                eng.run_warm_steps()
                for batch in default_sizes(min(eng.cfg.max_running_requests, eng.sizes.num_state_slots)):
                    step(eng, 1, batch - 1)
                warmed = set(keys.seen)
                for n in [*range(1, 141), 200, 513, 1000, 4097, 8192]:
                    step(eng, n, 0)
                for n in (1, 3, 20, 70, 130, 600):
                    step(eng, n, 1)
                    step(eng, n, 3)
                new = keys.new_since(warmed)
                assert not new, f"{quant}: variants first compiled while serving:\n" + "\n".join(new)
    finally:
        resident.use_kernels = orig
    return 0.0


def case_compile_ahead_walk_covers_the_warm_up(device, seed=0):
    """`--compile-workers`' walk (`engine.boot_walk` under `ShapeOnly`, nothing computed) goes
    through the kernel path of whole models, resident and through a 4-slot offload cache, with
    no op left without a shape, and requests every kernel variant (compile key, with the configs
    a GPU picks) that the warm-up's steps, an eager decode step of each captured batch size and
    the MoE path choice then launch, though it steps through one layer of each kernel signature
    only (resident: 2 of 8 layers of Qwen3.5, 1 of 8 of Qwen3-MoE); the walk comes first, as at boot, and the logits after it are
    those of an engine it never touched (state a part caches on its first call must not be built
    from the walk's zeros). (On the H100 a walk once stopped at `.item()` in the conv's launcher:
    59 of 74 kernels compiled ahead.)"""
    import tempfile

    import moeferry.moe.offload as offload
    import moeferry.moe.resident as resident
    from moeferry.checkpoint.synthetic import make_model
    if device != "cpu":
        pytest.skip("records the interpreter's launches")

    orig = resident.use_kernels
    resident.use_kernels = offload.use_kernels = lambda dev: True
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for arch, kinds in (("qwen3_5_moe", 2), ("qwen3_moe", 1)):  # (GDN and attention layers; attention alone)
                path = make_model(Path(tmp) / arch, arch, "tiny", seed=seed, quant="mixed_nvfp4", num_layers=8)
                _walk_first(path, {}, kinds)
                _walk_first(path, {"moe_backend": "offload", "moe_cache_size": 4})
    finally:
        resident.use_kernels = offload.use_kernels = orig
    return 0.0


def _walk_first(path, kw: dict, kinds: int | None = None) -> None:
    """An engine of `path` (`kw`) walked before anything runs; with `kinds` (resident: recorded
    launches compute nothing, so an offload cache would read unset ids), the walk took that many
    layers and the warm-up's steps launch nothing it did not request."""
    from tests.compile_keys import CompileKeys
    from moeferry.engine.compile_ahead import ShapeOnly, representative_layers
    from moeferry.engine.cuda_graph import default_sizes
    from moeferry.engine.engine import boot_walk
    from moeferry.llm import LLM
    from moeferry.model.batch import SeqChunk

    def engine():
        return LLM(str(path), device="cpu", dtype="bfloat16", max_running_requests=3, max_extend_tokens=600,
                   max_seq_len=1400, **kw)
    untouched = engine().logits(list(range(3, 14)))
    llm = engine()
    eng = llm.engine
    assert kinds is None or len(representative_layers(eng.model.layers)) == kinds, path
    with CompileKeys() as keys:
        with ShapeOnly("cpu"):
            boot_walk(eng.cfg, eng.spec, eng.model, eng.experts, eng.model.dtype, eng.device)()
        walked = set(keys.seen)
        if kinds is not None:
            eng.choose_moe_paths(timer=lambda fn: fn() or 1.0)
            eng.run_warm_steps()
            for rows in default_sizes(3):
                with eng.cache.sequences([2] * rows) as held:
                    eng.forward([SeqChunk([1], 1, b.pages, b.state_slot) for b in held])
            new = keys.new_since(walked)
            assert not new, "launched after the walk, not requested by it:\n" + "\n".join(new)
    if kw:
        eng.experts.finish(eng.sizes.expert_slots)  # as the boot does after its walk
    assert torch.equal(llm.logits(list(range(3, 14))), untouched), (path, kw)


CASES = {name[5:]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}


# -- interpreter workers -------------------------------------------------------------------
def _worker(shard: int, nshards: int) -> None:
    report_cases(list(CASES), lambda name: CASES[name]("cpu"), shard, nshards)


@pytest.fixture(scope="module")
def interpreted():
    return run_workers(__file__, WORKERS, MOEFERRY_TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")


@pytest.mark.parametrize("case", sorted(CASES))
def test_interpreted(interpreted, case):
    assert_case_passed(interpreted, case)


def test_reference_stays_default_on_cpu():
    """Without CUDA tensors or MOEFERRY_TRITON_INTERPRET, the ops never touch Triton."""
    from moeferry.ops.triton import use_triton
    if os.environ.get("MOEFERRY_TRITON_INTERPRET") == "1":
        pytest.skip("interpreter dispatch requested for this run")
    assert not use_triton(torch.ones(1))


def _chunk_attention_case(ctx, qlen, hq, hkv, d, device, dtype):
    """Sequences of `ctx` tokens whose last `qlen` are new: q, the new k / v, a page pool holding
    every token's k / v, and the paged reference's output."""
    g = torch.Generator(device=device).manual_seed(len(ctx))
    ps = 16
    kc, vc, table = _paged_kv(torch.Generator().manual_seed(3), ctx, hkv, d, ps, device)
    kc, vc, table = kc.to(dtype), vc.to(dtype), table.to(device)
    q = torch.randn(sum(qlen), hq, d, generator=g, device=device).to(dtype)
    new = [ref_attn.sequence_slots(table[b], c, ps)[c - n:] for b, (c, n) in enumerate(zip(ctx, qlen))]
    k, v = kc[torch.cat(new)], vc[torch.cat(new)]
    ref = ref_attn.paged_attention_ref(q.float(), kc.float(), vc.float(), _cu(qlen), ctx, table, ps, d ** -0.5)
    return q, k, v, kc, vc, table, ref


def test_reference_row_blocks_change_nothing(monkeypatch):
    """The reference's query-row blocks (REF_ROWS, bounding its scores) give the one-block result
    (to fp32 rounding: the matmuls block differently), for chunks after a prefix and whole prompts."""
    ctx, qlen = [37, 90, 5, 70], [37, 40, 5, 1]
    q, _, _, kc, vc, table, whole = _chunk_attention_case(ctx, qlen, 4, 2, 32, "cpu", torch.float32)
    monkeypatch.setattr(ref_attn, "REF_ROWS", 7)
    blocks = ref_attn.paged_attention_ref(q, kc, vc, _cu(qlen), ctx, table, 16, 32 ** -0.5)
    _check(blocks, whole, 1e-6, "row blocks")


def test_chunk_attention_matches_paged_reference():
    """SDPA per sequence (GQA by enable_gqa) equals the paged reference: whole prompts over their
    own k / v, chunks after a cached prefix over their gathered context (mask aligned to its end);
    on the CPU the engine keeps the reference."""
    ctx, qlen = [37, 90, 5, 70], [37, 40, 5, 1]
    q, k, v, kc, vc, table, ref = _chunk_attention_case(ctx, qlen, 4, 2, 32, "cpu", torch.float32)
    out = ref_attn.chunk_attention(q, k, v, kc, vc, _cu(qlen), ctx, table, 16, 32 ** -0.5, flash_only=False)
    _check(out, ref, 1e-5, "four sequences")
    one = ref_attn.chunk_attention(q[37:77], k[37:77], v[37:77], kc, vc, [0, 40], ctx[1:2], table[1:2], 16,
                                   32 ** -0.5, flash_only=False)
    _check(one, ref[37:77], 1e-5, "one chunk after a prefix")
    assert not ref_attn.use_chunk_attention(q, k, kc, [2048])


# -- GPU: compiled kernels ---------------------------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_small(case):
    CASES[case]("cuda")


def _bf16_pair(*shape, g, scale=1.0):
    x = (torch.randn(*shape, generator=g, device="cuda") * scale).bfloat16()
    return x, x.float()


@pytest.mark.gpu
@gpu
def test_gpu_attention_real_shapes():
    """Qwen3.6-35B-A3B attention (16 q heads, 2 kv heads, head_dim 256) in bf16: decode for
    16 sequences of ragged contexts up to 4k, and a 2k-token prefill chunk over a 1.5k prefix."""
    from moeferry.ops.triton import attention as ta
    g = torch.Generator(device="cuda").manual_seed(0)
    hq, hkv, d, ps = 16, 2, 256, 16
    ctx = torch.randint(1, 4096, (16,), generator=g, device="cuda").tolist()
    ctx[0], ctx[1] = 1, 4096
    kc, vc, table = _paged_kv(torch.Generator().manual_seed(1), ctx, hkv, d, ps, "cuda")
    kb, vb = kc.bfloat16(), vc.bfloat16()
    q, qf = _bf16_pair(16, hq, d, g=g)
    kv = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    ref = ref_attn.paged_attention_ref(qf, kb.float(), vb.float(), list(range(17)), ctx, table, ps, d ** -0.5)
    for splits in (1, 8, 32):
        _check(ta.paged_attention_decode(q, kb, vb, kv, table, ps, d ** -0.5, splits), ref, 1e-2, f"decode {splits}")
    ctx, qlen = [3584, 700], [2048, 700]
    kc, vc, table = _paged_kv(torch.Generator().manual_seed(2), ctx, hkv, d, ps, "cuda")
    kb, vb = kc.bfloat16(), vc.bfloat16()
    q, qf = _bf16_pair(sum(qlen), hq, d, g=g)
    out = ta.paged_attention(q, kb, vb, _cu(qlen), ctx, table, ps, d ** -0.5)
    ref = ref_attn.paged_attention_ref(qf, kb.float(), vb.float(), _cu(qlen), ctx, table, ps, d ** -0.5)
    _check(out, ref, 1e-2, "prefill")


@pytest.mark.gpu
@gpu
def test_gpu_chunk_attention_flash():
    """Qwen3.6-35B-A3B attention geometry (16 q heads, 2 kv heads, head_dim 256), bf16, through
    SDPA flash against the paged reference: whole prompts of 2048 and 700 tokens, then a
    2048-token chunk after a 1536-token prefix batched with a 300-token prompt; the engine
    takes this path for such steps, not for a few tokens or an fp8 cache."""
    for ctx, qlen in (([2048, 700], [2048, 700]), ([3584, 300], [2048, 300])):
        q, k, v, kc, vc, table, ref = _chunk_attention_case(ctx, qlen, 16, 2, 256, "cuda", torch.bfloat16)
        assert ref_attn.use_chunk_attention(q, k, kc, qlen)
        out = ref_attn.chunk_attention(q, k, v, kc, vc, _cu(qlen), ctx, table, 16, 256 ** -0.5)
        _check(out, ref, 1e-2, f"flash {ctx} {qlen}")
    assert not ref_attn.use_chunk_attention(q, k, kc, [16, 1])
    assert not ref_attn.use_chunk_attention(q, k, kc.to(torch.float8_e4m3fn), qlen)


@pytest.mark.gpu
@gpu
def test_gpu_gdn_real_shapes():
    """Qwen3.6 Gated DeltaNet (16 k heads, 32 v heads, 128x128 state) in bf16 with an fp32
    pool: a ragged prefill (1, 1000, 3000 tokens) and a 16-sequence decode step."""
    from moeferry.ops.triton import gdn as tg
    g = torch.Generator().manual_seed(3)
    hk, hv, dk, dv = 16, 32, 128, 128
    lens, slots = [1, 1000, 3000], [2, 0, 5]
    q, k, v, a, b, a_log, dt_bias = _gdn_inputs(g, sum(lens), hk, hv, dk, dv, "cuda")
    q, k, v, a, b = (x.bfloat16() for x in (q, k, v, a, b))
    gg, beta = ref_gdn.gdn_gates(a, b, a_log, dt_bias)
    pool = (torch.randn(8, hv, dk, dv, generator=g) * 0.1).cuda()
    ref_pool = pool.clone()
    out = tg.gdn_prefill(q, k, v, gg, beta, pool, _cu(lens), slots)
    ref = ref_gdn.gdn_prefill_ref(q.float(), k.float(), v.float(), gg, beta.float(), ref_pool, _cu(lens), slots)
    _check(out, ref, 1e-2, "gdn prefill out")
    _check(pool, ref_pool, 1e-2, "gdn prefill state")
    q, k, v, a, b, a_log, dt_bias = _gdn_inputs(g, 16, hk, hv, dk, dv, "cuda")
    q, k, v, a, b = (x.bfloat16() for x in (q, k, v, a, b))
    pool = (torch.randn(20, hv, dk, dv, generator=g) * 0.1).cuda()
    ref_pool = pool.clone()
    slots = torch.randperm(20, generator=g)[:16].int().cuda()
    out = tg.gdn_decode_gated(q, k, v, a, b, a_log, dt_bias, pool, slots)
    gg, beta = ref_gdn.gdn_gates(a, b, a_log, dt_bias)
    ref = ref_gdn.gdn_decode(q.float(), k.float(), v.float(), gg, beta.float(), ref_pool, slots)
    _check(out, ref, 1e-2, "gdn decode out")
    _check(pool, ref_pool, 1e-4, "gdn decode state")


@pytest.mark.gpu
@gpu
def test_gpu_conv_norm_rope_real_shapes():
    """conv over q|k|v (8192 channels, kernel 4), the decoder norm (2048), q/k norm and
    partial rotary (16 heads x 256, 64 rotary dims), gated norm (128), in bf16."""
    from moeferry.ops.triton import conv as tc
    from moeferry.ops.triton import norm as tn
    from moeferry.ops.triton import rope as tr
    g = torch.Generator(device="cuda").manual_seed(4)
    lens, slots = [1, 700, 2000], [3, 1, 0]
    x, xf = _bf16_pair(sum(lens), 8192, g=g)
    w, wf = _bf16_pair(8192, 4, g=g, scale=0.5)
    st, stf = _bf16_pair(4, 8192, 3, g=g)
    _check(tc.causal_conv1d(x, w, st, _cu(lens), slots),
           ref_conv.causal_conv1d_ref(xf, wf, stf, _cu(lens), slots), 1e-2, "conv")
    _check(st, stf, 1e-2, "conv state")
    h, hf = _bf16_pair(4096, 2048, g=g)
    r, rf = _bf16_pair(4096, 2048, g=g)
    nw, nwf = _bf16_pair(2048, g=g, scale=0.1)
    out, summed = tn.add_rms_norm(h, r, nw, 1e-6, True)
    ref_out, ref_sum = ref_norm.add_rms_norm_ref(hf, rf, nwf, 1e-6, True)
    _check(out, ref_out, 1e-2, "add_rms_norm")
    _check(summed, ref_sum, 1e-2, "residual sum")
    q, qf = _bf16_pair(4096, 16, 256, g=g)
    qw, qwf = _bf16_pair(256, g=g, scale=0.1)
    _check(tn.rms_norm(q, qw, 1e-6, True), ref_norm.rms_norm_ref(qf, qwf, 1e-6, True), 1e-2, "q norm")
    cos, sin = ref_rope.rope_cos_sin(torch.arange(4096, device="cuda"), ref_rope.rope_inv_freq(64, 1e7).cuda(),
                                     torch.bfloat16)
    _check(tr.apply_rope(q, cos, sin), ref_rope.apply_rope_ref(qf, cos.float(), sin.float()), 1e-2, "rope")
    k, kf = _bf16_pair(4096, 2, 256, g=g)
    kw, kwf = _bf16_pair(256, g=g, scale=0.1)
    qo, ko = tr.qk_norm_rope(q, k, qw, kw, 1e-6, True, cos, sin)
    _check(qo, ref_rope.apply_rope_ref(ref_norm.rms_norm_ref(qf, qwf, 1e-6, True), cos.float(), sin.float()), 1e-2,
           "q norm + rope")
    _check(ko, ref_rope.apply_rope_ref(ref_norm.rms_norm_ref(kf, kwf, 1e-6, True), cos.float(), sin.float()), 1e-2,
           "k norm + rope")
    o, of = _bf16_pair(4096 * 32, 128, g=g)
    z, zf = _bf16_pair(4096 * 32, 128, g=g)
    gw, gwf = _bf16_pair(128, g=g)
    _check(tn.gated_rms_norm(o, z, gw, 1e-6), ref_norm.gated_rms_norm_ref(of, zf, gwf, 1e-6), 1e-2, "gated norm")


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == "--worker":
    _worker(int(sys.argv[2]), int(sys.argv[3]))
