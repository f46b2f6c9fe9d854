"""POST /v1/chat/completions."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable

from fastapi import APIRouter, Request

from server.auth import require_api_key
from server.errors import APIError
from server.generation import (
    EngineCall,
    EngineStreamingResponse,
    chunk_writer,
    collect,
    sse_stream,
    start_call,
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
    call = start_call(engine, request_id, [prompt], params)
    if body.stream:
        chunk = chunk_writer(ChatCompletionChunk, request_id, model)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = sse_stream(
            call, _choice_chunks(call, chunk, tokenizer, params.n), chunk, include_usage
        )
        return EngineStreamingResponse(events, call)
    (final,) = await collect(call, http_request)
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
        id=request_id, created=unix_time(), model=model, choices=choices, usage=call.usage
    )


def _reject_unsupported(body: ChatCompletionRequest) -> None:
    if body.tools or body.functions or body.tool_choice not in (None, "none"):
        raise APIError(400, "tools and function calling are not supported yet", param="tools")
    if body.response_format and body.response_format.get("type") != "text":
        raise APIError(
            400, "response_format other than text is not supported yet", param="response_format"
        )


async def _choice_chunks(
    call: EngineCall, chunk: Callable[..., str], tokenizer, n: int
) -> AsyncGenerator[str, None]:
    """The role delta of each choice first, then content deltas, and a final chunk with
    finish_reason per choice."""
    for index in range(n):
        yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))])
    async for _, delta in call.deltas():
        for c in delta.outputs:
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
                yield chunk(
                    [
                        ChatChunkChoice(
                            index=c.index, delta=ChatDelta(), finish_reason=c.finish_reason
                        )
                    ]
                )
