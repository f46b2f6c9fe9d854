"""From an OpenAI request body to the engine's SamplingParams (invalid values become 400s)."""

from __future__ import annotations

from engine.errors import InvalidRequestError
from engine.sampling.grammar import GrammarSpec
from engine.sampling.sampling_params import MAX_LOGPROBS, SamplingParams
from server.errors import APIError
from server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

MAX_STOP_SEQUENCES = 4


def chat_sampling_params(
    body: ChatCompletionRequest,
    structured: GrammarSpec | None = None,
    skip_special_tokens: bool | None = None,
) -> SamplingParams:
    """`skip_special_tokens` overrides the body's (tool parsers whose markers are special)."""
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= MAX_LOGPROBS:
        raise APIError(
            400, f"top_logprobs must be between 0 and {MAX_LOGPROBS}", param="top_logprobs"
        )
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_completion_tokens or body.max_tokens
    _check_positive(body.max_completion_tokens, "max_completion_tokens")
    _check_positive(body.max_tokens, "max_tokens")
    skip = body.skip_special_tokens if skip_special_tokens is None else skip_special_tokens
    return _sampling_params(body, max_tokens, logprobs, structured, skip)


def completion_sampling_params(
    body: CompletionRequest, structured: GrammarSpec | None = None
) -> SamplingParams:
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of other than n is not supported yet", param="best_of")
    _check_positive(body.max_tokens, "max_tokens")
    return _sampling_params(
        body, body.max_tokens, body.logprobs, structured, body.skip_special_tokens
    )


def _sampling_params(
    body: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    structured: GrammarSpec | None,
    skip_special_tokens: bool,
) -> SamplingParams:
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > MAX_STOP_SEQUENCES:
        raise APIError(
            400, f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed", param="stop"
        )
    try:
        logit_bias = {int(k): v for k, v in (body.logit_bias or {}).items()}
    except ValueError:
        raise APIError(400, "logit_bias keys must be token ids", param="logit_bias") from None
    try:
        return SamplingParams(
            n=body.n,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k or 0,
            min_p=body.min_p or 0.0,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=(
                1.0 if body.repetition_penalty is None else body.repetition_penalty
            ),
            logit_bias=logit_bias or None,
            seed=body.seed,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop=tuple(stop),
            stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            structured=structured,
        )
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param=exc.param) from None


def _check_positive(value: int | None, param: str) -> None:
    if value is not None and value < 1:
        raise APIError(400, f"{param} must be at least 1", param=param)
