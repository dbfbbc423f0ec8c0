"""OpenAI wire format: request and response models (pydantic) and the error body.

Requests forbid unknown fields, so a misspelt parameter is a 400 naming it rather than a
silently ignored setting. Parameters OpenAI defines that this server does not implement are
declared and refused with a clear message (see `unsupported()`), never ignored. Non-OpenAI
sampling fields (top_k, min_p, repetition_penalty, min_tokens, stop_token_ids, ignore_eos)
are accepted the way vLLM and SGLang accept them (the openai client's `extra_body`).
"""
from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt


class ApiError(Exception):
    """An error the client gets as OpenAI's error body with `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    include_usage: StrictBool = False


# Ranges are checked by SamplingParams.validate(); these bounds only keep integers inside what the
# sampler's int64 tensors and torch.Generator seeds can hold. Numbers are strict, as OpenAI's API
# has them: "5", true or 5.5 for an integer is a 400 (an integer is fine for a float).
_INT32 = 2**31 - 1


class SamplingFields(_Request):
    """Sampling fields shared by both endpoints; None = not set (a default applies)."""
    model: str
    max_tokens: Optional[StrictInt] = Field(default=None, le=_INT32)
    temperature: Optional[StrictFloat] = None
    top_p: Optional[StrictFloat] = None
    top_k: Optional[StrictInt] = Field(default=None, le=_INT32)
    min_p: Optional[StrictFloat] = None
    presence_penalty: Optional[StrictFloat] = None
    frequency_penalty: Optional[StrictFloat] = None
    repetition_penalty: Optional[StrictFloat] = None
    seed: Optional[StrictInt] = Field(default=None, ge=-(2**63), le=2**64 - 1)
    min_tokens: Optional[StrictInt] = Field(default=None, le=_INT32)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[StrictInt]] = None
    ignore_eos: Optional[StrictBool] = None
    n: Optional[StrictInt] = None
    stream: StrictBool = False  # strict: "yes", "1" or 1 is a 400, not true
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None  # an end-user id for the caller's own bookkeeping; logged, nothing else
    logit_bias: Optional[dict[str, StrictFloat]] = None  # {"token id": bias in [-100, 100]}, added to the logits

    def unsupported(self) -> list[tuple[str, str]]:
        """(param, why) for set parameters this server does not implement (a request type adds them)."""
        return []


# ---------------------------------------------------------------- chat


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: FunctionDef


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: Union[str, dict[str, Any]] = ""


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: Optional[str] = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: Optional[str] = None


class ChatMessage(BaseModel):
    # Unknown message keys are kept and handed to the chat template (which may use them).
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None
    reasoning_content: Optional[str] = None


class ResponseFormat(_Request):
    type: str
    json_schema: Optional[dict[str, Any]] = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = Field(default=None, le=_INT32)
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=20)
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], dict[str, Any]]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    response_format: Optional[ResponseFormat] = None
    parallel_tool_calls: Optional[bool] = None
    reasoning_effort: Optional[str] = None



# ---------------------------------------------------------------- completions


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[StrictInt], list[str], list[list[StrictInt]]]
    logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=20)
    echo: StrictBool = False
    suffix: Optional[str] = None
    best_of: Optional[StrictInt] = None

    def unsupported(self) -> list[tuple[str, str]]:
        out = super().unsupported()
        if self.echo and self.logprobs is not None:
            out.append(("echo", "echo with logprobs (the log probabilities of the prompt's tokens) is not supported yet"))
        if self.suffix:
            out.append(("suffix", "suffix (fill-in-the-middle) is not supported yet"))
        return out


# ---------------------------------------------------------------- responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    content: Optional[list[TokenLogprobOut]] = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # a JSON object as text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[ToolCallOut]] = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None


def _now() -> int:
    return int(time.time())


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaFunction(BaseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None


class DeltaToolCall(BaseModel):
    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: DeltaFunction


class Delta(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = None
    tool_calls: Optional[list[DeltaToolCall]] = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "moeferry"
    max_model_len: int
    root: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
