"""Structured outputs and tool calls through the official `openai` SDK on a live tiny-model server:
whatever the random model prefers, constrained answers parse and validate, forced tool calls carry
valid arguments, streamed tool-call deltas reassemble into the unstreamed calls, and earlier tool
calls and results reach the prompt."""

from __future__ import annotations

import json
import re

import pytest
from pydantic import BaseModel, Field

from server.protocol import ChatCompletionRequest
from server.tools import tool_request, tools_system_prompt
from tests.server.conftest import TINY_NAME, prompt_tokens_of

pytestmark = pytest.mark.timeout(120)

HELLO = [{"role": "user", "content": "Hello there"}]


class Point(BaseModel):
    x: int = Field(ge=-99, le=99)
    y: int = Field(ge=-99, le=99)


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    nicknames: list[str] = Field(max_length=2)
    home: Point


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 6}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("model", [Point, Person])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_parse_returns_a_valid_object(client, model, temperature) -> None:
    completion = client.chat.completions.parse(
        model=TINY_NAME,
        messages=HELLO,
        response_format=model,
        temperature=temperature,
        seed=5,
        max_tokens=300,
    )
    (choice,) = completion.choices
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, model)


def test_json_mode_parses(client) -> None:
    response = client.chat.completions.create(
        model=TINY_NAME,
        messages=HELLO,
        response_format={"type": "json_object"},
        temperature=1.0,
        seed=0,
        n=4,
        max_tokens=400,
    )
    for choice in response.choices:
        assert choice.message.content.startswith("{")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
    assert any(c.finish_reason == "stop" for c in response.choices)


@pytest.mark.parametrize(
    "extra, pattern",
    [
        ({"guided_regex": r"[a-c]{3}-[0-9]"}, r"[a-c]{3}-[0-9]"),
        ({"guided_choice": ["left", "right"]}, r"left|right"),
        ({"structured_outputs": {"choice": ["up", "down"]}}, r"up|down"),
        ({"guided_grammar": 'root ::= "<" [a-z]+ ">"'}, r"<[a-z]+>"),
        ({"guided_json": {"type": "integer", "minimum": 0, "maximum": 9}}, r"[0-9]"),
    ],
)
def test_vllm_extras_constrain_chat_and_completions(client, extra, pattern) -> None:
    chat = client.chat.completions.create(
        model=TINY_NAME, messages=HELLO, temperature=0, max_tokens=60, extra_body=extra
    )
    assert re.fullmatch(pattern, chat.choices[0].message.content)
    text = client.completions.create(
        model=TINY_NAME, prompt="abc", temperature=0, max_tokens=60, extra_body=extra
    )
    assert re.fullmatch(pattern, text.choices[0].text)


def tool_calls_of(client, stream: bool, **options):
    """[(name, arguments)] and the finish reason of an answer, streamed or not."""
    request = {
        "model": TINY_NAME,
        "messages": HELLO,
        "temperature": 0,
        "max_tokens": 200,
        **options,
    }
    if not stream:
        (choice,) = client.chat.completions.create(**request).choices
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert all(
            c.id.startswith("call") and c.type == "function" for c in choice.message.tool_calls
        )
        return calls, choice.finish_reason
    calls: dict[int, list] = {}
    finish_reason = None
    for chunk in client.chat.completions.create(stream=True, **request):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, ["", ""])
                entry[0] += delta.function.name or ""
                entry[1] += delta.function.arguments or ""
            finish_reason = choice.finish_reason or finish_reason
    return [tuple(calls[i]) for i in sorted(calls)], finish_reason


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_time"}}],
)
def test_forced_calls_are_valid_and_stream_the_same(client, tool_choice) -> None:
    options = dict(tools=[WEATHER, TIME], tool_choice=tool_choice)
    calls, finish_reason = tool_calls_of(client, False, **options)
    assert finish_reason == "tool_calls" and calls
    for name, arguments in calls:
        arguments = json.loads(arguments)
        if name == "get_weather":
            assert set(arguments) == {"city", "unit"} and arguments["unit"] in (
                "celsius",
                "fahrenheit",
            )
        else:
            assert name == "get_time" and set(arguments) == {"zone"}
    if isinstance(tool_choice, dict):
        assert [name for name, _ in calls] == ["get_time"]
    assert tool_calls_of(client, True, **options) == (calls, finish_reason)


def test_parallel_tool_calls_false_gives_one_call(client) -> None:
    calls, _ = tool_calls_of(
        client,
        False,
        tools=[WEATHER, TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=3,
    )
    assert len(calls) == 1


def test_tool_choice_none_answers_in_text(client) -> None:
    response = client.chat.completions.create(
        model=TINY_NAME, messages=HELLO, tools=[WEATHER], tool_choice="none", max_tokens=5
    )
    assert response.choices[0].message.tool_calls is None


def test_earlier_calls_and_tool_results_reach_the_prompt(client) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'},
    }
    messages = [
        *HELLO,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees"},
    ]
    response = client.chat.completions.create(
        model=TINY_NAME, messages=messages, tools=[WEATHER], max_tokens=2
    )
    body = ChatCompletionRequest(messages=messages, tools=[WEATHER])
    system = tools_system_prompt(tool_request(body).functions)
    listing = [{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]
    calls = f"<tool_call>{json.dumps(listing)}</tool_call>"
    rendered = (
        f"<s>system: {system}\n<s>user: Hello there\n<s>assistant: {calls}\n"
        "<s>tool: 4 degrees\n<s>assistant: "
    )
    assert response.usage.prompt_tokens == prompt_tokens_of(rendered)


def test_a_tool_message_without_its_call_id_is_a_400(tiny_server) -> None:
    body = {
        "model": TINY_NAME,
        "messages": [*HELLO, {"role": "tool", "content": "x"}],
        "max_tokens": 2,
    }
    response = tiny_server.post("/v1/chat/completions", body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "messages.1.tool_call_id"
