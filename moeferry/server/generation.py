"""The API process's side of a generation: prompt -> token ids -> worker -> text pieces.

`Frontend` owns the tokenizer, the sampling defaults and the supervisor. `Frontend.start`
tokenizes, checks the context, resolves the sampling parameters, submits the request and
waits for the worker to accept it, so every refusal is an HTTP error before any byte of a
response is sent. The returned `Generation` is iterated for `Piece`s of text: detokenized
here, with stop strings matched in the text (the worker is told to abort when one matches).
Closing a `Generation` before it finished (client gone) aborts it in the worker.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from starlette.concurrency import run_in_threadpool

from moeferry.scheduler.request import Request, TokenEvent, TokenLogprob
from moeferry.scheduler.sampling import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS, SamplingParamError, SamplingParams
from moeferry.server.messages import Accepted, Rejected
from moeferry.server.protocol import ApiError, SamplingFields, bad_request
from moeferry.server.stats import ServerStats
from moeferry.server.supervisor import Supervisor, Unavailable, WorkerDied
from moeferry.text.detokenizer import IncrementalDetokenizer
from moeferry.text.tokenizer import InvalidText, TextTooLong

log = logging.getLogger("moeferry.api")

# Prompts tokenized at once (each in a worker thread, without the GIL); more wait their turn, so a
# burst of huge prompts cannot take every core and every thread from the API process.
MAX_CONCURRENT_TOKENIZE = 2

# generation_config.json key -> SamplingParams field, for --sampling-defaults model.
MODEL_DEFAULT_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                      "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# Request fields copied into SamplingParams when set.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "seed", "min_tokens", "ignore_eos")


def model_sampling_defaults(model_dir: str) -> dict:
    """The sampling fields generation_config.json sets (SamplingParams names)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text())
    except ValueError as e:
        log.warning("ignoring unreadable %s: %s", path, e)
        return {}
    return {field: cfg[key] for key, field in MODEL_DEFAULT_KEYS.items() if cfg.get(key) is not None}


@dataclass(frozen=True)
class Piece:
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # set on the last piece: stop | length


def engine_failure(message: str) -> ApiError:
    return ApiError(500, message, "server_error", None, "engine_error")


def worker_died(item: WorkerDied) -> ApiError:
    return ApiError(503, item.message, "server_error", None, item.code)


