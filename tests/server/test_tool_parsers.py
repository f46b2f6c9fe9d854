"""Tool-call parsers per template family, and the streamed answer: content streamed as it comes
and calls at the end reassemble into exactly the unstreamed message."""

from __future__ import annotations

import json

import pytest

from server.tool_answers import ToolAnswers
from server.tool_parsers import PARSERS, ParsedCall, parser_for_template
from server.tools import Function, ToolRequest

NAMES = {"get_weather", "get_time"}
WEATHER = ParsedCall("get_weather", json.dumps({"city": "Oslo"}))
TIME = ParsedCall("get_time", json.dumps({"zone": "UTC"}))


@pytest.mark.parametrize(
    "family, text, content, calls",
    [
        (
            "tagged",
            'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '\n</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}'
            "</tool_call>",
            "Let me check.",
            [WEATHER, TIME],
        ),
        (  # SmolLM2's list inside one pair of tags, without its closing tag at the end
            "tagged",
            '<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
            '{"name": "get_time", "arguments": {"zone": "UTC"}}]',
            None,
            [WEATHER, TIME],
        ),
        (
            "mistral",
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
            None,
            [WEATHER],
        ),
        ("mistral", '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}', None, [TIME]),
        (
            "llama3_json",
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
            None,
            [WEATHER],
        ),
        (
            "llama3_json",
            '{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
            '{"name": "get_time", "parameters": {"zone": "UTC"}}',
            None,
            [WEATHER, TIME],
        ),
    ],
)
def test_each_family_parses_its_calls(family, text, content, calls) -> None:
    assert PARSERS[family].extract(text, NAMES) == (content, calls)


@pytest.mark.parametrize(
    "text",
    [
        "The weather is fine.",
        '<tool_call>{"name": "unknown_tool", "arguments": {}}</tool_call>',
        "<tool_call>{not json</tool_call>",
    ],
)
def test_text_without_valid_calls_stays_text(text) -> None:
    assert PARSERS["tagged"].extract(text, NAMES) == (text, [])


def test_template_families() -> None:
    assert parser_for_template("{{ '[TOOL_CALLS]' }}").family == "mistral"
    assert parser_for_template("{{ '<|python_tag|>' }}").family == "llama3_json"
    assert parser_for_template("<tool_call>").family == "tagged"
    assert parser_for_template(None).family == "tagged"


def auto_answers(parallel: bool = True) -> ToolAnswers:
    functions = tuple(Function(n, None, {"type": "object"}) for n in sorted(NAMES))
    return ToolAnswers(ToolRequest(functions, "auto", None, parallel), PARSERS["tagged"])


@pytest.mark.parametrize(
    "text",
    [
        'Sure.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>',
        "No tools needed: <tool_c is not a tag, and < alone is text.",
        '<tool_call>[{"name": "get_time", "arguments": {"zone": "UTC"}}]</tool_call>',
    ],
)
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_streamed_answer_reassembles_into_the_message(text, piece) -> None:
    answers = auto_answers()
    message, finish_reason = answers.message(text, "stop")
    stream = answers.stream()
    content = "".join(stream.feed(text[i : i + piece]) for i in range(0, len(text), piece))
    rest, deltas, streamed_finish = stream.finish("stop")
    content += rest
    assert streamed_finish == finish_reason
    calls = [(d.function.name, d.function.arguments) for d in deltas]
    assert calls == [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert content.strip() == (message.content or "").strip()
    if not message.tool_calls:
        assert content == text  # plain text streams through unchanged


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text = (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
        '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    )
    message, _ = auto_answers(parallel=False).message(text, "stop")
    assert [c.function.name for c in message.tool_calls] == ["get_weather"]
