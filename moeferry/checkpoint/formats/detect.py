"""Which format each module of a checkpoint is stored in, from config.json / hf_quant_config.json.

`detect_scheme(config, hf_quant_config)` reads the producer's own description once and
returns a frozen `QuantScheme`: an ordered rule list (first match wins) and a default.
Module names are full HF names (`model.layers.3.mlp.experts.7.gate_proj`, `lm_head`);
the multimodal wrapper spellings (`model.language_model.layers...`,
`language_model.model.layers...`, `model.language_model.lm_head`) are treated as the same
module, so a config written against either spelling matches the reader's canonical names.

Routers (`mlp.gate`, `shared_expert_gate`, `router`), norms, embeddings and `conv1d` are
never quantized unless the config names them explicitly (a ModelOpt `quantized_layers`
entry, a compressed-tensors exact or `re:` target).
"""
from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

from .base import QuantParams, UnsupportedQuantization

SUPPORTED_METHODS = ("awq", "compressed-tensors", "fp8", "modelopt")


@dataclass(frozen=True)
class LayerQuant:
    format: str
    params: QuantParams = field(default_factory=QuantParams)


BF16 = LayerQuant("bf16")


# -- names ----------------------------------------------------------------------------------
_WRAPPERS = ("model.language_model.", "language_model.model.")


def canonical_module(name: str) -> str:
    """`model.language_model.X` / `language_model.model.X` -> `model.X`; any lm_head -> `lm_head`."""
    if name in ("model.language_model.lm_head", "language_model.lm_head", "model.lm_head"):
        return "lm_head"
    for w in _WRAPPERS:
        if name.startswith(w):
            return "model." + name[len(w):]
    return name


def name_aliases(name: str) -> tuple[str, ...]:
    """The spellings one module goes by: as given, canonical (`model.`...), multimodal."""
    canon = canonical_module(name)
    out = [name, canon]
    if canon.startswith("model."):
        out.append("model.language_model." + canon[len("model."):])
    if canon == "lm_head":
        out.append("model.language_model.lm_head")
    return tuple(dict.fromkeys(out))


