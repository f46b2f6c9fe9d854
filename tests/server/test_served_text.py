"""The server serves the engine's own text: a greedy request through the OpenAI SDK (chat and
completions, streamed and not) returns what `engine.LLM` generates in this process for the same
model, prompt and chat template; and the speculating server returns plain decoding's text.

A difference is allowed only where floating point may break a near-tie (DESIGN.md, Acceptance):
then the first differing token must be one, in the target's own logits."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from tests.drafting.test_speculative_generation import assert_same_or_near_tie
from tests.server.conftest import BAN_SPECIALS, SPEC_NAME, TINY_CONTEXT, TINY_NAME, LiveServer

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 32
CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three colours."},
        {"role": "assistant", "content": "Red, green"},
        {"role": "user", "content": "And one more?"},
    ],
]
PROMPTS = ["Once upon a time", "def add(a, b):\n    return"]
# Greedy; the special tokens, which decode to no text, banned, so every token is one character.
GREEDY = SamplingParams(
    temperature=0, max_tokens=MAX_TOKENS, logit_bias={int(k): v for k, v in BAN_SPECIALS.items()}
)


def served(server: LiveServer, kind: str, prompt, stream: bool) -> tuple[str, str]:
    """(text, finish_reason) of one greedy request through the OpenAI SDK."""
    common = dict(temperature=0, max_tokens=MAX_TOKENS, logit_bias=BAN_SPECIALS, stream=stream)
    with server.client() as client:
        if kind == "chat":
            answer = client.chat.completions.create(model=server.model, messages=prompt, **common)
            if not stream:
                (choice,) = answer.choices
                assert answer.usage.completion_tokens == MAX_TOKENS
                return choice.message.content, choice.finish_reason
            chunks = [chunk.choices[0] for chunk in answer if chunk.choices]
            text = "".join(choice.delta.content or "" for choice in chunks)
        else:
            answer = client.completions.create(model=server.model, prompt=prompt, **common)
            if not stream:
                (choice,) = answer.choices
                assert answer.usage.completion_tokens == MAX_TOKENS
                return choice.text, choice.finish_reason
            chunks = [chunk.choices[0] for chunk in answer if chunk.choices]
            text = "".join(choice.text for choice in chunks)
    finishes = [choice.finish_reason for choice in chunks if choice.finish_reason]
    assert len(finishes) == 1, f"one chunk carries the finish reason: {finishes}"
    return text, finishes[0]


def prompt_ids(llm: LLM, kind: str, prompt) -> list[int]:
    """The prompt's token ids as the server makes them (server/prompts.py)."""
    if kind == "chat":
        return llm.apply_chat_template(prompt)
    return llm.get_tokenizer().encode(prompt)


def assert_served_is_engines(model: Path, llm: LLM, prompt: list[int], engine, text: str):
    """`text` is the engine's output text, or diverges from it first at a near-tie."""
    if text == engine.text:
        return
    served_ids = llm.get_tokenizer().convert_tokens_to_ids(list(text))  # one token a character
    assert_same_or_near_tie(model, prompt, engine.token_ids, served_ids)


CASES = [("chat", c) for c in CONVERSATIONS] + [("completion", p) for p in PROMPTS]


@pytest.fixture(scope="module")
def engine_llm(tiny_model) -> LLM:
    """The tiny_server's engine (tiny_server_args), built in this process."""
    return LLM(
        str(tiny_model), draft=None, device="cpu", max_model_len=TINY_CONTEXT, num_kv_blocks=2048
    )


@pytest.fixture(scope="module")
def engine_outputs(engine_llm) -> list:
    """The engine's greedy output for each case, generated directly (no server)."""
    prompts = [prompt_ids(engine_llm, kind, prompt) for kind, prompt in CASES]
    outputs = engine_llm.generate(prompts, GREEDY, use_tqdm=False)
    return list(zip(prompts, [o.outputs[0] for o in outputs]))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_the_served_text_is_the_engines(
    tiny_server, tiny_model, engine_llm, engine_outputs, kind, stream
):
    assert tiny_server.model == TINY_NAME
    for (case_kind, prompt), (ids, engine) in zip(CASES, engine_outputs):
        if case_kind != kind:
            continue
        assert len(engine.text) == MAX_TOKENS  # a real comparison: a character a token
        text, finish_reason = served(tiny_server, kind, prompt, stream)
        assert finish_reason == engine.finish_reason == "length"
        assert_served_is_engines(tiny_model, engine_llm, ids, engine, text)


def test_the_speculating_server_serves_plain_decodings_text(spec_server, spec_model):
    target, _ = spec_model
    assert spec_server.model == SPEC_NAME
    plain = LLM(str(target), draft=None, device="cpu", max_model_len=512, num_kv_blocks=2048)
    accepted = "aerie_spec_decode_num_accepted_tokens_total"
    before = spec_server.metrics().get(accepted, 0.0)
    for kind, prompt in CASES:
        ids = prompt_ids(plain, kind, prompt)
        (output,) = plain.generate([ids], GREEDY, use_tqdm=False)
        engine = output.outputs[0]
        assert len(engine.text) == MAX_TOKENS
        for stream in (False, True):
            text, finish_reason = served(spec_server, kind, prompt, stream)
            assert finish_reason == "length"
            assert_served_is_engines(target, plain, ids, engine, text)
    assert spec_server.metrics()[accepted] > before, "the server speculated, and drafts landed"
