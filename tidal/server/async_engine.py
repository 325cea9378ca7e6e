"""The API process's side of the engine: the core runs in its own process
(`core_process.run_core`), and this bridges it to asyncio.

Requests are made here (`InputProcessor`; a text is tokenized off the event loop) and
sent to the core; the core's step outputs come back in one message per step, which a
reader thread hands to the loop (`call_soon_threadsafe`), where it is detokenized
(`OutputProcessor`) and routed to each `generate` call's `Outputs`. A sender thread writes to
the core, so the event loop never waits on the pipe. If the core process dies, every open
request ends with an `EngineError` and `on_death` is called (the server then exits).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing as mp
import queue
import threading
from typing import AsyncIterator, Callable

from tidal.config import EngineConfig
from tidal.engine import EngineCore
from tidal.processing import EngineOutput, InputProcessor, OutputProcessor
from tidal.request import Request, RequestOutput
from tidal.server.core_process import run_core
from tidal.server.metrics import ServerMetrics
from tidal.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """A request ended without its result: the engine failed or the server is shutting down
    (`status`: the HTTP status a response that has not started yet gets)."""

    def __init__(self, message: str, status: int = 500):
        super().__init__(message)
        self.status = status


class AsyncEngine:
    def __init__(self, config: EngineConfig, metrics: ServerMetrics | None = None,
                 make_core: Callable[[EngineConfig], EngineCore] = EngineCore, start_timeout: float = 3600.0):
        """Start the core process and wait until it is ready. `make_core` builds the core in
        that process (a module-level function: it travels by name)."""
        self.config = config
        self.metrics = metrics or ServerMetrics()
        context = mp.get_context("spawn")  # CUDA cannot be forked into a child
        inbox_reader, self._to_core = context.Pipe(duplex=False)
        self._from_core, outbox_writer = context.Pipe(duplex=False)
        # A daemonic process may not start processes of its own, as a core of several
        # tensor-parallel ranks does; such a core, if left running at exit (a server that
        # failed before its lifespan stopped it), is killed rather than waited for.
        daemon = config.tensor_parallel_size == 1
        self.process = context.Process(target=run_core, args=(config, inbox_reader, outbox_writer, make_core),
                                       name="tidal-engine-core", daemon=daemon)
        self.process.start()
        if not daemon:
            atexit.register(self.process.kill)
        inbox_reader.close()
        outbox_writer.close()
        try:  # while the core starts (a second or more of its imports alone)
            self.tokenizer = Tokenizer.from_pretrained(config.model)
        except BaseException:
            self.process.kill()
            raise
        if not self._from_core.poll(start_timeout):
            self.process.kill()
            raise RuntimeError(f"the engine core did not start within {start_timeout:g} s")
        try:
            kind, info = self._from_core.recv()
        except EOFError:
            self.process.join()
            raise RuntimeError(f"the engine core failed to start (exit code {self.process.exitcode}); "
                               "its error is in the log above") from None
        self.max_model_len, self.description = info["max_model_len"], info["describe"]
        self.metrics.update_stats(info["stats"])
        self.outputs = OutputProcessor(self.tokenizer)
        self.inputs = InputProcessor(self.tokenizer, self.max_model_len, info["vocab_size"],
                                     config.speculative_config, config.seed, self.outputs.requests.__contains__)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._listeners: dict[str, Outputs] = {}  # request id -> its consumer's; loop thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self.dead = False
        self.on_death: Callable[[], None] | None = None

    @property
    def is_running(self) -> bool:
        return bool(self._threads) and not self.dead and not self._stopping

    def start(self) -> None:
        """Start the threads that talk to the core; call from the event loop that consumes outputs."""
        self._loop = asyncio.get_running_loop()
        self._threads = [threading.Thread(target=self._read, name="tidal-core-reader", daemon=True),
                         threading.Thread(target=self._write, name="tidal-core-writer", daemon=True)]
        for thread in self._threads:
            thread.start()

    async def stop(self) -> None:
        """Fail whatever is still running, stop the core process and the threads."""
        if self._stopping:
            return
        self._stopping = True
        self.fail_all(EngineError("the request was aborted: the server is shutting down", 503))
        self._outbox.put(("stop", None))
        await asyncio.to_thread(self.process.join, 30)
        if self.process.is_alive():
            self.process.kill()
        self._outbox.put(None)  # ends the writer

    def make_request(self, *args, **kwargs) -> Request:
        """`InputProcessor.make_request` (a text prompt is tokenized: call it off the event loop)."""
        return self.inputs.make_request(*args, **kwargs)

    async def generate(self, requests: list[Request]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Run requests together and yield (position in `requests`, output) as steps commit
        their tokens, until all have finished. Closing the generator early (a client went
        away) aborts the unfinished ones, freeing their pages."""
        if not self.is_running:
            raise EngineError("the engine is not running", 503)
        outputs = Outputs()
        position = {req.request_id: i for i, req in enumerate(requests)}
        for req in requests:
            self._listeners[req.request_id] = outputs
            self.outputs.add(req)
        self._outbox.put(("add", requests))
        unfinished = set(position)
        try:
            while unfinished:
                for out in await outputs.get():
                    if out.finished:
                        unfinished.discard(out.request_id)
                    yield position[out.request_id], out
        finally:
            for request_id in position:
                del self._listeners[request_id]
            if unfinished and not self.dead:
                self._outbox.put(("finish", [(request_id, "abort", None) for request_id in unfinished]))

    def fail_all(self, error: EngineError) -> None:
        """End every open request with `error` (loop thread)."""
        for listener in set(self._listeners.values()):
            listener.fail(error)

    # -- the threads -----------------------------------------------------------------------

    def _write(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self._to_core.send(message)
            except OSError:
                return  # the core is gone; the reader says so

    def _read(self) -> None:
        try:
            while True:
                kind, *payload = self._from_core.recv()
                if kind == "outputs":
                    self._loop.call_soon_threadsafe(self._deliver, *payload)
                else:  # "failed": a step failed, and the core ended these requests
                    request_ids, message = payload
                    self._loop.call_soon_threadsafe(self._fail, request_ids, EngineError(message))
        except (EOFError, OSError):
            pass
        if self._stopping:
            return
        self.process.join(5)
        self.dead = True
        logger.error("the engine core process died (exit code %s)", self.process.exitcode)
        self._loop.call_soon_threadsafe(self._die)

    # -- on the event loop -----------------------------------------------------------------

    def _deliver(self, outputs: list[EngineOutput], stats: dict | None) -> None:
        """One step's outputs: detokenized here, on the loop, rather than in the reader
        thread, so that one thread, not two taking turns at the GIL, does the API process's
        Python work (two made the stream of every request wait on the other's turns)."""
        results, stopped = self.outputs.process(outputs)
        if stopped:
            self._outbox.put(("finish", [(request_id, "stop", s) for request_id, s in stopped]))
        if stats is not None:
            self.metrics.update_stats(stats)
        for out in results:
            if out.finished:
                self.metrics.record_finished(out)
            listener = self._listeners.get(out.request_id)
            if listener is not None:  # None: its consumer left and an abort is on its way
                listener.put(out)

    def _fail(self, request_ids: list[str], error: EngineError) -> None:
        for request_id in request_ids:
            self.outputs.requests.pop(request_id, None)
        for listener in {self._listeners[r] for r in request_ids if r in self._listeners}:
            listener.fail(error)

    def _die(self) -> None:
        self.outputs.requests.clear()
        self.fail_all(EngineError(f"the engine process died (exit code {self.process.exitcode})"))
        if self.on_death is not None:
            self.on_death()


class Outputs:
    """What one `generate` call's consumer has not taken yet: each request's newest output,
    with the text of any it replaced joined in front of its delta. A consumer that falls
    behind the steps (a busy API process, a slow client) then takes one output per request
    holding several steps' tokens, not a backlog of one per step: the work per chunk sent
    stays the same while the chunks grow, so streaming cannot fall further behind."""

    def __init__(self):
        self.pending: dict[str, RequestOutput] = {}
        self.error: EngineError | None = None
        self.ready = asyncio.Event()

    def put(self, out: RequestOutput) -> None:
        older = self.pending.get(out.request_id)
        if older is not None:
            out.outputs[0].delta = older.outputs[0].delta + out.outputs[0].delta
        self.pending[out.request_id] = out
        self.ready.set()

    def fail(self, error: EngineError) -> None:
        self.error = error
        self.ready.set()

    async def get(self) -> list[RequestOutput]:
        """The outputs waiting (at least one); once none is left, the error, if any."""
        await self.ready.wait()
        if self.pending:
            outs = list(self.pending.values())
            self.pending.clear()
        else:
            raise EngineError(str(self.error), self.error.status)  # a fresh one per consumer: they share it
        if self.error is None:
            self.ready.clear()
        return outs
