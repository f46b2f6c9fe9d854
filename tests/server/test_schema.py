"""Conformance with OpenAI's own OpenAPI description (tests/data/openai-openapi.yml).

schemathesis generates requests from the spec for POST /chat/completions, POST /completions and
GET /models (the spec's paths lack /v1, so the base URL ends in /v1). For every generated request:
no 5xx; a 200 body conforms to OpenAI's response schema; any other answer is OpenAI's
ErrorResponse. Streamed chunks, which schemathesis does not parse, are checked against the spec's
stream schemas with jsonschema_rs.

Deliberate narrowing, each explained where it is done:
- generated requests name the served model and ask for at most 4 tokens, without streaming;
- mid-stream `finish_reason: null` and `usage: null` in legacy-completion chunks are allowed.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from collections import Counter
from pathlib import Path

import jsonschema_rs
import pytest
import schemathesis
import yaml
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error, response_schema_conformance
from schemathesis.core.failures import FailureGroup

from tests.server.conftest import BAN_SPECIALS, TINY_NAME, LiveServer, sse_events, sse_json

pytestmark = pytest.mark.timeout(240)

SPEC = Path(__file__).resolve().parents[1] / "data" / "openai-openapi.yml"
MAX_EXAMPLES = 40
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def openai_schema():
    return schemathesis.openapi.from_path(str(SPEC))


@functools.cache
def spec_components() -> dict:
    """The spec's component schemas as JSON Schema 2020-12: OpenAPI's `nullable: true` (which
    this 3.1 document still uses, and which JSON Schema ignores) becomes "or null"."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    raw = yaml.load(SPEC.read_text(), Loader=loader)
    return _nullable_to_json_schema(raw["components"])


def _nullable_to_json_schema(node):
    if isinstance(node, list):
        return [_nullable_to_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    converted = {key: _nullable_to_json_schema(value) for key, value in node.items()}
    if converted.get("nullable") is True:
        del converted["nullable"]
        return {"anyOf": [converted, {"type": "null"}]}
    return converted


def validator(name: str, components: dict | None = None):
    schema = {"$ref": f"#/components/schemas/{name}", "components": components or spec_components()}
    return jsonschema_rs.Draft202012Validator(schema)


def violations(validate, instance) -> list[str]:
    return [
        f"{'/'.join(map(str, e.instance_path)) or '.'}: {e.message}"
        for e in validate.iter_errors(instance)
    ]


# ------------------------------------------------------------------- generated requests
def narrow_generation(body) -> None:
    """Keep generated requests servable and cheap, explicitly:
    - `model`: generated ids are random strings, which can only ever get 404; the served id lets
      the rest of the request reach the engine (404 has its own test in test_errors.py);
    - token limits: at most MAX_TOKENS (generated values below it, even invalid ones, are kept),
      and always set, since an unset chat limit means "until the 4096-token context is full";
    - `stream`: off, since schemathesis validates JSON bodies only; streams are checked below;
    - a null completion `prompt` becomes a plain one (see below).
    """
    if not isinstance(body, dict):
        return
    body["model"] = TINY_NAME
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if key in body and (not isinstance(value, int) or value > MAX_TOKENS):
            body[key] = MAX_TOKENS
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS
    body["stream"] = False
    if "prompt" in body and body["prompt"] is None:
        # OpenAI reads a null prompt as GPT's "<|endoftext|>"; Aerie rejects it on purpose (see
        # test_nullable_fields_accept_null). A plain prompt keeps the case servable.
        body["prompt"] = "Hello"


def fuzz(operation, server: LiveServer) -> Counter:
    """Run MAX_EXAMPLES generated requests; fail with every distinct problem found."""
    problems: dict[str, str] = {}
    statuses: Counter = Counter()
    error_response = validator("ErrorResponse")

    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy())
    def run(case) -> None:
        narrow_generation(case.body)
        response = case.call(base_url=f"{server.base_url}/v1", headers=server.headers, timeout=60)
        statuses[response.status_code] += 1
        try:
            case.validate_response(
                response, checks=[not_a_server_error, response_schema_conformance]
            )
        except FailureGroup as group:
            for failure in group.exceptions:
                text = str(failure)
                where = re.search(r"Schema at (\S+)", text)
                key = f"{text.splitlines()[0]} at {where.group(1) if where else '?'}"
                problems.setdefault(key, f"HTTP {response.status_code}\n{text}"[:2500])
        if response.status_code != 200:
            try:
                found = violations(error_response, response.json())
            except ValueError:
                found = [f"not JSON: {response.text[:200]!r}"]
            if found:
                problems.setdefault(f"HTTP {response.status_code} is not ErrorResponse", str(found))

    run()
    assert not problems, f"answers: {dict(statuses)}\n\n" + "\n\n".join(
        f"== {key}\n{detail}" for key, detail in problems.items()
    )
    return statuses