def never_quantized(name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return (leaf in ("gate", "shared_expert_gate", "router", "embed_tokens", "conv1d")
            or "norm" in leaf or "embed" in leaf)


def _hf_match(name: str, key: str) -> bool:
    """transformers' should_convert_module: prefix up to a module boundary, a regex with
    the same boundary, or a plain suffix."""
    try:
        if re.match(rf"(?:{key})(?:(?<=\.)|(?=\.|$))", name):
            return True
    except re.error:
        if name == key or name.startswith(key + "."):
            return True
    return name.endswith(key)


def _glob_match(name: str, pattern: str) -> bool:
    """ModelOpt exclude_modules: a glob, or an exact module name / parent module prefix."""
    return fnmatch.fnmatchcase(name, pattern) or name == pattern or name.startswith(pattern + ".")


def _ct_match(name: str, target: str) -> bool:
    """compressed-tensors match_name: `re:` -> re.match (anchored at the start), else equality."""
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


@dataclass(frozen=True)
class Rule:
    """kind: exact | prefix | glob | hf | ct | never | linear. A match resolves to `layer`."""

    kind: str
    pattern: str
    layer: LayerQuant

    def matches(self, name: str) -> bool:
        k, p = self.kind, self.pattern
        if k == "linear":
            return True
        if k == "never":
            return never_quantized(name)
        if k == "exact":
            return name == p
        if k == "prefix":
            return name.startswith(p + ".")
        if k == "glob":
            return _glob_match(name, p)
        if k == "hf":
            return _hf_match(name, p)
        if k == "ct":
            return _ct_match(name, p)
        raise ValueError(f"unknown rule kind {k!r}")


_INDEXED = ("exact", "prefix")


def _prefixes(name: str) -> list[str]:
    """`name` up to each of its dots (`a.b.c` -> `a`, `a.b`): the modules it lies inside."""
    out, i = [], name.find(".")
    while i != -1:
        out.append(name[:i])
        i = name.find(".", i + 1)
    return out


class _GlobRun:
    """Consecutive `glob` rules as one regular expression (an alternative each, in order): a
    name's first matching rule is the alternative that matches it, in one `re.match`."""

    def __init__(self, rules: list[Rule]):
        self.rules = rules
        self.regex = re.compile("|".join(  # `_glob_match`: the glob, the name itself, or a module inside it
            f"(?P<r{i}>{fnmatch.translate(r.pattern)}|{re.escape(r.pattern)}(?s:\\..*)?\\Z)"
            for i, r in enumerate(rules)))

    def first(self, names: tuple[str, ...]) -> Rule | None:
        found = None
        for n in names:
            m = self.regex.match(n)
            if m is not None:
                i = next(i for i in range(len(self.rules)) if m.group(f"r{i}") is not None)
                found = i if found is None else min(found, i)
        return None if found is None else self.rules[found]


class RuleIndex:
    """Rules in their order, each run of `exact` or `prefix` rules held in a dict and each run
    of `glob` rules in one regular expression: the first match is the same as a scan's, found in
    a few lookups. A full-depth ModelOpt config makes ~580 rules; scanning them for each of a
    layer's 768 expert tensors cost up to 0.9 s a layer."""

    def __init__(self, rules: tuple[Rule, ...]):
        self.segments: list[Rule | _GlobRun | tuple[str, dict[str, tuple[int, Rule]]]] = []
        globs: list[Rule] = []
        for i, rule in enumerate(rules):
            if rule.kind == "glob":
                globs.append(rule)
                continue
            if globs:
                self.segments.append(_GlobRun(globs))
                globs = []
            last = self.segments[-1] if self.segments else None
            if rule.kind not in _INDEXED:
                self.segments.append(rule)
                continue
            if not (isinstance(last, tuple) and last[0] == rule.kind):
                last = (rule.kind, {})
                self.segments.append(last)
            last[1].setdefault(rule.pattern, (i, rule))  # an earlier rule for the same name wins
        if globs:
            self.segments.append(_GlobRun(globs))

    def first(self, names: tuple[str, ...]) -> Rule | None:
        for seg in self.segments:
            if isinstance(seg, Rule):
                if any(seg.matches(n) for n in names):
                    return seg
                continue
            if isinstance(seg, _GlobRun):
                found = seg.first(names)
                if found is not None:
                    return found
                continue
            kind, table = seg
            keys = names if kind == "exact" else [k for n in names for k in _prefixes(n)]
            hits = [table[k] for k in keys if k in table]
            if hits:
                return min(hits, key=lambda h: h[0])[1]
        return None


@dataclass(frozen=True)
class QuantScheme:
    """The resolved quantization of a checkpoint. `method`: none | fp8 | modelopt | awq |
    compressed-tensors. `kv_cache`: the producer's KV-cache quantization, informational."""

    method: str
    rules: tuple[Rule, ...] = ()
    default: LayerQuant = BF16
    kv_cache: str | None = None
    index: RuleIndex = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "index", RuleIndex(self.rules))

    def layer_for(self, module_name: str) -> LayerQuant:
        rule = self.index.first(name_aliases(module_name))
        return self.default if rule is None else rule.layer

    def format_for(self, module_name: str) -> str:
        return self.layer_for(module_name).format

    def params_for(self, module_name: str) -> QuantParams:
        return self.layer_for(module_name).params

    @property
    def formats(self) -> frozenset[str]:
        return frozenset([self.default.format] + [r.layer.format for r in self.rules])


NO_QUANT = QuantScheme("none")


# -- entry point ----------------------------------------------------------------------------
def detect_scheme(config: dict, hf_quant_config: dict | None = None) -> QuantScheme:
    qc = config.get("quantization_config")
    if qc is None:
        qc = (config.get("text_config") or {}).get("quantization_config")
    hq = (hf_quant_config or {}).get("quantization") if hf_quant_config else None
    if qc is None:
        return _modelopt(hq) if hq is not None else NO_QUANT
    method = str(qc.get("quant_method") or ("modelopt" if "quant_algo" in qc else "")).lower()
    if method == "fp8":
        return _fp8(qc)
    if method == "modelopt":
        return _modelopt(hq if hq is not None else _modelopt_from_config(qc))
    if method == "awq":
        return _awq(qc)
    if method == "compressed-tensors":
        return _compressed_tensors(qc)
    raise UnsupportedQuantization(
        f"unsupported quantization: quant_method {method or None!r}; "
        f"moeferry supports {', '.join(SUPPORTED_METHODS)} (or an unquantized checkpoint)")


