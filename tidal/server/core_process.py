"""The engine core's own process behind `tidal serve`.

It only schedules and runs steps: requests arrive already tokenized (`Request`s made by the
API process's `InputProcessor`), and each step's outputs, token ids for every request that
committed any, leave in one message, which the API process detokenizes and frames. So the
core's host work never waits on HTTP parsing, tokenization or streaming, nor they on it.

Messages in:  ("add", [Request]), ("finish", [(request id, reason, stop reason)]), ("stop", None)
Messages out: ("ready", info), ("outputs", [EngineOutput], stats or None),
              ("failed", [request id], message)
"""

from __future__ import annotations

import logging
import time
from multiprocessing.connection import Connection

from tidal.config import EngineConfig
from tidal.engine import EngineCore, frozen_heap
from tidal.parallel import TensorParallelError

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.1  # how often a busy core sends its stats (an idle one sends them at once)


def run_core(config: EngineConfig, inbox: Connection, outbox: Connection, make_core=EngineCore) -> None:
    """The process's main: build the core, say it is ready, then serve until told to stop
    (or until the API process is gone), and stop the core's tensor-parallel ranks."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    core = make_core(config)
    outbox.send(("ready", {"max_model_len": core.max_model_len, "vocab_size": core.model_config.vocab_size,
                           "describe": core.describe(), "stats": core.stats()}))
    try:
        serve(core, inbox, outbox)
    finally:
        core.shutdown()


def serve(core: EngineCore, inbox: Connection, outbox: Connection) -> None:
    """Step while there is work, applying commands between steps, until told to stop. A
    failed step fails its requests and serving goes on, unless tensor-parallel ranks
    failed: then no step can run again, and the process ends."""
    last_stats = time.monotonic()
    with frozen_heap():
        while True:
            idle = not core.has_unfinished()
            if idle:
                inbox.poll(None)  # nothing to run: wait for a command
            if not apply_commands(core, inbox, outbox):
                return
            if not core.has_unfinished():
                outbox.send(("outputs", [], core.stats()))  # idle: the pages freed, the requests ended
                continue
            try:
                outputs = core.step()
            except TensorParallelError:
                raise
            except Exception as e:
                # The step's requests cannot be trusted to finish: end every running one.
                logger.exception("engine step failed; failing its requests")
                failed = list(core.request_ids())
                for request_id in failed:
                    core.finish(request_id)
                outbox.send(("failed", failed, f"engine step failed: {e!r}"))
                continue
            now = time.monotonic()
            send_stats = now - last_stats >= STATS_INTERVAL_S or not core.has_unfinished()
            if outputs or send_stats:
                outbox.send(("outputs", outputs, core.stats() if send_stats else None))
                last_stats = now if send_stats else last_stats


def apply_commands(core: EngineCore, inbox: Connection, outbox: Connection) -> bool:
    """Apply every command waiting; False once told to stop (or the API process is gone)."""
    ended = []
    try:
        while inbox.poll():
            command, payload = inbox.recv()
            if command == "stop":
                return False
            if command == "add":
                for req in payload:
                    core.add_request(req)
            else:
                ended += [out for args in payload if (out := core.finish(*args)) is not None]
    except EOFError:
        return False
    if ended:
        outbox.send(("outputs", ended, None))
    return True
