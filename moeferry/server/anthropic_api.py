"""Anthropic Messages API: /v1/messages (with SSE streaming) and /v1/messages/count_tokens.

A request is translated into the chat-template messages the OpenAI route uses (system prompt,
text, tool_use -> assistant tool_calls, tool_result -> tool messages, thinking -> the assistant's
reasoning_content), planned and rendered by `chat_plan`, and its output read back by the same
parsers into content blocks: `thinking`, `text`, `tool_use`. Streaming sends Anthropic's event
sequence: message_start, ping, then per block content_block_start / content_block_delta /
content_block_stop, then message_delta (stop_reason, usage) and message_stop. Errors have
Anthropic's shape: {"type": "error", "error": {"type": ..., "message": ...}}.

`thinking.budget_tokens` is checked as Anthropic checks it (>= 1024, < max_tokens) but bounds
the thinking only through max_tokens: Qwen3 has no thinking budget to set.
"""
from __future__ import annotations

import json
import logging
import uuid
from typing import Any, AsyncIterator, Literal, Optional, Union

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

from moeferry.server.chat_plan import ChatPlan, plan_chat
from moeferry.server.generation import Generation
from moeferry.server.openai_api import AsciiJSONResponse, _collect, _server
from moeferry.server.protocol import ApiError, SamplingFields, bad_request
from moeferry.server.structured import forced_tool_params
from moeferry.text.chat_output import ChatOutput, Content, ParsedToolCall, Reasoning

log = logging.getLogger("moeferry.anthropic")
router = APIRouter()

_INT32 = 2**31 - 1
# HTTP status -> Anthropic error type.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error", 529: "overloaded_error"}


def error_body(e: ApiError) -> dict:
    message = e.message if not e.param or e.param in e.message else f"{e.param}: {e.message}"
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error" if e.status >= 500
                                                               else "invalid_request_error"), "message": message}}


def error_response(e: ApiError) -> AsciiJSONResponse:
    headers = {"Retry-After": "1"} if e.status == 503 else None
    return AsciiJSONResponse(error_body(e), status_code=e.status, headers=headers)


# ---------------------------------------------------------------- request


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class InputMessage(_Strict):
    role: Literal["user", "assistant"]
    content: Union[str, list[dict[str, Any]]]


class CountTokensRequest(_Strict):
    model: str
    messages: list[InputMessage] = Field(min_length=1)
    system: Optional[Union[str, list[dict[str, Any]]]] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[dict[str, Any]] = None
    thinking: Optional[dict[str, Any]] = None


class MessagesRequest(CountTokensRequest):
    max_tokens: StrictInt = Field(ge=1, le=_INT32)  # numbers strict: "5" or true is a 400
    stop_sequences: Optional[list[str]] = None
    stream: StrictBool = False  # strict: "yes" or 1 is a 400, not true
    temperature: Optional[StrictFloat] = Field(default=None, ge=0.0, le=1.0)
    top_p: Optional[StrictFloat] = None
    top_k: Optional[StrictInt] = Field(default=None, ge=0, le=_INT32)
    metadata: Optional[dict[str, Any]] = None