def test_generated_chat_completions(openai_schema, tiny_server) -> None:
    statuses = fuzz(openai_schema["/chat/completions"]["POST"], tiny_server)
    # The narrowing must leave requests that the engine serves, or nothing was checked.
    assert statuses[200] >= MAX_EXAMPLES // 5, statuses


def test_generated_completions(openai_schema, tiny_server) -> None:
    statuses = fuzz(openai_schema["/completions"]["POST"], tiny_server)
    assert statuses[200] >= MAX_EXAMPLES // 5, statuses


def test_list_models(openai_schema, tiny_server) -> None:
    operation = openai_schema["/models"]["GET"]
    case = operation.Case()
    response = case.call(base_url=f"{tiny_server.base_url}/v1", headers=tiny_server.headers)
    assert response.status_code == 200
    case.validate_response(response, checks=[not_a_server_error, response_schema_conformance])
    assert violations(validator("ListModelsResponse"), response.json()) == []


# ------------------------------------------------------------------------------ streams
def stream_chunks(server: LiveServer, path: str, body: dict) -> list[dict]:
    with server.http() as http, http.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        return sse_json(list(sse_events(response)))


STREAM_VARIANTS = [
    {"n": 2, "max_tokens": 5, "temperature": 1.0, "seed": 1},
    {"max_tokens": 5, "logprobs": True, "top_logprobs": 2, "temperature": 0},
    {"max_tokens": 5, "stream_options": {"include_usage": True}, "stop": ["e"]},
]
TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {"key": {"type": "string", "maxLength": 5}},
            "required": ["key"],
            "additionalProperties": False,  # bounded: a random model's call always ends
        },
    },
}
# Structured answers: tool calls (whole, at the end) and a JSON schema answer.
STRUCTURED_VARIANTS = [
    {"max_tokens": 60, "tools": [TOOL], "tool_choice": "required", "n": 2, "seed": 2},
    {
        "max_tokens": 60,
        "tools": [TOOL],
        "tool_choice": {"type": "function", "function": TOOL["function"]},
    },
    {
        "max_tokens": 60,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "k", "schema": TOOL["function"]["parameters"]},
        },
    },
]


def stream_violations(server: LiveServer, path: str, bodies: list[dict], schema) -> str:
    """Every distinct violation in the chunks of the streamed `bodies`, with an example."""
    found: dict[str, str] = {}
    for body in bodies:
        for chunk in stream_chunks(server, path, body):
            for problem in violations(schema, chunk):
                found.setdefault(problem, json.dumps(chunk)[:400])
    return "\n".join(f"{problem}\n    in {chunk}" for problem, chunk in found.items())


def test_chat_stream_chunks(tiny_server) -> None:
    bodies = [
        {
            "model": TINY_NAME,
            "messages": [{"role": "user", "content": "Hello"}],
            "logit_bias": BAN_SPECIALS,
            "stream": True,
            **variant,
        }
        for variant in STREAM_VARIANTS + STRUCTURED_VARIANTS
    ]
    found = stream_violations(
        tiny_server,
        "/v1/chat/completions",
        bodies,
        validator("CreateChatCompletionStreamResponse"),
    )
    assert not found, f"chunks violate CreateChatCompletionStreamResponse:\n{found}"


