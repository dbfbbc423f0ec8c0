"""OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/completions (with SSE streaming).

A route checks the model name and the parameters, renders and tokenizes the prompt, and asks
the Frontend to start a generation (which waits until the worker accepted it, so refusals are
proper HTTP errors). Streaming responses are `data: {chunk}` server-sent events ending with
`data: [DONE]`; an error after the stream began (the worker died, the engine failed) is sent
as one `data: {"error": ...}` event before `[DONE]`, which the openai client raises.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from moeferry.server.chat_plan import ChatPlan, finish_reason, plan_chat
from moeferry.server.choices import MAX_CHOICES, merge, start_choices
from moeferry.server.generation import Generation, Piece
from moeferry.server.protocol import (ApiError, AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion,
                                      ChatCompletionChunk, ChatCompletionRequest, ChoiceLogprobs, Completion,
                                      CompletionChoice, CompletionLogprobs, CompletionRequest, Delta, DeltaFunction,
                                      DeltaToolCall, FunctionCallOut, ModelCard, ModelList, PromptTokensDetails,
                                      SamplingFields, TokenLogprobOut, ToolCallOut, TopLogprob, Usage, bad_request)
from moeferry.server.structured import forced_tool_params, structured_params
from moeferry.text.chat_output import ChatOutput, Content, ParsedToolCall, Reasoning

log = logging.getLogger("moeferry.api")
router = APIRouter()

DISCONNECT_POLL_S = 0.5


def _server(request: Request):
    return request.app.state.server


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    server = _server(request)
    cfg = server.cfg
    # `root` is the served name: the model's path on this machine is none of a client's business.
    return ModelList(data=[ModelCard(id=cfg.served_model_name, max_model_len=server.frontend.max_seq_len,
                                     root=cfg.served_model_name)])


def _check_request(server, body: SamplingFields) -> None:
    if body.model != server.cfg.served_model_name:
        raise ApiError(404, f"The model '{body.model}' does not exist; this server serves "
                            f"'{server.cfg.served_model_name}'", "invalid_request_error", "model", "model_not_found")
    for param, why in body.unsupported():
        raise bad_request(why, param=param)
    if body.user:
        log.debug("request for user %r", body.user)


# ---------------------------------------------------------------- chat


def chat_messages(body: ChatCompletionRequest) -> list[dict]:
    """Messages as the chat template expects them: text content, developer -> system, tool-call
    arguments as objects (templates iterate over them)."""
    out = []
    for i, m in enumerate(body.messages):
        d = m.model_dump(exclude_none=True)
        d["role"] = "system" if m.role == "developer" else m.role
        if isinstance(m.content, list):
            for part in m.content:
                if part.type != "text" or part.text is None:
                    raise bad_request(f"content parts of type '{part.type}' are not supported (this server is "
                                      "text-only)", param=f"messages[{i}].content")
            d["content"] = "".join(part.text for part in m.content)
        elif m.content is None:
            d["content"] = ""
        for call in d.get("tool_calls", []):
            args = call["function"].get("arguments")
            if isinstance(args, str):
                try:
                    parsed = json.loads(args) if args.strip() else {}
                except ValueError:
                    parsed = None
                if isinstance(parsed, dict):
                    call["function"]["arguments"] = parsed
        out.append(d)
    return out


def chat_plan(server, body: ChatCompletionRequest) -> ChatPlan:
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    plan = plan_chat(server.cfg, server.frontend.tokenizer, tools, body.tool_choice, body.parallel_tool_calls,
                     body.chat_template_kwargs, body.reasoning_effort)
    if body.response_format is not None and body.response_format.type != "text":
        if plan.forced_tool is not None:
            raise bad_request("response_format cannot be combined with a forced tool_choice", param="response_format")
        plan.answer_only = True  # the JSON is the answer: no thinking block before it, no tool calls in it
        plan.tools_read = False
    return plan


def _per_prompt(items: list, size: int) -> list[list]:
    """Items in runs of `size`, one run per prompt (`start_choices` starts a prompt's choices together)."""
    return [items[i:i + size] for i in range(0, len(items), size)]


def _usage(gens: list[Generation], cache_report: bool, n: int | None = None) -> Usage:
    """A prompt counts once however many choices were generated from it (`n` choices a prompt,
    in runs: a completions request may list several prompts; default: one prompt)."""
    runs = _per_prompt(gens, n or len(gens))
    prompt, completion = sum(run[0].prompt_tokens for run in runs), sum(g.completion_tokens for g in gens)
    cached = sum(max(g.cached_tokens for g in run) for run in runs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached) if cache_report else None)


