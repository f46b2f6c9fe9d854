"""POST /v1/chat/completions through the official `openai` SDK (and raw SSE where the wire format
itself is the point), on a live tiny-model server.

The tiny model has a character-level tokenizer, so prompt lengths follow from the chat template
exactly, and greedy text can be cut at stop strings and stop tokens by hand.
"""

from __future__ import annotations

import pytest

from tests.server.conftest import (
    BAN_SPECIALS,
    TINY_NAME,
    prompt_tokens_of,
    render_chat,
    sse_events,
    sse_json,
)

pytestmark = pytest.mark.timeout(120)

HELLO = [{"role": "user", "content": "Hello there"}]


def greedy(client, messages=HELLO, max_tokens: int = 16, **options):
    extra_body = {"ignore_eos": True, **options.pop("extra_body", {})}
    return client.chat.completions.create(
        model=TINY_NAME,
        messages=messages,
        temperature=0,
        max_tokens=max_tokens,
        logit_bias=BAN_SPECIALS,
        extra_body=extra_body,
        **options,
    )


def only_text(response) -> str:
    assert len(response.choices) == 1
    return response.choices[0].message.content


def test_non_streaming_response(client) -> None:
    response = greedy(client, max_tokens=12)
    assert response.object == "chat.completion"
    assert response.id.startswith("chatcmpl-")
    assert response.model == TINY_NAME
    assert response.created > 0
    (choice,) = response.choices
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and len(choice.message.content) == 12
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == prompt_tokens_of(render_chat([("user", "Hello there")]))
    assert response.usage.completion_tokens == 12
    assert response.usage.total_tokens == response.usage.prompt_tokens + 12


def test_greedy_is_deterministic(client) -> None:
    assert only_text(greedy(client)) == only_text(greedy(client))


