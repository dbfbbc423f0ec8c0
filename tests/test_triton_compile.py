"""Kernels compile for the GPU we serve on (sm_90), on a machine without one.

The Triton interpreter accepts code the compiler refuses (a plain module global read inside a
kernel, for one), so a kernel checked only under the interpreter can still fail at its first
real launch. `triton.compile` needs no GPU for a given target: these cases build the cubin of
the kernels that run inside the decode graph of a device-managed expert cache, in each
specialisation the engine launches, and check what the compiler made of the aligned gather;
and of the few-token MoE path's kernels for every slot form, as `decode_moe` launches them.
"""
from __future__ import annotations

import re

import torch

import pytest

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.language import target_info  # noqa: E402

from moeferry.ops.triton import cache_resolve, slot_gather  # noqa: E402

H200 = GPUTarget("cuda", 90, 32)
ALIGNED = [["tt.divisibility", 16]]  # what the launcher passes for a 16-byte aligned pointer


def _compile(fn, signature: dict, constants: dict, attrs: dict | None = None, target: GPUTarget = H200):
    try:
        return triton.compile(ASTSource(fn, signature, constants, attrs or {}), target=target)
    except RuntimeError as e:  # a toolchain this machine lacks is not the kernel's fault
        if "ptxas" in str(e):
            pytest.skip(f"no ptxas: {e}")
        raise


@pytest.mark.parametrize("prefetch,lfu,n,s", [(False, False, 16, 4096), (True, False, 16, 4096),
                                               (False, False, 64, 16384), (False, True, 16, 4096),
                                               (True, True, 64, 16384)])
def test_cache_resolve_compiles(prefetch, lfu, n, s):
    sig = {"ids_ptr": "*i64", "n": "i32", "table_ptr": "*i32", "owner_ptr": "*i32", "stamp_ptr": "*i64",
           "flag_ptr": "*i8", "prio_ptr": "*i64", "uses_ptr": "*i32", "state_ptr": "*i64", "dst_ptr": "*i32",
           "count_ptr": "*i64", "key_base": "i32", "num_slots": "i32", "budget": "i32", "PREFETCH": "constexpr", "LFU": "constexpr",
           "N": "constexpr", "S": "constexpr"}
    constants = {"PREFETCH": prefetch, "LFU": lfu, "N": n, "S": s}
    assert "cubin" in _compile(cache_resolve._resolve_kernel, sig, constants).asm


@pytest.mark.parametrize("vec", [True, False])
def test_slot_gather_compiles_and_vectorises(vec):
    """The vec path moves 16 bytes per access (its base pointers aligned); the word path 4."""
    sig = {"desc_ptr": "*i64", "pieces_ptr": "*i32", "src_ptr": "*i64", "dst_ptr": "*i32", "src_base": "*i32",
           "dst_base": "*i32", "items": "i32", "pieces": "i32", "BLOCK": "constexpr", "VEC": "constexpr"}
    kernel = _compile(slot_gather._gather_kernel, sig, {"BLOCK": 2048, "VEC": vec}, {(4,): ALIGNED, (5,): ALIGNED})
    ptx = kernel.asm["ptx"]
    wide = len(re.findall(r"ld\.global(\.\w+)*\.v4", ptx)), len(re.findall(r"st\.global(\.\w+)*\.v4", ptx))
    assert (min(wide) > 0) == vec, wide


_POINTERS = {torch.uint8: "*u8", torch.int8: "*i8", torch.int32: "*i32", torch.int64: "*i64",
             torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float8_e4m3fn: "*fp8e4nv"}


def _target(target: GPUTarget):
    """A stand-in for `triton.language.target_info.current_target` (the driver's device, none here)
    that names `target`, as the JIT's own does (a builtin to its dependency scan)."""
    def current_target():
        return target
    current_target.__triton_builtin__ = True
    return current_target


def _qwen_slots(fmt: str, experts: int):
    """A CPU slot buffer of `experts` random experts in `fmt` at Qwen3.6's H = 2048 and I = 512."""
    from moeferry.checkpoint.formats import FORMATS
    from moeferry.moe.slots import SlotBuffer
    f, gen = FORMATS[fmt], torch.Generator().manual_seed(0)

    def packed(n, m):
        w = torch.randn(n, m, generator=gen) * 0.05
        return f.packed(f.quantize(w.bfloat16() if fmt == "bf16" else w))
    return SlotBuffer.from_experts(fmt, [(packed(512, 2048), packed(512, 2048), packed(2048, 512))
                                         for _ in range(experts)], "cpu")


