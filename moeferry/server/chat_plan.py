"""How one chat request is rendered and how its output is read back, shared by the OpenAI and
Anthropic routes: tools and tool_choice, thinking on/off, the output parsers.

`tool_choice` `required` or a named function starts the assistant's turn with the opening of a
tool call in the prompt (closing an open `<think>` first), so the model continues inside the
call, and a grammar (`structured.tool_call_grammar`) holds the rest to one valid call; the
parser reads that opening as the model's own text. `none` leaves the tools out of the prompt
and reads no calls.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moeferry.server.protocol import bad_request
from moeferry.text.chat_output import ChatOutput
from moeferry.text.reasoning import END_THINK, ReasoningStream, opens_reasoning
from moeferry.text.tool_parsers import ToolCallStream, forced_prefix

# chat_template_kwargs may not override what the server passes itself.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "tokenize", "conversation"})
# reasoning_effort -> the template's enable_thinking. Qwen3 has one switch, no budget: every level
# above "minimal" turns thinking on and the model decides how long it thinks.
REASONING_EFFORT = {"none": False, "minimal": False, "low": True, "medium": True, "high": True, "xhigh": True}


@dataclass
class ChatPlan:
    tool_parser: str | None  # None: output is text
    reasoning_parser: str | None
    tools: list[dict] | None = None  # as the template gets them
    schemas: dict[str, dict] = field(default_factory=dict)  # function name -> parameters schema
    template_kwargs: dict = field(default_factory=dict)
    forced_tool: str | None = None  # "" = any tool (required), a name = that function, None = free
    parallel: bool = True
    answer_only: bool = False  # structured output: close an open <think> in the prompt; no reasoning
    tools_read: bool = True  # False: tool-call text in the output stays text

    @property
    def reads_tools(self) -> bool:
        return self.tool_parser is not None and self.tools is not None and self.tools_read

    def render(self, tokenizer, messages: list[dict], max_tokens: int | None = None) -> tuple[list[int], str]:
        """(prompt ids, prompt text); template errors are the client's (400); `max_tokens`: the
        context, which text provably longer than (from its byte length) is refused before tokenizing."""
        try:
            text = tokenizer.apply_chat_template(messages, tools=self.tools, add_generation_prompt=True,
                                                 **self.template_kwargs)
        except Exception as e:  # noqa: BLE001 - a template refusing these messages is the client's error
            raise bad_request(f"the chat template could not render these messages: {type(e).__name__}: {e}",
                              param="messages") from None
        if (self.forced_tool is not None or self.answer_only) and opens_reasoning(text):
            text += "\n" + END_THINK + "\n\n"
        text += self.prefix
        return tokenizer.encode(text, max_tokens), text

    @property
    def prefix(self) -> str:
        if self.forced_tool is None:
            return ""
        return forced_prefix(self.tool_parser, self.forced_tool or None)

    def output(self, prompt_text: str) -> ChatOutput:
        reasoning = ReasoningStream(opens_reasoning(prompt_text)) if self.reasoning_parser else None
        tools = ToolCallStream(self.tool_parser, self.schemas, self.parallel, self.prefix) if self.reads_tools else None
        return ChatOutput(reasoning, tools)


def plan_chat(cfg, tokenizer, tools: list[dict] | None, tool_choice, parallel: bool | None,
              template_kwargs: dict | None, reasoning_effort: str | None = None,
              param_prefix: str = "") -> ChatPlan:
    """Check the request's tool and thinking fields; 400 with the field named otherwise.
    `tools` are OpenAI function tools ({"type": "function", "function": {...}})."""
    kwargs = dict(template_kwargs or {})
    reserved = RESERVED_TEMPLATE_KWARGS & kwargs.keys()
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}",
                          param="chat_template_kwargs")
    if reasoning_effort is not None:
        _thinking_switch(tokenizer, kwargs, reasoning_effort)
    plan = ChatPlan(cfg.tool_call_parser, cfg.reasoning_parser, template_kwargs=kwargs,
                    parallel=parallel is not False)
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice requires tools", param=param_prefix + "tool_choice")
        return plan
    names = [t["function"]["name"] for t in tools]
    if tool_choice == "none":
        return plan
    plan.tools = tools
    plan.schemas = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
    if tool_choice in (None, "auto"):
        return plan
    if plan.tool_parser is None:
        raise bad_request(f"tool_choice {tool_choice!r} needs a tool-call parser; this server runs with "
                          "--tool-call-parser off", param=param_prefix + "tool_choice")
    if tool_choice == "required":
        plan.forced_tool = ""
        return plan
    name = _named_choice(tool_choice)
    if name is None:
        raise bad_request("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                          "\"function\": {\"name\": ...}}", param=param_prefix + "tool_choice")
    if name not in names:
        raise bad_request(f"tool_choice names function '{name}', which is not among the tools "
                          f"({', '.join(names)})", param=param_prefix + "tool_choice")
    plan.forced_tool = name
    return plan


def _named_choice(choice) -> str | None:
    if not isinstance(choice, dict) or choice.get("type") != "function":
        return None
    fn = choice.get("function")
    name = fn.get("name") if isinstance(fn, dict) else None
    return name if isinstance(name, str) and name else None


def _thinking_switch(tokenizer, kwargs: dict, effort: str) -> None:
    if effort not in REASONING_EFFORT:
        raise bad_request(f"reasoning_effort must be one of {', '.join(REASONING_EFFORT)}, got {effort!r}",
                          param="reasoning_effort")
    template = getattr(tokenizer, "chat_template", None) or ""
    if "enable_thinking" not in template:
        raise bad_request("reasoning_effort is not supported by this model: its chat template has no thinking "
                          "switch (enable_thinking)", param="reasoning_effort")
    want = REASONING_EFFORT[effort]
    if kwargs.get("enable_thinking", want) != want:
        raise bad_request(f"reasoning_effort {effort!r} contradicts chat_template_kwargs.enable_thinking",
                          param="reasoning_effort")
    kwargs["enable_thinking"] = want


def finish_reason(reason: str | None, num_calls: int) -> str | None:
    """OpenAI's finish reason: a turn that ended by itself with tool calls is `tool_calls`."""
    return "tool_calls" if num_calls and reason == "stop" else reason