def test_streaming_with_usage_wire_format(tiny_server, client) -> None:
    """Role delta first, then content deltas, one chunk with finish_reason, the usage chunk with
    `choices == []`, then `[DONE]` and the end of the stream."""
    expected = only_text(greedy(client, max_tokens=10))
    body = {
        "model": TINY_NAME,
        "messages": HELLO,
        "temperature": 0,
        "max_tokens": 10,
        "logit_bias": BAN_SPECIALS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with (
        tiny_server.http() as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        chunks = sse_json(list(sse_events(response)))

    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == TINY_NAME for c in chunks)
    first, *middle, final, usage = chunks
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert first["choices"][0]["finish_reason"] is None
    assert middle, "no content deltas"
    for chunk in middle:
        (choice,) = chunk["choices"]
        assert choice["finish_reason"] is None
        assert choice["delta"].get("role") is None
    assert "".join(c["choices"][0]["delta"]["content"] or "" for c in middle) == expected
    (last_choice,) = final["choices"]
    assert last_choice["finish_reason"] == "length"
    assert usage["choices"] == []
    assert usage["usage"] == {
        "prompt_tokens": prompt_tokens_of(render_chat([("user", "Hello there")])),
        "completion_tokens": 10,
        "total_tokens": prompt_tokens_of(render_chat([("user", "Hello there")])) + 10,
    }
    assert all(c.get("usage") is None for c in chunks[:-1])


def test_streaming_through_the_sdk(client) -> None:
    expected = only_text(greedy(client, max_tokens=10))
    stream = greedy(client, max_tokens=10, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_streaming_without_include_usage_sends_no_usage(client) -> None:
    chunks = list(greedy(client, max_tokens=4, stream=True))
    assert all(c.choices for c in chunks), "a usage chunk was sent without include_usage"
    assert all(c.usage is None for c in chunks)


def test_n_choices(client) -> None:
    response = client.chat.completions.create(
        model=TINY_NAME,
        messages=HELLO,
        n=2,
        temperature=1.0,
        seed=11,
        max_tokens=8,
        logit_bias=BAN_SPECIALS,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in response.choices] == [0, 1]
    assert all(len(c.message.content) == 8 for c in response.choices)
    assert all(c.finish_reason == "length" for c in response.choices)
    assert response.choices[0].message.content != response.choices[1].message.content
    assert response.usage.completion_tokens == 16


def test_n_choices_streaming(client) -> None:
    chunks = list(
        client.chat.completions.create(
            model=TINY_NAME,
            messages=HELLO,
            n=2,
            temperature=1.0,
            seed=5,
            max_tokens=6,
            logit_bias=BAN_SPECIALS,
            extra_body={"ignore_eos": True},
            stream=True,
        )
    )
    texts: dict[int, str] = {0: "", 1: ""}
    finishes: dict[int, str] = {}
    roles: set[int] = set()
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.delta.role:
                roles.add(choice.index)
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert roles == {0, 1}
    assert finishes == {0: "length", 1: "length"}
    assert len(texts[0]) == len(texts[1]) == 6


def test_stop_string(client) -> None:
    text = only_text(greedy(client, max_tokens=24))
    stop = text[6:8]
    expected = text[: text.find(stop)]
    response = greedy(client, max_tokens=24, stop=[stop])
    assert only_text(response) == expected
    assert response.choices[0].finish_reason == "stop"
    streamed = greedy(client, max_tokens=24, stop=stop, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected


def test_seeded_sampling_is_reproducible(client) -> None:
    def sample(seed: int) -> str:
        response = client.chat.completions.create(
            model=TINY_NAME,
            messages=HELLO,
            temperature=1.0,
            seed=seed,
            max_tokens=16,
            extra_body={"ignore_eos": True},
        )
        return only_text(response)

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first
    assert first != only_text(greedy(client)), "temperature 1 sampled exactly the greedy text"


def test_logprobs_shape(client) -> None:
    # No logit_bias here: logprobs describe the model's own distribution (as in vLLM), so a
    # banned token could otherwise be the top alternative.
    response = client.chat.completions.create(
        model=TINY_NAME,
        messages=HELLO,
        temperature=0,
        max_tokens=6,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    (choice,) = response.choices
    content = choice.logprobs.content
    assert len(content) == response.usage.completion_tokens == 6
    visible = [e.token for e in content if e.token not in ("<pad>", "<s>", "</s>")]
    assert "".join(visible) == choice.message.content
    for entry in content:
        assert entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 3
        top = [t.logprob for t in entry.top_logprobs]
        assert top == sorted(top, reverse=True)
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)


def test_logprobs_without_top_logprobs(client) -> None:
    response = greedy(client, max_tokens=3, logprobs=True)
    entries = response.choices[0].logprobs.content
    assert len(entries) == 3 and all(e.top_logprobs == [] for e in entries)
    assert greedy(client, max_tokens=3).choices[0].logprobs is None


def test_max_tokens_ends_with_length(client) -> None:
    response = greedy(client, max_tokens=7)
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 7


def test_max_completion_tokens(client) -> None:
    response = client.chat.completions.create(
        model=TINY_NAME,
        messages=HELLO,
        temperature=0,
        max_completion_tokens=5,
        extra_body={"ignore_eos": True},
    )
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 5


def test_system_prompt_reaches_the_model(client) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hello there"},
    ]
    response = greedy(client, messages=messages, max_tokens=8)
    expected = render_chat([("system", "You are terse."), ("user", "Hello there")])
    assert response.usage.prompt_tokens == prompt_tokens_of(expected)
    assert only_text(response) != only_text(greedy(client, max_tokens=8))


def test_developer_role_is_a_system_prompt(client) -> None:
    def ask(role: str):
        messages = [
            {"role": role, "content": "Answer in French."},
            {"role": "user", "content": "Hello there"},
        ]
        return greedy(client, messages=messages, max_tokens=8)

    developer, system = ask("developer"), ask("system")
    assert only_text(developer) == only_text(system)
    assert developer.usage.prompt_tokens == system.usage.prompt_tokens


def test_multi_turn_conversation(client) -> None:
    turns = [
        ("system", "Be kind."),
        ("user", "Hi"),
        ("assistant", "Hello! How can I help?"),
        ("user", "Tell me a joke"),
    ]
    response = greedy(client, messages=[{"role": r, "content": c} for r, c in turns])
    assert response.usage.prompt_tokens == prompt_tokens_of(render_chat(turns))
    assert len(only_text(response)) == 16


def test_continue_final_message_extends_the_assistant_turn(client) -> None:
    start = [("user", "Hello there"), ("assistant", "Gen")]
    response = greedy(
        client,
        messages=[{"role": r, "content": c} for r, c in start],
        extra_body={"continue_final_message": True, "add_generation_prompt": False},
    )
    # The prompt ends inside the assistant's turn: the template's turn end is cut away.
    continued = render_chat(start[:1]) + "Gen"
    assert response.usage.prompt_tokens == prompt_tokens_of(continued)
    assert len(only_text(response)) == 16


def test_chat_template_kwargs_reach_the_template(client) -> None:
    plain = greedy(client)
    with_kwargs = greedy(client, extra_body={"chat_template_kwargs": {"preamble": "Be brief. "}})
    assert with_kwargs.usage.prompt_tokens == plain.usage.prompt_tokens + len("Be brief. ")
    assert only_text(with_kwargs) != only_text(plain)


def test_content_as_a_list_of_text_parts(client) -> None:
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]
    as_parts = greedy(client, messages=[{"role": "user", "content": parts}])
    as_string = greedy(client)
    assert only_text(as_parts) == only_text(as_string)
    assert as_parts.usage.prompt_tokens == as_string.usage.prompt_tokens


def test_sampling_extras_are_accepted_and_honoured(client) -> None:
    reference = only_text(greedy(client, max_tokens=12))

    def sampled(**extra) -> str:
        response = client.chat.completions.create(
            model=TINY_NAME,
            messages=HELLO,
            temperature=1.0,
            seed=99,
            max_tokens=12,
            logit_bias=BAN_SPECIALS,
            extra_body={"ignore_eos": True, **extra},
        )
        assert response.choices[0].finish_reason == "length"
        return only_text(response)

    # top_k=1 and min_p=1 keep only the most likely token: sampling becomes greedy.
    assert sampled(top_k=1) == reference
    assert sampled(min_p=1.0) == reference
    assert len(sampled(repetition_penalty=1.3)) == 12


def test_user_as_a_string_is_accepted(client) -> None:
    with_user = greedy(client, max_tokens=8, user="user-1234")
    assert with_user.choices[0].finish_reason == "length"
    assert only_text(with_user) == only_text(greedy(client, max_tokens=8))


@pytest.mark.parametrize("penalty", ["frequency_penalty", "presence_penalty"])
def test_penalties_change_greedy_output(client, penalty) -> None:
    """Greedy text repeats itself on the tiny model; a strong penalty on tokens already
    generated makes it pick others, so the text differs and uses more distinct characters."""
    plain = only_text(greedy(client, max_tokens=32))
    penalized = only_text(greedy(client, max_tokens=32, **{penalty: 2.0}))
    assert len(penalized) == 32
    assert penalized != plain
    assert len(set(penalized)) > len(set(plain)), (plain, penalized)


def test_stop_token_ids_and_min_tokens(client) -> None:
    text = only_text(greedy(client, max_tokens=24))
    char = text[5]
    token_id = ord(char) - 32 + 3  # the tiny tokenizer: chr(32 + i) is token i + 3
    first = text.index(char)

    stopped = greedy(client, max_tokens=24, extra_body={"stop_token_ids": [token_id]})
    assert only_text(stopped) == text[:first]
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == first + 1

    # min_tokens bans the stop token while fewer than `first + 1` tokens exist (as in vLLM), so
    # it cannot be chosen at position `first`: the text agrees up to there, then differs.
    held = greedy(
        client,
        max_tokens=24,
        extra_body={"stop_token_ids": [token_id], "min_tokens": first + 1},
    )
    held_text = only_text(held)
    assert held.usage.completion_tokens > first + 1
    assert held_text[:first] == text[:first]
    assert held_text[first] != char


def test_ignore_eos(client) -> None:
    """Without ignore_eos a forced end-of-sequence token ends the answer at once; with it, the
    answer runs to max_tokens."""
    eos_first = {"2": 100}
    ended = client.chat.completions.create(
        model=TINY_NAME, messages=HELLO, temperature=0, max_tokens=8, logit_bias=eos_first
    )
    assert ended.choices[0].finish_reason == "stop"
    assert ended.usage.completion_tokens == 1
    ignored = client.chat.completions.create(
        model=TINY_NAME,
        messages=HELLO,
        temperature=0,
        max_tokens=8,
        logit_bias=eos_first,
        extra_body={"ignore_eos": True},
    )
    assert ignored.choices[0].finish_reason == "length"
    assert ignored.usage.completion_tokens == 8


def test_model_may_be_omitted(tiny_server) -> None:
    response = tiny_server.post(
        "/v1/chat/completions", {"messages": HELLO, "max_tokens": 2, "temperature": 0}
    )
    assert response.status_code == 200, response.text
    assert response.json()["model"] == TINY_NAME
