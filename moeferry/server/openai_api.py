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

from moeferry.server.generation import Generation, Piece
from moeferry.server.protocol import (ApiError, AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletion,
                                      ChatCompletionChunk, ChatCompletionRequest, ChoiceLogprobs, Completion,
                                      CompletionChoice, CompletionLogprobs, CompletionRequest, Delta, ModelCard,
                                      ModelList, PromptTokensDetails, SamplingFields, TokenLogprobOut, TopLogprob,
                                      Usage, bad_request)

log = logging.getLogger("moeferry.api")
router = APIRouter()

DISCONNECT_POLL_S = 0.5
# chat_template_kwargs may not override what the server passes itself.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "tokenize", "conversation"})


def _server(request: Request):
    return request.app.state.server


@router.get("/v1/models")
async def list_models(request: Request) -> ModelList:
    cfg = _server(request).cfg
    # `root` is the served name: the model's path on this machine is none of a client's business.
    return ModelList(data=[ModelCard(id=cfg.served_model_name, max_model_len=cfg.max_seq_len,
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


def render_chat(tokenizer, body: ChatCompletionRequest, max_tokens: int | None = None) -> list[int]:
    kwargs = dict(body.chat_template_kwargs or {})
    reserved = RESERVED_TEMPLATE_KWARGS & kwargs.keys()
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}",
                          param="chat_template_kwargs")
    tools = None
    if body.tools and body.tool_choice != "none":
        tools = [t.model_dump(exclude_none=True) for t in body.tools]
    messages = chat_messages(body)
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, **kwargs)
    except Exception as e:  # noqa: BLE001 - a template refusing these messages is the client's error
        raise bad_request(f"the chat template could not render these messages: {type(e).__name__}: {e}",
                          param="messages") from None
    return tokenizer.encode(text, max_tokens)


def _usage(gen: Generation, cache_report: bool) -> Usage:
    return Usage(prompt_tokens=gen.prompt_tokens, completion_tokens=gen.completion_tokens,
                 total_tokens=gen.prompt_tokens + gen.completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=gen.cached_tokens) if cache_report else None)


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
    ids = await front.tokenize("messages", render_chat, body)
    front.check_prompt(ids, "messages")
    gen = await front.start(ids, params, "chatcmpl")
    cache_report = server.cfg.enable_cache_report
    model = server.cfg.served_model_name
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return _sse(_chat_chunks(gen, model, include_usage, cache_report), gen)
    pieces = await _collect(gen, request)
    if pieces is None:
        return Response(status_code=499)
    logprobs = None
    if params.logprobs is not None:
        logprobs = ChoiceLogprobs(content=[c for p in pieces for c in (_chat_logprobs(gen, p) or _NO_LOGPROBS).content])
    return ChatCompletion(
        id=gen.request_id, model=model, usage=_usage(gen, cache_report),
        choices=[ChatChoice(message=AssistantMessage(content="".join(p.text for p in pieces)), logprobs=logprobs,
                            finish_reason=pieces[-1].finish_reason)])


async def _chat_chunks(gen: Generation, model: str, include_usage: bool, cache_report: bool) -> AsyncIterator[str]:
    def chunk(delta: Delta, finish: str | None = None, logprobs: ChoiceLogprobs | None = None) -> str:
        return _event(ChatCompletionChunk(id=gen.request_id, model=model, choices=[
            ChatChunkChoice(delta=delta, logprobs=logprobs, finish_reason=finish)]))

    yield chunk(Delta(role="assistant", content=""))
    async for piece in gen.pieces():
        yield chunk(Delta(content=piece.text or None), piece.finish_reason, _chat_logprobs(gen, piece))
    if include_usage:
        yield _event(ChatCompletionChunk(id=gen.request_id, model=model, choices=[],
                                         usage=_usage(gen, cache_report)))


# ---------------------------------------------------------------- completions


def completion_prompt(tokenizer, prompt, max_tokens: int | None = None) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, max_tokens)
    if prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise bad_request(f"a list of {len(prompt)} prompts is not supported yet: send one request per prompt",
                              param="prompt")
        return completion_prompt(tokenizer, prompt[0], max_tokens)
    return list(prompt)


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
    ids = await front.tokenize("prompt", completion_prompt, body.prompt)
    front.check_prompt(ids, "prompt")
    gen = await front.start(ids, params, "cmpl")
    cache_report = server.cfg.enable_cache_report
    model = server.cfg.served_model_name
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return _sse(_completion_chunks(gen, model, include_usage, cache_report), gen)
    pieces = await _collect(gen, request)
    if pieces is None:
        return Response(status_code=499)
    logprobs = None
    if params.logprobs is not None:
        offsets, logprobs = _Offsets(), CompletionLogprobs()
        for p in pieces:
            part = offsets.convert(gen, p) or CompletionLogprobs()
            for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(logprobs, name).extend(getattr(part, name))
    return Completion(id=gen.request_id, model=model, usage=_usage(gen, cache_report), choices=[
        CompletionChoice(text="".join(p.text for p in pieces), logprobs=logprobs,
                         finish_reason=pieces[-1].finish_reason)])


async def _completion_chunks(gen: Generation, model: str, include_usage: bool,
                             cache_report: bool) -> AsyncIterator[str]:
    offsets = _Offsets()
    async for piece in gen.pieces():
        yield _event(Completion(id=gen.request_id, model=model, choices=[
            CompletionChoice(text=piece.text, logprobs=offsets.convert(gen, piece),
                             finish_reason=piece.finish_reason)]))
    if include_usage:
        yield _event(Completion(id=gen.request_id, model=model, choices=[], usage=_usage(gen, cache_report)))


# ---------------------------------------------------------------- plumbing


def _event(model) -> str:
    """One SSE event. Unset fields are left out, except that every choice carries `finish_reason` and
    `logprobs` (null until set), as OpenAI's chunks do."""
    data = model.model_dump(exclude_none=True)
    for choice in data.get("choices", ()):
        choice.setdefault("logprobs", None)
        choice.setdefault("finish_reason", None)
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _sse(chunks: AsyncIterator[str], gen: Generation) -> StreamingResponse:
    async def stream():
        try:
            async for text in chunks:
                yield text
        except ApiError as e:
            log.warning("stream %s ended with an error: %s", gen.request_id, e.message)
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:
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


class _AsciiJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error message may quote a client's text, lone surrogates included."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(e: ApiError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 503 else None
    return _AsciiJSONResponse(e.body(), status_code=e.status, headers=headers)
