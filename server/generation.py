"""Running engine requests for an HTTP call: collecting or merging deltas, disconnects, logging."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from pydantic import BaseModel

from engine.async_llm import AsyncLLM, EngineStepError
from engine.errors import AerieError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from server.errors import APIError, ClientDisconnected, api_error_from_engine
from server.protocol import Usage

logger = logging.getLogger("aerie.server")


def start_requests(
    engine: AsyncLLM, request_id: str, prompts: list[list[int]], params: SamplingParams
) -> list[AsyncIterator[RequestOutput]]:
    """Add one engine request per prompt; if any is invalid, none is left running."""
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
    streams = []
    try:
        for sub_id, prompt in zip(ids, prompts):
            streams.append(engine.add_request(sub_id, prompt, params))
    except AerieError as exc:
        for sub_id in ids[: len(streams)]:
            engine.abort(sub_id)
        raise api_error_from_engine(exc) from None
    return streams


async def merged(
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Deltas of several requests as they come, tagged with the index of their stream."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for delta in stream:
                await queue.put((index, delta))
        except BaseException as exc:
            await queue.put((index, exc))
            raise
        finally:
            await queue.put((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


async def collect(
    streams: list[AsyncIterator[RequestOutput]], http_request: Request
) -> list[RequestOutput]:
    """The final outputs of every request, aborting them all if the client disconnects."""

    async def consume() -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        async for index, delta in merged(streams):
            if finals[index] is None:
                finals[index] = delta
            else:
                finals[index].merge(delta)
        return finals

    work = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_wait_for_disconnect(http_request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not work.done():
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work
        raise ClientDisconnected
    try:
        return work.result()
    except EngineStepError as exc:
        raise APIError(500, str(exc), code="internal_error") from None


async def _wait_for_disconnect(http_request: Request) -> None:
    while True:
        message = await http_request.receive()
        if message["type"] == "http.disconnect":
            return


def usage_of(outputs: list[RequestOutput]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    return token_usage(prompt, sum(len(c.token_ids) for o in outputs for c in o.outputs))


def token_usage(num_prompt: int, num_completion: int) -> Usage:
    return Usage(
        prompt_tokens=num_prompt,
        completion_tokens=num_completion,
        total_tokens=num_prompt + num_completion,
    )


def stream_end(
    request_id: str,
    usage: Usage,
    started: float,
    finish_reasons: list,
    usage_chunk: Callable[[Usage], str] | None,
) -> list[str]:
    """The last SSE events of a stream (the usage chunk when asked, then [DONE]); logs it."""
    log_request(request_id, usage, started, finish_reasons)
    return ([usage_chunk(usage)] if usage_chunk else []) + [SSE_DONE]


def sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json(exclude_unset=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(error: APIError) -> str:
    body = {
        "error": {
            "message": error.message,
            "type": "server_error",
            "param": error.param,
            "code": error.code,
        }
    }
    return f"data: {json.dumps(body)}\n\n"


def log_request(request_id: str, usage: Usage, started: float, finish_reasons: list) -> None:
    logger.info(
        "%s prompt=%d completion=%d latency=%.3fs finish=%s",
        request_id,
        usage.prompt_tokens,
        usage.completion_tokens,
        time.monotonic() - started,
        ",".join(str(r) for r in finish_reasons),
    )