def _excluded(kind: str, patterns: Iterable[str] | None) -> list[Rule]:
    return [Rule(kind, p, BF16) for p in (patterns or [])]


_NEVER = Rule("never", "", BF16)
_NO_LM_HEAD = Rule("exact", "lm_head", BF16)


# -- HF fine-grained fp8 --------------------------------------------------------------------
def _fp8(qc: dict) -> QuantScheme:
    if str(qc.get("scale_fmt", "float")) != "float":
        raise UnsupportedQuantization(f"fp8 scale_fmt {qc['scale_fmt']!r} is not supported (only float)")
    block = qc.get("weight_block_size")
    if block:
        if len(block) != 2:
            raise UnsupportedQuantization(f"fp8 weight_block_size {block!r} must have two entries")
        layer = LayerQuant("fp8_block", QuantParams(block_size=(int(block[0]), int(block[1]))))
    else:
        layer = LayerQuant("fp8_tensor")
    skip = qc.get("modules_to_not_convert") or qc.get("ignored_layers")
    return QuantScheme("fp8", tuple(_excluded("hf", skip) + [_NEVER, _NO_LM_HEAD]), layer)


# -- NVIDIA ModelOpt ------------------------------------------------------------------------
def _modelopt_algo(algo: str | None, group_size: Any = None) -> LayerQuant:
    a = str(algo).upper()
    if a == "FP8":
        return LayerQuant("fp8_tensor")
    if a == "FP8_PER_CHANNEL_PER_TOKEN":
        return LayerQuant("fp8_tensor", QuantParams(per_channel=True))
    if a in ("NVFP4", "W4A16_NVFP4"):
        if group_size not in (None, 16):
            raise UnsupportedQuantization(f"modelopt {a} with group_size {group_size} (only 16)")
        return LayerQuant("nvfp4", QuantParams(group_size=16))
    raise UnsupportedQuantization(
        f"modelopt quant_algo {algo!r} is not supported; supported: FP8, NVFP4, W4A16_NVFP4, "
        "FP8_PER_CHANNEL_PER_TOKEN, MIXED_PRECISION of those")


def _modelopt_from_config(qc: dict) -> dict:
    """config.json's modelopt quantization_config (ModelOpt's converted form) -> hf_quant_config keys."""
    group_size = None
    for grp in (qc.get("config_groups") or {}).values():
        group_size = group_size or (grp.get("weights") or {}).get("group_size")
    layers = qc.get("quantized_layers")
    if layers is None and str(qc.get("quant_algo")).upper() == "MIXED_PRECISION":
        layers = {}  # older exports: per-layer choices only as config_groups targets
        for grp in (qc.get("config_groups") or {}).values():
            w = grp.get("weights") or {}
            bits, typ = w.get("num_bits"), w.get("type")
            algo = "FP8" if bits == 8 else "NVFP4" if typ == "float" else f"{typ}{bits}"
            layers.update({t: {"quant_algo": algo, "group_size": w.get("group_size")}
                           for t in grp.get("targets") or [] if t != "Linear"})
    kv = qc.get("kv_cache_scheme")
    return {"quant_algo": qc.get("quant_algo"), "group_size": qc.get("group_size", group_size),
            "exclude_modules": qc.get("exclude_modules", qc.get("ignore")),
            "quantized_layers": layers,
            "kv_cache_quant_algo": kv if isinstance(kv, str) or kv is None else "FP8"}


def _modelopt(q: dict) -> QuantScheme:
    algo = q.get("quant_algo")
    kv = q.get("kv_cache_quant_algo")
    excl = _excluded("glob", q.get("exclude_modules"))
    if algo is None:
        return QuantScheme("modelopt", tuple(excl), BF16, kv)
    if str(algo).upper() == "MIXED_PRECISION":
        layers = q.get("quantized_layers") or {}
        parsed = {n: _modelopt_algo(c.get("quant_algo"), c.get("group_size", q.get("group_size")))
                  for n, c in layers.items()}
        exact = [Rule("exact", n, lq) for n, lq in parsed.items()]
        prefix = [Rule("prefix", n, lq) for n, lq in sorted(parsed.items(), key=lambda x: -len(x[0]))]
        return QuantScheme("modelopt", tuple(excl + exact + [_NEVER] + prefix), BF16, kv)
    return QuantScheme("modelopt", tuple(excl + [_NEVER]), _modelopt_algo(algo, q.get("group_size")), kv)


