"""Tensor parallelism: the target model split over ranks, one process each.

The engine's own process is rank 0: it plans every step (scheduler, policy, drafter),
samples, and runs its slice of the target. It starts the other ranks itself
(`TensorParallel.start`: spawned processes running `run_worker`); each builds its slice of
the target and a KV cache for its heads, then runs what rank 0's runner calls on every rank
(the `ModelRunner` methods marked `on_every_rank`) until told to stop. A call travels as a
small pickled message over a gloo group of its own (host lists: a step's feeds, contexts and
page tables); the tensors that only rank 0's device holds (a step's input ids with its
drafts, where its logits are taken) follow as broadcasts over the model's group (NCCL on
CUDA, gloo on CPU), whose all-reduces the model's layers run.
"""

from __future__ import annotations

import atexit
import contextlib
import signal
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Connection, wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tidal.config import EngineConfig
from tidal.models.config import ModelConfig
from tidal.runner import ModelRunner

HOST = "127.0.0.1"
# The model's collectives: every rank is inside the same call, so a wait this long means a
# rank is gone or hung.
COLLECTIVE_TIMEOUT = timedelta(minutes=5)
# Workers wait for rank 0's next call however long the engine idles; a rank 0 that ends
# closes its connections, which ends the wait.
IDLE_TIMEOUT = timedelta(days=3650)
STOP = "stop"  # the call that ends a worker's loop
STOP_TIMEOUT_S = 30  # for a worker told to stop to end, before it is terminated


class TensorParallelError(RuntimeError):
    """A rank failed, so the ranks can run no collective together again: the engine stops."""


def check(config: EngineConfig, model_config: ModelConfig) -> None:
    """ValueError, naming tensor_parallel_size, for a split the model or the machine cannot take."""
    size, mc = config.tensor_parallel_size, model_config
    problems = []
    if mc.num_heads % size:
        problems.append(f"does not divide num_attention_heads {mc.num_heads}")
    if mc.num_kv_heads % size and size % mc.num_kv_heads:
        problems.append(f"is neither a divisor nor a multiple of num_key_value_heads {mc.num_kv_heads}")
    dense = len(mc.moe_layer_ids) < mc.num_layers
    if dense and mc.intermediate_size % size:
        problems.append(f"does not divide intermediate_size {mc.intermediate_size}")
    if mc.moe_layer_ids and mc.moe_intermediate_size % size:
        problems.append(f"does not divide the experts' intermediate size {mc.moe_intermediate_size}")
    if config.device.startswith("cuda:"):
        problems.append(f"needs device 'cuda' (rank r runs on cuda:r), not {config.device!r}")
    elif config.device == "cuda" and size > torch.cuda.device_count():
        problems.append(f"is more ranks than the {torch.cuda.device_count()} GPUs torch sees")
    if dist.is_initialized():
        problems.append("needs a process without a torch.distributed process group (the engine starts its own "
                        "ranks; an engine with tensor parallelism before this one must be shut down)")
    if problems:
        raise ValueError(f"tensor_parallel_size: {size} " + "; ".join(problems))


@dataclass
class _TensorSlot:
    """Stands in a call's message for a tensor argument, which follows as a broadcast."""

    shape: tuple[int, ...]
    dtype: torch.dtype


