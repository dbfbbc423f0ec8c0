"""The checkpoint's tokenizer (tokenizer.json) and chat template (jinja), without transformers."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from moeferry.text.parts import RecentEncodings, splits_at_lines


class TemplateError(ValueError):
    """The chat template rejected the conversation (raise_exception in the template)."""


class InvalidText(ValueError):
    """Text that is not valid Unicode (a lone surrogate such as JSON's "\\ud800")."""


class TextTooLong(ValueError):
    """Text whose byte length alone proves it has more tokens than allowed (found without tokenizing)."""

    def __init__(self, min_tokens: int, limit: int):
        super().__init__(f"at least {min_tokens} tokens (limit {limit})")
        self.min_tokens, self.limit = min_tokens, limit


def utf8(text: str) -> bytes:
    """text as UTF-8; InvalidText if it holds a lone surrogate."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidText(f"the text is not valid Unicode: {e.reason} at character {e.start} "
                          f"({text[e.start:e.end].encode('unicode_escape').decode()})") from None


def _raise(message: str):
    raise TemplateError(message)


def _tojson(value, indent=None, ensure_ascii=False, **kwargs):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, **kwargs)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _tokenizer_config(d: Path) -> dict:
    path = d / "tokenizer_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def read_chat_template(model_dir: str | Path, config: dict | None = None) -> str | None:
    """The checkpoint's chat template: chat_template.jinja, else tokenizer_config.json's
    (of named templates, "default")."""
    d = Path(model_dir)
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text()
    template = (config if config is not None else _tokenizer_config(d)).get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        return named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, config: dict, chat_template: str | None, eos_token_ids: list[int]):
        self._tok = tokenizer
        self.in_parts = splits_at_lines(tokenizer)  # long texts encoded in parallel parts
        self.recent = RecentEncodings(self._encode_batch) if self.in_parts else None
        self.config = config
        self.chat_template = chat_template
        self._template = _environment().from_string(chat_template) if chat_template else None
        self.eos_token_ids = eos_token_ids
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        # Bytes one token can cover at most: a text of B bytes has at least B / bytes_per_token tokens.
        # A normalizer may shorten the text before it is split (NFC composes up to 3 code points into one,
        # e.g. Hangul jamo, 9 bytes -> 3), hence the factor 3 when there is one.
        longest = max((len(t.encode("utf-8", "replace")) for t in tokenizer.get_vocab(with_added_tokens=True)),
                      default=1)
        self.max_bytes_per_token = max(longest, 1) * (3 if tokenizer.normalizer is not None else 1)

    @classmethod
    def from_dir(cls, model_dir: str | Path, extra_eos_ids: list[int] | tuple[int, ...] = ()) -> "Tokenizer":
        d = Path(model_dir)
        if not (d / "tokenizer.json").is_file():
            raise FileNotFoundError(f"{d}: no tokenizer.json")
        tok = HFTokenizer.from_file(str(d / "tokenizer.json"))
        config = _tokenizer_config(d)
        template = read_chat_template(d, config)
        eos = list(extra_eos_ids)
        eos_text = _token_text(config.get("eos_token"))
        if eos_text is not None and tok.token_to_id(eos_text) is not None and tok.token_to_id(eos_text) not in eos:
            eos.append(tok.token_to_id(eos_text))
        return cls(tok, config, template, eos)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def min_tokens(self, num_bytes: int) -> int:
        """A lower bound on the tokens of any text of num_bytes UTF-8 bytes."""
        return -(-num_bytes // self.max_bytes_per_token)

    def encode(self, text: str, max_tokens: int | None = None) -> list[int]:
        """Token ids of text. InvalidText for a lone surrogate; TextTooLong, before any tokenizing, when
        the byte length alone proves the text has more than max_tokens tokens. The work runs without
        the GIL (encode_batch releases it, encode does not), so other threads keep running. Where the
        tokenizer allows it (`in_parts`), a long text is encoded in parts on every core, and only
        from where it stops matching a text encoded lately (`moeferry.text.parts`)."""
        data = utf8(text)
        if max_tokens is not None and self.min_tokens(len(data)) > max_tokens:
            raise TextTooLong(self.min_tokens(len(data)), max_tokens)
        del data
        return self.recent.encode(text) if self.recent is not None else self._encode_batch([text])[0]

    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [enc.ids for enc in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def added_token_id(self, token: str) -> int | None:
        """The id of `token` if it is an added token (e.g. <tool_call>), which text never encodes into
        piecewise; None otherwise."""
        return next((i for i, t in self._tok.get_added_tokens_decoder().items() if t.content == token), None)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            add_generation_prompt: bool = True, **kwargs) -> str:
        if self._template is None:
            raise TemplateError("this model has no chat template; use the completions API")
        try:
            return self._template.render(messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template failed: {e}") from None
