"""AsyncLLM: the engine loop in its own thread, for asyncio callers such as the HTTP server.

`add_request` validates at once (raising the engine's ValueError subclasses in the caller) and
returns an async iterator of deltas. Closing that iterator early (a client that went away) aborts
the request, which frees its KV blocks. An internal fault while adding a request, or in a step,
fails that request (or the requests that step scheduled) with EngineStepError; the engine thread
goes on. Nothing here blocks the event loop on torch.
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
from engine.core.request import Request
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """The engine failed while adding or running a request; that request (and any other the
    failed step had scheduled) was ended, the engine goes on."""


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
    def has_unfinished_requests(self) -> bool:
        """Requests in flight, or sent and not yet picked up by the engine thread (approximate:
        read from another thread)."""
        return self.engine.has_unfinished_requests() or not self._inbox.empty()

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
            self._handle_inbox()
            if not self.engine.has_unfinished_requests():
                self._wakeup.wait()
                continue
            self._step()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a fault fails the requests of that step, not the engine
            logger.exception("engine step failed")
            for request_id in self._requests_of_failed_step():
                self._abort_quietly(request_id)
                self._fail_stream(request_id, exc)
            return
        for output in outputs:
            self._deliver(output)

    def _requests_of_failed_step(self) -> set[str]:
        """The requests the failed step scheduled, still in flight: their state is in doubt.
        If none (schedule() itself failed on a batch that has since ended), every request,
        since nothing tells which one the fault is about."""
        in_flight = set(self.engine.requests) | set(self._streams)
        batch = self.engine.last_schedule
        scheduled = {item.seq.request.request_id for item in batch.scheduled} & in_flight
        return scheduled or in_flight

    def _handle_inbox(self) -> None:
        while True:
            try:
                kind, payload, stream = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self._add(payload, stream)
                continue
            request_ids = list(self.engine.requests) if kind == "abort_all" else [payload]
            for request_id in request_ids:
                final = self._abort_quietly(request_id)
                if final is not None:
                    self._deliver(final)

    def _add(self, request: Request, stream: _Stream) -> None:
        """Add one request; if that fails, that request alone fails (its client is told)."""
        request_id = request.request_id
        try:
            self.engine.add_request(request_id, request)
        except ValueError as exc:  # e.g. a duplicate request id: the running one is untouched
            stream.put(exc)
            return
        except Exception as exc:
            logger.exception("could not add request %s", request_id)
            if self.engine.requests.get(request_id) is request:  # it got in half-way
                self._abort_quietly(request_id)
            stream.put(_internal_error(exc))
            return
        self._streams[request_id] = stream

    def _abort_quietly(self, request_id: str) -> RequestOutput | None:
        """`abort_request` that never raises: a request that cannot be aborted cleanly is
        dropped (its blocks may leak, but the engine must live on) and its client told."""
        try:
            return self.engine.abort_request(request_id)
        except Exception as exc:
            logger.exception("could not abort %s cleanly", request_id)
            self.engine.requests.pop(request_id, None)
            self._fail_stream(request_id, exc)
            return None

    def _fail_stream(self, request_id: str, exc: Exception) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.put(_internal_error(exc))

    def _deliver(self, output: RequestOutput) -> None:
        stream = self._streams.get(output.request_id)
        if output.finished:
            self._streams.pop(output.request_id, None)
        if stream is not None:
            stream.put(output)


def _internal_error(exc: Exception) -> EngineStepError:
    return EngineStepError(f"internal engine error: {exc}")
