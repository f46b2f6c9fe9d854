"""From a request's structured-output fields to the engine's GrammarSpec (bad ones become 400s).

Accepted forms: OpenAI's `response_format` (`text`, `json_object`, `json_schema`), vLLM's
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (Lark, or GBNF/EBNF), and vLLM's
newer `structured_outputs` object with the keys `json`, `regex`, `choice`, `grammar`,
`json_object`. At most one may ask for a grammar.
"""

from __future__ import annotations

import json
from typing import Any

from engine.errors import InvalidRequestError
from engine.sampling.grammar import GrammarCompiler, GrammarSpec
from server.errors import APIError
from server.protocol import SamplingFields

_STRUCTURED_OUTPUT_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def requested_grammar(body: SamplingFields) -> tuple[GrammarSpec, str] | None:
    """The grammar the body asks for and the parameter that asked, or None for free text."""
    found = [
        (spec, param)
        for spec, param in (
            (_response_format(body.response_format), "response_format"),
            _guided(body),
            _structured_outputs(body.structured_outputs),
        )
        if spec is not None
    ]
    if len(found) > 1:
        names = " and ".join(param for _, param in found)
        raise APIError(400, f"only one structured-output constraint is allowed: got {names}")
    return found[0] if found else None


def checked_grammar(compiler: GrammarCompiler, spec: GrammarSpec, param: str) -> GrammarSpec:
    """Compile `spec` now (the engine finds it in the cache) so a bad grammar is a 400 that
    names the parameter."""
    try:
        compiler.compile(spec)
    except InvalidRequestError as exc:
        raise APIError(400, f"{param}: {exc}", param=param) from None
    return spec


def _response_format(response_format: dict[str, Any] | None) -> GrammarSpec | None:
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind == "json_schema":
        holder = response_format.get("json_schema")
        if not isinstance(holder, dict):
            raise APIError(
                400,
                "response_format.json_schema must be an object with the schema under 'schema'",
                param="response_format.json_schema",
            )
        schema = holder.get("schema")
        if schema is None:  # OpenAI's schema makes it optional: any JSON object
            return GrammarSpec("json_object")
        return GrammarSpec("json_schema", _schema_text(schema, "response_format.json_schema"))
    raise APIError(
        400,
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        param="response_format.type",
    )


def _guided(body: SamplingFields) -> tuple[GrammarSpec | None, str]:
    asked = [
        (name, value)
        for name, value in (
            ("guided_json", body.guided_json),
            ("guided_regex", body.guided_regex),
            ("guided_choice", body.guided_choice),
            ("guided_grammar", body.guided_grammar),
        )
        if value is not None
    ]
    if not asked:
        return None, ""
    if len(asked) > 1:
        raise APIError(400, f"only one of {', '.join(n for n, _ in asked)} is allowed")
    name, value = asked[0]
    return _spec(name.removeprefix("guided_"), value, name), name


def _structured_outputs(value: dict[str, Any] | None) -> tuple[GrammarSpec | None, str]:
    if value is None:
        return None, ""
    asked = [k for k in _STRUCTURED_OUTPUT_KEYS if value.get(k) not in (None, False)]
    unknown = sorted(set(value) - set(_STRUCTURED_OUTPUT_KEYS) - {"disable_any_whitespace"})
    if unknown:
        raise APIError(
            400,
            f"structured_outputs: unsupported keys {', '.join(unknown)}",
            param="structured_outputs",
        )
    if len(asked) != 1:
        raise APIError(
            400,
            f"structured_outputs needs exactly one of {', '.join(_STRUCTURED_OUTPUT_KEYS)}",
            param="structured_outputs",
        )
    key = asked[0]
    if key == "json_object":
        return GrammarSpec("json_object"), "structured_outputs"
    return _spec(key, value[key], f"structured_outputs.{key}"), "structured_outputs"


def _spec(kind: str, value: Any, param: str) -> GrammarSpec:
    if kind == "json":
        return GrammarSpec("json_schema", _schema_text(value, param))
    if kind == "regex":
        _require(isinstance(value, str) and value, f"{param} must be a non-empty string", param)
        return GrammarSpec("regex", value)
    if kind == "choice":
        _require(
            isinstance(value, list) and value and all(isinstance(c, str) for c in value),
            f"{param} must be a non-empty list of strings",
            param,
        )
        return GrammarSpec("choice", json.dumps(value))
    _require(isinstance(value, str) and value.strip(), f"{param} must be a grammar", param)
    return GrammarSpec("lark", _lark(value, param))


def _lark(grammar: str, param: str) -> str:
    """Lark as is; GBNF / EBNF (rules written `name ::= ...`) converted to Lark."""
    if "::=" not in grammar:
        return grammar
    from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

    try:
        return gbnf_to_lark(grammar)
    except GbnfToLarkError as exc:
        raise APIError(400, f"{param}: invalid grammar: {exc}", param=param) from None


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise APIError(
                400, f"{param}: the schema is not valid JSON: {exc}", param=param
            ) from None
    _require(isinstance(schema, (dict, bool)), f"{param}: a JSON schema must be an object", param)
    return json.dumps(schema, sort_keys=True)


def _require(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise APIError(400, message, param=param)
