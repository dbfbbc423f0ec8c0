"""A small byte-level BPE tokenizer trained offline, for synthetic checkpoints.

Real Qwen tokenizers cannot be downloaded in CI, so synthetic models ship this one. It is
trained with the `tokenizers` library on a corpus generated in code (English prose, Python
and shell code, JSON, a little non-Latin text), deterministically, in well under a second.

Pipeline (the same as `transformers.Qwen3_5Tokenizer` builds, so whichever class
`AutoTokenizer` picks for a model type, ids are identical): NFC normalizer, the Qwen3.5
split regex, ByteLevel(add_prefix_space=False, use_regex=False), ByteLevel decoder.

Ids. The BPE vocabulary holds ids ``0 .. vocab_size - len(SPECIAL_TOKENS) - 1`` (the 256
byte symbols first). The added tokens take the **last** ``len(SPECIAL_TOKENS)`` ids, in
the order of :data:`SPECIAL_TOKENS`, so the total vocabulary is exactly ``vocab_size``.
For the default ``vocab_size=4096``::

    <|endoftext|> 4083   <|im_start|> 4084   <|im_end|> 4085
    <think> 4086  </think> 4087  <tool_call> 4088  </tool_call> 4089
    <tool_response> 4090  </tool_response> 4091
    <|vision_start|> 4092  <|vision_end|> 4093  <|image_pad|> 4094  <|video_pad|> 4095

As in Qwen3, the ChatML and vision markers are *special* (dropped by
``skip_special_tokens``) while ``<think>``/``<tool_call>``/``<tool_response>`` and their
closing tags are added but **not** special, so they survive decoding for the reasoning and
tool-call parsers. All of them always encode as single ids.
"""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "NON_SPECIAL_ADDED",
    "build_corpus",
    "special_token_ids",
    "train_demo_tokenizer",
]

# Order fixes the ids: token i gets id vocab_size - len(SPECIAL_TOKENS) + i.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Added tokens that are not "special": kept by decode(skip_special_tokens=True), like Qwen3.
NON_SPECIAL_ADDED = frozenset(
    {"<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"}
)

# The Qwen3.5 pre-tokenizer split regex (same as transformers' Qwen3_5Tokenizer).
_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}|"""
    r""" ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML, modelled on the Qwen3 template: system/user/assistant/tool roles, `tools`,
# assistant `tool_calls` and `reasoning_content`, tool results as <tool_response> inside a
# user turn, `add_generation_prompt` and `enable_thinking`. Content may be a string or a
# list of {"type": "text", "text": ...} parts.
CHAT_TEMPLATE = r"""{%- macro text_of(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- elif content is iterable and content is not mapping -%}
        {%- for part in content -%}
            {%- if part is string -%}{{- part -}}
            {%- elif part.type == 'text' or part.text is defined -%}{{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- elif content is not none -%}
        {{- content -}}
    {%- endif -%}
{%- endmacro -%}
{%- set first_is_system = messages and messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if first_is_system -%}
        {{- text_of(messages[0].content) + '\n\n' -}}
    {%- endif -%}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n' -}}
    {{- '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- elif first_is_system -%}
    {{- '<|im_start|>system\n' + text_of(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}
{#- The last real user query: reasoning is rendered only for assistant turns after it. -#}
{%- set ns = namespace(last_query=-1) -%}
{%- for m in messages -%}
    {%- if m.role == 'user' -%}
        {%- set t = text_of(m.content) -%}
        {%- if not (t.startswith('<tool_response>') and t.endswith('</tool_response>')) -%}
            {%- set ns.last_query = loop.index0 -%}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- for m in messages -%}
    {%- set content = text_of(m.content) -%}
    {%- if m.role == 'user' or (m.role == 'system' and not loop.first) -%}
        {{- '<|im_start|>' + m.role + '\n' + content + '<|im_end|>\n' -}}
    {%- elif m.role == 'assistant' -%}
        {%- set reasoning = '' -%}
        {%- if m.reasoning_content is string -%}
            {%- set reasoning = m.reasoning_content -%}
        {%- elif '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
            {%- set content = content.split('</think>')[-1] -%}
        {%- endif -%}
        {%- set reasoning = reasoning.strip('\n') -%}
        {%- set content = content.lstrip('\n') -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}
            {{- '<think>\n' + reasoning + '\n</think>\n\n' -}}
        {%- endif -%}
        {{- content -}}
        {%- for call in (m.tool_calls or []) -%}
            {%- set fn = call.function if call.function is defined else call -%}
            {%- if content or not loop.first -%}{{- '\n' -}}{%- endif -%}
            {{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' -}}
            {%- if fn.arguments is string -%}
                {{- fn.arguments -}}
            {%- else -%}
                {{- fn.arguments | tojson -}}
            {%- endif -%}
            {{- '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif m.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- endif -%}
{%- endif -%}
"""

