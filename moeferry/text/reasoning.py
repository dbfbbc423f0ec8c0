"""Reasoning in model output: Qwen3's `<think>…</think>` split from the answer.

Qwen3 writes `<think>\n…\n</think>\n\n` itself; Qwen3.5/3.6 templates open the block in the
prompt (`<|im_start|>assistant\n<think>\n`), so the output starts inside it and only closes it.
`opens_reasoning(prompt)` says which: the stream starts in reasoning when the prompt ends inside
an open `<think>`. With thinking switched off the template closes the block in the prompt and
the whole output is content.
"""
from __future__ import annotations

from dataclasses import dataclass

from moeferry.text.tool_parsers import Content, held_suffix

REASONING_PARSERS = ("qwen3",)
THINK, END_THINK = "<think>", "</think>"


@dataclass(frozen=True)
class Reasoning:
    text: str


def opens_reasoning(prompt_text: str) -> bool:
    """Whether the prompt leaves the assistant's turn inside an open <think> block."""
    return prompt_text.rfind(THINK) > prompt_text.rfind(END_THINK)


def detect_reasoning_parser(chat_template: str | None) -> str | None:
    return "qwen3" if chat_template and THINK in chat_template else None


class ReasoningStream:
    """Feed output text; get Reasoning and Content items (leading/trailing newlines of the
    reasoning and the blank lines after </think> are the format's, not the text's)."""

    def __init__(self, in_reasoning: bool):
        self.state = "reasoning" if in_reasoning else "start"
        self.buffer = ""
        self.fresh = True  # nothing of the current part emitted yet (strip its leading newlines)

    def feed(self, text: str) -> list:
        self.buffer += text
        out: list = []
        while True:
            if self.state == "start":
                head = self.buffer.lstrip()
                if head.startswith(THINK):
                    self.buffer, self.state, self.fresh = head[len(THINK):], "reasoning", True
                    continue
                if THINK.startswith(head):  # may still become <think>
                    return out
                self.state = "content"
            if self.state == "reasoning":
                end = self.buffer.find(END_THINK)
                if end < 0:
                    self._emit_settled(out)
                    return out
                body, self.buffer = self.buffer[:end], self.buffer[end + len(END_THINK):]
                self._reasoning(body.rstrip("\n"), out)
                self.state, self.fresh = "content", True
                continue
            # content
            if self.fresh:
                self.buffer = self.buffer.lstrip()
                if not self.buffer:
                    return out
                self.fresh = False
            if self.buffer:
                out.append(Content(self.buffer))
            self.buffer = ""
            return out

    def finish(self) -> list:
        out = self.feed("")
        if self.state == "reasoning":
            self._reasoning(self.buffer.rstrip("\n"), out)
        elif self.buffer and not (self.fresh and self.state == "content"):
            out.append(Content(self.buffer))
        self.buffer = ""
        return out

    def _emit_settled(self, out: list) -> None:
        """Emit the reasoning that cannot be part of </think> or its preceding newlines."""
        keep = held_suffix(self.buffer, END_THINK, "\n")
        self._reasoning(self.buffer[:len(self.buffer) - keep], out)
        self.buffer = self.buffer[len(self.buffer) - keep:]

    def _reasoning(self, text: str, out: list) -> None:
        if self.fresh:
            text = text.lstrip("\n")
        if text:
            self.fresh = False
            out.append(Reasoning(text))
