"""POST /v1/completions (prompt as a string, a list of strings, token ids; echo; streaming) and
GET /v1/models, on a live tiny-model server."""

from __future__ import annotations

import pytest

from tests.server.conftest import (
    BAN_SPECIALS,
    TINY_NAME,
    assert_openai_error,
    sse_events,
    sse_json,
)

pytestmark = pytest.mark.timeout(120)


def token_ids(text: str) -> list[int]:
    """The tiny character-level tokenizer: chr(32 + i) is token i + 3."""
    return [ord(ch) - 32 + 3 for ch in text]


def complete(client, prompt, max_tokens: int = 12, **options):
    return client.completions.create(
        model=TINY_NAME,
        prompt=prompt,
        temperature=0,
        max_tokens=max_tokens,
        logit_bias=BAN_SPECIALS,
        extra_body={"ignore_eos": True},
        **options,
    )


def test_prompt_as_a_string(client) -> None:
    response = complete(client, "Once upon a time")
    assert response.object == "text_completion"
    assert response.id.startswith("cmpl-")
    assert response.model == TINY_NAME
    (choice,) = response.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    assert len(choice.text) == 12
    assert response.usage.prompt_tokens == len("Once upon a time")
    assert response.usage.completion_tokens == 12
    assert response.usage.total_tokens == len("Once upon a time") + 12


def test_prompt_as_a_list_of_strings(client) -> None:
    prompts = ["Once upon a time", "The quick brown fox"]
    singles = [complete(client, p).choices[0].text for p in prompts]
    response = complete(client, prompts)
    assert [c.index for c in response.choices] == [0, 1]
    assert [c.text for c in response.choices] == singles
    assert response.usage.prompt_tokens == sum(len(p) for p in prompts)
    assert response.usage.completion_tokens == 24


def test_prompt_as_token_ids(client) -> None:
    text = complete(client, "Once upon a time").choices[0].text
    assert complete(client, token_ids("Once upon a time")).choices[0].text == text
    batch = complete(client, [token_ids("Once upon a time"), token_ids("The quick brown fox")])
    assert batch.choices[0].text == text
    assert batch.choices[1].text == complete(client, "The quick brown fox").choices[0].text


def test_n_with_several_prompts_orders_choices_by_prompt(client) -> None:
    response = client.completions.create(
        model=TINY_NAME,
        prompt=["abc", "xyz"],
        n=2,
        temperature=1.0,
        seed=3,
        max_tokens=4,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert response.usage.completion_tokens == 16


def test_echo(client) -> None:
    plain = complete(client, "Once upon a time").choices[0].text
    echoed = complete(client, "Once upon a time", echo=True).choices[0].text
    assert echoed == "Once upon a time" + plain


def test_stop_and_logprobs(client) -> None:
    text = complete(client, "Once upon a time", max_tokens=20).choices[0].text
    stop = text[5:7]
    stopped = complete(client, "Once upon a time", max_tokens=20, stop=stop)
    assert stopped.choices[0].text == text[: text.find(stop)]
    assert stopped.choices[0].finish_reason == "stop"

    scored = client.completions.create(
        model=TINY_NAME,
        prompt="Once upon a time",
        temperature=0,
        max_tokens=5,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    logprobs = scored.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 5
    assert len(logprobs.top_logprobs) == len(logprobs.text_offset) == 5
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_logprobs_zero_gives_objects_in_top_logprobs(client) -> None:
    """logprobs=0 asks for no alternatives; OpenAI's CreateCompletionResponse still types every
    top_logprobs entry as an object (token -> logprob), never null."""
    response = client.completions.create(
        model=TINY_NAME, prompt="Once upon a time", max_tokens=3, logprobs=0
    )
    logprobs = response.choices[0].logprobs
    assert len(logprobs.token_logprobs) == 3
    assert all(isinstance(top, dict) for top in logprobs.top_logprobs), (
        f"top_logprobs={logprobs.top_logprobs}: null entries violate OpenAI's schema "
        "(server/logprobs.py completion_logprobs turns an empty dict into None)"
    )


def test_suffix_is_rejected(tiny_server) -> None:
    response = tiny_server.post(
        "/v1/completions", {"model": TINY_NAME, "prompt": "def f(", "suffix": "return 1"}
    )
    assert_openai_error(response, 400, type_="invalid_request_error", param="suffix")


def test_streaming_completion(tiny_server, client) -> None:
    expected = complete(client, "Once upon a time").choices[0].text
    body = {
        "model": TINY_NAME,
        "prompt": "Once upon a time",
        "temperature": 0,
        "max_tokens": 12,
        "logit_bias": BAN_SPECIALS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with (
        tiny_server.http() as http,
        http.stream("POST", "/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        chunks = sse_json(list(sse_events(response)))
    *deltas, usage = chunks
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in deltas) == expected
    assert [c["choices"][0]["finish_reason"] for c in deltas][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in deltas[:-1])
    assert usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 12
    assert usage["usage"]["prompt_tokens"] == len("Once upon a time")


def test_streaming_completion_through_the_sdk_with_echo(client) -> None:
    expected = complete(client, "Once upon a time").choices[0].text
    stream = complete(client, "Once upon a time", echo=True, stream=True)
    assert "".join(c.choices[0].text for c in stream) == "Once upon a time" + expected


def test_list_models(client, tiny_server) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [TINY_NAME]
    (card,) = models.data
    assert card.object == "model"
    assert isinstance(card.created, int) and card.created > 0
    assert isinstance(card.owned_by, str) and card.owned_by
    with tiny_server.http() as http:
        raw = http.get("/v1/models").json()
    assert raw["object"] == "list"


def test_retrieve_model(client) -> None:
    card = client.models.retrieve(TINY_NAME)
    assert (card.id, card.object) == (TINY_NAME, "model")
    assert card == client.models.list().data[0]