_NO_LOGPROBS = ChoiceLogprobs(content=[])


def _chat_logprobs(gen: Generation, piece: Piece) -> ChoiceLogprobs | None:
    if piece.logprobs is None:
        return None
    out = []
    for lp in piece.logprobs:
        text = gen.token_text(lp.token_id)
        top = [TopLogprob(token=(t := gen.token_text(tid)), logprob=v, bytes=list(t.encode()))
               for tid, v in lp.top]
        out.append(TokenLogprobOut(token=text, logprob=lp.logprob, bytes=list(text.encode()), top_logprobs=top))
    return ChoiceLogprobs(content=out)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    server = _server(request)
    _check_request(server, body)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    front = server.frontend
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = front.sampling_params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
    params = structured_params(params, body.response_format, server.cfg.model_dir)
    plan = chat_plan(server, body)
    params = forced_tool_params(params, plan, front.tokenizer, server.cfg.model_dir)
    ids, prompt_text = await front.tokenize("messages", plan.render, chat_messages(body))
    front.check_prompt(ids, "messages")
    gens = await start_choices(front, [ids], params, "chatcmpl", 1 if body.n is None else body.n)
    cache_report = server.cfg.enable_cache_report
    model = server.cfg.served_model_name
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = merge([_chat_chunks(g, i, model, plan.output(prompt_text)) for i, g in enumerate(gens)])
        return _sse(_with_usage(chunks, gens, model, include_usage, cache_report, ChatCompletionChunk), gens)
    results = await asyncio.gather(*[_collect(g, request) for g in gens])
    if any(pieces is None for pieces in results):
        return Response(status_code=499)
    choices = [_chat_choice(g, i, pieces, plan.output(prompt_text), params.logprobs is not None)
               for i, (g, pieces) in enumerate(zip(gens, results))]
    return ChatCompletion(id=gens[0].request_id, model=model, usage=_usage(gens, cache_report), choices=choices)


def _chat_choice(gen: Generation, index: int, pieces: list[Piece], output: ChatOutput, logprobs: bool) -> ChatChoice:
    items = output.feed("".join(p.text for p in pieces)) + output.finish()
    reasoning, content, calls = ChatOutput.collect(items)
    lp = None
    if logprobs:
        lp = ChoiceLogprobs(content=[c for p in pieces for c in (_chat_logprobs(gen, p) or _NO_LOGPROBS).content])
    message = AssistantMessage(content=content, reasoning_content=reasoning, tool_calls=[
        ToolCallOut(id=c.id, function=FunctionCallOut(name=c.name, arguments=c.arguments)) for c in calls] or None)
    return ChatChoice(index=index, message=message, logprobs=lp,
                      finish_reason=finish_reason(pieces[-1].finish_reason, len(calls)))


def _deltas(items: list, output: ChatOutput, calls_before: int) -> list[Delta]:
    """Items of the parsed output as deltas; a tool call is its id and name, then its arguments."""
    out, index = [], calls_before
    for item in items:
        if isinstance(item, Reasoning):
            out.append(Delta(reasoning_content=item.text))
        elif isinstance(item, Content):
            out.append(Delta(content=item.text))
        elif isinstance(item, ParsedToolCall):
            out.append(Delta(tool_calls=[DeltaToolCall(index=index, id=item.id, type="function",
                                                       function=DeltaFunction(name=item.name, arguments=""))]))
            out.append(Delta(tool_calls=[DeltaToolCall(index=index, function=DeltaFunction(arguments=item.arguments))]))
            index += 1
    return out


