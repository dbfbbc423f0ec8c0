"""Tool calls in model output: the Qwen3 JSON format (`hermes`) and the Qwen3.5/3.6 XML format (`qwen3_coder`).

hermes:       <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>
qwen3_coder:  <tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call>
              (parameter values are text, typed here from the tool's JSON schema)

`ToolCallStream` is fed the model's text as it arrives and returns content text and complete tool
calls; whole-text parsing is the same stream fed once. A block is emitted as a call only once it
is complete and parses; a block that does not parse (malformed JSON, no function name, cut off
by max_tokens) comes back as plain content, exactly as the model wrote it.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

TOOL_CALL_PARSERS = ("qwen3_coder", "hermes")
START, END = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ParsedToolCall:
    name: str
    arguments: str  # a JSON object, as text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class Content:
    text: str


# ---------------------------------------------------------------- formats


def _hermes_block(body: str, schemas: dict[str, dict]) -> tuple[str, dict] | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some fine-tunes write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"], args


_FUNCTION = re.compile(r"^<function=([^>\n]+)>(.*)</function>$", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


def _strip_newline(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _typed(value: str, schema: dict | None):
    """A parameter's text as the type its JSON schema declares; text when it does not convert."""
    if not isinstance(schema, dict):
        return value
    types = schema.get("type")
    if types is None and isinstance(schema.get("anyOf"), list):
        types = [s.get("type") for s in schema["anyOf"] if isinstance(s, dict)]
    types = types if isinstance(types, list) else [types]
    text = value.strip()
    for t in types:
        if t == "string":
            return value
        if t == "null" and text.lower() in ("null", "none"):
            return None
        if t == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if t == "integer" and re.fullmatch(r"[-+]?\d+", text):
            return int(text)
        if t == "number":
            try:
                number = float(text)
            except ValueError:
                continue
            return int(number) if number.is_integer() and re.fullmatch(r"[-+]?\d+", text) else number
        if t in ("object", "array"):
            try:
                parsed = json.loads(text)
            except ValueError:
                continue
            if isinstance(parsed, dict if t == "object" else list):
                return parsed
    return value


def _coder_block(body: str, schemas: dict[str, dict]) -> tuple[str, dict] | None:
    m = _FUNCTION.match(body)
    if m is None:
        return None
    name = m.group(1).strip()
    rest = m.group(2)
    schema = schemas.get(name)
    params = schema.get("properties") if isinstance(schema, dict) else None
    params = params if isinstance(params, dict) else {}
    args = {}
    for p in _PARAMETER.finditer(rest):
        key = p.group(1).strip()
        args[key] = _typed(_strip_newline(p.group(2)), params.get(key))
    leftover = _PARAMETER.sub("", rest).strip()
    if not name or leftover:
        return None
    return name, args


_FORMATS = {"hermes": _hermes_block, "qwen3_coder": _coder_block}


def forced_prefix(parser: str, name: str | None) -> str:
    """Text that starts the assistant's turn with a tool call (of `name`, when given)."""
    if name is None:
        return START + "\n"
    if parser == "hermes":
        return START + '\n{"name": ' + json.dumps(name) + ', "arguments": '
    return START + f"\n<function={name}>\n"


# ---------------------------------------------------------------- the stream


def held_suffix(text: str, marker: str, blank: str | None = None) -> int:
    """Length of the tail of text to hold back: the longest suffix that is a proper prefix of
    marker, and the `blank` characters (whitespace if None) just before it."""
    n = next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if text.endswith(marker[:n])), 0)
    head = text[:len(text) - n]
    return n + len(head) - len(head.rstrip(blank))


class ToolCallStream:
    """Split streamed model text into Content and ParsedToolCall items.

    `tools` maps function names to their JSON schema `parameters` (used to type qwen3_coder
    values). With `parallel=False` only the first call is kept. `prefix` is text the prompt
    already holds of the assistant's turn (a forced tool-call opening) and is parsed as if the
    model had written it."""

    def __init__(self, parser: str, tools: dict[str, dict], parallel: bool = True, prefix: str = ""):
        self.block = _FORMATS[parser]
        self.tools = tools
        self.parallel = parallel
        self.buffer = ""
        self.inside = False
        self.gap = ""
        self.calls = 0
        self._prefix = prefix

    def feed(self, text: str) -> list:
        if self._prefix:
            text, self._prefix = self._prefix + text, ""
        self.buffer += text
        out: list = []
        while True:
            if self.inside:
                end = self.buffer.find(END)
                if end < 0:
                    return out
                self._close(self.buffer[:end], self.buffer[:end] + END, out)
                self.buffer = self.buffer[end + len(END):]
                self.inside = False
                continue
            start = self.buffer.find(START)
            if start < 0:
                keep = held_suffix(self.buffer, START)
                self._content(self.buffer[:len(self.buffer) - keep], out)
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return out
            before = self.buffer[:start].rstrip()
            self._content(before, out)
            self.gap = self.buffer[len(before):start]  # whitespace before the call: kept if it fails
            self.buffer = self.buffer[start + len(START):]
            self.inside = True

    def finish(self) -> list:
        """The end of the output: an unterminated block is a call if it parses, else content."""
        out = self.feed("")
        if self.inside:
            self._close(self.buffer, self.buffer, out)
        else:
            self._content(self.buffer, out)
        self.buffer, self.inside = "", False
        return out

    def _content(self, text: str, out: list) -> None:
        if text and not (self.calls and not text.strip()):
            out.append(Content(text))

    def _close(self, body: str, raw: str, out: list) -> None:
        try:
            parsed = self.block(body.strip(), self.tools)
        except Exception:  # noqa: BLE001 - whatever the model wrote, it is never a server error
            parsed = None
        if parsed is None:
            out.append(Content(self.gap + START + raw))
            return
        if self.calls and not self.parallel:
            return
        name, args = parsed
        self.calls += 1
        out.append(ParsedToolCall(name, json.dumps(args, ensure_ascii=False)))


def parse_tool_calls(parser: str, text: str, tools: dict[str, dict]) -> tuple[str, list[ParsedToolCall]]:
    """Whole-text parse: (content, calls)."""
    stream = ToolCallStream(parser, tools)
    items = stream.feed(text) + stream.finish()
    content = "".join(i.text for i in items if isinstance(i, Content))
    return content, [i for i in items if isinstance(i, ParsedToolCall)]


def detect_tool_parser(chat_template: str | None) -> str | None:
    """The format a chat template teaches the model: qwen3_coder, hermes, or None."""
    if not chat_template or START not in chat_template:
        return None
    return "qwen3_coder" if "<function=" in chat_template else "hermes"
