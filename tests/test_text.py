"""Tokenizer loading, chat template, incremental detokenization and stop strings."""
from __future__ import annotations

import pytest

from moeferry.text.detokenizer import IncrementalDetokenizer
from moeferry.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(checkpoint):
    return Tokenizer.from_dir(checkpoint("qwen3_5_moe"))


TEXT = "Héllo wörld — naïve café 🚀🎉 日本語テキスト\nprint(\"ok\")  # done"


def stream(tok, ids, stop=(), step=1):
    d = IncrementalDetokenizer(tok, stop)
    parts = [d.feed(ids[i:i + step]) for i in range(0, len(ids), step)]
    parts.append(d.flush())
    return d, parts


def test_detokenizer_streams_only_complete_utf8(tok):
    ids = tok.encode(TEXT)
    d, parts = stream(tok, ids)
    assert "".join(parts) == tok.decode(ids) == TEXT
    assert all("\ufffd" not in p for p in parts)


@pytest.mark.parametrize("stop", ["wörld", "🎉", "print(", "e"])
def test_stop_string_ends_text_and_never_leaks(tok, stop):
    ids = tok.encode(TEXT)
    d, parts = stream(tok, ids, stop=(stop, "never-here"))
    text = "".join(parts)
    assert d.stopped and d.stop_reason == stop
    assert text == TEXT[: TEXT.find(stop)]


def test_held_back_prefix_is_released_when_not_a_stop(tok):
    ids = tok.encode("abc ab")
    d, parts = stream(tok, ids, stop=("abd",))
    assert "".join(parts) == "abc ab" and not d.stopped


def test_chat_template_thinking_and_tools(tok):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    on = tok.apply_chat_template(msgs, enable_thinking=True)
    off = tok.apply_chat_template(msgs, enable_thinking=False)
    assert on.endswith("<|im_start|>assistant\n") and off.endswith("<think>\n\n</think>\n\n")
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    with_tools = tok.apply_chat_template(msgs, tools=tools)
    assert "get_time" in with_tools and "<tool_call>" in with_tools
    assert tok.eos_token_ids and tok.encode("<|im_end|>") == [tok.token_to_id("<|im_end|>")]


# Fragments that stress the pre-tokenizer around newlines: letters of several scripts, a
# decomposed accent and Hangul jamo (NFC composes them), lone combining marks, digits, symbols,
# contractions, every kind of space and line break, added tokens, emoji sequences, controls.
FRAGMENTS = ["word", "Zeta", "é", "e\u0301", "\u1100\u1161", "中文", "Ωμέγα", "слово", "كلمة", "\u0301", "\u0308",
             "42", "7", "\u0661\u0662", ".", ",;", "()", "{}", "<", ">", "'s", "'LL", "\"", "#", "$%", "_", "\\",
             " ", "  ", "\t", "\n", "\n\n", "\r\n", " \n", "\n ", "\n\t", "\u00a0", "\u3000", "\u2028", "\x85",
             "\x1c", "\u200b", "<|im_start|>", "<|im_end|>", "<tool_call>", "<think>", "😀", "👩\u200d💻", "def f():"]


def random_text(rng, n: int) -> str:
    return "".join(rng.choice(FRAGMENTS) for _ in range(n))


def qwen3_pattern_tokenizer(tok: Tokenizer) -> Tokenizer:
    """The demo tokenizer with Qwen2-3's pre-tokenizer pattern (no combining marks) instead of
    Qwen3.5's: the same merges, the other pattern of LINE_SPLIT_PATTERNS."""
    import json

    from tokenizers import Tokenizer as HFTokenizer

    from moeferry.text.parts import LINE_SPLIT_PATTERNS

    config = json.loads(tok._tok.to_str())
    split = config["pre_tokenizer"]["pretokenizers"][0]
    split["pattern"]["Regex"] = next(p for p in LINE_SPLIT_PATTERNS if p != split["pattern"]["Regex"])
    return Tokenizer(HFTokenizer.from_str(json.dumps(config)), tok.config, None, tok.eos_token_ids)


