"""SamplingParams: how one request picks its tokens, validated once."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moeferry.scheduler.grammar import StructuredOutput


class SamplingParamError(ValueError):
    """An invalid sampling parameter; `param` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


MAX_LOGIT_BIAS = 1024  # tokens a request may bias
MAX_STOP_TOKEN_IDS = 1024  # stop token ids a request may name


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 (or below ops.sampler.GREEDY_BELOW) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None = up to the context length
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off, 0 = chosen token only, n = chosen + top-n
    n: int = 1
    structured: "StructuredOutput | None" = None  # a grammar the output must follow (scheduler/grammar.py)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit before sampling)

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", tuple(tuple(kv) for kv in self.logit_bias))

    @property
    def greedy(self) -> bool:
        from moeferry.ops.sampler import GREEDY_BELOW

        return self.temperature < GREEDY_BELOW

    def replace(self, **changes) -> "SamplingParams":
        return replace(self, **changes)

    def validate(self) -> "SamplingParams":
        def bad(param, message):
            raise SamplingParamError(param, f"{param}: {message}")

        if not 0.0 <= self.temperature <= 100.0:
            bad("temperature", f"must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            bad("top_k", f"must be -1, 0 (off) or a positive integer, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 10.0:
            bad("repetition_penalty", f"must be in (0, 10], got {self.repetition_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", f"must be a positive integer, got {self.max_tokens}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", f"must be a non-negative integer, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            bad("logprobs", f"must be in [0, 20], got {self.logprobs}")
        if self.n != 1:
            bad("n", f"only n=1 is supported, got {self.n}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "stop strings must be non-empty strings")
        if len(self.stop) > 16:
            bad("stop", f"at most 16 stop strings, got {len(self.stop)}")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", f"must be an integer, got {self.seed!r}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            bad("logit_bias", f"at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        for token, bias in self.logit_bias:
            if not isinstance(token, int) or token < 0:
                bad("logit_bias", f"keys must be token ids (non-negative integers), got {token!r}")
            if not -100.0 <= bias <= 100.0:
                bad("logit_bias", f"token {token}: the bias must be in [-100, 100], got {bias}")
        return self

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
