"""Fused MoE Triton kernels against the CPU reference: dequantize (registry), then fp32 matmul.

Interpreter cases (small shapes, every registry format, token counts 1/3/64, slots in
permuted order, non-resident experts, a shared expert) run in two worker subprocesses with
TRITON_INTERPRET=1, so the variable never reaches this process or other test files; each
case is reported as its own test. GPU cases (`-m gpu`, Qwen3.6 shapes E=256 k=8 H=2048
I=512, T up to 8192) run the compiled kernels here and skip without CUDA.
"""
from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

import pytest

from tests.interpreter_workers import assert_case_passed, report_cases, run_workers
import torch

pytest.importorskip("triton")

from moeferry.checkpoint.formats import FORMATS, QuantParams  # noqa: E402
from moeferry.moe.resident import DenseExperts  # noqa: E402
from moeferry.moe.slots import SlotBuffer  # noqa: E402
from moeferry.moe.triton_experts import TritonExperts  # noqa: E402
from moeferry.ops.moe import experts_reference, swiglu  # noqa: E402
from moeferry.ops.triton import moe_decode  # noqa: E402
from moeferry.ops.triton.moe_decode import DecodeConfig  # noqa: E402
from moeferry.ops.triton.moe_prep import RoutingScratch, max_blocks, prepare_routing  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORKERS = 2


# -- shared helpers ----------------------------------------------------------------------------
def _routing(t, e, k, gen, device, dtype=torch.float32):
    logits = torch.randn(t, e, generator=gen)
    w, ids = torch.topk(torch.softmax(logits, -1), k)
    return (w / w.sum(-1, keepdim=True)).to(device, dtype), ids.to(device)


def _quantized_expert(fmt, h, i, gen, params):
    """(gate, up, down) PackedWeights from random weights through the registry's quantizer."""
    f = FORMATS[fmt]
    ws = [torch.randn(i, h, generator=gen) * 0.05, torch.randn(i, h, generator=gen) * 0.05,
          torch.randn(h, i, generator=gen) * 0.05]
    return tuple(f.packed(f.quantize(w.bfloat16() if fmt == "bf16" else w, params), params) for w in ws)


def _dequant(expert, device="cpu"):
    g, u, d = (w.dequantize(torch.float32).to(device) for w in expert)
    return torch.cat([g, u]), d


def _rel(out, ref):
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out.float() - ref).norm() / ref.norm()).item()


def _path_config(path, t, buf):
    """None: the default path for T; "gemm": the grouped-GEMM path; "decode": the decode GEMV path
    (its interpreter config; or a DecodeConfig)."""
    from moeferry.ops.triton import moe_gemm
    if isinstance(path, DecodeConfig):
        return path
    if path == "gemm":
        return moe_gemm.choose_config(t, buf.gate_up, buf.down)
    return moe_gemm.INTERPRET_DECODE_CONFIG if path == "decode" else None


def check_moe(fmt, t, e, k, h=128, i=64, slots=None, missing=0, shared=False, dtype="bfloat16",
              tol=2e-2, seed=0, params=None, path=None, sms=0):
    """One fused-MoE run through a slot buffer vs the reference; returns the relative error.
    `path`: force the grouped-GEMM ("gemm") or the decode ("decode") kernels; `sms`: the SMs the
    decode path plans gate_up's waves for (`gate_up_split`; 0: none, as on the CPU)."""
    gen = torch.Generator().manual_seed(seed)
    params = QuantParams(**params) if params else None
    n_exp = e + int(shared)
    experts = [_quantized_expert(fmt, h, i, gen, params) for _ in range(n_exp)]
    s = max(slots or n_exp, n_exp)
    where = torch.randperm(s, generator=gen)[:n_exp]  # expert j lives in slot where[j]
    contents = [None] * s
    for j, sl in enumerate(where.tolist()):
        contents[sl] = experts[j]
    for sl in range(s):  # unused slots hold other experts: reading them would show
        if contents[sl] is None:
            contents[sl] = _quantized_expert(fmt, h, i, gen, params)
    buf = SlotBuffer.from_experts(fmt, contents, "cpu")
    table = where[:e].to(torch.int32).clone()
    gone = torch.randperm(e, generator=gen)[:missing]
    table[gone] = -1
    xdt = getattr(torch, dtype)
    x = (torch.randn(t, h, generator=gen)).to(xdt)
    w, ids = _routing(t, e, k, gen, "cpu")
    gate = torch.randn(t, generator=gen) if shared else None  # the shared gate's logits
    with mock.patch.object(moe_decode, "_sms", lambda device: sms):
        out = buf.run(x, ids, w.to(xdt), table, int(where[e]) if shared else -1, gate,
                      config=_path_config(path, t, buf))
    assert out.shape == x.shape and out.dtype == xdt
    assert not buf.scratch.arrivals.any(), "arrival words not set back to 0"
    dq = [_dequant(ex) for ex in experts]
    w_ref = w.to(xdt).float().masked_fill(torch.isin(ids, gone), 0.0)
    ref = experts_reference(x.float(), ids, w_ref, lambda j: dq[j])
    if shared:
        ref = ref + torch.sigmoid(gate)[:, None] * swiglu(x.float(), *dq[e])
    err = _rel(out, ref)
    assert err < tol, f"relative error {err:.3g} >= {tol}"
    return err


