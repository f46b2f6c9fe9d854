"""Checks a request against the model and the engine before anything is scheduled."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.errors import ContextLengthExceededError, InvalidRequestError
from engine.sampling.sampling_params import SamplingParams


def validate_request(
    prompt_ids: list[int],
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
    config: EngineConfig,
    num_kv_blocks: int,
) -> int:
    """Raise a clear InvalidRequestError for what cannot be served; return the request's token cap
    (prompt plus output)."""
    if not prompt_ids:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    if any(not 0 <= t < vocab_size for t in prompt_ids):
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size})", param="prompt")
    _check_token_ids(params, vocab_size)
    if params.n > config.max_num_seqs:
        raise InvalidRequestError(
            f"n={params.n} exceeds max_num_seqs={config.max_num_seqs}", param="n"
        )
    num_prompt = len(prompt_ids)
    if num_prompt >= max_model_len:
        raise ContextLengthExceededError(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
            f"has {num_prompt} tokens, leaving no room for a completion.",
            param="messages",
        )
    capacity = num_kv_blocks * config.block_size
    max_total = min(max_model_len, capacity)  # without max_tokens: until the context is full
    if params.max_tokens is not None:
        if num_prompt + params.max_tokens > max_model_len:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {max_model_len} tokens. However, you "
                f"requested {num_prompt + params.max_tokens} tokens ({num_prompt} in the prompt, "
                f"{params.max_tokens} in the completion). Please reduce the prompt or max_tokens.",
                param="max_tokens",
            )
        max_total = num_prompt + params.max_tokens
    if max_total > capacity or num_prompt >= capacity:
        raise InvalidRequestError(
            f"the request may need {max_total} tokens of KV cache but the cache holds {capacity}; "
            "lower max_tokens or start the engine with a larger KV cache",
            param="max_tokens",
        )
    return max_total


def _check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    if any(not 0 <= t < vocab_size for t in params.stop_token_ids):
        raise InvalidRequestError(
            f"stop_token_ids must be in [0, {vocab_size})", param="stop_token_ids"
        )
    if params.logit_bias and any(not 0 <= t < vocab_size for t in params.logit_bias):
        raise InvalidRequestError(
            f"logit_bias token ids must be in [0, {vocab_size})", param="logit_bias"
        )
