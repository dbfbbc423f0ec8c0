"""CPU references of the MoE slot forms: `SlotMatrix.dense` / `dense_slots` (per-format
dequantizers over the slot layout) against the registry's `PackedWeight.dequantize`, and
`SlotBuffer.run_reference` against `moeferry.ops.moe.experts_reference` over the dequantized
registry weights. Plain PyTorch on the CPU: no Triton kernel runs here.
"""
from __future__ import annotations

import pytest
import torch

from moeferry.checkpoint.formats import QuantParams
from moeferry.moe.slots import SlotBuffer
from moeferry.ops.moe import experts_reference, swiglu
from tests.test_moe_kernels import _quantized_expert, _rel

H, I = 160, 48  # partial fp8 blocks and int4 groups along both dims; multiples of 16 for fp4

# case -> (registry format, quantizer params)
CASES = {
    "bf16": ("bf16", None),
    "fp8_tensor": ("fp8_tensor", None),
    "fp8_tensor-per_row": ("fp8_tensor", QuantParams(per_channel=True)),
    "fp8_block": ("fp8_block", None),
    "fp8_block-32x64": ("fp8_block", QuantParams(block_size=(32, 64))),
    "nvfp4": ("nvfp4", None),
    "nvfp4_ct": ("nvfp4_ct", None),
    "int4_awq": ("int4_awq", None),
    "int4_awq-g32": ("int4_awq", QuantParams(group_size=32, symmetric=False)),
    "int4_ct": ("int4_ct", None),
    "int4_ct-asym-g32": ("int4_ct", QuantParams(group_size=32, symmetric=False)),
}


def _expert(fmt, params, gen):
    """(gate, up, down) PackedWeights of random weights through the registry's quantizer."""
    return _quantized_expert(fmt, H, I, gen, params)


def _dequant(expert, dtype=torch.float32):
    gate, up, down = (w.dequantize(dtype) for w in expert)
    return torch.cat([gate, up]), down


def _buffer(case, num_experts, num_slots, seed):
    """A buffer of `num_slots` slots, expert j in slot where[j], the other slots holding
    unrelated experts (reading one would show)."""
    fmt, params = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    contents = [_expert(fmt, params, gen) for _ in range(num_slots)]
    where = torch.randperm(num_slots, generator=gen)[:num_experts]
    buf = SlotBuffer.from_experts(fmt, contents, "cpu")
    return buf, contents, where, gen


@pytest.mark.parametrize("case", sorted(CASES))
def test_dense_slots_equal_registry_dequantize(case):
    buf, contents, _, _ = _buffer(case, 0, 5, seed=1)
    for s, expert in enumerate(contents):
        gate_up, down = _dequant(expert)
        assert torch.equal(buf.gate_up.dense(s, torch.float32), gate_up)
        assert torch.equal(buf.down.dense(s, torch.float32), down)
        # other dtypes: the registry's fp32 math, then one cast
        bf_gate_up, bf_down = _dequant(expert, torch.bfloat16)
        assert buf.gate_up.dense(s, torch.bfloat16).dtype == torch.bfloat16
        assert torch.equal(buf.gate_up.dense(s, torch.bfloat16), bf_gate_up)
        assert torch.equal(buf.down.dense(s, torch.bfloat16), bf_down)
    # a batch of slots in any order (repeats allowed) is the stack of single slots
    order = torch.tensor([3, 0, 4, 3])
    batch = buf.gate_up.dense_slots(order, torch.float32)
    assert batch.shape == (4, 2 * I, H)
    assert torch.equal(batch, torch.stack([_dequant(contents[s])[0] for s in order.tolist()]))
    assert torch.equal(buf.down.dense_slots([1, 2], torch.float32),
                       torch.stack([_dequant(contents[s])[1] for s in (1, 2)]))


def test_fp8_held_as_raw_bytes_dequantizes_the_same():
    """Host banks may keep fp8 tensors as uint8; the dequantizers read either."""
    for case in ("fp8_tensor", "fp8_block-32x64", "nvfp4"):
        buf, _, _, _ = _buffer(case, 0, 2, seed=2)
        for m in (buf.gate_up, buf.down):
            want = m.dense_slots([1, 0], torch.float32)
            raw = type(m)(**{**m.__dict__, **{k: t.view(torch.uint8) for k, t in m.tensors().items()
                                               if t.dtype == torch.float8_e4m3fn}})
            assert any(t.dtype == torch.uint8 for t in raw.tensors().values())
            assert torch.equal(raw.dense_slots([1, 0], torch.float32), want)


def test_slot_out_of_range_is_an_error():
    buf, _, _, _ = _buffer("nvfp4", 0, 3, seed=3)
    for bad in ([3], [-1], [0, 5]):
        with pytest.raises(IndexError, match="out of range"):
            buf.gate_up.dense_slots(bad, torch.float32)


@pytest.mark.parametrize("case", sorted(CASES))
def test_write_packed_round_trips(case):
    buf, _, _, gen = _buffer(case, 0, 3, seed=4)
    fmt, params = CASES[case]
    expert = _expert(fmt, params, gen)
    packed = buf.pack(expert)
    buf.write_packed(1, packed)
    back = buf.read_slot(1)
    for want, got in zip(packed, back):
        assert want.keys() == got.keys()
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    for t in (*back[0].values(), *back[1].values()):  # a copy, not a view of the slot
        t.view(torch.uint8).zero_()
    gate_up, down = _dequant(expert)
    assert torch.equal(buf.gate_up.dense(1, torch.float32), gate_up)
    assert torch.equal(buf.down.dense(1, torch.float32), down)