def test_a_long_text_encodes_in_parts_to_the_whole_texts_ids(tok):
    """Cut by `line_parts` into parts of ~40 characters (dozens of cuts a text), the parts'
    ids are the whole text's, for both Qwen pre-tokenizer patterns, and so are their
    pre-tokenizer pieces (after NFC), which does not depend on what the small vocabulary merges;
    `encode` of a long text uses the parts."""
    import random

    from moeferry.text.parts import line_parts

    def pieces(t, text):
        return [p for p, _ in t._tok.pre_tokenizer.pre_tokenize_str(t._tok.normalizer.normalize_str(text))]

    rng = random.Random(7)
    for t in (tok, qwen3_pattern_tokenizer(tok)):
        assert t.in_parts
        for _ in range(40):
            text = random_text(rng, 3000)
            parts = line_parts(text, 40)
            assert "".join(parts) == text and len(parts) > 50
            whole = t._tok.encode_batch([text], add_special_tokens=False)[0].ids
            assert [i for e in t._tok.encode_batch(parts, add_special_tokens=False) for i in e.ids] == whole
            assert [p for part in parts for p in pieces(t, part)] == pieces(t, text)
    text = random_text(rng, 20000)
    assert len(line_parts(text)) > 2 and tok.encode(text) == tok._tok.encode(text, add_special_tokens=False).ids


def test_only_known_pre_tokenizers_encode_in_parts(tok):
    import json

    from tokenizers import Tokenizer as HFTokenizer

    from moeferry.text.parts import splits_at_lines

    config = json.loads(tok._tok.to_str())
    assert splits_at_lines(HFTokenizer.from_str(json.dumps(config)))
    newline_token = {"id": len(config["model"]["vocab"]) + 100, "content": "<br>\n", "single_word": False,
                     "lstrip": False, "rstrip": False, "normalized": False, "special": True}
    for change in (lambda c: c["pre_tokenizer"]["pretokenizers"][0]["pattern"].update(Regex=r"\s+|\S+"),
                   lambda c: c["pre_tokenizer"]["pretokenizers"][1].update(add_prefix_space=True),
                   lambda c: c.update(pre_tokenizer={"type": "Whitespace"}),
                   lambda c: c.update(normalizer={"type": "NFKC"}),
                   lambda c: c["added_tokens"].append(newline_token),
                   lambda c: c["added_tokens"][0].update(lstrip=True)):
        changed = json.loads(json.dumps(config))
        change(changed)
        assert not splits_at_lines(HFTokenizer.from_str(json.dumps(changed)))


def test_a_text_that_continues_a_recent_one_encodes_only_its_new_part(tok):
    """Turns of conversations (appended to, edited in the middle, cut short, or new), encoded
    through `RecentEncodings` with ~40-character parts: always the whole text's ids; a turn
    that appends to the last one encodes only from the last cut inside the shared beginning."""
    import random

    from moeferry.text.parts import RecentEncodings

    def whole(text):
        return tok._tok.encode(text, add_special_tokens=False).ids

    encoded = []

    def encode_parts(parts):
        encoded.append(sum(map(len, parts)))
        return tok._encode_batch(parts)

    recent = RecentEncodings(encode_parts, capacity=3, part_chars=40)
    rng = random.Random(11)
    texts = [random_text(rng, 200) for _ in range(3)]
    for text in texts:
        recent.encode(text)
    resumed = 0
    for turn in range(120):
        i = rng.randrange(len(texts))
        kind = rng.choice(["append", "append", "edit", "cut", "new"])
        last = text = texts[i]
        if kind == "append":
            text += random_text(rng, rng.randrange(1, 40))
        elif kind == "edit":
            at = rng.randrange(len(text))
            text = text[:at] + rng.choice(FRAGMENTS) + text[at + 1:]
        elif kind == "cut":
            text = text[:rng.randrange(1, len(text))]
        else:
            text = random_text(rng, 200)
        texts[i] = text
        # the last version is still kept, cut inside: an appended turn must resume from that cut
        resumable = kind == "append" and any(old == last and cuts[0][0] < len(last)
                                             for old, _, cuts in recent.entries.values())
        before = recent.reused_chars
        assert recent.encode(text) == whole(text), (turn, kind)
        if resumable:
            resumed += 1
            assert recent.reused_chars > before and encoded[-1] == len(text) - (recent.reused_chars - before)
    assert resumed >= 10 and len(recent.entries) <= 3
