"""Where a long text may be cut so that its parts encode to the whole text's ids, and the reuse
of the last long texts' encodings.

HF tokenizers encodes one text on one core, and an agent's prompt is its whole conversation
again: 400 KB, 200k tokens, 94 ms of encoding on two cores. For the Qwen pre-tokenizers a text
cut just after a newline that a non-space character follows encodes, part by part, to the whole
text's ids (`splits_at_lines`, `line_parts`). So a long text is encoded in parts on every core,
and a text that begins like one encoded lately (the next turn of a conversation) is encoded only
from the last cut inside the shared beginning (`RecentEncodings`).
"""
from __future__ import annotations

import itertools
import json
import threading
import unicodedata
from array import array
from collections import OrderedDict
from typing import Callable

from tokenizers import Tokenizer as HFTokenizer

from moeferry.common_prefix import common_prefix_length

# Pre-tokenizer patterns (Qwen2 to Qwen3, and Qwen3.5 / 3.6, which adds combining marks) under
# which a newline followed by a character that is neither a space nor a combining mark always
# ends a piece: no alternative matches a newline and then such a character (the optional lead of
# `?\p{L}+` excludes \r\n; the others end at a newline or hold only spaces), and the piece that
# ends there matches the same with the text cut after it (a greedy run that stops before that
# character stops at the end alike). Encoding the text in parts cut there gives the whole's ids.
LINE_SPLIT_PATTERNS = frozenset({
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+""",
})
PART_CHARS = 8192  # a long text is encoded in parts of about this many characters, in parallel


def splits_at_lines(tokenizer: HFTokenizer) -> bool:
    """Whether a tokenizer encodes a text cut at `line_parts`' cuts into the same ids as the
    whole: a Split pre-tokenizer with one of `LINE_SPLIT_PATTERNS` then byte-level bytes, no
    normalizer but NFC (nothing composes with a newline), and no added token that holds a
    newline or takes the spaces around it. (Read from the parts, not `to_str`: the vocabulary
    need not be serialised.)"""
    pre = json.loads(tokenizer.pre_tokenizer.__getstate__()) if tokenizer.pre_tokenizer is not None else {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if len(steps) != 2:
        return False
    split, byte = steps
    pattern = (split.get("pattern") or {}).get("Regex")
    if not (split.get("type") == "Split" and pattern in LINE_SPLIT_PATTERNS and split.get("behavior") == "Isolated"
            and not split.get("invert") and byte.get("type") == "ByteLevel" and byte.get("use_regex") is False
            and not byte.get("add_prefix_space")):
        return False
    if tokenizer.normalizer is not None and json.loads(tokenizer.normalizer.__getstate__()).get("type") != "NFC":
        return False
    return all("\n" not in t.content and not t.lstrip and not t.rstrip
               for t in tokenizer.get_added_tokens_decoder().values())


def _cuttable(text: str, at: int) -> bool:
    """A newline at `at` is followed by a character that is neither a space nor a combining mark."""
    c = text[at + 1:at + 2]
    return bool(c) and not c.isspace() and not unicodedata.category(c).startswith("M")


def line_parts(text: str, size: int = PART_CHARS) -> list[str]:
    """`text` in parts of about `size` characters (the last up to twice that), each but the last
    ending with a newline that `_cuttable` allows."""
    parts, start = [], 0
    while len(text) - start > 2 * size:
        cut = text.find("\n", start + size)
        while cut != -1 and not _cuttable(text, cut):
            cut = text.find("\n", cut + 1)
        if cut == -1:
            break
        parts.append(text[start:cut + 1])
        start = cut + 1
    parts.append(text[start:])
    return parts


class RecentEncodings:
    """The last `capacity` long texts encoded, each with its ids and its cuts (character offset,
    token count). A text that shares a beginning with one of them takes its ids up to the last
    cut inside the shared part (the character after that cut is shared too, so it is a cut of
    the new text as well) and encodes only the rest, in parts. Texts too short to be cut are
    encoded whole and not kept. Thread-safe (requests are tokenized on worker threads)."""

    def __init__(self, encode_parts: Callable[[list[str]], list[list[int]]], capacity: int = 8,
                 part_chars: int = PART_CHARS):
        self.encode_parts, self.capacity, self.part_chars = encode_parts, capacity, part_chars
        self.entries: OrderedDict[int, tuple[str, array, list[tuple[int, int]]]] = OrderedDict()
        self.lock = threading.Lock()
        self.keys = itertools.count()
        self.reused_chars = 0  # characters whose ids came from an earlier text

    def encode(self, text: str) -> list[int]:
        if len(text) <= 2 * self.part_chars:
            return self.encode_parts([text])[0]
        resumed, start, ids, cuts = self._resume(text)
        parts = line_parts(text[start:], self.part_chars)
        at = start
        for part, part_ids in zip(parts, self.encode_parts(parts)):
            ids.extend(part_ids)
            at += len(part)
            cuts.append((at, len(ids)))
        self._keep(resumed, text, ids, cuts)
        return ids.tolist()

    def _resume(self, text: str) -> tuple[int | None, int, array, list[tuple[int, int]]]:
        """(the entry resumed from, the character to encode from, the ids before it, its cuts)."""
        with self.lock:
            best, shared = None, 0
            for key, (old, _, _) in self.entries.items():
                n = common_prefix_length(old, text)
                if n > shared:
                    best, shared = key, n
            if best is None:
                return None, 0, array("i"), []
            _, ids, cuts = self.entries[best]
            keep = [c for c in cuts if c[0] < shared]
            if not keep:
                return best, 0, array("i"), []
            self.reused_chars += keep[-1][0]
            return best, keep[-1][0], ids[:keep[-1][1]], keep

    def _keep(self, resumed: int | None, text: str, ids: array, cuts: list[tuple[int, int]]) -> None:
        """Remember the text, in place of the one it continues (a conversation keeps one entry)."""
        with self.lock:
            if resumed in self.entries and text.startswith(self.entries[resumed][0]):
                del self.entries[resumed]
            self.entries[next(self.keys)] = (text, ids, cuts)
            while len(self.entries) > self.capacity:
                self.entries.popitem(last=False)
