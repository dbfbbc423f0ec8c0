"""A generation request and the events the scheduler emits for it."""
from __future__ import annotations

import os
from dataclasses import dataclass
from enum import Enum

import torch

from moeferry.scheduler.sampling import SamplingParams
from moeferry.transfer import to_device


class RequestState(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class TokenEvent:
    """What one step produced for one request."""
    request_id: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | "invalid" (the request's own input)
    prompt_tokens: int
    cached_tokens: int
    error: str | None = None


class Request:
    """Prompt, params, generated tokens and the cache resources the request holds."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: SamplingParams):
        if not prompt_ids:
            raise ValueError("prompt must contain at least one token")
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.output_ids: list[int] = []
        self.state = RequestState.WAITING
        self.finish_reason: str | None = None
        self.max_new_tokens = params.max_tokens  # clamped to the context at admission
        self.clamped = False
        # cache resources (moeferry.cache.manager.SeqBlocks while admitted)
        self.blocks = None
        self.num_computed = 0  # tokens whose KV / state is in the pools
        self.fed = -1  # >= 0: the newest token is row `fed` of the step sampled last, not read on the host yet
        self.cached_tokens = 0  # prompt tokens served from the prefix cache
        self.num_preemptions = 0
        self.matcher = None  # structured output: the grammar matcher, made in the worker when first sampled
        self.seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self._generators: dict[torch.device, torch.Generator] = {}
        self._seen: tuple[torch.Tensor, int] | None = None  # (the repetition penalty's token mask, tokens in it)
        self.arrival: int = 0
        self.queued_at = 0  # scheduler step at which it last entered the waiting queue
        self.admitted_at = 0  # scheduler step at which it last started running

    def generator(self, device: torch.device | str) -> torch.Generator:
        """The request's random stream on `device`, the one that draws its token this step (made
        on first use from its seed; one per device, so a request whose draws move between the
        host and the GPU continues each stream rather than restarting it)."""
        device = torch.device(device)
        if device not in self._generators:
            self._generators[device] = torch.Generator(device).manual_seed(self.seed)
        return self._generators[device]

    def seen_mask(self, vocab: int, device: torch.device | str) -> torch.Tensor:
        """[vocab] bool: the tokens of its prompt and outputs so far (the repetition penalty's set).
        Kept from step to step and only the new outputs marked: rebuilt from the whole context each
        step it cost 8 ms of host time a step at 100k tokens."""
        device = torch.device(device)
        mask, marked = self._seen if self._seen is not None else (None, 0)
        if mask is None or mask.device != device or mask.shape[0] != vocab:
            mask, marked = torch.zeros(vocab, dtype=torch.bool, device=device), 0
        new = self.prompt_ids[marked:] + self.output_ids[max(marked - len(self.prompt_ids), 0):]
        if new:
            # index_fill_, not `mask[ids] = True`: PyTorch makes that True a host tensor and copies it
            # to the device synchronously (the host would wait for the step in flight)
            mask.index_fill_(0, to_device(torch.tensor(new, dtype=torch.long), device), True)
        self._seen = (mask, len(self.prompt_ids) + len(self.output_ids))
        return mask

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def ids_between(self, start: int, end: int) -> list[int]:
        """all_ids[start:end] without building all_ids (a decode step wants the last token of a
        context that can be 100k long)."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p:end - p]
        if end <= p:
            return self.prompt_ids[start:end]
        return self.prompt_ids[start:] + self.output_ids[:end - p]

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens, the one still on its way from the device included."""
        return len(self.prompt_ids) + len(self.output_ids) + (self.fed >= 0)

    @property
    def pending(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED
