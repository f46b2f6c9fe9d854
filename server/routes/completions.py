"""POST /v1/completions (the legacy text-completion API)."""

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
from server.structured import checked_grammar, requested_grammar

router = APIRouter(dependencies=[require_api_key])


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, http_request: Request, state: StateDep):
    engine = state.ready_engine()
    state.check_model(body.model)
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if body.echo and body.logprobs is not None:
        raise APIError(400, "echo with logprobs is not supported yet", param="echo")
    asked = requested_grammar(body)
    grammar = None if asked is None else checked_grammar(engine.engine.grammars, *asked)
    params = completion_sampling_params(body, grammar)
    tokenizer = engine.engine.tokenizer
    prompts = completion_prompts(tokenizer, body)
    state.check_queue(engine)
    request_id, model = random_id("cmpl"), state.settings.served_model_name
    echoes = [tokenizer.decode(p) if body.echo else "" for p in prompts]
    call = start_call(engine, request_id, prompts, params)
    if body.stream:
        chunk = chunk_writer(CompletionResponse, request_id, model)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = _choice_chunks(call, chunk, tokenizer, params.n, echoes)
        return EngineStreamingResponse(sse_stream(call, chunks, chunk, include_usage), call)
    finals = await collect(call, http_request)
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
    return CompletionResponse(
        id=request_id, created=unix_time(), model=model, choices=choices, usage=call.usage
    )


async def _choice_chunks(
    call: EngineCall, chunk: Callable[..., str], tokenizer, n: int, echoes: list[str]
) -> AsyncGenerator[str, None]:
    """One chunk per delta; a choice's first carries its prompt's echo."""
    offsets: dict[int, int] = {}  # choice -> characters of text (echo included) sent so far
    async for prompt_index, delta in call.deltas():
        for c in delta.outputs:
            index = prompt_index * n + c.index
            prefix = "" if index in offsets else echoes[prompt_index]
            offset = offsets.get(index, len(prefix))
            offsets[index] = offset + len(c.text)
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
