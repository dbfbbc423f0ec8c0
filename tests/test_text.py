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