def _block_text(block, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        raise bad_request(f"content blocks of type '{kind}' are not supported here (this server is text-only)",
                          param=where)
    return block["text"]


def _text_of(blocks, where: str) -> str:
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise bad_request(f"content must be a string or a list of content blocks, got {type(blocks).__name__}",
                          param=where)
    return "".join(_block_text(b, f"{where}[{i}]") for i, b in enumerate(blocks))


def _assistant(msg: InputMessage, where: str) -> dict:
    if isinstance(msg.content, str):
        return {"role": "assistant", "content": msg.content}
    text, reasoning, calls = [], [], []
    for i, b in enumerate(msg.content):
        kind = b.get("type")
        if kind == "text":
            text.append(_block_text(b, f"{where}[{i}]"))
        elif kind == "thinking":
            if not isinstance(b.get("thinking", ""), str):
                raise bad_request("a thinking block's thinking must be a string", param=f"{where}[{i}]")
            reasoning.append(b.get("thinking", ""))
        elif kind == "redacted_thinking":
            continue
        elif kind == "tool_use":
            if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                raise bad_request("a tool_use block needs a name and an input object", param=f"{where}[{i}]")
            calls.append({"id": str(b.get("id", "")), "type": "function",
                          "function": {"name": b["name"], "arguments": b.get("input", {})}})
        else:
            raise bad_request(f"assistant content blocks of type '{kind}' are not supported", param=f"{where}[{i}]")
    out = {"role": "assistant", "content": "".join(text)}
    if reasoning:
        out["reasoning_content"] = "".join(reasoning)
    if calls:
        out["tool_calls"] = calls
    return out


def _user(msg: InputMessage, where: str) -> list[dict]:
    """A user turn: its tool_result blocks become tool messages, its text a user message."""
    if isinstance(msg.content, str):
        return [{"role": "user", "content": msg.content}]
    out, text = [], []
    for i, b in enumerate(msg.content):
        if b.get("type") == "tool_result":
            content = b.get("content", "")
            result = _text_of(content, f"{where}[{i}].content") if content else ""
            if not isinstance(b.get("is_error", False), bool):
                raise bad_request("is_error must be true or false", param=f"{where}[{i}].is_error")
            if b.get("is_error"):
                result = f"Error: {result}"
            out.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")), "content": result})
        else:
            text.append(_block_text(b, f"{where}[{i}]"))
    if text:
        out.append({"role": "user", "content": "".join(text)})
    return out


def chat_messages(body: CountTokensRequest) -> list[dict]:
    out = []
    if body.system:
        out.append({"role": "system", "content": _text_of(body.system, "system")})
    for i, m in enumerate(body.messages):
        where = f"messages[{i}].content"
        out += _user(m, where) if m.role == "user" else [_assistant(m, where)]
    return out


def _tools(body: CountTokensRequest) -> list[dict] | None:
    if not body.tools:
        return None
    out = []
    for i, t in enumerate(body.tools):
        if t.get("type") not in (None, "custom") or not isinstance(t.get("name"), str):
            raise bad_request(f"tool type '{t.get('type')}' is not supported: only custom tools with a name and an "
                              "input_schema", param=f"tools[{i}]")
        schema = t.get("input_schema")
        if not isinstance(schema, dict):
            raise bad_request("a tool needs an input_schema object", param=f"tools[{i}].input_schema")
        fn = {"name": t["name"], "parameters": schema}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: dict | None) -> tuple[Any, bool | None]:
    """Anthropic tool_choice -> (OpenAI tool_choice, parallel)."""
    if choice is None:
        return None, None
    parallel = False if choice.get("disable_parallel_tool_use") else None
    kind = choice.get("type")
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice of type 'tool' needs a name", param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind) if isinstance(kind, str) else None
    if mapped is None:
        raise bad_request(f"tool_choice type must be auto, any, tool or none, got {kind!r}", param="tool_choice")
    return mapped, parallel


def _thinking(body: CountTokensRequest) -> dict:
    t = body.thinking
    if t is None:
        return {}
    kind = t.get("type")
    if kind == "disabled":
        return {"enable_thinking": False}
    if kind not in ("enabled", "adaptive"):
        raise bad_request(f"thinking.type must be enabled, adaptive or disabled, got {kind!r}", param="thinking")
    budget = t.get("budget_tokens")
    if kind == "enabled":
        if not isinstance(budget, int) or budget < 1024:
            raise bad_request("thinking.budget_tokens must be an integer >= 1024", param="thinking.budget_tokens")
        if isinstance(body, MessagesRequest) and budget >= body.max_tokens:
            raise bad_request("max_tokens must be greater than thinking.budget_tokens",
                              param="thinking.budget_tokens")
    return {"enable_thinking": True}


def _check_model(server, model: str) -> None:
    if model != server.cfg.served_model_name:
        raise ApiError(404, f"model: {model} (this server serves '{server.cfg.served_model_name}')",
                       "not_found_error", "model", "model_not_found")


def _plan(server, body: CountTokensRequest) -> ChatPlan:
    _check_model(server, body.model)
    kwargs = _thinking(body)
    if kwargs and "enable_thinking" not in (server.frontend.tokenizer.chat_template or ""):
        raise bad_request("thinking is not supported by this model: its chat template has no thinking switch",
                          param="thinking")
    choice, parallel = _tool_choice(body.tool_choice)
    return plan_chat(server.cfg, server.frontend.tokenizer, _tools(body), choice, parallel, kwargs)


# ---------------------------------------------------------------- routes


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> dict:
    server = _server(request)
    plan = _plan(server, body)
    ids, _ = await server.frontend.tokenize("messages", plan.render, chat_messages(body))
    return {"input_tokens": len(ids)}


@router.post("/v1/messages")
async def messages(body: MessagesRequest, request: Request):
    server = _server(request)
    plan = _plan(server, body)
    front = server.frontend
    if body.metadata and body.metadata.get("user_id"):
        log.debug("message for user %r", body.metadata["user_id"])
    fields = SamplingFields(model=body.model, max_tokens=body.max_tokens, temperature=body.temperature,
                            top_p=body.top_p, top_k=body.top_k, stop=body.stop_sequences)
    params = forced_tool_params(front.sampling_params(fields, body.max_tokens, None), plan, front.tokenizer,
                                server.cfg.model_dir)
    ids, prompt_text = await front.tokenize("messages", plan.render, chat_messages(body))
    front.check_prompt(ids, "messages")
    gen = await front.start(ids, params, "msg")
    msg_id = "msg_" + gen.request_id.split("-", 1)[1]
    output = plan.output(prompt_text)
    if body.stream:
        return _stream(_events(gen, msg_id, body.model, output, server.cfg.enable_cache_report), gen)
    pieces = await _collect(gen, request)
    if pieces is None:
        return Response(status_code=499)
    items = output.feed("".join(p.text for p in pieces)) + output.finish()
    return {"id": msg_id, "type": "message", "role": "assistant", "model": body.model,
            "content": _blocks(items), "stop_reason": _stop_reason(gen, pieces[-1].finish_reason, output.num_calls),
            "stop_sequence": gen.stop_string, "usage": _usage(gen, server.cfg.enable_cache_report)}


