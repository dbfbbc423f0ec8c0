"""Compiling the boot's Triton kernels ahead (`moeferry.engine.compile_ahead`, `--compile-workers`).

On the CPU: `ShapeOnly` (treating the CPU as the device) computes nothing and writes nothing yet
gives every op's shapes, Triton launches become compile requests and the JIT is put back, a walk
that raises ends the walk and not the boot (the flag: test_cli.py). On the GPU:
a boot with it walks every step of a real model and greedy outputs equal a boot without it.
"""
from __future__ import annotations

import gc
import logging

import pytest
import torch

from moeferry.engine.compile_ahead import ShapeOnly, WalkAborted, compile_ahead


def test_shape_only_computes_and_writes_nothing():
    x = torch.randn(4, 6)
    w = torch.randn(6, 3)
    before = x.clone()
    with ShapeOnly("cpu"):
        y = x @ w
        assert y.shape == (4, 3) and y.dtype == x.dtype and not y.any()
        z = torch.softmax(x.double(), dim=-1)
        assert z.dtype == torch.float64 and z.shape == x.shape and not z.any()
        assert x.add_(1) is x                                  # a write in place is dropped
        out = torch.empty(4, 6)
        assert torch.add(x, x, out=out) is out and not out.any()  # ... and into out=; allocations are zeros
        row = x[1:3]                                           # a view stays a view
        assert row.data_ptr() == x.data_ptr() + 6 * x.element_size()
        assert x.sum().item() == 0                             # a scalar read reads the zeros
        parts = torch.split(x, 2)
        assert [p.shape for p in parts] == [(2, 6), (2, 6)]
        ids = torch.topk(x, 2).indices                         # indices come back in range (zeros)
        assert ids.dtype == torch.int64 and int(ids.max()) == 0
    assert torch.equal(x, before)


def test_shape_only_runs_ops_sized_by_values_and_stops_at_others_without_a_shape_function():
    x = torch.tensor([3, 0, 3, 5])
    f = x.float()
    with ShapeOnly("cpu"):
        assert torch.unique(x).tolist() == [0, 3, 5] and torch.nonzero(x).shape == (3, 1)
        assert f[f > 0].shape == (0,)  # a float mask is not computed, so zeros: nothing selected
        assert torch.where(x)[0].tolist() == [0, 2, 3]  # x itself is given, not computed
        # small integer tensors (lengths, positions) are computed: a size read from them is real
        assert int((x[1:] - x[:-1]).max().item()) == 3 and x[x > 0].tolist() == [3, 3, 5]
        assert not (torch.zeros(1 << 17, dtype=torch.int32) + 1).any()  # a large one is not
        with pytest.raises(WalkAborted, match="no_shape"):
            torch.ops.moeferry_test.no_shape(f)


@pytest.mark.parametrize("quant", ["bf16", "mixed_nvfp4"])
def test_boot_walk_goes_through_a_model_and_changes_nothing(quant, tmp_path):
    """The boot's walk (`engine.boot_walk`: every warm-up prefill length, a decode step after each,
    the largest decode batch) under `ShapeOnly` gets through a whole model's steps (here its CPU
    path, the CPU as the device) with no op left without a shape, and the logits after it are
    those of an engine it never touched, bit for bit."""
    from moeferry import LLM
    from moeferry.checkpoint.synthetic import make_model
    from moeferry.engine.engine import boot_walk
    path = make_model(tmp_path / "m", arch="qwen3_5_moe", size="tiny", seed=4, dtype="bfloat16",
                      quant=None if quant == "bf16" else quant)
    untouched = LLM(str(path), device="cpu", max_running_requests=2, max_extend_tokens=64).logits([5, 17, 99, 3])
    llm = LLM(str(path), device="cpu", max_running_requests=2, max_extend_tokens=64)
    e = llm.engine
    with ShapeOnly("cpu"):  # first, as at boot: nothing a part builds on its first call is built from zeros
        boot_walk(e.cfg, e.spec, e.model, e.experts, e.model.dtype, e.device)()
    assert torch.equal(llm.logits([5, 17, 99, 3]), untouched)


def test_kernel_signature_tells_apart_what_a_launch_sees_and_not_which_layer():
    """Parts equal but for which layer they are (their pools' rows: `kv_index`) share a signature;
    a weight's shape, dtype or 16-byte alignment (Triton specializes on it) tells them apart, and
    the walk steps through the first part of each signature, in order."""
    from moeferry.model.layers import DenseMLP
    from moeferry.model.linear import Linear
    from moeferry.ops.triton.specialization import kernel_signature
    from moeferry.engine.compile_ahead import representative_layers

    def mlp(h=8, i=16, dtype=torch.bfloat16, offset=0):
        def w(n, k):
            return torch.randn(n * k + offset, dtype=dtype)[offset:].view(n, k)
        part = DenseMLP(Linear(w(i, h)), Linear(w(i, h)), Linear(w(h, i)))
        part.kv_index = offset  # (an attribute naming a layer's row: not seen by a launch)
        return part

    base = kernel_signature(mlp())
    assert kernel_signature(mlp()) == base
    assert kernel_signature(mlp(i=32)) != base
    assert kernel_signature(mlp(dtype=torch.float16)) != base
    misaligned = mlp(offset=1)
    assert misaligned.down_proj.weight.data_ptr() % 16 and kernel_signature(misaligned) != base
    parts = [mlp(), mlp(i=32), mlp(), misaligned, mlp(i=32)]
    assert representative_layers(parts) == [parts[0], parts[1], parts[3]]