# ---------------------------------------------------------------------------------------
# Corpus

_WORDS = """
the of and to in is that it for as with was on be by at this are from or an have not
but had they which you were all one can there their has more been if will would so
what about when who some them out into time up other only new could these than then
its also two may first any like now my over such our man me even most made after
many must before where through back years much your way well down should because each
just those people how too little state good very make world still own see men work
long get here between both life being under never day same another know while last
might us great old year off come since against go came right used take three states
himself few house use during without again place around however home small found
thought went say part once general high upon school every does got united left number
course war until always away something fact though water less public put think almost
hand enough far took head yet government system better set told nothing night end why
called didn't eyes find going look asked later point knew city next program business
give group toward young days let room president side social given present several
order national possible rather second face per among form important often things
early making white case john become large big need four within felt children along
saw best church ever least power development light thing seemed family interest want
members mind country area others done turned although open god service certain kind
problem began different door thus help sense means whole matter perhaps itself york
times law human line above name example action company hands local show whether five
history gave today either act feet across taken past quite anyone having seen death
experience body word half really week free field car words order question model
server request response token tokens expert experts memory cache layer layers router
batch prefill decode stream kernel tensor weight weights shard index config value
values key keys queue worker process thread device host bandwidth latency throughput
quantized attention linear state gate gated norm residual vocabulary sampling
temperature probability distribution function argument arguments return returns
error errors exception retry timeout schedule scheduler engine budget plan measure
weather forecast city temperature celsius fahrenheit rain sunny cloudy wind humidity
calendar meeting tomorrow morning evening afternoon coffee tea breakfast lunch dinner
river mountain forest ocean island desert valley bridge garden library museum market
quickly slowly carefully happily suddenly finally usually rarely gently quietly
beautiful simple complex careful curious ancient modern bright dark heavy tiny huge
"""

_CODE_WORDS = """
def class return import from self None True False lambda yield async await with
try except finally raise assert pass break continue elif else while for in not and or
print len range list dict set tuple int float str bytes bool isinstance enumerate zip
torch tensor shape dtype device cuda numpy json path open read write append extend
config model layer weight bias hidden size num heads dim batch seq tokens logits
const let var function console log fn pub struct impl mut match Some Ok Err usize
include int main void char return printf sizeof malloc free static inline
echo export cd ls grep sed awk cat curl pip install python make git run test
"""

_UNICODE_LINES = [
    "Café, naïve, résumé, façade, coöperate, jalapeño, Zürich, Ærøskøbing.",
    "Ελληνικά: καλημέρα κόσμε. Русский: привет, мир! Українська: дякую.",
    "日本語のテキスト、中文文本，한국어 텍스트。",
    "Emoji: 🚀 🧪 ✅ ❌ 🙂 — “quotes”, ‘single’, «guillemets», …ellipsis",
    "Math: ∑ x² ≤ ∞, α + β = γ, √2 ≈ 1.414, 3 × 4 ÷ 2 = 6, ±0.5°C",
    "हिन्दी पाठ, العربية نص, עברית טקסט, ไทย ข้อความ",
]