class _Recorder:
    """Stands in for a JIT kernel: `kernel[grid](*args, **kw)` records the launch instead."""

    def __init__(self, fn, launches: list):
        self.fn, self.launches = fn, launches

    def __getitem__(self, grid):
        return lambda *args, **kw: self.launches.append((self.fn, args, kw))


def _compile_launch(fn, args, kw):
    """Compile a recorded launch for sm_90 (`_launch_source`)."""
    return _compile(fn, *_launch_source(fn, args, kw))


def _launch_source(fn, args, kw):
    """(signature, constants, attrs) of a recorded launch: pointers typed by their tensors, floats
    as fp32, ints as i32, the constexprs as launched; 16-byte aligned pointers and ints divisible by
    16 carry the divisibility the JIT would specialize them on (not the ints named in do_not_specialize)."""
    constants = {p.name: kw[p.name] for p in fn.params if p.is_constexpr}
    values = list(args) + [constants.get(n) for n in fn.arg_names[len(args):]]
    sig = {name: ("constexpr" if name in constants else _POINTERS[a.dtype] if isinstance(a, torch.Tensor)
                  else "fp32" if isinstance(a, float) else "i32")
           for name, a in zip(fn.arg_names, values)}
    loose = {fn.arg_names[i] if isinstance(i, int) else i for i in fn.do_not_specialize}
    attrs = {(i,): ALIGNED for i, (name, a) in enumerate(zip(fn.arg_names, values)) if name not in constants and (
        (isinstance(a, torch.Tensor) and a.data_ptr() % 16 == 0)
        or (isinstance(a, int) and not isinstance(a, bool) and a % 16 == 0 and name not in loose))}
    return sig, constants, attrs


@pytest.mark.parametrize("fmt,shared,down_pairs,arrive,pdl", [(f, s, 0, False, False) for f in (
    "bf16", "fp8_tensor", "fp8_block", "nvfp4", "int4_awq") for s in (False, True)]
                         + [("nvfp4", True, 2, False, False), ("nvfp4", True, 1, True, False),
                            ("int4_awq", True, 1, True, False), ("fp8_tensor", True, 1, True, False),
                            ("nvfp4", True, 1, True, True), ("int4_awq", True, 1, True, True),
                            ("fp8_tensor", True, 0, False, True)])
def test_moe_decode_kernels_compile(fmt, shared, down_pairs, arrive, pdl, monkeypatch):
    """The few-token MoE path (`moe_decode.py`) compiles for sm_90 for every slot form at Qwen3.6's
    H and I, with and without the shared expert (and once with the down launch split into pair
    chunks; with `arrive`, the chunks summed by their last arrival; with `pdl`, down launched as a
    programmatic dependent of gate_up, as on an sm_90 device): its launches are recorded on the CPU
    and each is compiled as launched."""
    import dataclasses
    from moeferry.ops.triton import grid_dependency, moe_decode
    monkeypatch.setattr(grid_dependency, "supported", lambda device: True)  # the host check, as on sm_90
    monkeypatch.setattr(target_info, "current_target", _target(H200))  # what the JIT compiles for there
    h, i, e, k = 2048, 512, 4, 2
    buf = _qwen_slots(fmt, e)
    launches = []
    for name in ("_decode_gate_up_kernel", "_decode_down_kernel", "_sum_chunks_kernel"):
        monkeypatch.setattr(moe_decode, name, _Recorder(getattr(moe_decode, name), launches))
    x, ids = torch.randn(1, h).bfloat16(), torch.tensor([[0, 2]])
    table = torch.arange(e, dtype=torch.int32)
    cfg = moe_decode.DECODE_CONFIGS.get(buf.gate_up.kernel.name, moe_decode.DecodeConfig())  # the GPU's
    cfg = dataclasses.replace(cfg, down_pairs=down_pairs, down_arrive=arrive, down_pdl=pdl)
    moe_decode.decode_moe(x, ids, torch.full((1, k), 0.5), buf.gate_up, buf.down, table, e - 1 if shared else -1,
                          torch.ones(1) if shared else None, cfg, buf.scratch.arrivals)
    assert len(launches) == (3 if down_pairs and not arrive else 2)
    assert all(kw.get("ARRIVE", arrive) == arrive for _, _, kw in launches)
    assert {fn.fn.__name__ for fn, _, _ in launches} >= {"_decode_gate_up_kernel", "_decode_down_kernel"}
    ptx = {}
    for fn, args, kw in launches:
        compiled = _compile_launch(fn, args, kw)
        assert "cubin" in compiled.asm
        ptx[fn.fn.__name__] = compiled.asm["ptx"]
        assert kw.get("launch_pdl", False) == (pdl and fn.fn.__name__ == "_decode_down_kernel")
    assert ("griddepcontrol.launch_dependents" in ptx["_decode_gate_up_kernel"]) == pdl
    down = ptx["_decode_down_kernel"]
    packed = moe_decode.packs_inter(buf.gate_up, x.dtype, min(cfg.gate_up_bn, i))
    assert ("griddepcontrol.wait" in down) == (pdl or packed)  # a packed read always waits (a no-op unless pdl)
    if pdl and packed:  # the first step's weight words are asked for before the wait
        assert re.search(r"ld\.global(\.\w+)*\.v4", down[:down.index("griddepcontrol.wait")])


@pytest.mark.parametrize("fmt", ["nvfp4", "int4_awq"])
def test_moe_decode_preloaded_down_compiles(fmt, monkeypatch):
    """`down_preload` with `down_pdl` compiles for sm_90 at Qwen3.6's H and I (top-8 and the shared
    expert): down runs the preloaded path over all 9 pairs and asks for every pair's weight words
    before it waits for gate_up's end."""
    import dataclasses
    from moeferry.ops.triton import grid_dependency, moe_decode
    monkeypatch.setattr(grid_dependency, "supported", lambda device: True)
    monkeypatch.setattr(target_info, "current_target", _target(H200))
    buf = _qwen_slots(fmt, 9)
    launches = []
    monkeypatch.setattr(moe_decode, "_decode_down_kernel", _Recorder(moe_decode._decode_down_kernel, launches))
    cfg = dataclasses.replace(moe_decode.DECODE_CONFIGS[buf.down.kernel.name], down_bn=8, down_pairs=0,
                              down_arrive=False, down_pdl=True, down_preload=True)
    inter = torch.zeros(9, 512 // 2 + 512 // 8, dtype=torch.int32)  # what gate_up hands down (packed)
    moe_decode.decode_down(inter, torch.empty(1, 2048).bfloat16(), torch.arange(8)[None], torch.full((1, 8), 0.1),
                           buf.down, torch.arange(9, dtype=torch.int32), 8, torch.ones(1), cfg, buf.scratch.arrivals)
    (fn, args, kw), = launches
    assert kw["PRELOAD"] and kw["PAIRS"] == 9 and kw["BK"] == 512 and kw["launch_pdl"]
    ptx = _compile_launch(fn, args, kw).asm["ptx"]
    before = ptx[:ptx.index("griddepcontrol.wait")]
    assert len(re.findall(r"ld\.global(\.\w+)*\.v4", before)) >= 9  # each pair's words (at least one load each)


@pytest.mark.parametrize("fmt", ["nvfp4", "int4_awq", "fp8_tensor"])
def test_moe_decode_split_gate_up_compiles(fmt, monkeypatch):
    """`gate_up_split` compiles for sm_90 at Qwen3.6's H and I: on a pretend 64-SM GPU, T = 1 with
    top-2 and the shared expert is 3 pairs x 32 row blocks = one wave of 64 units and a tail of 32
    in 2 k slices (grid 64 + 32 x 2), both the whole-unit and the slice branch in one kernel."""
    import dataclasses
    from moeferry.ops.triton import moe_decode
    monkeypatch.setattr(moe_decode, "_sms", lambda device: 64)
    buf = _qwen_slots(fmt, 4)
    launches = []
    monkeypatch.setattr(moe_decode, "_decode_gate_up_kernel", _Recorder(moe_decode._decode_gate_up_kernel, launches))
    cfg = dataclasses.replace(moe_decode.DECODE_CONFIGS.get(buf.gate_up.kernel.name, moe_decode.DecodeConfig()),
                              gate_up_bn=16, gate_up_bk=2048, gate_up_split=4)
    moe_decode.decode_gate_up(torch.randn(1, 2048).bfloat16(), torch.tensor([[0, 2]]), torch.full((1, 2), 0.5),
                              buf.gate_up, torch.arange(4, dtype=torch.int32), 3, torch.ones(1), cfg,
                              buf.scratch.arrivals)
    (fn, args, kw), = launches
    assert kw["SPLIT"] == 2 and kw["BK"] == 2048
    assert "cubin" in _compile_launch(fn, args, kw).asm


def test_grid_dependency_compiles_to_nothing_before_sm90(monkeypatch):
    """Consumer GPUs before sm_90 have no programmatic dependent launch: the decode kernels, with
    down's release and wait asked for, still compile for sm_89 and hold no griddepcontrol."""
    import dataclasses
    from moeferry.ops.triton import grid_dependency, moe_decode
    ada = GPUTarget("cuda", 89, 32)
    monkeypatch.setattr(grid_dependency, "supported", lambda device: True)
    monkeypatch.setattr(target_info, "current_target", _target(ada))
    buf = _qwen_slots("nvfp4", 4)
    launches = []
    for name in ("_decode_gate_up_kernel", "_decode_down_kernel"):
        monkeypatch.setattr(moe_decode, name, _Recorder(getattr(moe_decode, name), launches))
    cfg = dataclasses.replace(moe_decode.DECODE_CONFIGS["fp4"], down_pdl=True)
    moe_decode.decode_moe(torch.randn(1, 2048).bfloat16(), torch.tensor([[0, 2]]), torch.full((1, 2), 0.5),
                          buf.gate_up, buf.down, torch.arange(4, dtype=torch.int32), 3, torch.ones(1), cfg,
                          buf.scratch.arrivals)
    assert len(launches) == 2
    for fn, args, kw in launches:
        assert "griddepcontrol" not in _compile(fn, *_launch_source(fn, args, kw), target=ada).asm["ptx"]


@pytest.mark.parametrize("form,n", [("fp4", 4096), ("fp4", 248320), ("fp8_row", 2048), ("fp8_row", 8192)])
def test_row_gemv_compiles(form, n, monkeypatch):
    """The one-row dense GEMV compiles for sm_90 with each ROW_TILES entry the GPU uses, as
    `quant_linear` launches it at M = 1 (K = 2048)."""
    from moeferry.checkpoint.formats import FORMATS
    from moeferry.ops.triton import quant_linear as Q
    fmt = {"fp4": "nvfp4", "fp8_row": "fp8_tensor"}[form]
    f = FORMATS[fmt]
    op = Q.dense_operands(f.packed(f.quantize(torch.randn(64, 2048) * 0.05)), form)
    op = Q.DenseOperands(op.kernel, n, op.k, op.w, op.s, op.z, op.rs, op.group, op.group_n, op.counters)
    cfg = Q.choose_config(1, op, torch.device("cuda", 0))
    assert cfg.row
    launches = []
    monkeypatch.setattr(Q, "_row_gemv_kernel", _Recorder(Q._row_gemv_kernel, launches))
    Q.quant_linear(torch.randn(1, 2048).bfloat16(), op, cfg)
    (fn, args, kw), = launches
    assert "cubin" in _compile_launch(fn, args, kw).asm


@pytest.mark.parametrize("zero_centered", [True, False])
def test_qk_norm_rope_compiles(zero_centered, monkeypatch):
    """The fused q/k norm + rotary picks q's or k's pointers by program id (one branch per
    tensor): it compiles for sm_90 at Qwen3.6's attention shapes (16 q heads of 256 with the
    output gate interleaved, 2 k heads, 64 rotary dims), as `qk_norm_rope` launches it."""
    from moeferry.ops.triton import rope
    launches = []
    monkeypatch.setattr(rope, "_qk_norm_rope_kernel", _Recorder(rope._qk_norm_rope_kernel, launches))
    q = torch.randn(1, 16, 512).bfloat16()[..., :256]
    k, w = torch.randn(1, 2, 256).bfloat16(), torch.randn(256).bfloat16()
    cos = sin = torch.randn(1, 64).bfloat16()
    rope.qk_norm_rope(q, k, w, w, 1e-6, zero_centered, cos, sin)
    (fn, args, kw), = launches
    assert "cubin" in _compile_launch(fn, args, kw).asm


def test_route_topk_compiles(monkeypatch):
    """The router kernel (top-8 of 256 gathered in registers, one cast at the store) compiles
    for sm_90 with bf16 logits, as `route_topk` launches it."""
    from moeferry.ops.triton import router
    launches = []
    monkeypatch.setattr(router, "_route_kernel", _Recorder(router._route_kernel, launches))
    router.route_topk(torch.randn(1, 256).bfloat16(), 8, True)
    (fn, args, kw), = launches
    assert "cubin" in _compile_launch(fn, args, kw).asm


@pytest.mark.parametrize("rows", [1, 8])
def test_lane_signal_compiles(rows, monkeypatch):
    """The CPU lane's split and collect kernels (system-wide fences in inline PTX, a spin on a
    host word) compile for sm_90 at Qwen3.6's shapes (top-8 of 256, H 2048, bf16), as
    `cpu_lane` launches them."""
    from moeferry.moe.cpu_lane import WORDS, Box
    from moeferry.ops.triton import lane_signal
    launches = []
    for name in ("_split_kernel", "_collect_kernel"):
        monkeypatch.setattr(lane_signal, name, _Recorder(getattr(lane_signal, name), launches))
    h, k, pairs = 2048, 8, rows * 8
    box = Box(torch.zeros(pairs, dtype=torch.int64), torch.zeros(pairs), torch.zeros(rows * h), torch.zeros(rows * h),
              *(torch.zeros(n, dtype=torch.int32) for n in (WORDS, WORDS, 1, 1, 1)))
    x = torch.randn(rows, h).bfloat16()
    lane_signal.split(torch.randint(0, 256, (rows, k)), torch.rand(rows, k).bfloat16(), x,
                      torch.zeros(256, dtype=torch.int32), torch.zeros(pairs + 1, dtype=torch.int32), box,
                      torch.zeros(1, dtype=torch.int64))
    lane_signal.collect(x, box)
    assert len(launches) == 2
    for fn, args, kw in launches:
        assert "cubin" in _compile_launch(fn, args, kw).asm


def test_compile_watch_counts_real_compiles_and_restores_the_listener(tmp_path, monkeypatch):
    """`CompileWatch` (the boot log's compile time) hears `triton.compile` through its
    compilation listener while watching: a real sm_90 compile counts as compiled, the same
    kernel again as loaded from the on-disk cache; a listener already set still hears every
    compile, and is put back after. The JIT's launch hooks stay unset (one set makes every first
    launch serialize its specialization, which fails for a function given as a constexpr)."""
    from triton import knobs

    from moeferry.ops.triton.compile_watch import CompileWatch

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # a fresh cache: the first compile is one
    seen = []

    def theirs(**kw):
        seen.append(kw["cache_hit"])
    saved = knobs.compilation.listener
    knobs.compilation.listener = theirs
    sig = dict(ids_ptr="*i32", n="i32", table_ptr="*i32", owner_ptr="*i32", stamp_ptr="*i64", flag_ptr="*i8",
               prio_ptr="*i64", uses_ptr="*i32", state_ptr="*i64", dst_ptr="*i32", count_ptr="*i64",
               key_base="i32", num_slots="i32", PREFETCH="constexpr", LFU="constexpr", N="constexpr", S="constexpr")
    consts = dict(PREFETCH=False, LFU=False, N=16, S=1024)
    try:
        watch = CompileWatch()
        assert watch.describe() == "no Triton kernel compiled"
        with watch.watching():
            assert knobs.compilation.listener is not theirs
            for _ in range(2):
                _compile(cache_resolve._resolve_kernel, sig, consts)
            assert knobs.runtime.jit_cache_hook is None and knobs.runtime.jit_post_compile_hook is None
        assert (watch.compiled, watch.loaded) == (1, 1) and watch.seconds > 0
        assert seen == [False, True]
        assert knobs.compilation.listener is theirs
        assert watch.describe().startswith("Triton: 1 kernels compiled, 1 loaded from its cache")
    finally:
        knobs.compilation.listener = saved