def check_run_reference(case, t, e=8, k=3, slots=11, missing=3, shared=False, dtype=torch.float32, seed=0):
    """`run_reference` through a table with `missing` experts at -1 vs a loop of the ops.moe
    reference over the registry's dequantized weights, the missing experts dropped."""
    buf, contents, where, gen = _buffer(case, e + int(shared), slots, seed)
    experts = [contents[s] for s in where.tolist()]
    table = where[:e].to(torch.int32).clone()
    gone = torch.randperm(e, generator=gen)[:missing]
    table[gone] = -1
    x = torch.randn(t, H, generator=gen).to(dtype)
    logits = torch.randn(t, e, generator=gen)
    w, ids = torch.topk(torch.softmax(logits, -1), k)
    w = (w / w.sum(-1, keepdim=True)).to(dtype)
    gate = torch.randn(t, generator=gen).to(dtype) if shared else None  # the shared gate's logits
    out = buf.run_reference(x, ids, w, table, int(where[e]) if shared else -1, gate)
    assert out.shape == x.shape and out.dtype == dtype
    dq = [_dequant(ex) for ex in experts]
    ref = experts_reference(x.float(), ids, w.float().masked_fill(torch.isin(ids, gone), 0.0), lambda j: dq[j])
    if shared:
        ref = ref + torch.sigmoid(gate.float())[:, None] * swiglu(x.float(), *dq[e])
    return _rel(out, ref)


@pytest.mark.parametrize("case", sorted(CASES))
def test_run_reference_matches_ops_reference_fp32(case):
    for t, shared, seed in ((1, False, 10), (5, True, 11), (37, False, 12)):
        err = check_run_reference(case, t, shared=shared, seed=seed)
        assert err <= 1e-5, f"T={t} shared={shared}: relative error {err:.3g}"


@pytest.mark.parametrize("case", ["bf16", "nvfp4", "int4_awq"])
def test_run_reference_bf16_activations(case):
    err = check_run_reference(case, 9, shared=True, dtype=torch.bfloat16, seed=20)
    assert err <= 2e-2, f"relative error {err:.3g}"


def test_run_reference_reads_each_used_slot_once_and_skips_missing():
    buf, _, where, gen = _buffer("int4_ct", 8, 10, seed=30)
    table = where.to(torch.int32).clone()
    table[[2, 5]] = -1
    seen = []
    orig = buf.gate_up.dense_slots
    buf.gate_up.dense_slots = lambda s, dtype: (seen.extend(s.tolist()), orig(s, dtype))[1]
    ids = torch.tensor([[0, 2], [2, 5], [0, 7], [5, 7], [2, 5]])
    w = torch.full((5, 2), 0.5)
    x = torch.randn(5, H, generator=gen)
    out = buf.run_reference(x, ids, w, table)
    assert sorted(seen) == sorted({int(table[0]), int(table[7])})
    assert torch.equal(out[[1, 4]], torch.zeros(2, H))  # both choices missing: contributes 0
    empty = buf.run_reference(x[:0], ids[:0], w[:0], table)
    assert empty.shape == (0, H)


@pytest.mark.parametrize("depth", [1, 2])
def test_host_staging_reuses_one_buffer_per_layout(depth):
    """Placing layers through `HostStaging` (as the resident backend does on CUDA): each layer
    reuses its layout's host buffers (`depth` of them, taken in turn), a different format or
    quantization gets its own, and every layer's copy holds that layer's experts after later
    layers refilled the buffer."""
    from moeferry.moe.layer_experts import LayerExperts
    from moeferry.moe.slots import HostStaging
    gen = torch.Generator().manual_seed(5)
    staging = HostStaging(pin=False, depth=depth)
    layers = [("nvfp4", None), ("nvfp4", None), ("int4_awq", None), ("int4_awq", QuantParams(group_size=32)),
              ("nvfp4", None)]
    placed, buffers = [], []
    for fmt, params in layers:
        experts = [_quantized_expert(fmt, H, I, gen, params) for _ in range(3)]
        host = staging.filled(LayerExperts(fmt, experts))
        buffers.append(host)
        placed.append((host.to("cpu"), experts, fmt))
    if depth == 1:
        assert buffers[0] is buffers[1] is buffers[4]
        assert len({id(b) for b in buffers}) == 3  # nvfp4, int4 g128, int4 g32
    else:  # nvfp4's layers take its two buffers in turn
        assert buffers[0] is not buffers[1] and buffers[4] is buffers[0]
        assert len({id(b) for b in buffers}) == 4
    for buf, experts, fmt in placed:
        want = SlotBuffer.from_experts(fmt, experts, "cpu")
        for a, b in ((buf.gate_up, want.gate_up), (buf.down, want.down)):
            for name, t in b.tensors().items():
                assert torch.equal(getattr(a, name), t), (fmt, name)
    staging.release()
    assert not staging._buffers