class Frontend:
    def __init__(self, supervisor: Supervisor, tokenizer, *, max_seq_len: int, vocab_size: int,
                 default_max_tokens: int | None, sampling_defaults: dict, stats: ServerStats):
        self.supervisor = supervisor
        self.tokenizer = tokenizer
        self._flag_max_seq_len = max_seq_len  # what the flags imply; the worker's Ready has the resolved one
        self.vocab_size = vocab_size
        self.default_max_tokens = default_max_tokens
        self.defaults = sampling_defaults
        self.stats = stats
        self._tokenizing = asyncio.Semaphore(MAX_CONCURRENT_TOKENIZE)

    # ------------------------------------------------------------ prompts

    async def tokenize(self, param: str, render, *args):
        """render(tokenizer, *args, max_tokens=...) -> token ids (or lists of them), run off the
        event loop (bounded).
        Text that is not valid Unicode, or that is provably longer than the context from its byte
        length alone (checked before tokenizing), is a 400."""
        async with self._tokenizing:
            try:
                return await run_in_threadpool(render, self.tokenizer, *args, max_tokens=self.max_seq_len)
            except InvalidText as e:
                raise bad_request(f"{param}: {e}", param=param, code="invalid_text") from None
            except TextTooLong as e:
                raise bad_request(f"This model's maximum context length is {self.max_seq_len} tokens. However, "
                                  f"your prompt has at least {e.min_tokens} tokens. Please shorten it.",
                                  param=param, code="context_length_exceeded") from None

    @property
    def max_seq_len(self) -> int:
        ready = getattr(self.supervisor, "ready", None)
        return ready.max_seq_len if ready is not None else self._flag_max_seq_len

    # ------------------------------------------------------------ parameters

    def sampling_params(self, req: SamplingFields, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        fields = {}
        for name in SAMPLING_FIELDS:
            value = getattr(req, name)
            if value is None:
                value = self.defaults.get(name)
            if value is not None:
                fields[name] = value
        if max_tokens is None:
            max_tokens = self.default_max_tokens or self.defaults.get("max_tokens")  # None: rest of the context
        fields["max_tokens"] = max_tokens
        if req.stop is not None:
            fields["stop"] = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)
        if req.stop_token_ids:
            fields["stop_token_ids"] = self._stop_token_ids(req.stop_token_ids)
        fields["logprobs"] = logprobs
        if req.logit_bias:
            fields["logit_bias"] = self._logit_bias(req.logit_bias)
        try:
            params = SamplingParams(**fields)
            params.validate()
        except SamplingParamError as e:
            raise bad_request(str(e), param=e.param, code="invalid_value") from None
        except (TypeError, ValueError) as e:
            raise bad_request(f"invalid sampling parameters: {e}", code="invalid_value") from None
        return params

    def _stop_token_ids(self, ids: list[int]) -> tuple[int, ...]:
        """At most MAX_STOP_TOKEN_IDS ids, each in the vocabulary (else a 400: the scheduler checks
        every sampled token against them)."""
        if len(ids) > MAX_STOP_TOKEN_IDS:
            raise bad_request(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}",
                              param="stop_token_ids", code="invalid_value")
        self.check_in_vocab(ids, "stop_token_ids", "stop_token_ids: ", "invalid_value")
        return tuple(ids)

    def _logit_bias(self, bias: dict[str, float]) -> tuple[tuple[int, float], ...]:
        """OpenAI's {"token id": bias} as (id, bias) pairs; a key that is not a token id is a 400."""
        if len(bias) > MAX_LOGIT_BIAS:  # before the loop: a 32 MiB body can hold millions of keys
            raise bad_request(f"logit_bias: at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}", param="logit_bias",
                              code="invalid_value")
        out = []
        for key, value in bias.items():
            if not key.isascii() or not key.isdigit():  # not int(): it takes " 5 ", "1_0" and other scripts' digits
                raise bad_request(f"logit_bias: keys must be token ids, got {key!r}", param="logit_bias",
                                  code="invalid_value")
            token = int(key)
            if not 0 <= token < self.vocab_size:
                raise bad_request(f"logit_bias: token id {token} is outside the vocabulary [0, {self.vocab_size})",
                                  param="logit_bias", code="invalid_value")
            out.append((token, float(value)))
        return tuple(out)

    def check_prompt(self, ids: list[int], param: str) -> None:
        if not ids:
            raise bad_request("the prompt is empty", param=param)
        if len(ids) >= self.max_seq_len:  # first: a huge prompt is refused without a scan of its ids
            raise bad_request(f"This model's maximum context length is {self.max_seq_len} tokens. However, your "
                              f"prompt has {len(ids)} tokens, leaving no room for output. Please shorten it.",
                              param=param, code="context_length_exceeded")
        self.check_in_vocab(ids, param)

    def check_in_vocab(self, ids: list[int], param: str, prefix: str = "", code: str | None = None) -> None:
        """A 400 naming the first id outside [0, vocab_size). (`min` and `max` clear a valid prompt
        in C: the scan in Python took 14 ms of the event loop for an agent's 200k-token prompt.)"""
        if not ids or (0 <= min(ids) and max(ids) < self.vocab_size):
            return
        bad = next((i for i in ids if not 0 <= i < self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"{prefix}token id {bad} is outside the vocabulary [0, {self.vocab_size})", param=param,
                              code=code)

    # ------------------------------------------------------------ running

    async def start(self, prompt_ids: list[int], params: SamplingParams, prefix: str) -> "Generation":
        """Submit and wait until the worker accepted the request; raises ApiError otherwise."""
        rid = f"{prefix}-{uuid.uuid4().hex[:24]}"
        loop = asyncio.get_running_loop()
        items: asyncio.Queue = asyncio.Queue()

        def sink(item) -> None:  # called on the supervisor thread
            loop.call_soon_threadsafe(items.put_nowait, item)

        try:
            request = Request(rid, list(prompt_ids), params)
        except (ValueError, RuntimeError) as e:
            raise bad_request(f"invalid request: {e}") from None
        try:
            self.supervisor.submit(request, sink)
        except Unavailable as e:
            self.stats.requests_rejected += 1
            raise ApiError(503, str(e), "server_error", None, f"server_{e.state}") from None
        gen = Generation(self, rid, len(prompt_ids), params, items)
        try:
            first = await items.get()
        except BaseException:  # cancelled while waiting (client gone)
            gen.close()
            raise
        if isinstance(first, Rejected):
            self.stats.requests_rejected += 1
            gen.finished = True
            if first.code == "internal_error":
                raise engine_failure(first.message)
            raise bad_request(first.message, param=first.param, code=first.code)
        if isinstance(first, WorkerDied):
            self.stats.requests_failed += 1
            gen.finished = True
            raise worker_died(first)
        assert isinstance(first, Accepted), first
        self.stats.requests_total += 1
        return gen


class Generation:
    """One request the worker accepted. Iterate for pieces; close() aborts it if unfinished."""

    def __init__(self, frontend: Frontend, request_id: str, prompt_len: int, params: SamplingParams,
                 items: asyncio.Queue):
        self.frontend = frontend
        self.request_id = request_id
        self.items = items
        self.prompt_tokens = prompt_len
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.finished = False
        self.started = time.monotonic()
        self._last_token = self.started  # when the previous tokens arrived (latency metrics)
        self._first = True
        self._detok = IncrementalDetokenizer(frontend.tokenizer, tuple(params.stop))

    async def pieces(self):
        """Yield Pieces until the last one (finish_reason set). Raises ApiError on failure."""
        stats = self.frontend.stats
        try:
            while not self.finished:
                item = await self.items.get()
                if isinstance(item, WorkerDied):
                    self.finished = True
                    stats.requests_failed += 1
                    raise worker_died(item)
                piece = self._on_event(item)
                if piece is not None:
                    yield piece
        finally:
            self.close()

    def _on_event(self, ev: TokenEvent) -> Piece | None:
        stats = self.frontend.stats
        first = self._first
        if first:
            self._first = False
            self.prompt_tokens = ev.prompt_tokens or self.prompt_tokens
            self.cached_tokens = ev.cached_tokens or 0
            stats.prefilled(self.prompt_tokens, self.cached_tokens, self.started)
        else:
            self.cached_tokens = max(self.cached_tokens, ev.cached_tokens or 0)
        if ev.finish_reason == "invalid":  # the engine found the request unservable as asked (its schema)
            self.finished = True
            stats.requests_rejected += 1
            raise bad_request(ev.error or "the request cannot be served as asked", code="invalid_value")
        if ev.finish_reason == "error" or (ev.finished and ev.finish_reason not in ("stop", "length")):
            self.finished = True
            stats.requests_failed += 1
            raise engine_failure(ev.error or f"the engine ended the request ({ev.finish_reason})")
        self.completion_tokens += len(ev.token_ids)
        stats.generated(len(ev.token_ids), self._last_token, first)
        if ev.token_ids:
            self._last_token = time.monotonic()
        try:
            text = self._detok.feed(ev.token_ids)
            if self._detok.stopped:  # a stop string ended the output: the worker stops too
                self.finished = True
                self.frontend.supervisor.abort(self.request_id)
                stats.requests_finished += 1
                self._log_done(f"stop string {self._detok.stop_reason!r}")
                return Piece(text, ev.token_ids, ev.logprobs, "stop")
            if ev.finished:
                text += self._detok.flush()
        except Exception as e:  # noqa: BLE001 - a detokenizer failure fails this request only
            log.exception("detokenizing %s failed", self.request_id)
            self.finished = True
            self.frontend.supervisor.abort(self.request_id)
            stats.requests_failed += 1
            raise engine_failure(f"detokenizing the output failed: {type(e).__name__}: {e}") from None
        if ev.finished:
            self.finished = True
            stats.requests_finished += 1
            self._log_done(ev.finish_reason)
            return Piece(text, ev.token_ids, ev.logprobs, ev.finish_reason)
        if not text and not ev.logprobs:
            return None
        return Piece(text, ev.token_ids, ev.logprobs, None)

    def _log_done(self, why: str) -> None:
        self.frontend.stats.request_done(self.started)
        log.info("%s done (%s): %d prompt tokens (%d cached), %d generated, %.2f s", self.request_id, why,
                 self.prompt_tokens, self.cached_tokens, self.completion_tokens, time.monotonic() - self.started)

    def close(self) -> None:
        """Abort in the worker unless finished. Idempotent."""
        if not self.finished:
            self.finished = True
            self.frontend.stats.requests_aborted += 1
            log.info("request %s aborted before it finished", self.request_id)
            self.frontend.supervisor.abort(self.request_id)

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the output, if one did."""
        return self._detok.stop_reason

    def token_text(self, token_id: int) -> str:
        return self.frontend.tokenizer.decode([token_id])
