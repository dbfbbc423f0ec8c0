"""/tokenize and /detokenize: the server's own tokenizer and chat template, for clients that count
or inspect tokens (the shapes vLLM and SGLang use)."""
from __future__ import annotations

from typing import Any, Optional, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool

from moeferry.server.chat_plan import plan_chat
from moeferry.server.protocol import ApiError, ChatMessage, Tool, bad_request
from moeferry.text.tokenizer import InvalidText

router = APIRouter()


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    prompt: Optional[str] = None  # raw text, or
    messages: Optional[list[ChatMessage]] = None  # a conversation rendered by the chat template
    tools: Optional[list[Tool]] = None
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: Optional[str] = None
    tokens: list[int] = Field(max_length=1_000_000)


def _check_model(server, model: str | None) -> None:
    if model is not None and model != server.cfg.served_model_name:
        raise ApiError(404, f"The model '{model}' does not exist; this server serves "
                            f"'{server.cfg.served_model_name}'", "invalid_request_error", "model", "model_not_found")


def _tokenize(server, body: TokenizeRequest) -> list[int]:
    tok = server.frontend.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("send exactly one of prompt (text) or messages (a conversation)", param="prompt")
    if body.prompt is not None:
        return tok.encode(body.prompt)
    from moeferry.server.openai_api import chat_messages
    from moeferry.server.protocol import ChatCompletionRequest

    try:
        chat = ChatCompletionRequest(model=server.cfg.served_model_name, messages=body.messages, tools=body.tools)
    except ValidationError as e:  # e.g. no messages: the client's error, as on /v1/chat/completions
        err = e.errors()[0]
        param = ".".join(str(p) for p in err.get("loc", ())) or "messages"
        raise bad_request(f"{param}: {err.get('msg')}", param=param) from None
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    plan = plan_chat(server.cfg, tok, tools, None, None, body.chat_template_kwargs)
    if not body.add_generation_prompt:
        try:
            text = tok.apply_chat_template(chat_messages(chat), tools=plan.tools, add_generation_prompt=False,
                                           **plan.template_kwargs)
        except Exception as e:  # noqa: BLE001
            raise bad_request(f"the chat template could not render these messages: {e}", param="messages") from None
        return tok.encode(text)
    return plan.render(tok, chat_messages(chat))[0]


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    server = request.app.state.server
    _check_model(server, body.model)
    try:
        ids = await run_in_threadpool(_tokenize, server, body)
    except InvalidText as e:  # lone surrogates: the client's text, as on the generation routes
        param = "prompt" if body.prompt is not None else "messages"
        raise bad_request(f"{param}: {e}", param=param, code="invalid_text") from None
    out: dict[str, Union[int, list]] = {"tokens": ids, "count": len(ids), "max_model_len": server.cfg.max_seq_len}
    if body.return_token_strs:
        out["token_strs"] = [server.frontend.tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    return out


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    server = request.app.state.server
    _check_model(server, body.model)
    server.frontend.check_in_vocab(body.tokens, "tokens")
    text = await run_in_threadpool(server.frontend.tokenizer.decode, body.tokens, False)
    return {"prompt": text}