def test_shape_only_takes_attention_after_a_prefix():
    """A chunk after a cached prefix attends through SDPA with a lower-right causal bias (a Tensor
    subclass, which cannot be made inside a dispatch mode: the H100's walk stopped there)."""
    from moeferry.ops.attention import _sequence_attention
    q, k, k_cache = torch.randn(4, 4, 8), torch.randn(4, 2, 8), torch.randn(16, 2, 8)
    row = torch.arange(16, dtype=torch.int32)
    real = _sequence_attention(q, k, k, k_cache, k_cache, 0, 4, 10, row, 1, 0.3, True)
    with ShapeOnly("cpu"):
        walked = _sequence_attention(q, k, k, k_cache, k_cache, 0, 4, 10, row, 1, 0.3, True)
    assert walked.shape == real.shape and not walked.any() and real.any()


def test_a_quant_linear_first_called_in_the_walk_builds_real_operands():
    """A `QuantLinear` builds its kernel operands (views, and scales converted for the kernel) at
    its first kernel call, which at boot is inside the compile-ahead walk: they are built outside
    the walk's mode, so no conversion is kept as the walk's zeros. (The boot walks in inference
    mode, where `contiguous` and `to` reach the mode whole and, returning maybe an alias, run;
    outside it they decompose into `clone` / `_to_copy`, which compute nothing: as here.)"""
    import dataclasses

    pytest.importorskip("triton")
    from moeferry.checkpoint.formats import FORMATS
    from moeferry.model.linear import QuantLinear
    f = FORMATS["fp8_block"]
    packed = f.packed(f.quantize(torch.randn(256, 384)))
    strided = packed.scale_inv.t().contiguous().t()  # the same scales, column-major: the kernel's copy converts
    packed = dataclasses.replace(packed, scale_inv=strided)
    with ShapeOnly("cpu"):
        walked = QuantLinear(packed, "fp8_block")._kernel_operands()
    real = QuantLinear(packed, "fp8_block")._kernel_operands()
    assert real.s.is_contiguous() and real.s.abs().sum() > 0 and torch.equal(walked.s, real.s)


_LIB = torch.library.Library("moeferry_test", "FRAGMENT")  # an op with no meta function
_LIB.define("no_shape(Tensor x) -> Tensor")
_LIB.impl("no_shape", lambda x: x.clone(), "CPU")


def test_shape_only_leaves_host_work_alone_when_the_device_is_another():
    x = torch.arange(6.0)
    with ShapeOnly("cuda"):
        assert torch.equal(x * 2, torch.arange(0.0, 12.0, 2.0))


def test_compile_ahead_turns_launches_into_compile_requests(monkeypatch):
    """Inside the walk a launch goes to the JIT's run with warmup=True (compile, launch nothing);
    the JIT's run is put back after, and a walk that raises is reported, not raised."""
    triton = pytest.importorskip("triton")
    from triton.runtime.jit import JITFunction

    calls = []

    def recording_run(self, *args, grid, warmup, **kwargs):
        calls.append(warmup)

    monkeypatch.setattr(JITFunction, "run", recording_run)

    @triton.jit
    def kernel(x_ptr):
        pass

    said = compile_ahead(lambda: kernel[(1,)](torch.zeros(1)), workers=2, device_type="cpu")
    assert calls == [True] and "walked every step" in said and "2 threads" in said
    assert JITFunction.run is recording_run

    def failing():
        raise WalkAborted("aten.nonzero.default has no shape function")
    said = compile_ahead(failing, workers=2, device_type="cpu")
    assert "walk ended early (WalkAborted: aten.nonzero" in said


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["resident", "offload"])
def test_compile_ahead_walks_a_real_boot(backend, tmp_path, caplog):
    """A boot with --compile-workers walks every step of the probe and the warm-up without
    computing (no op lacks a shape function, nothing raises) and leaves no trace: the logits of a
    prompt equal a boot's without it (a 40-token prefill: the grouped MoE path either way, as the
    decode path's choice is timed and may differ between two boots)."""
    from moeferry import LLM
    from moeferry.checkpoint.synthetic import make_model
    path = make_model(tmp_path / "m", arch="qwen3_5_moe", size="tiny", seed=4, dtype="bfloat16", quant="mixed_nvfp4")
    extra = dict(moe_backend="offload", moe_cache_size=16) if backend == "offload" else {}
    logits = []
    for workers in (4, 0):
        with caplog.at_level(logging.INFO, logger="moeferry.engine"):
            # the plan measures device memory outside the allocator too, which other processes of a
            # parallel GPU suite change while it boots: a limit well above a tiny model's needs, a small KV
            llm = LLM(str(path), device="cuda", dtype="bfloat16", max_running_requests=2, compile_workers=workers,
                      gpu_memory_limit=32 << 30, num_tokens=512, **extra)
        logits.append(llm.logits(list(range(3, 43))).float())
        del llm
        gc.collect()
        torch.cuda.empty_cache()  # the first engine's memory back before the second boot measures
    said = [r.getMessage() for r in caplog.records if "compiled ahead" in r.getMessage()]
    assert len(said) == 1 and "walked every step" in said[0], said
    rel = ((logits[0] - logits[1]).norm() / logits[1].norm()).item()
    assert rel <= 1e-2, rel
