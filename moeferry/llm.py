"""Offline API: `LLM(model_dir)` with `.logits`, `.generate` and `.chat`."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moeferry.config import warn_beyond_positions
from moeferry.engine.config import EngineConfig
from moeferry.engine.engine import Engine, resolve_dtype
from moeferry.model.batch import SeqChunk
from moeferry.scheduler.request import Request, TokenLogprob
from moeferry.scheduler.sampling import SamplingParams
from moeferry.scheduler.scheduler import Scheduler
from moeferry.text.detokenizer import IncrementalDetokenizer
from moeferry.text.tokenizer import Tokenizer


@dataclass
class GenerationOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None


class LLM:
    """The engine and a scheduler in this process. Keyword arguments are `EngineConfig` fields
    (`moeferry.engine.config`), e.g. `LLM(path, moe_backend="offload", moe_cache_size=64)`;
    `device` is auto (cuda if available, else cpu), cpu, cuda or cuda:N, as `serve --device`;
    `num_tokens` is the KV capacity (default: one full context, or the memory plan's), `dtype="auto"`
    is bf16 on CUDA, fp32 elsewhere. A max_tokens beyond what the context leaves is clamped to it
    (finish_reason length), as in the server."""

    def __init__(self, model_dir: str, device: str = "auto", dtype: str = "auto", num_tokens: int | None = None,
                 **engine_kwargs):
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype_name = str(resolve_dtype(dtype, device)).removeprefix("torch.")
        self.cfg = EngineConfig(model_dir=str(model_dir), device=device, dtype=dtype_name, num_tokens=num_tokens,
                                **engine_kwargs)
        self.engine = Engine.build(self.cfg)
        self.spec = self.engine.spec
        if self.cfg.max_seq_len is not None and self.cfg.max_seq_len > self.spec.max_position_embeddings:
            warn_beyond_positions(self.cfg.max_seq_len, self.spec.max_position_embeddings, "max_seq_len")
        self.scheduler = Scheduler(self.engine)
        self.tokenizer = (Tokenizer.from_dir(model_dir, self.spec.eos_token_ids)
                          if (Path(model_dir) / "tokenizer.json").is_file() else None)
        self._ids = itertools.count()

    # --- scoring ------------------------------------------------------------------------
    def logits(self, token_ids: list[int], chunk_size: int | None = None) -> torch.Tensor:
        """[len, vocab] fp32 logits of every position, prefilled through the pools in chunks."""
        return self.logits_batch([token_ids], chunk_size)[0]

    def logits_batch(self, prompts: list[list[int]], chunk_size: int | list[int] | None = None) -> list[torch.Tensor]:
        """Score several sequences in shared steps. chunk_size: tokens per step per sequence (int),
        or a list of chunk lengths applied to every sequence (the last one repeats)."""
        with self.engine.cache.sequences([len(p) for p in prompts]) as held:
            return self._score(prompts, held, chunk_size)

    def _score(self, prompts, held, chunk_size) -> list[torch.Tensor]:
        outs: list[list[torch.Tensor]] = [[] for _ in prompts]
        done, step = [0] * len(prompts), 0
        while any(d < len(p) for d, p in zip(done, prompts)):
            size = chunk_size[min(step, len(chunk_size) - 1)] if isinstance(chunk_size, (list, tuple)) else chunk_size
            chunks, owners = [], []
            for i, (p, b) in enumerate(zip(prompts, held)):
                if done[i] < len(p):
                    n = min(size or len(p), len(p) - done[i])
                    chunks.append(SeqChunk(p[done[i]:done[i] + n], done[i], b.pages, b.state_slot, all_logits=True))
                    owners.append((i, n))
                    done[i] += n
            logits, row = self.engine.forward(chunks), 0
            for i, n in owners:
                outs[i].append(logits[row:row + n])
                row += n
            step += 1
        return [torch.cat(o) for o in outs]

    # --- generation ---------------------------------------------------------------------
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None) -> list[GenerationOutput]:
        """prompts: a string, a list of token ids, or a list of either."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        per = params if isinstance(params, list) else [params] * len(prompts)
        if len(per) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per)} SamplingParams")
        outputs, detoks = {}, {}
        for prompt, p in zip(prompts, per):
            ids = self._encode(prompt)
            req = Request(f"gen-{next(self._ids)}", ids, p.validate())
            self.scheduler.add(req)
            outputs[req.request_id] = GenerationOutput(req.request_id, ids, logprobs=[] if p.logprobs is not None else None)
            detoks[req.request_id] = IncrementalDetokenizer(self.tokenizer, p.stop) if self.tokenizer else None
        while any(o.finish_reason is None for o in outputs.values()):
            for ev in self.scheduler.step():
                if ev.request_id in outputs:  # skip late events of earlier calls (e.g. stop-string aborts)
                    self._apply(outputs[ev.request_id], detoks[ev.request_id], ev)
        return list(outputs.values())

    def _apply(self, out: GenerationOutput, detok, ev) -> None:
        if out.finish_reason is not None:
            return  # already ended by a stop string
        out.token_ids += ev.token_ids
        out.cached_tokens = ev.cached_tokens
        if ev.logprobs and out.logprobs is not None:
            out.logprobs += ev.logprobs
        if detok is not None:
            out.text += detok.feed(ev.token_ids)
            if detok.stopped:
                out.finish_reason = "stop"
                self.scheduler.abort(ev.request_id)
                return
        if ev.finished:
            out.finish_reason, out.error = ev.finish_reason, ev.error
            if detok is not None:
                out.text += detok.flush()

    def chat(self, messages: list[dict] | list[list[dict]], params: SamplingParams | list[SamplingParams] | None = None,
             tools: list[dict] | None = None, enable_thinking: bool | None = None,
             chat_template_kwargs: dict | None = None) -> list[GenerationOutput]:
        """One conversation (a list of messages) or several; returns what `generate` returns:
        one GenerationOutput per conversation. enable_thinking None = the template's default."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        kwargs = dict(chat_template_kwargs or {})
        if enable_thinking is not None:
            kwargs["enable_thinking"] = enable_thinking
        texts = [self._tokenizer().apply_chat_template(c, tools=tools, add_generation_prompt=True, **kwargs)
                 for c in conversations]
        return self.generate(texts, params)

    def _encode(self, prompt) -> list[int]:
        return self._tokenizer().encode(prompt) if isinstance(prompt, str) else list(prompt)

    def _tokenizer(self) -> Tokenizer:
        if self.tokenizer is None:
            raise ValueError("this model directory has no tokenizer.json; pass token ids")
        return self.tokenizer
