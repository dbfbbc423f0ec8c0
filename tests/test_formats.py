"""Quantization format registry: round trips, independent references, detection, errors.

Independent references: the `compressed-tensors` package (int4_ct, nvfp4_ct and the NVFP4
byte layout shared with ModelOpt), transformers' FP8 dequantization and module-exclusion
matcher, and hand-built tensors with known values for the AWQ nibble order and FP8 blocks.
"""
from __future__ import annotations

import pytest
import torch

from moeferry.checkpoint.formats import (AWQ_ORDER, AWQ_REVERSE_ORDER, FORMATS, PRESETS,
                                         QuantParams, QuantTensorError, UnsupportedQuantization,
                                         check_tensors, detect_scheme, never_quantized, quantize_module,
                                         synthetic_quant_config)
from moeferry.checkpoint.formats.fp4 import E2M1_VALUES, e2m1_encode, unpack_nibbles
from moeferry.checkpoint.formats.int4 import pack_int32

ct = pytest.importorskip("compressed_tensors")
from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam  # noqa: E402

OUT, IN = 96, 320  # IN: not a multiple of 128 -> partial fp8 blocks and int4 groups


def varied_weight(out=OUT, inp=IN, seed=0, dtype=torch.float32):
    """Gaussian weights whose magnitude spans ~3 decades across rows and columns."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g)
    w = w * torch.logspace(-2, 0.5, out)[:, None] * torch.logspace(-0.5, 0.5, inp)[None, :]
    return w.to(dtype)


def ct_scheme(**weights):
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights))


def expand(t, g, n):
    return t.repeat_interleave(g, dim=-1)[..., :n]


# -- registry -------------------------------------------------------------------------------
def test_registry_has_one_entry_per_format():
    assert list(FORMATS) == ["bf16", "fp8_tensor", "fp8_block", "nvfp4", "nvfp4_ct", "int4_awq", "int4_ct"]
    for name, fmt in FORMATS.items():
        assert fmt.name == name
        assert fmt.moe_kernel().name == fmt.device_form  # found on use, nothing registered at import
        assert set(fmt.expected_shapes(OUT, IN)) <= set(fmt.tensor_suffixes)


@pytest.mark.parametrize("name", list(FORMATS))
def test_quantize_outputs_match_declared_shapes_and_packed_form(name):
    fmt = FORMATS[name]
    w = varied_weight(dtype=torch.bfloat16)
    t = fmt.quantize(w)
    check_tensors(f"m.{name}", fmt, t, OUT, IN)
    assert set(fmt.expected_shapes(OUT, IN)) <= set(t) <= set(fmt.tensor_suffixes)
    pw = fmt.packed(t)
    assert (pw.out_features, pw.in_features) == (OUT, IN)
    assert pw.nbytes == fmt.bytes_for(OUT, IN)
    ref = fmt.dequantize(t, OUT, IN, torch.float32)
    assert ref.shape == (OUT, IN)
    torch.testing.assert_close(pw.to("cpu").dequantize(torch.float32), ref.to(torch.bfloat16).float()
                               if name == "bf16" else ref, rtol=0, atol=0)


# -- round trips with the format's own error bound --------------------------------------------
def test_fp8_round_trips_within_half_an_e4m3_ulp():
    w = varied_weight()
    for fmt, params in ((FORMATS["fp8_tensor"], None), (FORMATS["fp8_tensor"], QuantParams(per_channel=True)),
                        (FORMATS["fp8_block"], None)):
        t = fmt.quantize(w, params)
        dq = fmt.dequantize(t, OUT, IN, torch.float32)
        scale = t.get("weight_scale", t.get("weight_scale_inv")).float()
        if scale.dim() == 2 and scale.shape[1] > 1:  # blocks
            scale = scale.repeat_interleave(128, 0)[:OUT].repeat_interleave(128, 1)[:, :IN]
        bound = w.abs() * 2.0**-4 + scale * 2.0**-9 * 1.01  # 3 mantissa bits; subnormal step 2^-9
        assert ((dq - w).abs() <= bound).all(), fmt.name
        assert (dq.abs().amax() - w.abs().amax()).abs() <= w.abs().amax() * 2**-4


@pytest.mark.parametrize("name", ["nvfp4", "nvfp4_ct"])
def test_nvfp4_round_trip_is_nearest_e2m1(name):
    fmt = FORMATS[name]
    w = varied_weight(seed=1)
    t = fmt.quantize(w)
    dq = fmt.dequantize(t, OUT, IN, torch.float32)
    g = t["weight_scale"].float()
    eff = g * (t["weight_scale_2"] if name == "nvfp4" else 1.0 / t["weight_global_scale"])
    x = (w / expand(eff, 16, IN)).clamp(-6, 6)
    grid = E2M1_VALUES[:8]
    nearest = grid[(x.abs()[..., None] - grid).abs().argmin(-1)] * x.sign()
    best = (nearest * expand(eff, 16, IN) - w).abs()
    assert ((dq - w).abs() <= best + 1e-6 * w.abs().amax()).all()
    assert ((dq - w).abs() <= expand(eff, 16, IN) * 1.0 + 1e-12).all()  # largest E2M1 gap is 2
    assert t["weight_scale"].float().amax() <= 448


@pytest.mark.parametrize("name,params", [("int4_awq", None), ("int4_ct", None),
                                         ("int4_ct", QuantParams(group_size=64, symmetric=False)),
                                         ("int4_ct", QuantParams(group_size=None))])
def test_int4_round_trip_within_half_a_step(name, params):
    fmt = FORMATS[name]
    w = varied_weight(seed=2)
    t = fmt.quantize(w, params)
    check_tensors("m", fmt, t, OUT, IN, params)
    dq = fmt.dequantize(t, OUT, IN, torch.float32, params)
    s = t["scales"].float().t() if name == "int4_awq" else t["weight_scale"].float()
    g = fmt.params(params).group_size or IN
    step = expand(s, g, IN)
    assert ((dq - w).abs() <= step * 0.5 * (1 + 1e-3) + 1e-7).all()
    assert (dq - w).abs().mean() < step.mean() * 0.3


# -- compressed-tensors as the independent implementation --------------------------------------
@pytest.mark.parametrize("symmetric,group", [(True, 128), (False, 128), (False, 32)])
def test_int4_ct_matches_compressed_tensors(symmetric, group):
    fmt, p = FORMATS["int4_ct"], QuantParams(group_size=group, symmetric=symmetric)
    scheme = ct_scheme(num_bits=4, type="int", strategy="group", group_size=group, symmetric=symmetric)
    w = varied_weight(out=40, inp=256, seed=3)  # 40 rows: zero points pack 5 words along out
    t = fmt.quantize(w, p)
    assert ("weight_zero_point" in t) == (not symmetric)
    # dequantization: CT's decompress of our tensors
    ref = PackedQuantizationCompressor.decompress(dict(t), scheme)["weight"]
    torch.testing.assert_close(fmt.dequantize(t, 40, 256, torch.float32, p), ref.float(), rtol=0, atol=0)
    # quantizer parameters: CT's calculate_qparams
    wg = w.view(40, -1, group)
    scale, zp = calculate_qparams(wg.amin(-1), wg.amax(-1), scheme.weights)
    torch.testing.assert_close(t["weight_scale"], scale.to(t["weight_scale"].dtype), rtol=0, atol=0)
    # rounding + packing (weights and zero points): CT's compress with the same qparams
    sd = {"weight": w, "weight_scale": t["weight_scale"]}
    if not symmetric:
        sd["weight_zero_point"] = zp.to(torch.int8)
    c = PackedQuantizationCompressor.compress(sd, scheme)
    assert torch.equal(c["weight_packed"], t["weight_packed"])
    assert torch.equal(c["weight_shape"], t["weight_shape"])
    if not symmetric:
        assert torch.equal(c["weight_zero_point"], t["weight_zero_point"])


def test_int4_ct_bf16_weights_match_compressed_tensors_qparams():
    w = varied_weight(seed=4, dtype=torch.bfloat16)
    t = FORMATS["int4_ct"].quantize(w)
    wg = torch.cat([w, w[:, -1:].expand(OUT, 64)], 1).view(OUT, -1, 128)  # IN=320 -> 3 groups
    scale, _ = calculate_qparams(wg.amin(-1), wg.amax(-1),
                                 ct_scheme(num_bits=4, type="int", strategy="group", group_size=128).weights)
    assert t["weight_scale"].dtype == torch.bfloat16
    torch.testing.assert_close(t["weight_scale"], scale, rtol=0, atol=0)


def test_nvfp4_ct_matches_compressed_tensors():
    fmt = FORMATS["nvfp4_ct"]
    scheme = ct_scheme(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True)
    w = varied_weight(seed=5)
    t = fmt.quantize(w)
    # global and group scales: CT's generate_gparam / calculate_qparams(global_scale=...)
    gs = generate_gparam(w.amin(), w.amax())
    assert torch.equal(gs, t["weight_global_scale"])
    wg = w.view(OUT, -1, 16)
    scheme.weights.scale_dtype = torch.float8_e4m3fn
    scale, _ = calculate_qparams(wg.amin(-1), wg.amax(-1), scheme.weights, global_scale=gs)
    assert torch.equal(scale.float(), t["weight_scale"].float())
    # E2M1 rounding (ties, signs) + nibble packing: CT's compress with the same scales
    c = NVFP4PackedCompressor.compress({"weight": w, "weight_scale": t["weight_scale"].float(),
                                        "weight_global_scale": gs}, scheme)
    assert torch.equal(c["weight_packed"], t["weight_packed"])
    # dequantization: CT's decompress (which computes in bf16)
    ref = NVFP4PackedCompressor.decompress(dict(t), scheme)["weight"]
    torch.testing.assert_close(fmt.dequantize(t, OUT, IN, torch.float32), ref.float(), rtol=2**-7, atol=1e-6)


def test_modelopt_nvfp4_is_compressed_tensors_layout_with_reciprocal_global():
    w = varied_weight(seed=6)
    mo = FORMATS["nvfp4"].quantize(w)
    as_ct = {"weight_packed": mo["weight"], "weight_scale": mo["weight_scale"],
             "weight_global_scale": (1.0 / mo["weight_scale_2"]).reshape(1)}
    scheme = ct_scheme(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True)
    ref = NVFP4PackedCompressor.decompress(as_ct, scheme)["weight"].float()
    ours = FORMATS["nvfp4"].dequantize(mo, OUT, IN, torch.float32)
    torch.testing.assert_close(ours, ref, rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(FORMATS["nvfp4_ct"].dequantize(as_ct, OUT, IN, torch.float32), ours)
    a, b = FORMATS["nvfp4"].packed(mo), FORMATS["nvfp4_ct"].packed(as_ct)
    assert torch.equal(a.packed, b.packed) and torch.equal(a.scale.float(), b.scale.float())
    torch.testing.assert_close(a.global_scale, b.global_scale)


def test_e2m1_ties_round_to_even_and_low_nibble_first():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.1, -0.75, 0.0, -6.0])
    codes = e2m1_encode(x)
    assert codes.tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 8, 10, 0, 15]
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
    vals = E2M1_VALUES[codes.long()].view(1, -1)
    packed = pack_fp4_to_uint8(vals)
    assert torch.equal(unpack_nibbles(packed).view(-1), codes)
    assert packed[0, 0].item() == codes[0].item() | (codes[1].item() << 4)
    assert torch.equal(unpack_fp4_from_uint8(packed, 1, 12, torch.float32), vals)


# -- AWQ nibble order on hand-built tensors ----------------------------------------------------
def autoawq_pack(intweight: torch.Tensor) -> torch.Tensor:
    """AutoAWQ WQLinear_GEMM.from_linear's packing loop, verbatim in structure."""
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    rows, cols = intweight.shape
    q = torch.zeros(rows, cols // 8, dtype=torch.int64)
    for col in range(cols // 8):
        for i in range(8):
            q[:, col] |= intweight[:, col * 8 + order_map[i]].long() << (i * 4)
    return torch.where(q >= 2**31, q - 2**32, q).to(torch.int32)


def test_awq_single_word_nibble_order():
    fmt = FORMATS["int4_awq"]
    t = {"qweight": torch.tensor([[0x76543210]], dtype=torch.int32),
         "qzeros": torch.zeros(1, 1, dtype=torch.int32), "scales": torch.ones(1, 8, dtype=torch.float16)}
    # nibble i holds column ORDER[i]: column c reads nibble REVERSE[c] (= value REVERSE[c] here)
    assert fmt.dequantize(t, 8, 1, torch.float32)[:, 0].tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert list(AWQ_REVERSE_ORDER) == [AWQ_ORDER.index(c) for c in range(8)]


def test_awq_nibble_bytes_match_the_nibble_by_nibble_form():
    from moeferry.checkpoint.formats.fp4 import pack_nibbles
    from moeferry.checkpoint.formats.int4 import awq_nibble_bytes, unpack_int32
    words = torch.randint(-2**31, 2**31, (96, 5), generator=torch.Generator().manual_seed(3), dtype=torch.int64)
    words = words.to(torch.int32)  # every bit pattern, the sign bit included
    assert torch.equal(awq_nibble_bytes(words), pack_nibbles(unpack_int32(words, AWQ_ORDER).t()))


def test_awq_repack_in_c_gives_the_same_bytes(monkeypatch):
    """The loader's AWQ repack (`awq_device_bytes`: the C form where a compiler built it) gives
    `awq_nibble_bytes`' bytes: tiles of 16 words and 64 input pairs, whole and partial, a
    single row pair, and without the C form (PyTorch)."""
    import os
    import shutil

    from moeferry.checkpoint.formats import int4
    if shutil.which(os.environ.get("CC", "cc")) is not None:
        assert int4._repacker() is not None, "the C repack did not build"
    gen = torch.Generator().manual_seed(4)
    for rows, words in ((2048, 96), (130, 33), (2, 1), (256, 16)):
        q = torch.randint(-2**31, 2**31, (rows, words), generator=gen, dtype=torch.int64).to(torch.int32)
        assert torch.equal(int4.awq_device_bytes(q), int4.awq_nibble_bytes(q)), (rows, words)
        assert torch.equal(int4.awq_device_bytes(q.t().contiguous().t()), int4.awq_nibble_bytes(q)), "strided"
    monkeypatch.setattr(int4, "_repacker", lambda: None)
    assert torch.equal(int4.awq_device_bytes(q), int4.awq_nibble_bytes(q))


def test_int4_ct_device_bytes_are_the_stored_words_bytes():
    """int4_ct's packed form takes the stored words' bytes as they are; the same bytes as
    packing the unpacked nibbles, for in_features a multiple of 8 and not (padded words)."""
    from moeferry.checkpoint.formats.fp4 import pack_nibbles
    from moeferry.checkpoint.formats.int4 import unpack_int32
    fmt = FORMATS["int4_ct"]
    for inp in (64, 44):
        p = QuantParams(group_size=4 if inp == 44 else 32, symmetric=False)
        t = fmt.quantize(varied_weight(out=24, inp=inp, seed=inp), p)
        got = fmt.packed(t, p)
        assert torch.equal(got.packed, pack_nibbles(unpack_int32(t["weight_packed"])[:, :inp]))
        torch.testing.assert_close(got.dequantize(torch.float32), fmt.dequantize(t, 24, inp, torch.float32, p))


def test_awq_dequant_matches_formula_on_known_ints():
    fmt = FORMATS["int4_awq"]
    g, inp, out = 64, 160, 24  # partial last group
    gen = torch.Generator().manual_seed(7)
    q = torch.randint(0, 16, (inp, out), generator=gen)
    z = torch.randint(0, 16, (3, out), generator=gen)
    s = (torch.rand(3, out, generator=gen) + 0.1).to(torch.float16)
    t = {"qweight": autoawq_pack(q), "qzeros": autoawq_pack(z), "scales": s}
    assert torch.equal(t["qweight"], pack_int32(q, AWQ_ORDER))
    p = QuantParams(group_size=g, symmetric=False)
    check_tensors("m", fmt, t, out, inp, p)
    dq = fmt.dequantize(t, out, inp, torch.float32, p)
    for o in range(out):
        for i in range(0, inp, 7):
            assert dq[o, i].item() == (q[i, o] - z[i // g, o]).item() * s[i // g, o].float().item()
    torch.testing.assert_close(fmt.packed(t, p).dequantize(torch.float32), dq, rtol=0, atol=0)
    # our quantizer packs in the same order
    w = varied_weight(out=out, inp=inp, seed=8)
    tq = fmt.quantize(w, p)
    assert fmt.dequantize(tq, out, inp, torch.float32, p).sub(w).abs().max() <= tq["scales"].float().max() / 2 + 1e-6


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_stacked_rows_dequantize_to_the_parts_rows(name):
    """`PackedWeight.stack_rows`: projections quantized apart (their own scales, global scales,
    zero points) stacked into one weight dequantize to the parts' rows in order, exactly."""
    fmt = FORMATS[name]
    p = QuantParams(block_size=(16, 32)) if name == "fp8_block" else None
    parts = [fmt.packed(fmt.quantize(varied_weight(out=n, inp=64, seed=n) * (1 + n), p), p) for n in (32, 16, 48)]
    stacked = type(parts[0]).stack_rows(parts)
    assert stacked is not None and stacked.out_features == 96 and stacked.in_features == 64
    want = torch.cat([w.dequantize(torch.float32) for w in parts])
    assert torch.equal(stacked.dequantize(torch.float32), want)


def test_stack_rows_refuses_what_cannot_share_a_weight():
    int4 = FORMATS["int4_awq"]
    g32, g64 = QuantParams(group_size=32, symmetric=False), QuantParams(group_size=64, symmetric=False)
    a = int4.packed(int4.quantize(varied_weight(out=16, inp=128, seed=1), g32), g32)
    b = int4.packed(int4.quantize(varied_weight(out=16, inp=128, seed=2), g64), g64)
    assert type(a).stack_rows([a, b]) is None  # other group size
    fp8 = FORMATS["fp8_tensor"]
    c = fp8.packed(fp8.quantize(varied_weight(out=16, inp=128, seed=3)))
    d = fp8.packed(fp8.quantize(varied_weight(out=16, inp=64, seed=4)))
    assert type(c).stack_rows([c, d]) is None  # other input size
    assert type(c).stack_rows([c, a]) is None  # other class
    blk = FORMATS["fp8_block"]
    pb = QuantParams(block_size=(16, 32))
    e = blk.packed(blk.quantize(varied_weight(out=24, inp=64, seed=5), pb), pb)  # 24 rows: half a block left
    f = blk.packed(blk.quantize(varied_weight(out=16, inp=64, seed=6), pb), pb)
    assert type(e).stack_rows([e, f]) is None and type(e).stack_rows([f, e]) is not None


# -- FP8 scales on hand-built tensors ----------------------------------------------------------
def test_fp8_block_scales_apply_per_128x128_block():
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
    out, inp = 200, 300
    gen = torch.Generator().manual_seed(9)
    vals = torch.tensor([0.0, 1.0, -2.0, 0.5, 3.0, -448.0, 0.015625, 6.5])  # exact in e4m3
    w8 = vals[torch.randint(0, len(vals), (out, inp), generator=gen)].to(torch.float8_e4m3fn)
    scale = torch.tensor([[1.0, 2.0, 4.0], [0.5, 0.25, 8.0]])
    t = {"weight": w8, "weight_scale_inv": scale}
    check_tensors("m", "fp8_block", t, out, inp)
    dq = FORMATS["fp8_block"].dequantize(t, out, inp, torch.float32)
    rows, cols = torch.meshgrid(torch.arange(out), torch.arange(inp), indexing="ij")
    assert torch.equal(dq, w8.float() * scale[rows // 128, cols // 128])
    assert dq[127, 127] == w8[127, 127].float() and dq[128, 256] == w8[128, 256].float() * 8
    assert torch.equal(dq, _dequantize_fp8_weight(w8, scale, [128, 128], torch.float32))


def test_fp8_tensor_scalar_and_per_row_scales():
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
    w8 = torch.tensor([[1.0, -2.0], [0.5, 4.0], [3.0, 0.0]]).to(torch.float8_e4m3fn)
    fmt = FORMATS["fp8_tensor"]
    for scale in (torch.tensor(0.5), torch.tensor([0.5]), torch.tensor([1.0, 2.0, 3.0]),
                  torch.tensor([[1.0], [2.0], [3.0]])):
        t = {"weight": w8, "weight_scale": scale, "input_scale": torch.tensor(1.0)}
        check_tensors("m", fmt, t, 3, 2)
        want = w8.float() * scale.reshape(-1, 1) if scale.numel() > 1 else w8.float() * scale
        assert torch.equal(fmt.dequantize(t, 3, 2, torch.float32), want)
    hf = {"weight": w8, "weight_scale_inv": torch.tensor(0.25)}  # transformers' per-tensor naming
    check_tensors("m", fmt, hf, 3, 2)
    assert torch.equal(fmt.dequantize(hf, 3, 2, torch.float32),
                       _dequantize_fp8_weight(w8, torch.tensor(0.25), None, torch.float32))


# -- detection ---------------------------------------------------------------------------------
NAMES = ["model.layers.0.self_attn.q_proj", "model.layers.0.linear_attn.in_proj_qkv",
         "model.layers.0.linear_attn.in_proj_a", "model.layers.0.mlp.gate",
         "model.layers.0.mlp.shared_expert_gate", "model.layers.0.mlp.shared_expert.down_proj",
         "model.layers.0.mlp.experts.7.gate_proj", "model.layers.1.mlp.experts.0.down_proj",
         "model.layers.0.input_layernorm", "model.embed_tokens", "lm_head", "model.visual.blocks.0.attn.qkv"]


def formats_of(scheme, names=NAMES):
    return {n: scheme.format_for(n) for n in names}


def test_no_quantization_config_is_bf16_everywhere():
    s = detect_scheme({"model_type": "qwen3_moe"}, None)
    assert s.method == "none" and set(formats_of(s).values()) == {"bf16"}


def test_fp8_block_and_tensor_detection_with_exclusions():
    cfg = {"quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                   "weight_block_size": [128, 128],
                                   "modules_to_not_convert": ["model.layers.0.self_attn", "linear_attn.in_proj_a"]}}
    f = formats_of(detect_scheme(cfg))
    assert f["model.layers.0.self_attn.q_proj"] == "bf16" and f["model.layers.0.linear_attn.in_proj_a"] == "bf16"
    assert f["model.layers.0.mlp.experts.7.gate_proj"] == "fp8_block"
    assert f["model.layers.0.linear_attn.in_proj_qkv"] == "fp8_block"
    assert f["model.layers.0.mlp.gate"] == f["lm_head"] == f["model.embed_tokens"] == "bf16"
    assert detect_scheme(cfg).params_for("model.layers.1.mlp.experts.0.down_proj").block_size == (128, 128)
    per_tensor = {"quantization_config": {"quant_method": "fp8", "activation_scheme": "static",
                                          "ignored_layers": ["model.layers.1.mlp.experts"]}}
    f = formats_of(detect_scheme(per_tensor))
    assert f["model.layers.0.mlp.experts.7.gate_proj"] == "fp8_tensor"
    assert f["model.layers.1.mlp.experts.0.down_proj"] == "bf16"
    # nested under text_config (multimodal configs)
    assert detect_scheme({"text_config": per_tensor}).format_for("model.layers.0.self_attn.q_proj") == "fp8_tensor"


def test_hf_exclusion_matching_agrees_with_transformers():
    from transformers.quantizers.quantizers_utils import should_convert_module
    patterns = ["model.layers.0.self_attn", "mlp.gate", "layers.1", "model.layers.1", "lm_head",
                r"model\.layers\.\d+\.mlp\.experts", "shared_expert_gate", "gate_proj"]
    for p in patterns:
        s = detect_scheme({"quantization_config": {"quant_method": "fp8", "modules_to_not_convert": [p]}})
        for n in NAMES[:8]:
            if never_quantized(n):
                continue
            assert (s.format_for(n) == "bf16") == (not should_convert_module(n, [p])), (p, n)


MODELOPT_EXCLUDE = ["lm_head", "*mlp.gate", "*shared_expert_gate", "*visual*", "model.layers.1.mlp.experts"]


def test_modelopt_nvfp4_from_hf_quant_config_and_from_config_json():
    hq = {"producer": {"name": "modelopt", "version": "0.37.0"},
          "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8", "group_size": 16,
                           "exclude_modules": MODELOPT_EXCLUDE}}
    from_hq = detect_scheme({}, hq)
    from_cfg = detect_scheme({"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4",
                                                      "ignore": MODELOPT_EXCLUDE, "producer": hq["producer"]}})
    for s in (from_hq, from_cfg):
        f = formats_of(s)
        assert f["model.layers.0.mlp.experts.7.gate_proj"] == f["model.layers.0.self_attn.q_proj"] == "nvfp4"
        assert f["model.layers.1.mlp.experts.0.down_proj"] == "bf16"  # parent-module exclusion
        for n in ("model.layers.0.mlp.gate", "model.layers.0.mlp.shared_expert_gate", "lm_head",
                  "model.visual.blocks.0.attn.qkv", "model.layers.0.input_layernorm"):
            assert f[n] == "bf16", n
    assert from_hq.kv_cache == "FP8"
    with pytest.raises(UnsupportedQuantization, match="W4A8_AWQ"):
        detect_scheme({}, {"quantization": {"quant_algo": "W4A8_AWQ"}})


def test_modelopt_mixed_precision_per_layer_choices_and_excludes():
    hq = {"producer": {"name": "modelopt", "version": "0.37.0"},
          "quantization": {
              "quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None,
              "exclude_modules": ["*mlp.gate", "*visual*", "model.language_model.layers.1.mlp.experts"],
              "quantized_layers": {
                  "model.language_model.layers.0.self_attn.q_proj": {"quant_algo": "FP8"},
                  "model.language_model.layers.0.mlp.shared_expert": {"quant_algo": "FP8"},
                  "model.language_model.layers.0.mlp.experts": {"quant_algo": "W4A16_NVFP4", "group_size": 16},
                  "model.language_model.layers.1.mlp.experts": {"quant_algo": "NVFP4", "group_size": 16},
                  "model.language_model.layers.0.mlp.gate": {"quant_algo": "FP8"},
                  "lm_head": {"quant_algo": "W4A16_NVFP4", "group_size": 16}}}}
    s = detect_scheme({"quantization_config": {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"}}, hq)
    # the reader's canonical names (model.layers...) match the config's multimodal spelling
    assert s.format_for("model.layers.0.self_attn.q_proj") == "fp8_tensor"
    assert s.format_for("model.language_model.layers.0.self_attn.q_proj") == "fp8_tensor"
    assert s.format_for("model.layers.0.mlp.experts.7.gate_proj") == "nvfp4"
    assert s.format_for("model.layers.0.mlp.shared_expert.down_proj") == "fp8_tensor"
    assert s.format_for("model.layers.0.self_attn.k_proj") == "bf16"  # not listed
    assert s.format_for("model.layers.1.mlp.experts.0.down_proj") == "bf16"  # excluded wins
    assert s.format_for("model.layers.0.mlp.gate") == "bf16"  # exclude glob beats the listing
    assert s.format_for("lm_head") == s.format_for("model.language_model.lm_head") == "nvfp4"
    assert s.params_for("lm_head").group_size == 16
    # config.json alone (ModelOpt's converted form), with and without quantized_layers
    qc, _ = synthetic_quant_config("mixed_nvfp4", NAMES)
    for cfg in (qc, {k: v for k, v in qc.items() if k != "quantized_layers"}):
        c = formats_of(detect_scheme({"quantization_config": cfg}))
        assert c["model.layers.0.mlp.experts.7.gate_proj"] == c["lm_head"] == "nvfp4"
        assert c["model.layers.0.self_attn.q_proj"] == "fp8_tensor" and c["model.layers.0.mlp.gate"] == "bf16"
    with pytest.raises(UnsupportedQuantization, match="W8A8_SQ_PER_CHANNEL"):
        detect_scheme({}, {"quantization": {"quant_algo": "MIXED_PRECISION",
                                            "quantized_layers": {"x": {"quant_algo": "W8A8_SQ_PER_CHANNEL"}}}})


def test_rule_index_finds_the_scans_first_match():
    """QuantScheme.layer_for through RuleIndex (dicts for runs of exact / prefix rules, one
    regular expression for a run of globs) against the plain first-match scan, over random rule
    lists drawn from the names looked up (every kind, the same name twice, nested prefixes, runs
    split by other kinds, both spellings; globs with one or several stars, a `?`, or none: a module
    name, which matches itself and what lies inside it)."""
    import random

    from moeferry.checkpoint.formats.detect import LayerQuant, QuantScheme, Rule, name_aliases
    rng = random.Random(0)
    pool = ["model.layers.0.mlp.experts.7.gate_proj", "model.layers.0.mlp.experts.7.down_proj",
            "model.layers.1.self_attn.q_proj", "model.layers.0.mlp.gate", "lm_head", "model.layers.1.mlp.experts.3.up_proj"]

    def pattern(kind: str) -> str:
        n = rng.choice(name_aliases(rng.choice(pool)))
        dots = [i for i, c in enumerate(n) if c == "."]
        if kind == "prefix":
            return n[:rng.choice(dots)] if dots else n
        if kind == "glob":
            leaf = n.rsplit(".", 1)[-1]
            return rng.choice(["*" + leaf, "*layers*" + leaf, n[:rng.choice(dots)] if dots else n,
                               n[:-1] + "?", "model.*.mlp.*"])
        return {"never": "", "ct": "re:.*experts"}.get(kind, n)

    for trial in range(600):
        kinds = rng.choices(["exact", "prefix", "glob", "never", "ct"], weights=[4, 4, 3, 1, 1], k=rng.randint(0, 12))
        rules = [Rule(k, pattern(k), LayerQuant(f"f{i}")) for i, k in enumerate(kinds)]
        scheme = QuantScheme("modelopt", tuple(rules))
        for n in pool + ["model.language_model.layers.0.mlp.experts.7.gate_proj"]:
            scan = next((r.layer for r in rules if any(r.matches(a) for a in name_aliases(n))), scheme.default)
            assert scheme.layer_for(n) == scan, (trial, n, rules)


def test_awq_detection():
    cfg = {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
                                   "version": "gemm", "modules_to_not_convert": ["model.visual", "in_proj_a"]}}
    s = detect_scheme(cfg)
    f = formats_of(s)
    assert f["model.layers.0.mlp.experts.7.gate_proj"] == f["model.layers.0.self_attn.q_proj"] == "int4_awq"
    assert f["model.layers.0.linear_attn.in_proj_a"] == f["lm_head"] == f["model.layers.0.mlp.gate"] == "bf16"
    assert s.params_for("model.layers.0.self_attn.q_proj") == QuantParams(group_size=64, symmetric=False)
    with pytest.raises(UnsupportedQuantization, match="gemv"):
        detect_scheme({"quantization_config": {**cfg["quantization_config"], "version": "gemv"}})


def test_compressed_tensors_detection_priority_matches_the_package():
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import is_match, match_targets
    int4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": False}
    fp4 = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True}
    qc = {"quant_method": "compressed-tensors", "format": "mixed-precision", "quantization_status": "compressed",
          "config_groups": {
              "group_0": {"targets": ["Linear"], "weights": int4, "format": "pack-quantized"},
              "group_1": {"targets": [r"re:.*mlp\.experts\.\d+\..*_proj$"], "weights": fp4,
                          "format": "nvfp4-pack-quantized"},
              "group_2": {"targets": ["model.layers.1.mlp.experts.0.down_proj"], "weights": int4,
                          "format": "pack-quantized"}},
          "ignore": ["lm_head", "re:.*mlp.gate$", "re:.*visual.*", "model.layers.0.self_attn.q_proj"]}
    QuantizationConfig.model_validate(qc)  # a config the package itself accepts
    s = detect_scheme({"quantization_config": qc})
    f = formats_of(s)
    assert f["model.layers.0.mlp.experts.7.gate_proj"] == "nvfp4_ct"
    assert f["model.layers.1.mlp.experts.0.down_proj"] == "int4_ct"  # exact beats regex
    assert f["model.layers.0.linear_attn.in_proj_qkv"] == "int4_ct"
    assert s.params_for("model.layers.0.linear_attn.in_proj_qkv") == QuantParams(group_size=128, symmetric=False)
    # the same choices compressed-tensors makes for an nn.Linear of each name
    by_target = {t: g for g in qc["config_groups"].values() for t in g["targets"]}
    lin = torch.nn.Linear(2, 2)
    for n in NAMES[:8] + ["lm_head", "model.visual.blocks.0.attn.qkv"]:
        want = "bf16"
        if is_match(n, lin, list(by_target), qc["ignore"]):
            grp = by_target[match_targets(n, lin, list(by_target))[0]]
            want = "nvfp4_ct" if grp["format"].startswith("nvfp4") else "int4_ct"
        if n.endswith("shared_expert_gate"):
            want = "bf16"  # routers are never quantized by a class target
        assert f[n] == want, n


def test_compressed_tensors_fp8_and_unsupported_variants():
    fp8 = {"quant_method": "compressed-tensors", "format": "float-quantized",
           "config_groups": {"g": {"targets": ["Linear"],
                                   "weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}},
           "ignore": ["lm_head"]}
    s = detect_scheme({"quantization_config": fp8})
    assert s.format_for("model.layers.0.self_attn.q_proj") == "fp8_tensor"
    assert s.params_for("model.layers.0.self_attn.q_proj").per_channel
    int8 = {"quant_method": "compressed-tensors", "format": "int-quantized",
            "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "int"}}}}
    with pytest.raises(UnsupportedQuantization, match="num_bits=8"):
        detect_scheme({"quantization_config": int8})


def test_unknown_quant_method_names_it_and_the_supported_ones():
    with pytest.raises(UnsupportedQuantization) as e:
        detect_scheme({"quantization_config": {"quant_method": "gptq", "bits": 4}})
    msg = str(e.value)
    assert "gptq" in msg and all(m in msg for m in ("awq", "compressed-tensors", "fp8", "modelopt"))


# -- tensor checks -----------------------------------------------------------------------------
def test_check_tensors_names_module_format_and_tensor():
    mod = "model.layers.3.mlp.experts.7.gate_proj"
    t = FORMATS["nvfp4"].quantize(varied_weight(64, 256))
    del t["weight_scale_2"]
    with pytest.raises(QuantTensorError) as e:
        check_tensors(mod, "nvfp4", t, 64, 256)
    msg = str(e.value)
    assert mod in msg and "nvfp4" in msg and f"{mod}.weight_scale_2" in msg and "\n" not in msg
    t = FORMATS["fp8_block"].quantize(varied_weight(64, 256))
    t["weight_scale_inv"] = t["weight_scale_inv"][:, :1]
    with pytest.raises(QuantTensorError, match=r"weight_scale_inv has shape \[1, 1\], expected \[1, 2\]"):
        check_tensors(mod, "fp8_block", t, 64, 256)
    t = FORMATS["int4_ct"].quantize(varied_weight(64, 256), QuantParams(group_size=128, symmetric=False))
    del t["weight_zero_point"]
    with pytest.raises(QuantTensorError, match="weight_zero_point"):
        check_tensors(mod, "int4_ct", t, 64, 256, QuantParams(group_size=128, symmetric=False))
    t = FORMATS["int4_awq"].quantize(varied_weight(64, 256))
    t["qweight"] = t["qweight"].to(torch.int64)
    with pytest.raises(QuantTensorError, match="qweight has dtype torch.int64, expected int32"):
        check_tensors(mod, "int4_awq", t, 64, 256)


# -- synthetic presets -------------------------------------------------------------------------
@pytest.mark.parametrize("preset", PRESETS)
def test_presets_write_what_their_config_declares(preset):
    names = NAMES[:8] + ["lm_head"]
    qc, hq = synthetic_quant_config(preset, names)
    if qc.get("quant_method") == "compressed-tensors":
        from compressed_tensors.quantization import QuantizationConfig
        QuantizationConfig.model_validate(qc)
    scheme = detect_scheme({"quantization_config": qc}, hq)
    for n in names:
        fmt = FORMATS[scheme.format_for(n)]
        w = varied_weight(64, 256, seed=len(n))
        t = quantize_module(preset, n, w)
        local = {k[len(n) + 1:]: v for k, v in t.items()}
        assert all(k.startswith(n + ".") for k in t)
        assert set(fmt.expected_shapes(64, 256)) <= set(local) <= set(fmt.tensor_suffixes), (n, list(local))
        check_tensors(n, fmt, local, 64, 256, scheme.params_for(n))
        err = (fmt.dequantize(local, 64, 256, torch.float32, scheme.params_for(n)) - w).norm() / w.norm()
        assert err < 0.2, (n, fmt.name)
    f = formats_of(scheme, names)
    assert f["model.layers.0.mlp.gate"] == f["model.layers.0.mlp.shared_expert_gate"] == "bf16"
    if preset == "mixed_nvfp4":
        assert f["model.layers.0.mlp.experts.7.gate_proj"] == f["lm_head"] == "nvfp4"
        assert f["model.layers.0.self_attn.q_proj"] == "fp8_tensor"
        assert f["model.layers.0.mlp.shared_expert.down_proj"] == "nvfp4"  # as in the NVIDIA release
        assert f["model.layers.0.linear_attn.in_proj_qkv"] == "fp8_tensor"
        assert f["model.layers.0.linear_attn.in_proj_a"] == "bf16"
        assert "model.layers.0.mlp.experts" in hq["quantization"]["quantized_layers"]
        assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "MIXED_PRECISION"
    else:
        assert f["model.layers.0.mlp.experts.7.gate_proj"] == preset
        assert f["lm_head"] == "bf16"


def test_mixed_preset_config_needs_module_names():
    with pytest.raises(ValueError, match="module_names"):
        synthetic_quant_config("mixed_nvfp4")
    assert quantize_module("mixed_nvfp4", "model.layers.0.input_layernorm", torch.ones(8)).keys() == {
        "model.layers.0.input_layernorm.weight"}


def test_fp8_block_accepts_bf16_scale_inv():
    """Qwen's FP8 releases store weight_scale_inv in bf16."""
    fmt = FORMATS["fp8_block"]
    w = torch.randn(256, 384)
    t = fmt.quantize(w)
    t["weight_scale_inv"] = t["weight_scale_inv"].to(torch.bfloat16)
    check_tensors("model.layers.0.self_attn.q_proj", fmt, t, 256, 384)
    deq = fmt.dequantize(t, 256, 384, dtype=torch.float32)
    assert ((deq - w).abs().max() / w.abs().max()) < 0.1
