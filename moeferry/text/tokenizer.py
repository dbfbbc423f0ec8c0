"""The checkpoint's tokenizer (tokenizer.json) and chat template (jinja), without transformers."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


class TemplateError(ValueError):
    """The chat template rejected the conversation (raise_exception in the template)."""


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
        self.config = config
        self.chat_template = chat_template
        self._template = _environment().from_string(chat_template) if chat_template else None
        self.eos_token_ids = eos_token_ids
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))

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

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

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
