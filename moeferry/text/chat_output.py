"""A chat answer as it streams: reasoning, content and tool calls, one parser after the other.

The reasoning parser (when on) splits `<think>` text off first; the tool-call parser (when the
request has tools) then splits calls out of the content. Both hold back only what could still be
the start of one of their tags, so text streams with at most a tag's length of delay.
"""
from __future__ import annotations

from moeferry.text.reasoning import Reasoning, ReasoningStream
from moeferry.text.tool_parsers import Content, ParsedToolCall, ToolCallStream

__all__ = ["ChatOutput", "Content", "ParsedToolCall", "Reasoning"]


class ChatOutput:
    def __init__(self, reasoning: ReasoningStream | None, tools: ToolCallStream | None):
        self.reasoning, self.tools = reasoning, tools
        self.num_calls = 0

    def feed(self, text: str) -> list:
        items = self.reasoning.feed(text) if self.reasoning else [Content(text)] if text else []
        return self._tools(items, finish=False)

    def finish(self) -> list:
        items = self.reasoning.finish() if self.reasoning else []
        return self._tools(items, finish=True)

    def _tools(self, items: list, finish: bool) -> list:
        if self.tools is None:
            return items
        out = []
        for item in items:
            out += self.tools.feed(item.text) if isinstance(item, Content) else [item]
        if finish:
            out += self.tools.finish()
        self.num_calls += sum(isinstance(i, ParsedToolCall) for i in out)
        return out

    @staticmethod
    def collect(items: list) -> tuple[str | None, str | None, list[ParsedToolCall]]:
        """(reasoning, content, calls) of a whole answer; None where there is none."""
        reasoning = "".join(i.text for i in items if isinstance(i, Reasoning))
        content = "".join(i.text for i in items if isinstance(i, Content))
        calls = [i for i in items if isinstance(i, ParsedToolCall)]
        return reasoning or None, content or (None if calls or reasoning else ""), calls
