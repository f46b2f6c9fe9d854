"""POST /v1/completions (the legacy text-completion API)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from engine.async_llm import EngineStepError
from engine.outputs import RequestOutput
from server.auth import require_api_key
from server.errors import APIError
from server.generation import (
    collect,
    log_request,
    merged,
    sse,
    sse_error,
    start_requests,
    stream_end,
    token_usage,
    usage_of,
)
from server.logprobs import completion_logprobs
from server.prompts import completion_prompts
from server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    random_id,
    unix_time,
)
from server.sampling import completion_sampling_params
from server.state import StateDep

router = APIRouter(dependencies=[require_api_key])


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, http_request: Request, state: StateDep):
    engine = state.ready_engine()
    state.check_model(body.model)
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if body.echo and body.logprobs is not None:
        raise APIError(400, "echo with logprobs is not supported yet", param="echo")
    params = completion_sampling_params(body)
    tokenizer = engine.engine.tokenizer
    prompts = completion_prompts(tokenizer, body)
    state.check_queue(engine)
    request_id, model = random_id("cmpl"), state.settings.served_model_name
    streams = start_requests(engine, request_id, prompts, params)
    echoes = [tokenizer.decode(p) if body.echo else "" for p in prompts]
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = _stream_chunks(
            streams, request_id, model, tokenizer, params.n, echoes, include_usage
        )
        return StreamingResponse(chunks, media_type="text/event-stream")
    started = time.monotonic()
    finals = await collect(streams, http_request)
    usage = usage_of(finals)
    choices = []
    for i, final in enumerate(finals):
        for c in final.outputs:
            choices.append(
                CompletionChoice(
                    index=i * params.n + c.index,
                    text=echoes[i] + c.text,
                    logprobs=completion_logprobs(tokenizer, c.logprobs, len(echoes[i])),
                    finish_reason=c.finish_reason,
                )
            )
    log_request(request_id, usage, started, [c.finish_reason for c in choices])
    return CompletionResponse(
        id=request_id, created=unix_time(), model=model, choices=choices, usage=usage
    )


async def _stream_chunks(
    streams: list[AsyncIterator[RequestOutput]],
    request_id: str,
    model: str,
    tokenizer,
    n: int,
    echoes: list[str],
    include_usage: bool,
) -> AsyncIterator[str]:
    created, started = unix_time(), time.monotonic()
    echoed: set[int] = set()
    offsets: dict[int, int] = {}
    num_prompt: dict[int, int] = {}
    num_completion = 0
    finish_reasons = []

    def chunk(choices, usage=None) -> str:
        return sse(
            CompletionResponse(
                id=request_id, created=created, model=model, choices=choices, usage=usage
            )
        )

    try:
        async for prompt_index, delta in merged(streams):
            num_prompt[prompt_index] = len(delta.prompt_token_ids)
            for c in delta.outputs:
                index = prompt_index * n + c.index
                prefix = "" if index in echoed else echoes[prompt_index]
                echoed.add(index)
                offset = offsets.get(index, len(prefix))
                offsets[index] = offset + len(c.text)
                num_completion += len(c.token_ids)
                if c.finish_reason is not None:
                    finish_reasons.append(c.finish_reason)
                yield chunk(
                    [
                        CompletionChoice(
                            index=index,
                            text=prefix + c.text,
                            logprobs=completion_logprobs(tokenizer, c.logprobs, offset),
                            finish_reason=c.finish_reason,
                        )
                    ]
                )
    except EngineStepError as exc:
        yield sse_error(APIError(500, str(exc), code="internal_error"))
        return
    usage_chunk = (lambda usage: chunk([], usage=usage)) if include_usage else None
    usage = token_usage(sum(num_prompt.values()), num_completion)
    for event in stream_end(request_id, usage, started, finish_reasons, usage_chunk):
        yield event