def build_corpus(seed: int = 0, n_paragraphs: int = 700) -> list[str]:
    """Deterministic training texts: prose, code, shell, JSON and some non-Latin lines."""
    rng = random.Random(seed)
    words = _WORDS.split()
    code = _CODE_WORDS.split()
    ident_parts = words[:200] + code

    def sentence() -> str:
        n = rng.randint(5, 16)
        ws = [rng.choice(words) for _ in range(n)]
        if rng.random() < 0.3:
            ws.insert(rng.randrange(len(ws)), str(rng.randint(0, 10**rng.randint(1, 5))))
        ws[0] = ws[0].capitalize()
        if rng.random() < 0.2:
            i = rng.randrange(len(ws))
            ws[i] = ws[i] + ","
        return " ".join(ws) + rng.choice([".", ".", ".", "?", "!", ";", ":"])

    def ident() -> str:
        parts = [rng.choice(ident_parts) for _ in range(rng.randint(1, 3))]
        style = rng.random()
        if style < 0.6:
            return "_".join(parts).lower()
        if style < 0.8:
            return parts[0].lower() + "".join(p.capitalize() for p in parts[1:])
        return "".join(p.capitalize() for p in parts)

    def python_block() -> str:
        name, a, b = ident(), ident(), ident()
        body = [
            f"def {name}({a}, {b}=None):",
            f'    """{sentence()}"""',
            f"    if {b} is None:",
            f"        {b} = {rng.randint(0, 4096)}",
            f"    for i in range(len({a})):",
            f"        {a}[i] = {a}[i] * {b} + {rng.random():.4f}",
            f"    return {{'{rng.choice(words)}': {a}, 'n': len({a})}}",
        ]
        return "\n".join(body)

    def other_code() -> str:
        x, y = ident(), ident()
        return rng.choice(
            [
                f"const {x} = await fetch(`/v1/{y}`, {{ method: 'POST' }});\nconsole.log({x}.status);",
                f"fn {x}(v: &[f32]) -> f32 {{\n    v.iter().map(|a| a * a).sum::<f32>().sqrt()\n}}",
                f"int {x}(int n) {{\n    return n <= 1 ? n : {x}(n - 1) + {x}(n - 2);\n}}",
                f"$ pip install {y.replace('_', '-')} && python -m {x} --port {rng.randint(1024, 65535)}",
                f"x = torch.randn({rng.randint(1, 64)}, {rng.randint(1, 4096)}, dtype=torch.bfloat16)",
                f"SELECT {x}, COUNT(*) FROM {y} WHERE {x} > {rng.randint(0, 99)} GROUP BY {x};",
            ]
        )

    def json_block() -> str:
        def value(depth: int):
            r = rng.random()
            if depth < 2 and r < 0.25:
                return {rng.choice(words): value(depth + 1) for _ in range(rng.randint(1, 4))}
            if depth < 2 and r < 0.4:
                return [value(depth + 1) for _ in range(rng.randint(1, 3))]
            if r < 0.6:
                return rng.randint(-1000, 100000)
            if r < 0.7:
                return round(rng.uniform(-10, 10), 3)
            if r < 0.8:
                return rng.choice([True, False, None])
            return " ".join(rng.choice(words) for _ in range(rng.randint(1, 4)))

        if rng.random() < 0.4:
            obj = {"name": ident(), "arguments": {ident(): value(1) for _ in range(rng.randint(1, 3))}}
        else:
            obj = {ident(): value(0) for _ in range(rng.randint(1, 5))}
        return json.dumps(obj, ensure_ascii=False, indent=rng.choice([None, 2]))

    texts: list[str] = list(_UNICODE_LINES)
    makers = [
        lambda: " ".join(sentence() for _ in range(rng.randint(2, 6))),
        python_block,
        other_code,
        json_block,
    ]
    for _ in range(n_paragraphs):
        texts.append(rng.choice(makers)())
        if rng.random() < 0.05:
            texts.append(rng.choice(_UNICODE_LINES))
    return texts


# ---------------------------------------------------------------------------------------
# Training


def special_token_ids(vocab_size: int = 4096) -> dict[str, int]:
    """The fixed ids of the added tokens: the last len(SPECIAL_TOKENS) ids of the vocabulary."""
    base = vocab_size - len(SPECIAL_TOKENS)
    return {tok: base + i for i, tok in enumerate(SPECIAL_TOKENS)}


@functools.lru_cache(maxsize=4)
def _trained_json(vocab_size: int) -> str:
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer
    from tokenizers import AddedToken

    n_bpe = vocab_size - len(SPECIAL_TOKENS)
    if n_bpe < 512:
        raise ValueError(f"vocab_size {vocab_size} too small (need >= {512 + len(SPECIAL_TOKENS)})")
    tok = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=n_bpe,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(build_corpus(), trainer=trainer)
    got = tok.get_vocab_size()
    if got != n_bpe:
        raise RuntimeError(f"BPE training reached {got} tokens, wanted {n_bpe}; enlarge the corpus")
    tok.add_tokens(
        [
            AddedToken(t, special=t not in NON_SPECIAL_ADDED, normalized=False, single_word=False,
                       lstrip=False, rstrip=False)
            for t in SPECIAL_TOKENS
        ]
    )
    ids = special_token_ids(vocab_size)
    for t, i in ids.items():
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t), i)
    return tok.to_str()


def train_demo_tokenizer(out_dir: Path, vocab_size: int = 4096, *, model_max_length: int = 32768) -> None:
    """Train (cached per process) and write tokenizer.json, tokenizer_config.json, chat_template.jinja.

    The resulting vocabulary is exactly `vocab_size` ids (BPE first, added tokens last;
    see the module docstring). `eos_token` is <|im_end|>, `pad_token` <|endoftext|>, no BOS.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(_trained_json(vocab_size), encoding="utf-8")
    ids = special_token_ids(vocab_size)
    added = {
        str(ids[t]): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t not in NON_SPECIAL_ADDED,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in NON_SPECIAL_ADDED],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8")
