"""`response_format` -> the grammar the worker's sampler enforces (llguidance).

`json_object` is any JSON object; `json_schema` is its `schema` (draft 2020-12 subset that
llguidance compiles: types, properties/required, enum/const, anyOf/oneOf, numeric and length
bounds, pattern, $ref/$defs, additionalProperties). Output is compact JSON: the grammar allows
no free whitespace, so a model cannot pad its way to max_tokens. A schema llguidance cannot
compile is a 400 naming the reason.
"""
from __future__ import annotations

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
