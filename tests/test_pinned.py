"""Page-locked host tensors on huge pages (`memory.pinned`): carving, registration, lifetime."""
from __future__ import annotations

import gc

import torch

from moeferry.memory import pinned


def test_tensors_carved_from_one_registered_mapping_and_released_with_the_last():
    calls = []
    shapes = {"w": ((4, 3, 5), torch.uint8), "s": ((4, 7), torch.float32), "rs": ((4,), torch.bfloat16)}
    ts = pinned.pinned_tensors(shapes, register=lambda p, n: calls.append(("register", p, n)),
                               unregister=lambda p: calls.append(("unregister", p)))
    assert [(k, v.shape, v.dtype) for k, v in ts.items()] == [(k, torch.Size(s), d) for k, (s, d) in shapes.items()]
    (_, base, nbytes), = calls
    assert nbytes % pinned.HUGE == 0 and nbytes >= pinned.HUGE
    ptrs = sorted(v.data_ptr() for v in ts.values())
    assert ptrs[0] == base and all(p % pinned.ALIGN == 0 for p in ptrs)
    assert all(b - a >= pinned.ALIGN for a, b in zip(ptrs, ptrs[1:]))  # no overlap (each under ALIGN bytes here)
    ts["w"].fill_(7)
    ts["s"].fill_(1.5)
    assert ts["rs"].eq(0).all() and ts["s"].sum() == 42 and ts["w"].sum() == 7 * 60  # zeroed, then each its own
    keep = ts["s"]
    del ts
    gc.collect()
    assert calls[-1][0] == "register"  # a tensor over the mapping is still alive
    del keep
    gc.collect()
    assert calls[-1] == ("unregister", base)


def test_a_large_tensor_spans_whole_huge_pages():
    calls = []
    big = pinned.pinned_tensors({"bank": ((3 * pinned.HUGE + 5,), torch.uint8)},
                                register=lambda p, n: calls.append(n), unregister=lambda p: None)["bank"]
    assert calls == [4 * pinned.HUGE] and big.numel() == 3 * pinned.HUGE + 5


def test_a_bank_on_huge_pages_holds_what_a_plain_one_does(monkeypatch):
    """With `BANKS` on, a pinned slot matrix's tensors come from one mapping (registration stubbed
    on this CPU machine) and a layer's bank holds the same bytes as one in plain memory."""
    from moeferry.checkpoint.formats import FORMATS
    from moeferry.moe.bank import build_bank
    from moeferry.moe.layer_experts import LayerExperts
    f, gen = FORMATS["nvfp4"], torch.Generator().manual_seed(0)
    experts = [tuple(f.packed(f.quantize(torch.randn(n, m, generator=gen))) for n, m in ((32, 64), (32, 64), (64, 32)))
               for _ in range(3)]
    plain = build_bank(LayerExperts("nvfp4", experts), pin=False)
    registered = []
    monkeypatch.setattr(pinned, "BANKS", True)
    monkeypatch.setattr(pinned, "_cuda_register", lambda p, n: registered.append(n))
    monkeypatch.setattr(pinned, "_cuda_unregister", lambda p: None)
    huge = build_bank(LayerExperts("nvfp4", experts), pin=True)
    assert len(registered) == 2  # one mapping per slot matrix (gate_up, down)
    for m in ("gate_up", "down"):
        a, b = getattr(plain, m).tensors(), getattr(huge, m).tensors()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
