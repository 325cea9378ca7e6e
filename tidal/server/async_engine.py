"""The engine on its own thread, bridged to asyncio.

The event loop must never wait for a forward step, and the engine is not thread-safe, so
one thread owns it: it applies queued additions and aborts between steps (new requests
join the running batch at the next step) and hands each step's outputs to the loop with
`call_soon_threadsafe`, which routes them into per-request asyncio queues.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import AsyncIterator

from tidal.engine import LLMEngine, frozen_heap
from tidal.request import Request, RequestOutput
from tidal.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """A request ended without its result: the engine failed or is shutting down."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None):
        self.engine = engine
        self.metrics = metrics or ServerMetrics()
        self.metrics.update_stats(engine.stats())
        self._commands: queue.SimpleQueue[tuple[str, list]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._listeners: dict[str, asyncio.Queue] = {}  # request id -> its consumer; loop thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="tidal-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Abort whatever is still running (its consumers get an EngineError) and end the thread."""
        if self._thread is None:
            return
        self._stopping = True
        self._send("stop", [])
        await asyncio.to_thread(self._thread.join)

    async def generate(self, requests: list[Request]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run requests (made by engine.make_request) together and yield (position in
        `requests`, output) as steps commit tokens, until all have finished. Closing the
        generator early (a client went away) aborts the unfinished ones, freeing their pages."""
        if not self.is_running:
            raise EngineError("the engine is not running")
        outputs: asyncio.Queue = asyncio.Queue()
        position = {req.request_id: i for i, req in enumerate(requests)}
        for request_id in position:
            self._listeners[request_id] = outputs
        self._send("add", requests)
        unfinished = set(position)
        try:
            while unfinished:
                out = await outputs.get()
                if isinstance(out, EngineError):
                    raise EngineError(str(out))  # a fresh one per consumer: they share the error
                if out.finished:
                    unfinished.discard(out.request_id)
                yield position[out.request_id], out
        finally:
            for request_id in position:
                del self._listeners[request_id]
            if unfinished:
                self._send("abort", list(unfinished))

    # -- the engine thread ---------------------------------------------------------------

    def _send(self, command: str, payload: list) -> None:
        self._commands.put((command, payload))
        self._wake.set()

    def _run(self) -> None:
        try:
            with frozen_heap():
                while True:
                    self._wake.clear()  # before reading commands, so that one sent meanwhile ends the wait
                    if self._apply_commands():
                        break
                    if self.engine.has_unfinished():
                        self._step()
                    else:
                        self.metrics.update_stats(self.engine.stats())
                        self._wake.wait()
            self._abort(list(self.engine.requests), "the request was aborted: the server is shutting down")
        except Exception as e:
            # The engine is in an unknown state: nothing it runs can be trusted to finish.
            logger.exception("the engine thread failed")
            self._loop.call_soon_threadsafe(self._fail, None, EngineError(f"the engine failed: {e!r}"))

    def _apply_commands(self) -> bool:
        """Apply queued additions and aborts; True once asked to stop."""
        while True:
            try:
                command, payload = self._commands.get_nowait()
            except queue.Empty:
                return False
            if command == "stop":
                return True
            for item in payload:
                if command == "add":
                    self.engine.add_request(item)
                else:
                    out = self.engine.abort(item)
                    if out is not None:
                        self.metrics.record_finished(out)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            logger.exception("engine step failed; failing its requests")
            self._abort(list(self.engine.requests), f"engine step failed: {e!r}")
            return
        for out in outputs:
            if out.finished:
                self.metrics.record_finished(out)
        self.metrics.update_stats(self.engine.stats())
        if outputs:
            self._loop.call_soon_threadsafe(self._deliver, outputs)

    def _abort(self, request_ids: list[str], reason: str) -> None:
        """Abort requests in the engine (freeing their pages) and fail their consumers."""
        for request_id in request_ids:
            out = self.engine.abort(request_id)
            if out is not None:
                self.metrics.record_finished(out)
        self._loop.call_soon_threadsafe(self._fail, request_ids, EngineError(reason))

    # -- on the event loop ---------------------------------------------------------------

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            listener = self._listeners.get(out.request_id)
            if listener is not None:  # None: its consumer left and an abort is on its way
                listener.put_nowait(out)

    def _fail(self, request_ids: list[str] | None, error: EngineError) -> None:
        """Hand `error` to the consumers of these requests (None: of all requests)."""
        listeners = self._listeners if request_ids is None else \
            {r: self._listeners[r] for r in request_ids if r in self._listeners}
        for listener in set(listeners.values()):
            listener.put_nowait(error)
