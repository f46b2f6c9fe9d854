"""POST /v1/chat/completions."""

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
from server.logprobs import chat_logprobs
from server.prompts import chat_prompt_ids
from server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    random_id,
    unix_time,
)
from server.sampling import chat_sampling_params
from server.state import StateDep

router = APIRouter(dependencies=[require_api_key])


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(
    body: ChatCompletionRequest, http_request: Request, state: StateDep
):
    engine = state.ready_engine()
    state.check_model(body.model)
    _reject_unsupported(body)
    params = chat_sampling_params(body)
    tokenizer = engine.engine.tokenizer
    prompt = chat_prompt_ids(tokenizer, body)
    state.check_queue(engine)
    request_id, model = random_id("chatcmpl"), state.settings.served_model_name
    streams = start_requests(engine, request_id, [prompt], params)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = _stream_chunks(streams[0], request_id, model, tokenizer, params.n, include_usage)
        return StreamingResponse(chunks, media_type="text/event-stream")
    started = time.monotonic()
    (final,) = await collect(streams, http_request)
    usage = usage_of([final])
    log_request(request_id, usage, started, [c.finish_reason for c in final.outputs])
    choices = [
        ChatChoice(
            index=c.index,
            message=AssistantMessage(content=c.text),
            logprobs=chat_logprobs(tokenizer, c.logprobs),
            finish_reason=c.finish_reason,
        )
        for c in final.outputs
    ]
    return ChatCompletionResponse(
        id=request_id, created=unix_time(), model=model, choices=choices, usage=usage
    )


def _reject_unsupported(body: ChatCompletionRequest) -> None:
    if body.tools or body.functions or body.tool_choice not in (None, "none"):
        raise APIError(400, "tools and function calling are not supported yet", param="tools")
    if body.response_format and body.response_format.get("type") != "text":
        raise APIError(
            400, "response_format other than text is not supported yet", param="response_format"
        )


async def _stream_chunks(
    deltas: AsyncIterator[RequestOutput],
    request_id: str,
    model: str,
    tokenizer,
    n: int,
    include_usage: bool,
) -> AsyncIterator[str]:
    """SSE: the role delta first, then content deltas, a final chunk with finish_reason per
    choice, the usage chunk when asked, then [DONE]."""
    created, started = unix_time(), time.monotonic()

    def chunk(choices, usage=None) -> str:
        return sse(
            ChatCompletionChunk(
                id=request_id, created=created, model=model, choices=choices, usage=usage
            )
        )

    for index in range(n):
        yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))])
    num_prompt = num_completion = 0
    finish_reasons: dict[int, str] = {}
    try:
        async for _, delta in merged([deltas]):
            num_prompt = len(delta.prompt_token_ids)
            for c in delta.outputs:
                num_completion += len(c.token_ids)
                if c.text or c.logprobs:
                    yield chunk(
                        [
                            ChatChunkChoice(
                                index=c.index,
                                delta=ChatDelta(content=c.text),
                                logprobs=chat_logprobs(tokenizer, c.logprobs),
                            )
                        ]
                    )
                if c.finish_reason is not None:
                    finish_reasons[c.index] = c.finish_reason
                    yield chunk(
                        [
                            ChatChunkChoice(
                                index=c.index, delta=ChatDelta(), finish_reason=c.finish_reason
                            )
                        ]
                    )
    except EngineStepError as exc:
        yield sse_error(APIError(500, str(exc), code="internal_error"))
        return
    usage_chunk = (lambda usage: chunk([], usage=usage)) if include_usage else None
    usage = token_usage(num_prompt, num_completion)
    for event in stream_end(request_id, usage, started, list(finish_reasons.values()), usage_chunk):
        yield event
