"""End to end on the real default model with its shipped head (speculation on): the SDK's
`parse()` returns a valid object for each of a set of schemas, JSON mode parses, and forced tool
calls stream into the same calls as the unstreamed answer.

The schemas bound their strings and lists: greedy, the 135M model repeats itself inside an
unbounded JSON list or string until max_tokens (plain decoding does the same), and a bound is how
a schema guarantees that the output ends. JSON mode, which bounds nothing, samples with a
repetition penalty for the same reason."""

from __future__ import annotations

import json
from collections.abc import Iterator
from enum import Enum
from typing import Annotated

import pytest
from pydantic import BaseModel, Field, StringConstraints

from engine.execution.model_files import DEFAULT_MODEL
from tests.server.conftest import LiveServer, start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


Short = Annotated[str, StringConstraints(max_length=60)]


class City(BaseModel):
    name: Short
    country: Short


class Step(BaseModel):
    explanation: Short
    output: Short


class MathAnswer(BaseModel):
    steps: list[Step] = Field(max_length=3)
    final_answer: Short


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Palette(BaseModel):
    title: Short
    colors: list[Color] = Field(max_length=5)
    warm: bool
    score: float


class Event(BaseModel):
    name: Short
    year: int
    attendees: list[Short] = Field(max_length=4)
    place: City


SCHEMAS = {
    "city": (City, "What is the capital of France?"),
    "math": (MathAnswer, "Solve 8x + 7 = -23 step by step."),
    "palette": (Palette, "Describe a palette for a sunset."),
    "event": (Event, "Describe the first moon landing as an event."),
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}


@pytest.fixture(scope="module")
def default_server(server_logs) -> Iterator[LiveServer]:
    server = start_server(DEFAULT_MODEL, server_logs, api_key=None, served_name=None, wait=False)
    try:
        server.wait_ready(timeout=240)  # the default model and its head start slowly on a busy box
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("schema", list(SCHEMAS))
def test_parse_returns_a_valid_object(default_server, schema) -> None:
    model, question = SCHEMAS[schema]
    with default_server.client() as client:
        completion = client.chat.completions.parse(
            model=DEFAULT_MODEL,
            messages=[{"role": "user", "content": question}],
            response_format=model,
            temperature=0,
            max_tokens=400,
        )
    (choice,) = completion.choices
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, model)


def test_json_mode_parses(default_server) -> None:
    """Every answer that ends is a JSON object; a sampled answer may instead reach max_tokens
    inside a long string (the 135M model rambles), which no grammar can close."""
    finished = 0
    with default_server.client() as client:
        for seed in (1, 2, 3):
            response = client.chat.completions.create(
                model=DEFAULT_MODEL,
                messages=[{"role": "user", "content": "Give me a JSON object about a cat."}],
                response_format={"type": "json_object"},
                temperature=0.7,
                seed=seed,
                max_tokens=400,
                extra_body={"repetition_penalty": 1.3},
            )
            (choice,) = response.choices
            if choice.finish_reason == "stop":
                assert isinstance(json.loads(choice.message.content), dict)
                finished += 1
            else:
                assert choice.finish_reason == "length"
    assert finished, "no answer ended"


def test_streamed_tool_calls_equal_the_unstreamed_answer(default_server) -> None:
    request = dict(
        model=DEFAULT_MODEL,
        messages=[{"role": "user", "content": "What's the weather like in Paris?"}],
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,  # one call: greedy, the model would repeat calls to the limit
        temperature=0,
        max_tokens=100,
    )
    with default_server.client() as client:
        (choice,) = client.chat.completions.create(**request).choices
        chunks = list(client.chat.completions.create(stream=True, **request))
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert choice.finish_reason == "tool_calls"
    assert calls and all(name == "get_weather" for name, _ in calls)
    assert all(args["unit"] in ("celsius", "fahrenheit") for _, args in calls)
    streamed: dict[int, list[str]] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            entry = streamed.setdefault(delta.index, ["", ""])
            entry[0] += delta.function.name or ""
            entry[1] += delta.function.arguments or ""
    assert [(name, json.loads(args)) for name, args in streamed.values()] == calls
