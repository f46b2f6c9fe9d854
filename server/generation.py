"""Running engine requests for an HTTP call: collecting or merging deltas, disconnects, logging."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from engine.async_llm import AsyncLLM, EngineStepError
from engine.errors import AerieError
from engine.outputs import RequestOutput
from engine.sampling.sampling_params import SamplingParams
from server.errors import APIError, ClientDisconnected, api_error_from_engine, error_body
from server.protocol import Usage, unix_time

logger = logging.getLogger("aerie.server")


class EngineCall:
    """The engine requests behind one HTTP call (one per prompt): their deltas, the tokens so
    far, and the call's one log line. `close()` aborts whatever has not finished (a client that
    left, an engine fault) and writes that line; closing twice does nothing."""

    def __init__(
        self,
        engine: AsyncLLM,
        request_id: str,
        sub_ids: list[str],
        streams: list[AsyncIterator[RequestOutput]],
        num_prompt_tokens: int,
    ) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.num_completion_tokens = 0
        self._engine, self._sub_ids, self._streams = engine, sub_ids, streams
        self._started = time.monotonic()
        self._finish_reasons: dict[tuple[int, int], str] = {}  # (prompt, choice) -> reason
        self._finished: set[int] = set()  # prompts whose request has ended
        self._failed = self._closed = False

    @property
    def num_requests(self) -> int:
        return len(self._sub_ids)

    @property
    def usage(self) -> Usage:
        return token_usage(self.num_prompt_tokens, self.num_completion_tokens)

    async def deltas(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Every request's deltas as they come, tagged with its prompt's index; an engine
        fault raises APIError (500)."""
        try:
            async for index, delta in merged(self._streams):
                self._count(index, delta)
                yield index, delta
        except EngineStepError as exc:
            self._failed = True
            raise APIError(500, str(exc), code="internal_error") from None
        except AerieError as exc:  # refused by the engine thread after all (a duplicate id)
            self._failed = True
            raise api_error_from_engine(exc) from None

    def _count(self, index: int, delta: RequestOutput) -> None:
        for c in delta.outputs:
            self.num_completion_tokens += len(c.token_ids)
            if c.finish_reason is not None:
                self._finish_reasons[index, c.index] = c.finish_reason
        if delta.finished:
            self._finished.add(index)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        unfinished = [i for i in range(len(self._sub_ids)) if i not in self._finished]
        for index in unfinished:
            self._engine.abort(self._sub_ids[index])
        if unfinished:
            reasons = ["error" if self._failed else "abort"]
        else:
            reasons = [self._finish_reasons[key] for key in sorted(self._finish_reasons)]
        log_request(self.request_id, self.usage, self._started, reasons)


def start_call(
    engine: AsyncLLM, request_id: str, prompts: list[list[int]], params: SamplingParams
) -> EngineCall:
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
    return EngineCall(engine, request_id, ids, streams, sum(len(p) for p in prompts))


class EngineStreamingResponse(StreamingResponse):
    """SSE whose engine requests end with it: however the response ends (complete, the client
    gone before or during the first chunk, the server stopping), its generator is closed at
    once, not when garbage-collected, and the call is closed (unfinished requests aborted)."""

    def __init__(self, chunks: AsyncGenerator[str, None], call: EngineCall) -> None:
        super().__init__(chunks, media_type="text/event-stream")
        self._chunks, self._call = chunks, call

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._call.close()
            await self._chunks.aclose()


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


async def collect(call: EngineCall, http_request: Request) -> list[RequestOutput]:
    """The final outputs of every request of the call, aborting them all if the client
    disconnects; the call is closed (and logged) however this ends."""

    async def consume() -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * call.num_requests
        async for index, delta in call.deltas():
            if finals[index] is None:
                finals[index] = delta
            else:
                finals[index].merge(delta)
        return finals

    work = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_wait_for_disconnect(http_request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            raise ClientDisconnected
        return work.result()  # an engine fault raises its APIError here
    finally:
        watcher.cancel()
        work.cancel()
        call.close()
        await asyncio.wait({work, watcher})  # let both see their cancellation through


async def _wait_for_disconnect(http_request: Request) -> None:
    while True:
        message = await http_request.receive()
        if message["type"] == "http.disconnect":
            return


def token_usage(num_prompt: int, num_completion: int) -> Usage:
    return Usage(
        prompt_tokens=num_prompt,
        completion_tokens=num_completion,
        total_tokens=num_prompt + num_completion,
    )


def sse(payload: BaseModel) -> str:
    return f"data: {payload.model_dump_json(exclude_unset=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def chunk_writer(chunk_type: type[BaseModel], request_id: str, model: str) -> Callable[..., str]:
    """The SSE event of one chunk of a streamed completion (a `chunk_type`, created now): its
    choices, and usage on the last."""
    created = unix_time()

    def chunk(choices: list, usage: Usage | None = None) -> str:
        return sse(
            chunk_type(id=request_id, created=created, model=model, choices=choices, usage=usage)
        )

    return chunk


async def sse_stream(
    call: EngineCall,
    chunks: AsyncIterator[str],
    write_chunk: Callable[..., str],
    include_usage: bool,
) -> AsyncGenerator[str, None]:
    """A call's server-sent events: its `chunks`, a usage chunk (made with `write_chunk` at the
    end) when `include_usage`, then [DONE]. An engine fault ends the chunks with an error event,
    which [DONE] still follows, as in vLLM's server. However it ends, even before the first
    chunk, the call is closed: what has not finished is aborted."""
    try:
        async for chunk in chunks:
            yield chunk
        if include_usage:
            yield write_chunk([], usage=call.usage)
    except APIError as exc:
        yield sse_error(exc)
    finally:
        call.close()
    yield SSE_DONE  # not reached when the stream was closed (the client left)


def sse_error(error: APIError) -> str:
    body = error_body(error.status, error.message, error.param, error.code)
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