# -- AutoAWQ --------------------------------------------------------------------------------
def _awq(qc: dict) -> QuantScheme:
    version = str(qc.get("version", "gemm")).lower()
    bits = qc.get("bits", qc.get("w_bit", 4))
    if version != "gemm":
        raise UnsupportedQuantization(f"awq version {version!r} is not supported (only gemm)")
    if bits != 4:
        raise UnsupportedQuantization(f"awq with {bits} bits is not supported (only 4)")
    if not qc.get("zero_point", True):
        raise UnsupportedQuantization("awq without zero points is not supported (zero_point must be true)")
    g = int(qc.get("group_size", qc.get("q_group_size", 128)))
    layer = LayerQuant("int4_awq", QuantParams(group_size=None if g == -1 else g, symmetric=False))
    rules = _excluded("hf", qc.get("modules_to_not_convert")) + [_NEVER, _NO_LM_HEAD]
    return QuantScheme("awq", tuple(rules), layer)


# -- compressed-tensors ---------------------------------------------------------------------
_CT_DEFAULT_FORMAT = {("int", 4): "pack-quantized", ("float", 4): "nvfp4-pack-quantized",
                      ("float", 8): "float-quantized"}


def _ct_layer(group: dict, top_format: str | None) -> LayerQuant | None:
    w = group.get("weights")
    if not w:
        return None
    typ, bits = str(w.get("type", "int")).lower(), int(w.get("num_bits", 8))
    strategy = str(w.get("strategy") or "tensor").lower()
    fmt = group.get("format") or (top_format if top_format not in (None, "mixed-precision") else None)
    fmt = fmt or _CT_DEFAULT_FORMAT.get((typ, bits))
    gs = w.get("group_size")
    what = f"compressed-tensors weights type={typ} num_bits={bits} strategy={strategy} format={fmt}"
    if typ == "int" and bits == 4 and fmt == "pack-quantized" and strategy in ("group", "channel"):
        return LayerQuant("int4_ct", QuantParams(group_size=int(gs) if strategy == "group" else None,
                                                  symmetric=bool(w.get("symmetric", True))))
    if typ == "float" and bits == 4 and fmt == "nvfp4-pack-quantized" and gs == 16:
        return LayerQuant("nvfp4_ct", QuantParams(group_size=16))
    if (typ == "float" and bits == 8 and fmt in ("float-quantized", "naive-quantized")
            and strategy in ("tensor", "channel")):
        return LayerQuant("fp8_tensor", QuantParams(per_channel=strategy == "channel"))
    raise UnsupportedQuantization(
        f"{what} is not supported; supported: int4 pack-quantized (group/channel), "
        "nvfp4-pack-quantized (group 16), fp8 float-quantized (tensor/channel)")


def _compressed_tensors(qc: dict) -> QuantScheme:
    top_format = qc.get("format")
    exact, regex, classes = [], [], []
    for group in (qc.get("config_groups") or {}).values():
        layer = _ct_layer(group, top_format)
        if layer is None:
            continue
        for t in group.get("targets") or []:
            if t.startswith("re:"):
                regex.append(Rule("ct", t, layer))
            elif t == "Linear":
                classes.append(Rule("linear", t, layer))
            elif "." in t or t == "lm_head":
                exact.append(Rule("exact", t, layer))
            # other class names (Embedding, attention modules) never target a linear weight
    exact.sort(key=lambda r: r.pattern)   # CT's match_targets order: exact, regex, class
    regex.sort(key=lambda r: r.pattern)
    rules = _excluded("ct", qc.get("ignore")) + exact + regex + [_NEVER] + classes[:1]
    kv = "FP8" if qc.get("kv_cache_scheme") else None
    return QuantScheme("compressed-tensors", tuple(rules), BF16, kv)