def test_tool_call_and_structured_responses_conform(tiny_server) -> None:
    validate = validator("CreateChatCompletionResponse")
    with tiny_server.http() as http:
        for variant in STRUCTURED_VARIANTS:
            body = {"model": TINY_NAME, "messages": [{"role": "user", "content": "Hi"}], **variant}
            response = http.post("/v1/chat/completions", json=body)
            assert response.status_code == 200, response.text
            assert violations(validate, response.json()) == [], response.json()
            if "tools" in variant:
                for choice in response.json()["choices"]:
                    assert choice["message"].get("tool_calls"), choice


@functools.cache
def completion_chunk_components() -> dict:
    """CreateCompletionResponse for streamed chunks. The spec says streamed and non-streamed
    completions share one shape, but a chunk before the end has no finish_reason yet, and
    `stream_options.include_usage` is documented (ChatCompletionStreamOptions) to send
    `usage: null` on every chunk but the last: both are null there, which the shared schema
    does not allow. Narrowed for those two fields only."""
    components = copy.deepcopy(spec_components())
    schema = components["schemas"]["CreateCompletionResponse"]
    choice = schema["properties"]["choices"]["items"]["properties"]
    choice["finish_reason"] = {"anyOf": [choice["finish_reason"], {"type": "null"}]}
    schema["properties"]["usage"] = {"anyOf": [schema["properties"]["usage"], {"type": "null"}]}
    return components


def test_completion_stream_chunks(tiny_server) -> None:
    bodies = []
    for variant in STREAM_VARIANTS:
        variant = dict(variant)
        if variant.pop("logprobs", None):  # the legacy API's logprobs is the number of top ones
            variant["logprobs"] = variant.pop("top_logprobs")
        bodies.append(
            {
                "model": TINY_NAME,
                "prompt": "Hello",
                "logit_bias": BAN_SPECIALS,
                "stream": True,
                **variant,
            }
        )
    found = stream_violations(
        tiny_server,
        "/v1/completions",
        bodies,
        validator("CreateCompletionResponse", completion_chunk_components()),
    )
    assert not found, f"chunks violate CreateCompletionResponse:\n{found}"


# ------------------------------------------------------------------------- explicit nulls
def nullable_properties(request_schema: str) -> list[str]:
    """The request fields OpenAI's spec lets a client send as JSON null."""
    schemas = spec_components()["schemas"]

    def resolve(node: dict) -> dict:
        while "$ref" in node:
            node = schemas[node["$ref"].rsplit("/", 1)[-1]]
        return node

    properties: dict = {}
    pending = [schemas[request_schema]]
    while pending:
        node = resolve(pending.pop())
        pending.extend(node.get("allOf", []))
        properties.update(node.get("properties", {}))
    return sorted(
        name
        for name, prop in properties.items()
        if resolve(prop).get("type") == "null"
        or any(resolve(o).get("type") == "null" for o in resolve(prop).get("anyOf", []))
    )


@pytest.mark.parametrize(
    ("request_schema", "path", "base"),
    [
        (
            "CreateChatCompletionRequest",
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}]},
        ),
        # `prompt` is left out: a null prompt means OpenAI's "<|endoftext|>" (a GPT token), which
        # has no equivalent here; rejecting it is a deliberate choice.
        ("CreateCompletionRequest", "/v1/completions", {"prompt": "Hi"}),
    ],
    ids=["chat", "completions"],
)
def test_nullable_fields_accept_null(tiny_server, request_schema, path, base) -> None:
    """OpenAI's spec declares these fields nullable (null meaning "the default"); clients that
    serialize unset options as null must not get a 400."""
    fields = [f for f in nullable_properties(request_schema) if f not in base]
    assert len(fields) >= 10, fields
    # logit_bias forces the end-of-sequence token first, so even a null max_tokens ends at once;
    # max_tokens bounds the request whose logit_bias is the null one.
    bounded = {**base, "model": TINY_NAME, "max_tokens": 2, "logit_bias": {"2": 100}}
    rejected = {}
    with tiny_server.http() as http:
        for field in fields:
            response = http.post(path, json={**bounded, field: None})
            if response.status_code != 200:
                rejected[field] = f"{response.status_code} {response.json()['error']['message']}"
    assert not rejected, (
        f"fields OpenAI's spec marks nullable are rejected when null (server/protocol.py "
        f"declares them non-optional): {json.dumps(rejected, indent=1)}"
    )
