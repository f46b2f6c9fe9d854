"""Bad input fails fast: a ValueError subclass from engine.errors with a clear message, raised
before anything is scheduled, after which the engine serves a normal request as if nothing
happened."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import transformers

from engine import LLM, SamplingParams
from engine.errors import (
    AerieError,
    ContextLengthExceededError,
    InvalidRequestError,
    ModelLoadError,
    UnsupportedArchitectureError,
)
from tests.engine.helpers import tiny_engine, tiny_llm

MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def llm(tiny_models) -> LLM:
    return tiny_llm(tiny_models["llama"], max_model_len=MAX_MODEL_LEN, block_size=4)


def assert_nothing_scheduled(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.requests and not engine.has_unfinished_requests()
    assert not engine.scheduler.waiting and not engine.scheduler.running
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert engine.step() == []


def assert_serves_normally(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    (output,) = llm.generate([[5, 6, 7, 8, 9]], params, use_tqdm=False)
    assert output.finished
    assert len(output.outputs[0].token_ids) == 5
    assert output.outputs[0].finish_reason == "length"
    assert_nothing_scheduled(llm)


def expect_error(error: type[AerieError], match: str, call, *args, **kwargs) -> AerieError:
    with pytest.raises(error, match=match) as info:
        call(*args, **kwargs)
    assert isinstance(info.value, ValueError)
    return info.value


# ------------------------------------------------------------------ requests


def test_prompt_longer_than_the_context(llm) -> None:
    error = expect_error(
        ContextLengthExceededError,
        "maximum context length is 64 tokens.*your prompt has 64 tokens",
        llm.generate,
        [list(range(3, 3 + MAX_MODEL_LEN))],
        SamplingParams(max_tokens=1),
        use_tqdm=False,
    )
    assert error.param is not None
    assert_nothing_scheduled(llm)
    assert_serves_normally(llm)


def test_prompt_plus_max_tokens_past_the_context(llm) -> None:
    error = expect_error(
        ContextLengthExceededError,
        r"requested 70 tokens \(40 in the prompt, 30 in the completion\)",
        llm.generate,
        [list(range(3, 43))],
        SamplingParams(max_tokens=30),
        use_tqdm=False,
    )
    assert error.param == "max_tokens"
    assert_serves_normally(llm)


@pytest.mark.parametrize(
    ("options", "param", "match"),
    [
        ({"temperature": -0.5}, "temperature", "temperature must be >= 0"),
        ({"top_p": 0.0}, "top_p", r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, "top_p", r"top_p must be in \(0, 1\]"),
        ({"n": 0}, "n", "n must be at least 1"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens must be at least 1"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "min_tokens must not exceed"),
        ({"logprobs": 21}, "logprobs", "logprobs must be between 0 and 20"),
    ],
)
def test_bad_sampling_params(llm, options, param, match) -> None:
    error = expect_error(InvalidRequestError, match, SamplingParams, **options)
    assert error.param == param
    assert_serves_normally(llm)


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"n": 1.5}, "n"),  # passed `n >= 1` and then forked choices forever
        ({"n": "2"}, "n"),
        ({"n": True}, "n"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"max_tokens": "16"}, "max_tokens"),
        ({"min_tokens": 1.5}, "min_tokens"),
        ({"top_k": 2.5}, "top_k"),
        ({"logprobs": 1.0}, "logprobs"),
        ({"seed": "7"}, "seed"),
        ({"temperature": "0.7"}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": None}, "top_p"),
        ({"min_p": "0"}, "min_p"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"frequency_penalty": False}, "frequency_penalty"),
        ({"repetition_penalty": "1.1"}, "repetition_penalty"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"stop": 5}, "stop"),
        ({"stop": ["ok", 5]}, "stop"),
        ({"stop_token_ids": [2.5]}, "stop_token_ids"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"logit_bias": {5: "high"}}, "logit_bias"),
    ],
    ids=lambda value: repr(value) if isinstance(value, dict) else None,
)
def test_sampling_params_of_the_wrong_type(options, param) -> None:
    error = expect_error(InvalidRequestError, re.escape(param), SamplingParams, **options)
    assert error.param == param


def test_sampling_params_accept_ints_for_floats() -> None:
    params = SamplingParams(temperature=1, top_p=1, repetition_penalty=2, logit_bias={5: 1})
    assert params.temperature == 1 and params.logit_bias == {5: 1.0}


@pytest.mark.parametrize("prompt", ["", []], ids=["empty-text", "no-token-ids"])
def test_empty_prompt(llm, prompt) -> None:
    engine = llm.engine
    expect_error(InvalidRequestError, "the prompt is empty", engine.add_request, "x", prompt)
    assert_nothing_scheduled(llm)
    assert_serves_normally(llm)


@pytest.mark.parametrize("bad_token", [256, -1, 10**9])
def test_token_ids_outside_the_vocabulary(llm, bad_token) -> None:
    expect_error(
        InvalidRequestError,
        r"prompt token ids must be in \[0, 256\)",
        llm.generate,
        [[5, bad_token, 6]],
        use_tqdm=False,
    )
    assert_serves_normally(llm)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"stop_token_ids": [300]}, r"stop_token_ids must be in \[0, 256\)"),
        ({"logit_bias": {256: 1.0}}, r"logit_bias token ids must be in \[0, 256\)"),
        ({"n": 1000}, "exceeds max_num_seqs"),
    ],
)
def test_sampling_params_the_model_cannot_serve(llm, options, match) -> None:
    params = SamplingParams(**options)
    expect_error(InvalidRequestError, match, llm.generate, [[5, 6]], params, use_tqdm=False)
    assert_serves_normally(llm)


def test_one_bad_prompt_rejects_the_whole_batch_before_scheduling(llm) -> None:
    expect_error(
        InvalidRequestError,
        "prompt token ids",
        llm.generate,
        [[5, 6, 7], [8, 9, 10], [11, 999]],
        use_tqdm=False,
    )
    assert_nothing_scheduled(llm)
    assert_serves_normally(llm)


def test_duplicate_request_id_is_rejected(llm) -> None:
    engine = llm.engine
    engine.add_request("same", [5, 6, 7], SamplingParams(max_tokens=2))
    expect_error(InvalidRequestError, "already running", engine.add_request, "same", [5, 6])
    while engine.has_unfinished_requests():
        engine.step()
    assert_serves_normally(llm)


# ------------------------------------------------------------------ engines


def test_unknown_engine_option(tiny_models) -> None:
    expect_error(
        AerieError,
        r"unknown engine option\(s\) \['not_an_option'\]",
        LLM,
        str(tiny_models["llama"]),
        not_an_option=1,
    )


def test_max_model_len_beyond_the_model(tiny_models) -> None:
    expect_error(
        AerieError,
        "exceeds the model's context of 512",
        tiny_llm,
        tiny_models["llama"],
        max_model_len=4096,
    )


def test_missing_checkpoint_folder(tmp_path) -> None:
    expect_error(ModelLoadError, "no file or folder exists there", LLM, str(tmp_path / "nope"))


def test_unsupported_architecture(tmp_path: Path) -> None:
    folder = tmp_path / "gpt2"
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(folder)
    error = expect_error(UnsupportedArchitectureError, "gpt2", LLM, str(folder))
    for supported in ("llama", "mistral", "qwen2", "qwen3"):
        assert supported in str(error)


def test_unsupported_activation(tiny_models, tmp_path: Path) -> None:
    config = json.loads((tiny_models["llama"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    expect_error(UnsupportedArchitectureError, "hidden_act 'gelu'", LLM, str(tmp_path))


NO_CHUNKING = {"enable_chunked_prefill": False, "max_num_batched_tokens": 24, "max_model_len": 64}
BEYOND_BUDGET = {
    # The prompt alone is longer than a step's token budget.
    "prompt": ({}, 1, 30, 2),
    # Prompts fit, but a tiny pool preempts sequences; with no prefix cache, recomputing one means
    # prefilling its prompt and output (up to 40 tokens) in one step.
    "prompt-and-output-after-preemption": (
        {"block_size": 4, "num_kv_blocks": 16, "enable_prefix_caching": False},
        4,
        20,
        20,
    ),
}


@pytest.mark.parametrize("case", BEYOND_BUDGET)
def test_requests_beyond_the_budget_without_chunked_prefill_do_not_hang(tiny_models, case) -> None:
    """With chunked prefill off, a sequence longer than max_num_batched_tokens can never be
    (re)scheduled. The engine must refuse such requests, or the configuration, not stall."""
    options, num_requests, prompt_len, max_tokens = BEYOND_BUDGET[case]
    budget = NO_CHUNKING["max_num_batched_tokens"]
    try:
        engine = tiny_engine(tiny_models["llama"], **NO_CHUNKING, **options)
    except AerieError as exc:  # refusing the configuration is fine too, for this reason
        assert "max_num_batched_tokens" in str(exc), exc
        return
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    try:
        for i in range(num_requests):
            engine.add_request(str(i), list(range(3 + i, 3 + i + prompt_len)), params)
    except InvalidRequestError as exc:  # or the request, as beyond the budget-capped context
        assert f"maximum context length is {budget} tokens" in str(exc), exc
        return
    for _ in range(500):
        engine.step()
    assert not engine.has_unfinished_requests(), (
        f"chunked prefill off, max_num_batched_tokens=24: {num_requests} request(s) of "
        f"{prompt_len} + {max_tokens} tokens were accepted but never finish (waiting: "
        f"{[(s.num_tokens, s.num_computed_tokens) for s in engine.scheduler.waiting]}); "
        "LLM.generate would loop forever. Cap the usable context at max_num_batched_tokens "
        "when chunked prefill is off (as vLLM does), so such requests are rejected when added."
    )