def _tool_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _blocks(items: list) -> list[dict]:
    blocks: list[dict] = []
    for item in items:
        if isinstance(item, ParsedToolCall):
            blocks.append({"type": "tool_use", "id": _tool_id(), "name": item.name,
                           "input": json.loads(item.arguments)})
        elif isinstance(item, Reasoning):
            if blocks and blocks[-1]["type"] == "thinking":
                blocks[-1]["thinking"] += item.text
            else:
                blocks.append({"type": "thinking", "thinking": item.text, "signature": ""})
        elif isinstance(item, Content):
            if blocks and blocks[-1]["type"] == "text":
                blocks[-1]["text"] += item.text
            else:
                blocks.append({"type": "text", "text": item.text})
    return blocks


def _stop_reason(gen: Generation, finish: str | None, num_calls: int) -> str:
    if finish == "length":
        return "max_tokens"
    if gen.stop_string is not None:
        return "stop_sequence"
    return "tool_use" if num_calls else "end_turn"


def _usage(gen: Generation, cache_report: bool) -> dict:
    usage = {"input_tokens": gen.prompt_tokens, "output_tokens": gen.completion_tokens}
    if cache_report:
        usage["cache_read_input_tokens"] = gen.cached_tokens
    return usage


# ---------------------------------------------------------------- streaming


def _sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps({'type': event, **data}, ensure_ascii=False)}\n\n"


class _Blocks:
    """The open content block of a stream; a change of kind closes it and opens the next."""

    def __init__(self):
        self.index = -1
        self.kind: str | None = None

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        out = []
        if self.kind == "thinking":
            out.append(_sse("content_block_delta", {"index": self.index,
                                                    "delta": {"type": "signature_delta", "signature": ""}}))
        out.append(_sse("content_block_stop", {"index": self.index}))
        self.kind = None
        return out

    def open(self, kind: str, block: dict) -> list[str]:
        out = self.close()
        self.index += 1
        self.kind = kind
        return out + [_sse("content_block_start", {"index": self.index, "content_block": block})]

    def item(self, item) -> list[str]:
        if isinstance(item, ParsedToolCall):
            out = self.open("tool_use", {"type": "tool_use", "id": _tool_id(), "name": item.name, "input": {}})
            out.append(_sse("content_block_delta", {"index": self.index, "delta": {
                "type": "input_json_delta", "partial_json": item.arguments}}))
            return out + self.close()
        kind, field, delta = (("thinking", "thinking", "thinking_delta") if isinstance(item, Reasoning)
                              else ("text", "text", "text_delta"))
        out = [] if self.kind == kind else self.open(kind, {"type": kind, field: "",
                                                           **({"signature": ""} if kind == "thinking" else {})})
        return out + [_sse("content_block_delta", {"index": self.index, "delta": {"type": delta, field: item.text}})]


async def _events(gen: Generation, msg_id: str, model: str, output: ChatOutput,
                  cache_report: bool) -> AsyncIterator[str]:
    yield _sse("message_start", {"message": {
        "id": msg_id, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
        "stop_sequence": None, "usage": {"input_tokens": gen.prompt_tokens, "output_tokens": 0}}})
    yield _sse("ping", {})
    blocks = _Blocks()
    finish = None
    async for piece in gen.pieces():
        items = output.feed(piece.text) + (output.finish() if piece.finish_reason else [])
        for item in items:
            for event in blocks.item(item):
                yield event
        finish = piece.finish_reason or finish
    for event in blocks.close():
        yield event
    yield _sse("message_delta", {"delta": {"stop_reason": _stop_reason(gen, finish, output.num_calls),
                                           "stop_sequence": gen.stop_string},
                                 "usage": _usage(gen, cache_report)})
    yield _sse("message_stop", {})


def _stream(events: AsyncIterator[str], gen: Generation) -> StreamingResponse:
    async def stream():
        try:
            async for text in events:
                yield text
        except ApiError as e:
            log.warning("stream %s ended with an error: %s", gen.request_id, e.message)
            yield f"event: error\ndata: {json.dumps(error_body(e))}\n\n"
        finally:
            gen.close()

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