class TensorParallel:
    """This process's rank among `size`, and on rank 0 the other ranks' processes."""

    def __init__(self, rank: int, size: int, processes: list = (), pipes: list[Connection] = (),
                 caller_threads: int | None = None):
        self.rank, self.size = rank, size
        self.processes, self.pipes = list(processes), list(pipes)  # of ranks 1 .. size - 1
        self.caller_threads = caller_threads  # rank 0 on a CPU: torch's threads before `join`, given back at `stop`
        self.failure: str | None = None  # why the ranks stopped, once one failed
        self.stopped = False
        self.control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)

    @staticmethod
    def join(config: EngineConfig, rank: int, store: dist.Store) -> None:
        """Join the model's process group: NCCL on CUDA, one GPU per rank; gloo on a CPU, whose
        cores the ranks share, each taking its share of torch's threads (with more threads than
        cores, an operation waits for its preempted threads, and a forward is thousands)."""
        cuda = config.device == "cuda"
        if config.device == "cpu":
            torch.set_num_threads(max(1, torch.get_num_threads() // config.tensor_parallel_size))
        if cuda:
            torch.cuda.set_device(rank)
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank,
                                world_size=config.tensor_parallel_size, timeout=COLLECTIVE_TIMEOUT,
                                device_id=torch.device("cuda", rank) if cuda else None)

    @staticmethod
    def start(config: EngineConfig, model_config: ModelConfig, max_model_len: int,
              max_draft_len: int) -> TensorParallel:
        """Rank 0: start ranks 1 .. size - 1 and join them. They build their slices of the
        model while rank 0 builds its own (`wait_ready`)."""
        check(config, model_config)
        caller_threads = torch.get_num_threads()
        store = dist.TCPStore(HOST, 0, config.tensor_parallel_size, is_master=True, wait_for_workers=False)
        context = mp.get_context("spawn")
        processes, pipes = [], []
        for rank in range(1, config.tensor_parallel_size):
            reader, writer = context.Pipe(duplex=False)
            process = context.Process(target=run_worker, name=f"tidal-rank-{rank}", daemon=True,
                                      args=(rank, config, model_config, max_model_len, max_draft_len, store.port,
                                            writer))
            process.start()
            writer.close()
            processes.append(process)
            pipes.append(reader)
        try:
            TensorParallel.join(config, 0, store)
        except BaseException:
            torch.set_num_threads(caller_threads)
            for process in processes:
                process.kill()
                process.join()
            raise
        tp = TensorParallel(0, config.tensor_parallel_size, processes, pipes, caller_threads)
        atexit.register(tp.stop)  # an engine never shut down still stops its ranks and leaves the group
        return tp

    def wait_ready(self) -> None:
        """Rank 0: wait until every other rank has built its slice of the model."""
        for rank, (process, pipe) in enumerate(zip(self.processes, self.pipes), start=1):
            wait([pipe, process.sentinel])
            message = self._message(pipe)
            if message != ("ready", None):
                self.failure = self._ended(rank, process, message) or f"tensor-parallel rank {rank} ended"
                self.stop()
                raise TensorParallelError(self.failure)

    @contextlib.contextmanager
    def collective(self):
        """Rank 0: around a call that every rank makes. Once it fails, on any rank, the ranks
        are out of step for good: the others are stopped, and a failed worker's error is
        raised with its traceback."""
        if self.stopped:
            raise TensorParallelError("the tensor-parallel ranks have stopped: "
                                      f"{self.failure or 'the engine was shut down'}")
        try:
            yield
        except BaseException as e:
            worker = self._worker_failure()
            self.failure = worker or f"rank 0 failed: {e!r}"
            self.stop()
            if worker is None:
                raise
            raise TensorParallelError(worker) from e

    def call(self, name: str, *args) -> None:
        """Rank 0: have every other rank call its runner's method `name` with `args`."""
        message = (name, tuple(_TensorSlot(tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a
                               for a in args))
        dist.broadcast_object_list([message], src=0, group=self.control)
        for a in args:
            if isinstance(a, torch.Tensor):
                dist.broadcast(a.contiguous(), src=0)

    def receive(self, device: torch.device) -> tuple[str, tuple]:
        """The other ranks: rank 0's next call (`call`), its tensors on `device`."""
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        name, args = box[0]
        args = tuple(torch.empty(a.shape, dtype=a.dtype, device=device) if isinstance(a, _TensorSlot) else a
                     for a in args)
        for a in args:
            if isinstance(a, torch.Tensor):
                dist.broadcast(a, src=0)
        return name, args

    def min(self, value: int) -> int:
        """The smallest of every rank's `value`."""
        t = torch.tensor([value])
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t)

    def stop(self) -> None:
        """Rank 0: end the other ranks (told to stop, or terminated where the ranks are out of
        step) and leave the process group. Idempotent."""
        if self.stopped:
            return
        self.stopped = True
        atexit.unregister(self.stop)
        if self.failure is None:
            with contextlib.suppress(RuntimeError):  # a rank already gone
                self.call(STOP)
        for process in self.processes:
            if self.failure is None:
                process.join(timeout=STOP_TIMEOUT_S)
            if process.is_alive():
                process.terminate()
            process.join()
        dist.destroy_process_group()
        torch.set_num_threads(self.caller_threads)

    def _worker_failure(self) -> str | None:
        """How a worker failed, if one has (`_ended`)."""
        for rank, (process, pipe) in enumerate(zip(self.processes, self.pipes), start=1):
            ended = self._ended(rank, process, self._message(pipe) if pipe.poll() else None)
            if ended is not None:
                return ended
        return None

    @staticmethod
    def _ended(rank: int, process, message: tuple | None) -> str | None:
        """How a worker ended: the error it reported (`message`), with its traceback, or its
        exit code; None while it runs."""
        if message is not None and message[0] == "failed":
            return f"tensor-parallel rank {rank} failed:\n{message[1]}"
        process.join(timeout=1)
        if process.exitcode is not None:
            return f"tensor-parallel rank {rank} ended with exit code {process.exitcode}"
        return None

    @staticmethod
    def _message(pipe: Connection) -> tuple | None:
        """The worker's next message; None if it ended without one."""
        try:
            return pipe.recv()
        except EOFError:
            return None


def run_worker(rank: int, config: EngineConfig, model_config: ModelConfig, max_model_len: int,
               max_draft_len: int, port: int, pipe: Connection) -> None:
    """A worker rank's process: join the group, build this rank's runner, say so, then make
    every call rank 0 makes (`TensorParallel.call`) until it says stop. A failure is reported
    through `pipe`, with its traceback, before the process ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle: it stops the workers
    try:
        TensorParallel.join(config, rank, dist.TCPStore(HOST, port, config.tensor_parallel_size, is_master=False))
        tp = TensorParallel(rank, config.tensor_parallel_size)
        runner = ModelRunner(config, model_config, max_model_len, max_draft_len, tp)
        pipe.send(("ready", None))
        with torch.inference_mode():
            while (call := tp.receive(runner.device))[0] != STOP:
                name, args = call
                getattr(runner, name)(*args)
        dist.destroy_process_group()
    except BaseException:
        pipe.send(("failed", traceback.format_exc()))
        raise SystemExit(1) from None
