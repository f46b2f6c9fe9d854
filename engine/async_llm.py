"""AsyncLLM: the engine loop in its own thread, for asyncio callers such as the HTTP server.

`add_request` validates at once (raising the engine's ValueError subclasses in the caller) and
returns an async iterator of deltas. Closing that iterator early (a client that went away) aborts
the request, which frees its KV blocks. Nothing here blocks the event loop on torch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.request import Request
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """The engine failed while running a request; the request was ended, the engine goes on."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    def put(self, item: RequestOutput | BaseException) -> None:
        # RuntimeError: the caller's loop is closed, so nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncLLM:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}  # touched only by the engine thread
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="aerie-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLM:
        return cls(LLMEngine(config))

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    @property
    def num_waiting_requests(self) -> int:
        """Requests not yet running: queued in the engine or still in the inbox (approximate)."""
        return len(self.engine.scheduler.waiting) + self._inbox.qsize()

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Validate now; stream the request's deltas (the last has `finished` set)."""
        request = self.engine.make_request(request_id, prompt, params)
        stream = _Stream(asyncio.get_running_loop())
        self._send(("add", request, stream))
        return self._deltas(request, stream)

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id, None))

    def abort_all(self) -> None:
        """End every request in flight with finish_reason "abort" (used at shutdown)."""
        self._send(("abort_all", None, None))

    def shutdown(self, timeout: float | None = None) -> None:
        self._stopping.set()
        self._wakeup.set()
        self._thread.join(timeout)

    async def _deltas(self, request: Request, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request.request_id)

    def _send(self, message: tuple) -> None:
        self._inbox.put(message)
        self._wakeup.set()

    # ------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wakeup.clear()
            try:
                self._handle_inbox()
                if not self.engine.has_unfinished_requests():
                    self._wakeup.wait()
                    continue
                outputs = self.engine.step()
            except Exception as exc:  # a fault fails the requests in flight, not the engine
                logger.exception("engine step failed")
                self._fail_all(exc)
                continue
            for output in outputs:
                self._deliver(output)

    def _handle_inbox(self) -> None:
        while True:
            try:
                kind, payload, stream = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                try:
                    self.engine.add_request(payload.request_id, payload)
                    self._streams[payload.request_id] = stream
                except ValueError as exc:  # e.g. a duplicate request id
                    stream.put(exc)
                continue
            request_ids = list(self.engine.requests) if kind == "abort_all" else [payload]
            for request_id in request_ids:
                final = self.engine.abort_request(request_id)
                if final is not None:
                    self._deliver(final)

    def _deliver(self, output: RequestOutput) -> None:
        stream = self._streams.get(output.request_id)
        if output.finished:
            self._streams.pop(output.request_id, None)
        if stream is not None:
            stream.put(output)

    def _fail_all(self, exc: Exception) -> None:
        for request_id in list(self.engine.requests):
            try:
                self.engine.abort_request(request_id)
            except Exception:  # its blocks may leak, but the engine must live on
                logger.exception("could not abort %s cleanly", request_id)
                self.engine.requests.pop(request_id, None)
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(EngineStepError(f"internal engine error: {exc}"))
