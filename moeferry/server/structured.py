"""`response_format` -> the grammar the worker's sampler enforces (llguidance).

`json_object` is any JSON object; `json_schema` is its `schema` (draft 2020-12 subset that
llguidance compiles: types, properties/required, enum/const, anyOf/oneOf, numeric and length
bounds, pattern, $ref/$defs, additionalProperties). Output is compact JSON: the grammar allows
no free whitespace, so a model cannot pad its way to max_tokens. A schema llguidance cannot
compile is a 400 naming the reason.

Forced tool calls (`tool_choice` required or a named function) are enforced the same way: the
prompt opens the call (chat_plan.py) and a grammar holds the rest to a well-formed call of the
allowed functions whose arguments fit their schemas (`tool_call_grammar`).
"""
from __future__ import annotations

import json

from moeferry.scheduler.grammar import StructuredOutput
from moeferry.scheduler.sampling import SamplingParams
from moeferry.server.protocol import ResponseFormat, bad_request

JSON_OPTIONS = {"whitespace_flexible": False}


def compile_schema(schema: dict | bool) -> str:
    from llguidance import LLMatcher

    try:
        grammar = LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise bad_request(f"response_format.json_schema.schema is not a JSON schema: {e}",
                          param="response_format.json_schema.schema") from None
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise bad_request(f"response_format.json_schema.schema cannot be enforced: {error}",
                          param="response_format.json_schema.schema")
    return grammar


def structured_params(params: SamplingParams, fmt: ResponseFormat | None, tokenizer_dir: str) -> SamplingParams:
    """params with the grammar of `fmt` (unchanged for none or type text)."""
    if fmt is None or fmt.type == "text":
        return params
    if fmt.type == "json_object":
        grammar = compile_schema({"type": "object"})
    elif fmt.type == "json_schema":
        spec = fmt.json_schema
        if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
            raise bad_request("response_format.json_schema must be an object with a name and a schema",
                              param="response_format.json_schema")
        schema = spec.get("schema", {})
        if not isinstance(schema, (dict, bool)):
            raise bad_request("response_format.json_schema.schema must be an object",
                              param="response_format.json_schema.schema")
        grammar = compile_schema(schema)
    else:
        raise bad_request(f"response_format type must be text, json_object or json_schema, got '{fmt.type}'",
                          param="response_format.type")
    if params.ignore_eos:
        raise bad_request("ignore_eos cannot be combined with response_format (the output ends where the JSON "
                          "value does)", param="ignore_eos")
    if params.min_tokens:
        raise bad_request("min_tokens cannot be combined with response_format (the JSON value may be complete "
                          "sooner)", param="min_tokens")
    return params.replace(structured=StructuredOutput(grammar, tokenizer_dir))


# ---------------------------------------------------------------- forced tool calls


def _lit(text: str, tokenizer) -> str:
    """A lark literal; an added token (e.g. </tool_call>) by its id, as the model writes it."""
    token = tokenizer.added_token_id(text)
    return f"<[{token}]>" if token is not None else json.dumps(text, ensure_ascii=False)


def _object_schema(schema: dict) -> dict:
    schema = dict(schema) if isinstance(schema, dict) else {}
    schema.setdefault("type", "object")
    schema.setdefault("additionalProperties", False)  # a call carries the declared parameters only
    schema["x-guidance"] = JSON_OPTIONS
    return schema


def _json(schema: dict) -> str:
    return "%json " + json.dumps(schema, ensure_ascii=False)


def _hermes_call(i: int, name: str, schema: dict, close: str, named: bool) -> list[str]:
    head = "" if named else json.dumps(json.dumps(name) + ', "arguments": ', ensure_ascii=False) + " "
    return [f"call{i}: {head}args{i} " + json.dumps("}\n") + f" {close}", f"args{i}: {_json(_object_schema(schema))}"]


def _coder_call(i: int, name: str, schema: dict, close: str, named: bool) -> list[str]:
    schema = schema if isinstance(schema, dict) else {}
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = {r for r in schema.get("required") or () if isinstance(r, str)} \
        if isinstance(schema.get("required"), list) else set()
    rules, parts = [], []
    for k, (key, sub) in enumerate(props.items()):
        head = json.dumps(f"<parameter={key}>\n", ensure_ascii=False)
        if isinstance(sub, dict) and sub.get("type", "string") == "string":
            limit = sub.get("maxLength")
            span = f"{{0,{int(limit)}}}" if isinstance(limit, int) and limit >= 0 else "*"
            rules.append(f"p{i}_{k}: {head} t{i}_{k}")
            rules.append(f"t{i}_{k}[lazy]: /(?s:.{span})\\n<\\/parameter>\\n/")
        else:
            value = {**(sub if isinstance(sub, dict) else {}), "x-guidance": JSON_OPTIONS}
            rules.append(f"p{i}_{k}: {head} v{i}_{k} " + json.dumps("\n</parameter>\n"))
            rules.append(f"v{i}_{k}: {_json(value)}")
        parts.append(f"p{i}_{k}" + ("" if key in required else "?"))
    head = "" if named else json.dumps(f"<function={name}>\n", ensure_ascii=False) + " "
    body = " ".join(parts)
    rules.insert(0, f"call{i}: {head}{body} " + json.dumps("</function>\n") + f" {close}")
    return rules


def tool_call_grammar(plan, tokenizer) -> str:
    """The lark grammar of what follows the forced opening of a tool call (`plan.prefix`)."""
    from llguidance import LLMatcher

    named = bool(plan.forced_tool)
    names = [plan.forced_tool] if named else list(plan.schemas)
    close = _lit("</tool_call>", tokenizer)
    build = _hermes_call if plan.tool_parser == "hermes" else _coder_call
    rules = []
    for i, name in enumerate(names):
        rules += build(i, name, plan.schemas[name], close, named)
    calls = " | ".join(f"call{i}" for i in range(len(names)))
    opening = json.dumps('{"name": ') + " " if plan.tool_parser == "hermes" and not named else ""
    start = f"start: {opening}({calls})"
    lines = [start, *rules]
    grammar = LLMatcher.grammar_from_lark("\n".join(lines))
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise bad_request(f"the tools' parameter schemas cannot be enforced for tool_choice: {error}", param="tools")
    return grammar


def forced_tool_params(params: SamplingParams, plan, tokenizer, tokenizer_dir: str) -> SamplingParams:
    """params with the grammar of the forced call, when tool_choice forces one."""
    if plan.forced_tool is None:
        return params
    if params.ignore_eos or params.min_tokens:
        raise bad_request("ignore_eos and min_tokens cannot be combined with a forced tool_choice (the output ends "
                          "with the call)", param="tool_choice")
    return params.replace(structured=StructuredOutput(tool_call_grammar(plan, tokenizer), tokenizer_dir))