def check_prep(t, k, e=16, slots=24, missing=2, shared=False, block_m=16, seed=0):
    """Grouping invariants of the routing prep (run twice: the counters must reset)."""
    gen = torch.Generator().manual_seed(seed)
    w, ids = _routing(t, e, k, gen, "cpu")
    table = torch.randperm(slots, generator=gen)[:e].to(torch.int32)
    table[torch.randperm(e, generator=gen)[:missing]] = -1
    scratch = RoutingScratch(slots, "cpu")
    gate = torch.randn(t, generator=gen) if shared else None
    for _ in range(2):
        r = prepare_routing(ids, w, table, scratch, block_m, shared_slot=slots - 1, shared_gate=gate)
        assert int(scratch.counts.abs().sum()) == 0, "counters not reset"
    topk = k + int(shared)
    pair_slot = torch.cat([table[ids], torch.full((t, 1), slots - 1, dtype=torch.int32)], 1) if shared else table[ids]
    pair_slot = pair_slot.reshape(-1)
    assert torch.equal(r.pair_slot, pair_slot)
    want_w = torch.cat([w, torch.sigmoid(gate)[:, None]], 1) if shared else w
    assert torch.allclose(r.pair_w, want_w.reshape(-1).float())
    nb = int(r.num_blocks)
    assert nb <= r.max_blocks
    # the blocks are sized for the row's experts (+ shared), not for every slot of the buffer
    assert r.max_blocks == max_blocks(t * topk, min(slots, e + int(shared)), block_m)
    seen = []
    blocks_per_slot = {}
    for b in range(nb):
        rows = int(r.block_rows[b])
        assert 1 <= rows <= block_m
        ps = r.sorted_ids[b * block_m: b * block_m + rows].long()
        assert (pair_slot[ps] == r.block_slot[b]).all(), "a block mixes slots"
        seen += ps.tolist()
        blocks_per_slot[int(r.block_slot[b])] = blocks_per_slot.get(int(r.block_slot[b]), 0) + 1
    valid = torch.nonzero(pair_slot >= 0).flatten().tolist()
    assert sorted(seen) == valid, "each resident pair exactly once"
    for sl, n in blocks_per_slot.items():
        assert n == -(-int((pair_slot == sl).sum()) // block_m), "blocks per slot"
    assert r.topk == topk
    return 0.0


def check_executor(t=3, e=8, k=2, h=128, i=64, shared_i=64, seed=0):
    """TritonExperts.resident (shared expert in the slot buffer or its own) vs DenseExperts."""
    gen = torch.Generator().manual_seed(seed)
    gu = (torch.randn(e, 2 * i, h, generator=gen) * 0.05).bfloat16()
    dn = (torch.randn(e, h, i, generator=gen) * 0.05).bfloat16()
    sgu = (torch.randn(2 * shared_i, h, generator=gen) * 0.05).bfloat16()
    sdn = (torch.randn(h, shared_i, generator=gen) * 0.05).bfloat16()
    x = torch.randn(t, h, generator=gen).bfloat16()
    w, ids = _routing(t, e, k, gen, "cpu", torch.bfloat16)
    gate = torch.randn(t, 1, generator=gen).bfloat16()  # the shared gate's logits
    ex = TritonExperts.resident(gu, dn, shared=(sgu, sdn))
    assert (ex.shared_slot >= 0) == (shared_i == i)
    out = ex(x, ids, w, shared_gate=gate)
    ref = DenseExperts(gu.float(), dn.float())(x.float(), ids, w.float())
    ref = ref + torch.sigmoid(gate.float()) * swiglu(x.float(), sgu.float(), sdn.float())
    err = _rel(out, ref)
    assert err < 2e-2, f"relative error {err:.3g}"
    err2 = _rel(ex(x, ids, w), DenseExperts(gu.float(), dn.float())(x.float(), ids, w.float()))
    assert err2 < 2e-2
    return max(err, err2)


FORMAT_NAMES = ("bf16", "fp8_tensor", "fp8_block", "nvfp4", "nvfp4_ct", "int4_awq", "int4_ct")
_INT4_G64 = {"group_size": 64}


def _params(fmt):
    return _INT4_G64 if fmt.startswith("int4") else None


CASES: dict[str, tuple] = {}
for _f in FORMAT_NAMES:
    CASES[f"{_f}-T1"] = (check_moe, dict(fmt=_f, t=1, e=8, k=2, params=_params(_f)))
    CASES[f"{_f}-T3-permuted-missing-shared"] = (check_moe, dict(
        fmt=_f, t=3, e=16, k=4, slots=20, missing=3, shared=True, seed=1,
        params={"block_size": (32, 32)} if _f == "fp8_block" else _params(_f)))
    CASES[f"{_f}-T64"] = (check_moe, dict(fmt=_f, t=64, e=8, k=2, seed=2, params=_params(_f)))
for _f in ("fp8_block", "nvfp4", "int4_awq"):
    CASES[f"{_f}-T3-fp32-exact"] = (check_moe, dict(fmt=_f, t=3, e=8, k=2, dtype="float32", tol=1e-4, seed=3,
                                                    params=_params(_f)))
CASES["int4_ct-asymmetric-T3"] = (check_moe, dict(fmt="int4_ct", t=3, e=8, k=2, seed=4,
                                                  params={"group_size": 64, "symmetric": False}))
CASES["fp8_tensor-per-channel-T3"] = (check_moe, dict(fmt="fp8_tensor", t=3, e=8, k=2, seed=5,
                                                      params={"per_channel": True}))
CASES["fp8_block-T2-permuted-missing-shared"] = (check_moe, dict(
    fmt="fp8_block", t=2, e=16, k=4, slots=20, missing=3, shared=True, seed=6, params={"block_size": (32, 32)}))
CASES["int4_ct-asymmetric-T2-missing"] = (check_moe, dict(fmt="int4_ct", t=2, e=8, k=4, missing=2, seed=7,
                                                               params={"group_size": 32, "symmetric": False}))
# a buffer takes the decode path only where its warm-up timing chose it (`decode_tokens`, 0 by
# default): the cases above check the grouped-GEMM path at decode sizes, these force the decode path
for _f in FORMAT_NAMES:
    CASES[f"decode-{_f}-T2-permuted-missing-shared"] = (check_moe, dict(
        fmt=_f, t=2, e=16, k=4, slots=20, missing=3, shared=True, seed=9, path="decode",
        params={"block_size": (32, 32)} if _f == "fp8_block" else _params(_f)))
CASES["gemm-int4_awq-T2-fp32-exact"] = (check_moe, dict(fmt="int4_awq", t=2, e=8, k=2, dtype="float32", tol=1e-4,
                                                        seed=11, params=_params("int4_awq"), path="gemm"))
CASES["decode-nvfp4-T4-fp32-exact-missing"] = (check_moe, dict(fmt="nvfp4", t=4, e=8, k=3, missing=2,
                                                               dtype="float32", tol=1e-4, seed=12, path="decode"))
CASES["decode-unrolled-int4_ct-T2-asymmetric-missing-shared"] = (check_moe, dict(
    fmt="int4_ct", t=2, e=16, k=4, slots=20, missing=3, shared=True, seed=13, dtype="float32", tol=1e-4,
    params={"group_size": 32, "symmetric": False}, path=DecodeConfig(8, 32, 16, 64, unroll=True)))
# the down launch split into pair chunks (`down_pairs`): the last chunk padded past the token's
# pairs (and, at k=4 unshared, past the power-of-two pair vector), the chunks summed by a third launch
CASES["decode-down-pairs2-nvfp4-T3-fp32-exact-missing-shared"] = (check_moe, dict(
    fmt="nvfp4", t=3, e=16, k=4, slots=20, missing=3, shared=True, seed=14, dtype="float32", tol=1e-4,
    path=DecodeConfig(16, 64, 32, 32, down_pairs=2)))
CASES["decode-down-pairs3-int4_awq-T2"] = (check_moe, dict(
    fmt="int4_awq", t=2, e=8, k=4, missing=1, seed=15, params=_params("int4_awq"),
    path=DecodeConfig(16, 64, 32, 32, down_pairs=3)))
# the down chunks summed by their last arrival (`down_arrive`)
CASES["decode-arrive-nvfp4-T3-fp32-exact-missing-shared"] = (check_moe, dict(
    fmt="nvfp4", t=3, e=16, k=4, slots=20, missing=3, shared=True, seed=16, dtype="float32", tol=1e-4,
    path=DecodeConfig(16, 32, 32, 32, down_pairs=2, down_arrive=True)))
CASES["decode-arrive-int4_awq-T2-missing"] = (check_moe, dict(
    fmt="int4_awq", t=2, e=8, k=4, missing=1, seed=17, params=_params("int4_awq"),
    path=DecodeConfig(16, 64, 32, 32, down_pairs=1, down_arrive=True)))
CASES["decode-arrive-fp8_block-T2-shared"] = (check_moe, dict(
    fmt="fp8_block", t=2, e=16, k=4, slots=20, shared=True, seed=18, params={"block_size": (32, 32)},
    path=DecodeConfig(4, 64, 8, 64, down_pairs=3, down_arrive=True)))
CASES["decode-arrive-bf16-T1-shared"] = (check_moe, dict(
    fmt="bf16", t=1, e=8, k=2, shared=True, seed=19, path=DecodeConfig(2, 64, 8, 64, down_pairs=1, down_arrive=True)))
# `down_pdl` where the device has no programmatic dependent launch (here: the interpreter, as on a
# GPU before sm_90): two plain launches (the GPU cases time and check the overlap)
CASES["decode-pdl-unsupported-nvfp4-T2-fp32-exact-missing-shared"] = (check_moe, dict(
    fmt="nvfp4", t=2, e=16, k=4, slots=20, missing=3, shared=True, seed=22, dtype="float32", tol=1e-4,
    path=DecodeConfig(16, 64, 32, 32, down_pairs=1, down_arrive=True, down_pdl=True)))
# a down program holding all of its token's pairs, every pair's weights asked for first (`down_preload`)
CASES["decode-preload-nvfp4-T3-fp32-exact-missing-shared"] = (check_moe, dict(
    fmt="nvfp4", t=3, e=16, k=4, slots=20, missing=3, shared=True, seed=24, dtype="float32", tol=1e-4,
    path=DecodeConfig(16, 64, 8, 64, down_preload=True)))
CASES["decode-preload-int4_ct-T2-asymmetric-missing-shared"] = (check_moe, dict(
    fmt="int4_ct", t=2, e=16, k=4, slots=20, missing=3, shared=True, seed=25, dtype="float32", tol=1e-4,
    params={"group_size": 32, "symmetric": False}, path=DecodeConfig(16, 64, 16, 64, down_preload=True)))
# gate_up's last, partial wave cut into k slices summed by the last to arrive (`gate_up_split`), on
# a pretend GPU of `sms` SMs: 60 units on 56 SMs (4 slices: fp4, packed halves off in fp32), 40
# on 32 (2 slices: asymmetric int4 packing inter), 80 on 64 (4 slices: fp8 row scales)
CASES["decode-split4-nvfp4-T3-fp32-exact-missing-shared"] = (check_moe, dict(
    fmt="nvfp4", t=3, e=16, k=4, slots=20, missing=3, shared=True, seed=26, dtype="float32", tol=1e-4, sms=56,
    path=DecodeConfig(16, 128, 8, 64, gate_up_split=4)))
CASES["decode-split2-int4_ct-T2-asymmetric-missing-shared"] = (check_moe, dict(
    fmt="int4_ct", t=2, e=16, k=4, slots=20, missing=3, shared=True, seed=27, sms=32,
    params={"group_size": 32, "symmetric": False},
    path=DecodeConfig(16, 128, 32, 64, down_pairs=1, down_arrive=True, gate_up_split=2)))
CASES["decode-split4-fp8_tensor-T1-per-channel-shared"] = (check_moe, dict(
    fmt="fp8_tensor", t=1, e=16, k=4, slots=20, shared=True, seed=28, sms=64, params={"per_channel": True},
    path=DecodeConfig(4, 128, 8, 64, gate_up_split=8)))
CASES["nvfp4-T20"] = (check_moe, dict(fmt="nvfp4", t=20, e=8, k=2, seed=8))


def check_arrivals(fmt="nvfp4", t=3, e=8, k=3, h=128, i=64, seed=20):
    """`down_arrive` gives the summing launch's bytes exactly (same chunk order), twice in a row
    (the arrival words reset), and without arrival words (or too few) falls back to that launch."""
    from moeferry.ops.triton.moe_decode import decode_moe
    gen = torch.Generator().manual_seed(seed)
    buf = SlotBuffer.from_experts(fmt, [_quantized_expert(fmt, h, i, gen, None) for _ in range(e + 1)], "cpu")
    table = torch.arange(e, dtype=torch.int32)
    x = torch.randn(t, h, generator=gen)
    w, ids = _routing(t, e, k, gen, "cpu")
    gate = torch.randn(t, generator=gen)
    words = buf.scratch.arrivals

    def run(cfg, arrivals=words):
        return decode_moe(x, ids, w, buf.gate_up, buf.down, table, e, gate, cfg, arrivals)
    plain = run(DecodeConfig(16, 32, 32, 32, down_pairs=2))
    arrive = DecodeConfig(16, 32, 32, 32, down_pairs=2, down_arrive=True)
    for _ in range(2):
        assert torch.equal(run(arrive), plain)
        assert not words.any(), "arrival words not set back to 0"
    assert torch.equal(run(arrive, arrivals=None), plain)
    assert torch.equal(run(arrive, arrivals=words[:1]), plain)  # too few words: the summing launch
    return 0.0


CASES["decode-arrivals-nvfp4"] = (check_arrivals, dict())
CASES["decode-arrivals-int4_ct"] = (check_arrivals, dict(fmt="int4_ct", seed=21))
CASES["prep-T1"] = (check_prep, dict(t=1, k=2))
CASES["prep-T3-shared"] = (check_prep, dict(t=3, k=4, shared=True))
CASES["prep-T64"] = (check_prep, dict(t=64, k=4, block_m=32))
CASES["prep-T64-many-slots"] = (check_prep, dict(t=64, k=4, slots=400, block_m=32, shared=True))
CASES["prep-T600-multi-launch"] = (check_prep, dict(t=600, k=2, shared=True, missing=5))
CASES["executor-shared-in-buffer"] = (check_executor, dict())
CASES["executor-shared-own-buffer"] = (check_executor, dict(shared_i=32))


def check_path_choice(fmt="nvfp4", h=128, i=64, e=8, k=2, seed=0):
    """The warm-up's MoE path choice (`moe.path_choice`), with scripted timings: the decode path
    is taken up to the largest size at which it won at every size before, on every buffer of
    the timed one's layout (not on another layout's); a buffer then runs it up to that size
    and the grouped GEMM above; a decode output that disagrees, or an error, keeps it off."""
    from moeferry.moe import path_choice as pc
    from moeferry.ops.triton import moe_gemm
    gen = torch.Generator().manual_seed(seed)
    params = QuantParams(**_params(fmt)) if _params(fmt) else None

    def buffer(hidden):
        return SlotBuffer.from_experts(fmt, [_quantized_expert(fmt, hidden, i, gen, params) for _ in range(e + 1)], "cpu")

    table = torch.arange(e, dtype=torch.int32)
    a, b, other = buffer(h), buffer(h), buffer(2 * h)
    targets = [pc.DecodeTarget(a, table, e), pc.DecodeTarget(b, table, e), pc.DecodeTarget(other, table, e)]

    def scripted(times):  # time_paths asks for (grouped, decode) per size, in order
        times = iter(times)
        return lambda fn: next(times)

    # sizes 1, 2, 4 (max 4): decode wins at 1 and 2, loses at 4 -> 2; the other layout: loses at 1 -> 0
    chosen = pc.choose_decode_paths(targets[:2], k, 4, torch.bfloat16, scripted([2.0, 1.0, 2.0, 1.5, 2.0, 3.0]))
    assert list(chosen.values()) == [2] and a.decode_tokens == b.decode_tokens == 2, chosen
    assert pc.choose_decode_paths(targets[2:], k, 4, torch.bfloat16, scripted([1.0, 2.0]))
    assert other.decode_tokens == 0
    calls = []
    real = moe_gemm.decode_moe
    moe_gemm.decode_moe = lambda *args: calls.append(args[0].shape[0]) or real(*args)
    try:
        for t in (1, 2, 3, 4):
            w, ids = _routing(t, e, k, gen, "cpu", torch.bfloat16)
            x = torch.randn(t, h, generator=gen).bfloat16()
            out = a.run(x, ids, w, table)
            ref = a.run_reference(x.float(), ids, w.float(), table)
            assert _rel(out, ref.float()) < 2e-2
        assert calls == [1, 2], calls  # T = 3 and 4 took the grouped GEMM
        moe_gemm.decode_moe = lambda *args: real(*args) * 3  # a decode path that disagrees
        chosen = pc.choose_decode_paths(targets[:1], k, 4, torch.bfloat16, scripted([2.0, 1.0] * 3))
        assert list(chosen.values()) == [0] and a.decode_tokens == 0
    finally:
        moe_gemm.decode_moe = real
    return 0.0



def check_engine_path_choice(backend):
    """`Engine.choose_moe_paths` finds each backend's buffers (resident: every layer's; offload:
    its cache) and, with the decode path chosen for one token, decode steps through it give the
    logits of the plain-PyTorch path."""
    import tempfile
    from unittest import mock

    from moeferry import LLM
    from moeferry.checkpoint.synthetic import make_model
    from moeferry.ops.triton import moe_gemm

    model = make_model(tempfile.mkdtemp(), "qwen3_5_moe", "tiny", seed=4, num_layers=2)
    prompt, kw = [5, 17, 99, 3, 250, 8], ({"moe_backend": "offload", "moe_cache_size": 6} if backend == "offload" else {})
    ref = LLM(str(model), dtype="float32", **kw).logits(prompt, chunk_size=[4, 1])
    calls = []
    real = moe_gemm.decode_moe
    with mock.patch("moeferry.moe.resident.use_kernels", return_value=True), \
            mock.patch("moeferry.moe.offload.use_kernels", return_value=True), \
            mock.patch.object(moe_gemm, "decode_moe", lambda *a: calls.append(a[0].shape[0]) or real(*a)):
        llm = LLM(str(model), dtype="float32", **kw)
        targets = llm.engine.experts.decode_targets()
        assert len(targets) == (2 if backend == "resident" else 1), targets
        times = iter([2.0, 1.0, 2.0, 3.0] * len(targets))  # (grouped, decode) at T = 1, then 2
        llm.engine.choose_moe_paths(timer=lambda fn: next(times))
        assert all(t.buffer.decode_tokens == 1 for t in targets)
        calls.clear()  # the timing ran both paths at T = 1 and 2
        out = llm.logits(prompt, chunk_size=[4, 1])
    assert calls and set(calls) == {1}, calls  # the 4-token chunk took the grouped GEMM
    err = _rel(out, ref)
    assert err < 1e-5, err
    return err


def check_call_paths(fmt="nvfp4", h=128, i=64, e=8, k=2, seed=1):
    """`call_paths` (what the boot's compile-ahead walk calls): both paths of one buffer per slot
    layout, once at each size up to the largest, untimed, and no buffer's choice changed."""
    from moeferry.moe import path_choice as pc
    from moeferry.ops.triton import moe_gemm
    gen = torch.Generator().manual_seed(seed)
    params = QuantParams(**_params(fmt)) if _params(fmt) else None
    table = torch.arange(e, dtype=torch.int32)
    bufs = [SlotBuffer.from_experts(fmt, [_quantized_expert(fmt, hidden, i, gen, params) for _ in range(e + 1)], "cpu")
            for hidden in (h, h, 2 * h)]
    calls, real, before = [], moe_gemm.decode_moe, [b.decode_tokens for b in bufs]
    moe_gemm.decode_moe = lambda *args: calls.append(args[0].shape[0]) or real(*args)
    try:
        pc.call_paths([pc.DecodeTarget(b, table, e) for b in bufs], k, 4, torch.bfloat16)
    finally:
        moe_gemm.decode_moe = real
    assert calls == [1, 2, 4, 1, 2, 4], calls  # two layouts (the first two buffers share one)
    assert [b.decode_tokens for b in bufs] == before
    return 0.0


CASES["path-choice-nvfp4"] = (check_path_choice, dict())
CASES["call-paths-nvfp4"] = (check_call_paths, dict())
CASES["path-choice-engine-resident"] = (check_engine_path_choice, dict(backend="resident"))
CASES["path-choice-engine-offload"] = (check_engine_path_choice, dict(backend="offload"))


def check_gather(fmt, h=64, i=32, bank_slots=6, seed=0):
    """The one-launch slot gather moves exactly the bytes the per-tensor copies move."""
    gen = torch.Generator().manual_seed(seed)
    params = QuantParams(**_params(fmt)) if _params(fmt) else None
    bank = SlotBuffer.from_experts(fmt, [_quantized_expert(fmt, h, i, gen, params) for _ in range(bank_slots)], "cpu")
    src, dst = [4, 0, 5], [2, 0, 3]
    copied, gathered = (SlotBuffer.allocate_like(bank, 4) for _ in range(2))
    for buf in (copied, gathered):
        for t in (*buf.gate_up.tensors().values(), *buf.down.tensors().values()):
            t.view(torch.uint8).fill_(7)
    from moeferry.ops.triton.slot_gather import CONFIGS
    config = CONFIGS[seed % len(CONFIGS)]
    assert copied.copy_slots(dst, bank, src) == gathered.copy_slots(dst, bank, src, gather=config)
    assert gathered.gather_launch(bank, config) is not None, "every slot tensor is whole words"
    for m in ("gate_up", "down"):
        for name, t in getattr(copied, m).tensors().items():
            assert torch.equal(t.view(torch.uint8), getattr(getattr(gathered, m), name).view(torch.uint8)), (m, name)
    return 0.0


for _n, _f in enumerate(FORMAT_NAMES):  # each format with another gather config
    CASES[f"gather-slots-{_f}"] = (check_gather, dict(fmt=_f, seed=_n))


def check_shared_in_slots(quant=None):
    """The resident backend on kernels holds the shared expert in slot E of each layer's buffer
    (SparseMoE passes its gate per token): logits equal the same kernels with the shared
    expert as a separate MLP."""
    import tempfile
    from unittest import mock

    from moeferry import LLM
    from moeferry.checkpoint.synthetic import make_model
    from moeferry.moe.resident import ResidentBackend

    model = make_model(tempfile.mkdtemp(), "qwen3_5_moe", "tiny", seed=3, num_layers=2, quant=quant)
    prompt = [5, 17, 99, 3, 250, 8, 41]
    out = {}
    for fused in (False, True):
        with mock.patch("moeferry.moe.resident.use_kernels", return_value=True), \
                mock.patch.object(ResidentBackend, "takes_shared", fused):
            llm = LLM(str(model), dtype="float32", max_extend_tokens=4)
            held = [type(layer.mlp.experts).__name__ for layer in llm.engine.model.layers]
            assert all(h == "TritonExperts" for h in held), held
            assert all((layer.mlp.shared is None) == fused for layer in llm.engine.model.layers)
            out[fused] = llm.logits(prompt)
    err = _rel(out[True], out[False])
    assert err < 1e-4, f"relative error {err:.3g}"
    return err


CASES["shared-in-slots-bf16"] = (check_shared_in_slots, dict())
CASES["shared-in-slots-mixed_nvfp4"] = (check_shared_in_slots, dict(quant="mixed_nvfp4"))


# -- interpreter workers -------------------------------------------------------------------
def _worker(shard: int, nshards: int) -> None:
    def run(name):
        fn, kw = CASES[name]
        return fn(**kw)
    report_cases(list(CASES), run, shard, nshards)


def test_tail_split_spreads_the_last_wave():
    """gate_up's units on an H100's 132 SMs: at T = 1 (9 pairs x 32 row blocks = 2 waves + 24)
    the 24 in 4 slices leave the busiest SM 2.25 units instead of 3; at T = 4 (8 waves + 96) no cut
    saves a tenth; none without a whole wave, without a tail, or where the config allows none."""
    split = moe_decode.tail_split
    assert split(288, 132, 8) == 4 and split(288, 132, 2) == 2
    assert split(576, 132, 4) == 2  # T = 2: 4 waves + 48 -> 4.5 units
    assert split(1152, 132, 8) == 0
    assert split(100, 132, 8) == split(264, 132, 8) == split(288, 132, 0) == split(288, 0, 8) == 0


@pytest.fixture(scope="module")
def interpreted():
    return run_workers(__file__, WORKERS)


@pytest.mark.parametrize("case", sorted(CASES))
def test_interpreted(interpreted, case):
    assert_case_passed(interpreted, case)


# -- GPU: compiled kernels at Qwen3.6 shapes -----------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
QWEN = dict(e=256, k=8, h=2048, i=512)
DEVICE_FORMS = ("bf16", "fp8_tensor", "fp8_block", "nvfp4", "int4_awq")  # one per kernel


def random_device_experts(fmt, n, h, i, device, seed=0):
    """n experts of random device-form weights (gate, up, down), made on the device."""
    from moeferry.checkpoint.formats import DenseWeight, Fp4Weight, Fp8BlockWeight, Fp8Weight, Int4Weight
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=device)

    def uni(*shape):
        return torch.rand(*shape, generator=g, device=device)

    def one(out, inp):
        if fmt == "bf16":
            return DenseWeight(out, inp, (rnd(out, inp) * 0.03).bfloat16())
        if fmt == "fp8_tensor":
            return Fp8Weight(out, inp, (rnd(out, inp) * 64).clamp(-448, 448).to(torch.float8_e4m3fn),
                             (uni(1) * 5e-4 + 2e-4).expand(out).contiguous())
        if fmt == "fp8_block":
            return Fp8BlockWeight(out, inp, (rnd(out, inp) * 64).clamp(-448, 448).to(torch.float8_e4m3fn),
                                  uni(-(-out // 128), -(-inp // 128)) * 5e-4 + 2e-4, (128, 128))
        if fmt == "nvfp4":
            packed = torch.randint(0, 256, (out, inp // 2), generator=g, device=device, dtype=torch.uint8)
            return Fp4Weight(out, inp, packed, (uni(out, inp // 16) * 3 + 0.5).to(torch.float8_e4m3fn),
                             uni(1) * 4e-3 + 2e-3)
        if fmt == "int4_awq":
            packed = torch.randint(0, 256, (out, inp // 2), generator=g, device=device, dtype=torch.uint8)
            return Int4Weight(out, inp, packed, (uni(out, inp // 128) * 4e-3 + 1e-3).half(),
                              torch.randint(0, 16, (out, inp // 128), generator=g, device=device,
                                            dtype=torch.uint8), 128)
        raise ValueError(fmt)

    return [(one(i, h), one(i, h), one(h, i)) for _ in range(n)]


def _gpu_dequant(expert):
    from moeferry.checkpoint.formats import fp4
    dev = next(iter(expert[0].tensors().values())).device
    table = fp4.E2M1_VALUES
    fp4.E2M1_VALUES = table.to(dev)  # the registry's E2M1 table is a CPU tensor
    try:
        return _dequant(expert, dev)
    finally:
        fp4.E2M1_VALUES = table


_GPU_CACHE: dict = {}


def _gpu_setup(fmt):
    if fmt not in _GPU_CACHE:
        dev = torch.device("cuda")
        e, h, i = QWEN["e"], QWEN["h"], QWEN["i"]
        experts = random_device_experts(fmt, e + 1, h, i, dev)  # the last one is the shared expert
        s = e + 40
        gen = torch.Generator().manual_seed(7)
        where = torch.randperm(s, generator=gen)[:e + 1]
        contents = [experts[0]] * s  # unused slots repeat expert 0
        for j, sl in enumerate(where.tolist()):
            contents[sl] = experts[j]
        buf = SlotBuffer.from_experts(fmt, contents, dev)
        dq = [_gpu_dequant(ex) for ex in experts]
        _GPU_CACHE[fmt] = (buf, where.to(dev, torch.int32), dq)
    return _GPU_CACHE[fmt]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("t", [1, 3, 64, 1024, 8192])
@pytest.mark.parametrize("fmt", DEVICE_FORMS)
def test_gpu_qwen_shapes(fmt, t):
    buf, where, dq = _gpu_setup(fmt)
    e, k = QWEN["e"], QWEN["k"]
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(t, QWEN["h"], generator=gen).cuda().bfloat16()
    w, ids = _routing(t, e, k, gen, "cuda", torch.bfloat16)
    table = where[:e].clone()
    shared = t in (3, 1024)
    missing = torch.tensor([5, 77], device="cuda") if t == 64 else torch.tensor([], dtype=torch.long, device="cuda")
    table[missing] = -1
    gate = torch.randn(t, generator=gen).cuda() if shared else None
    out = buf.run(x, ids, w, table, int(where[e]) if shared else -1, gate)
    torch.cuda.synchronize()
    w_ref = w.float().masked_fill(torch.isin(ids, missing), 0.0)
    ref = experts_reference(x.float(), ids, w_ref, lambda j: dq[j])
    if shared:
        ref = ref + torch.sigmoid(gate)[:, None] * swiglu(x.float(), *dq[e])
    err = _rel(out, ref)
    assert err < 2e-2, f"{fmt} T={t}: relative error {err:.3g}"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("path", ["decode", "decode-pairs", "decode-arrive", "decode-pdl", "decode-preload",
                                  "decode-split", "gemm"])
@pytest.mark.parametrize("t", [1, 2, 4])
@pytest.mark.parametrize("fmt", DEVICE_FORMS)
def test_gpu_decode_paths(fmt, t, path):
    """Both MoE paths at decode sizes, Qwen3.6 shapes, with a shared expert and non-resident experts."""
    from moeferry.ops.triton import moe_gemm
    from moeferry.ops.triton.moe_decode import DecodeConfig
    buf, where, dq = _gpu_setup(fmt)
    e, k = QWEN["e"], QWEN["k"]
    gen = torch.Generator().manual_seed(100 + t)
    x = torch.randn(t, QWEN["h"], generator=gen).cuda().bfloat16()
    w, ids = _routing(t, e, k, gen, "cuda", torch.bfloat16)
    table = where[:e].clone()
    missing = ids[0, :2]  # two of token 0's experts are not resident
    table[missing] = -1
    gate = torch.randn(t, generator=gen).cuda()
    cfg = (DecodeConfig() if path == "decode" else DecodeConfig(down_pairs=2) if path == "decode-pairs"
           else DecodeConfig(down_pairs=1, down_arrive=True) if path == "decode-arrive"
           else DecodeConfig(down_pairs=1, down_arrive=True, down_pdl=True) if path == "decode-pdl"
           else DecodeConfig(down_bn=8, down_pdl=True, down_preload=True) if path == "decode-preload"
           else DecodeConfig(gate_up_bk=2048, down_pairs=1, down_arrive=True, down_pdl=True, gate_up_split=4)
           if path == "decode-split"
           else moe_gemm.choose_config(t, buf.gate_up, buf.down))
    out = buf.run(x, ids, w, table, int(where[e]), gate, config=cfg)
    w_ref = w.float().masked_fill(torch.isin(ids, missing), 0.0)
    ref = experts_reference(x.float(), ids, w_ref, lambda j: dq[j]) + torch.sigmoid(gate)[:, None] * swiglu(x.float(), *dq[e])
    err = _rel(out, ref)
    assert err < 2e-2, f"{fmt} T={t} {path}: relative error {err:.3g}"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant", ["entry", "preload", "split"])
@pytest.mark.parametrize("fmt", DEVICE_FORMS)
def test_gpu_decode_pdl_in_graph(fmt, variant):
    """Down launched as a programmatic dependent of gate_up (`down_pdl`; the entry's down, with
    "preload" a program per token's pairs holding every pair's weights first, with "split" gate_up's
    last wave in k slices where its entry takes all of H in one step), eight calls
    (T = 1..4, each its own routing and activations) captured in one CUDA graph, so that each
    down starts under its gate_up's tail and the next call follows at once: every replay's
    outputs are the plain launches' bytes (the same sums in the same order; a read of inter
    before gate_up's end would differ)."""
    from dataclasses import replace
    from moeferry.ops.triton.moe_decode import DECODE_CONFIGS, DecodeConfig
    buf, where, _ = _gpu_setup(fmt)
    e, k = QWEN["e"], QWEN["k"]
    gen = torch.Generator().manual_seed(31)
    table, shared = where[:e].clone(), int(where[e])
    calls = []
    for c in range(8):
        t = 1 + c % 4
        x = torch.randn(t, QWEN["h"], generator=gen).cuda().bfloat16()
        w, ids = _routing(t, e, k, gen, "cuda", torch.bfloat16)
        calls.append((x, ids, w, table, shared, torch.randn(t, generator=gen).cuda()))
    plain = replace(DECODE_CONFIGS.get(buf.gate_up.kernel.name, DecodeConfig()), down_pdl=False)
    if variant == "preload":
        plain = replace(plain, down_bn=8, down_pairs=0, down_arrive=False, down_preload=True)
    elif variant == "split":
        plain = replace(plain, gate_up_split=4)
    want = [buf.run(*call, config=plain) for call in calls]
    outs = []

    def step():
        outs[:] = [buf.run(*call, config=replace(plain, down_pdl=True)) for call in calls]
    step()
    torch.cuda.synchronize()
    assert all(torch.equal(o, r) for o, r in zip(outs, want)), "eager down_pdl differs from plain launches"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        for o in outs:
            o.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(o, r) for o, r in zip(outs, want)), "a replay's down_pdl output differs"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", DEVICE_FORMS)
def test_gpu_path_choice_times_both_paths(fmt):
    """The warm-up's MoE path choice on the device (graph-replay timing) at Qwen3.6 shapes with
    the shared expert: both paths agree at every size it times, every time is a real device
    time, and the buffer takes the decode path up to a measured size (or not at all)."""
    from moeferry.moe import path_choice as pc
    buf, where, _ = _gpu_setup(fmt)
    target = pc.DecodeTarget(buf, where[:QWEN["e"]].clone(), int(where[QWEN["e"]]))
    tokens, timings, why = pc.choose_decode_tokens(target, QWEN["k"], 16, torch.bfloat16)
    assert timings and all(0 < p.grouped_s < 1e-2 and 0 < p.decode_s < 1e-2 for p in timings), timings
    assert all(p.rel_diff <= pc.AGREE for p in timings), timings
    assert tokens in (0, *pc.SIZES) and (tokens == 0 or timings[0].decode_s < timings[0].grouped_s), (tokens, why)


@pytest.mark.gpu
@gpu
def test_gpu_resident_backend():
    """The resident backend puts a layer's experts into Triton slots on CUDA, the reference elsewhere."""
    from moeferry.engine.config import EngineConfig
    from moeferry.moe import LayerExperts, make_backend
    e, h, i = 64, QWEN["h"], QWEN["i"]
    g = torch.Generator().manual_seed(0)
    gu = (torch.randn(e, 2 * i, h, generator=g) * 0.03).bfloat16()
    dn = (torch.randn(e, h, i, generator=g) * 0.03).bfloat16()
    cfg = EngineConfig("(test)")
    ex = make_backend(cfg, None, torch.device("cuda"), torch.bfloat16).add_layer(0, LayerExperts.from_stacked(gu, dn))
    assert isinstance(ex, TritonExperts)
    x = torch.randn(16, h, generator=g).bfloat16()
    w, ids = _routing(16, e, 8, g, "cpu", torch.bfloat16)
    out = ex(x.cuda(), ids.cuda(), w.cuda())
    ref = DenseExperts(gu.float(), dn.float())(x.float(), ids, w.float())
    assert _rel(out.cpu(), ref) < 2e-2
    cpu = make_backend(cfg, None, torch.device("cpu"), torch.bfloat16).add_layer(0, LayerExperts.from_stacked(gu, dn))
    assert isinstance(cpu, DenseExperts)


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(int(sys.argv[2]), int(sys.argv[3]))