async def _chat_chunks(gen: Generation, index: int, model: str, output: ChatOutput) -> AsyncIterator[str]:
    def chunk(delta: Delta, finish: str | None = None, logprobs: ChoiceLogprobs | None = None) -> str:
        return _event(ChatCompletionChunk(id=gen.request_id, model=model, choices=[
            ChatChunkChoice(index=index, delta=delta, logprobs=logprobs, finish_reason=finish)]))

    yield chunk(Delta(role="assistant", content=""))
    async for piece in gen.pieces():
        before = output.num_calls
        items = output.feed(piece.text) + (output.finish() if piece.finish_reason else [])
        deltas = _deltas(items, output, before) or [Delta()]
        logprobs = _chat_logprobs(gen, piece)
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            yield chunk(delta, finish_reason(piece.finish_reason, output.num_calls) if last else None,
                        logprobs if k == 0 else None)


# ---------------------------------------------------------------- completions


def completion_prompts(tokenizer, prompt, max_tokens: int | None = None) -> list[list[int]]:
    """A completions request's prompts as token ids: a text or a list of token ids is one
    prompt, a list of texts or of token-id lists is one prompt each."""
    if isinstance(prompt, str):
        return [tokenizer.encode(prompt, max_tokens)]
    if prompt and isinstance(prompt[0], (str, list)):
        return [completion_prompts(tokenizer, p, max_tokens)[0] for p in prompt]
    return [list(prompt)]


class _Offsets:
    """Completion logprobs: token strings and their offsets in the generated text."""

    def __init__(self):
        self.offset = 0

    def convert(self, gen: Generation, piece: Piece) -> CompletionLogprobs | None:
        if piece.logprobs is None:
            return None
        out = CompletionLogprobs()
        for lp in piece.logprobs:
            text = gen.token_text(lp.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append({gen.token_text(tid): v for tid, v in lp.top})
            out.text_offset.append(self.offset)
            self.offset += len(text)
        return out


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    server = _server(request)
    _check_request(server, body)
    front = server.frontend
    params = front.sampling_params(body, body.max_tokens, body.logprobs)
    prompts = await front.tokenize("prompt", completion_prompts, body.prompt)
    for ids in prompts:
        front.check_prompt(ids, "prompt")
    n = 1 if body.n is None else body.n
    best_of = _best_of(body, n)
    run = params if best_of == n or params.logprobs is not None else params.replace(logprobs=0)  # to rank them
    gens = await start_choices(front, prompts, run, "cmpl", best_of)
    cache_report = server.cfg.enable_cache_report
    model = server.cfg.served_model_name
    echoes = _echoes(front.tokenizer, body.prompt, prompts) if body.echo else [""] * len(prompts)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = merge([_completion_chunks(g, i, model, echoes[i // n]) for i, g in enumerate(gens)])
        return _sse(_with_usage(chunks, gens, model, include_usage, cache_report, Completion, n), gens)
    results = await asyncio.gather(*[_collect(g, request) for g in gens])
    if any(pieces is None for pieces in results):
        return Response(status_code=499)
    kept = [pair for run in _per_prompt(list(zip(gens, results)), best_of) for pair in _best(run, n)]
    choices = [_completion_choice(g, i, pieces, params.logprobs is not None, echoes[i // n])
               for i, (g, pieces) in enumerate(kept)]
    return Completion(id=gens[0].request_id, model=model, usage=_usage(gens, cache_report, best_of), choices=choices)


def _best_of(body: CompletionRequest, n: int) -> int:
    """Generations a prompt gets: best_of (at least n, at most MAX_CHOICES; not streamed when
    above n, as the n returned are known only at the end), default n."""
    if body.best_of is None or body.best_of == n:
        return n
    if not n <= body.best_of <= MAX_CHOICES:
        raise bad_request(f"best_of must be at least n ({n}) and at most {MAX_CHOICES}, got {body.best_of}",
                          param="best_of", code="invalid_value")
    if body.stream:
        raise bad_request("best_of > n cannot be streamed: the choices returned are known only at the end",
                          param="best_of", code="invalid_value")
    return body.best_of


def _best(runs: list[tuple[Generation, list[Piece]]], n: int) -> list[tuple[Generation, list[Piece]]]:
    """The n generations of one prompt with the highest log probability per token (OpenAI's best_of)."""
    def per_token(run) -> float:
        lps = [lp.logprob for piece in run[1] for lp in piece.logprobs or ()]
        return sum(lps) / len(lps) if lps else float("-inf")
    return sorted(runs, key=per_token, reverse=True)[:n] if len(runs) > n else runs


def _echoes(tokenizer, prompt, prompts: list[list[int]]) -> list[str]:
    """`echo`: each prompt as text (a text prompt as sent, token ids decoded, special tokens kept)."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], str):
        return list(prompt)
    return [tokenizer.decode(ids, skip_special_tokens=False) for ids in prompts]


def _completion_choice(gen: Generation, index: int, pieces: list[Piece], logprobs: bool,
                       echo: str = "") -> CompletionChoice:
    out = None
    if logprobs:
        offsets, out = _Offsets(), CompletionLogprobs()
        for p in pieces:
            part = offsets.convert(gen, p) or CompletionLogprobs()
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(out, name).extend(getattr(part, name))
    return CompletionChoice(index=index, text=echo + "".join(p.text for p in pieces), logprobs=out,
                            finish_reason=pieces[-1].finish_reason)


async def _completion_chunks(gen: Generation, index: int, model: str, echo: str = "") -> AsyncIterator[str]:
    offsets = _Offsets()
    if echo:  # the prompt first, as its own chunk
        yield _event(Completion(id=gen.request_id, model=model, choices=[CompletionChoice(index=index, text=echo)]))
    async for piece in gen.pieces():
        yield _event(Completion(id=gen.request_id, model=model, choices=[
            CompletionChoice(index=index, text=piece.text, logprobs=offsets.convert(gen, piece),
                             finish_reason=piece.finish_reason)]))


# ---------------------------------------------------------------- plumbing


def _event(model) -> str:
    """One SSE event. Unset fields are left out, except that every choice carries `finish_reason` and
    `logprobs` (null until set), as OpenAI's chunks do."""
    data = model.model_dump(exclude_none=True)
    for choice in data.get("choices", ()):
        choice.setdefault("logprobs", None)
        choice.setdefault("finish_reason", None)
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _with_usage(chunks: AsyncIterator[str], gens: list[Generation], model: str, include_usage: bool,
                      cache_report: bool, chunk_type, n: int | None = None) -> AsyncIterator[str]:
    """The choices' chunks, then (stream_options.include_usage) one chunk with the usage of all."""
    async for text in chunks:
        yield text
    if include_usage:
        yield _event(chunk_type(id=gens[0].request_id, model=model, choices=[], usage=_usage(gens, cache_report, n)))


def _sse(chunks: AsyncIterator[str], gens: list[Generation]) -> StreamingResponse:
    async def stream():
        try:
            async for text in chunks:
                yield text
        except ApiError as e:
            log.warning("stream %s ended with an error: %s", gens[0].request_id, e.message)
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:
            for gen in gens:
                gen.close()  # client gone mid-stream (cancelled here) -> abort in the worker
        yield "data: [DONE]\n\n"

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _collect(gen: Generation, request: Request) -> list[Piece] | None:
    """All pieces of a non-streaming generation; None (and the request aborted) if the client left."""
    pieces: list[Piece] = []

    async def consume():
        async for piece in gen.pieces():
            pieces.append(piece)

    task = asyncio.ensure_future(consume())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                task.result()  # raises the generation's ApiError
                return pieces
            if await request.is_disconnected():
                log.info("client of %s disconnected; aborting", gen.request_id)
                return None
    finally:
        if not task.done():
            task.cancel()
        gen.close()


class AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error message may quote a client's text, lone surrogates included."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(e: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 503 else None
    return AsciiJSONResponse(e.body(), status_code=e.status, headers=headers)
