"""The model runner: owns the weights and the KV cache, turns a StepPlan into a StepResult.

One forward serves every row of the plan: prefill chunks, plain decodes and decodes
followed by K_i draft tokens. Rows that reach the end of their known tokens get logits
for their last K_i + 1 positions; those are sampled (K = 0 everywhere) or verified.

Under tensor parallelism every rank has a runner holding its slice of the model; rank 0
plans and samples, and the methods marked `on_every_rank` run on every rank together
(`tidal.parallel`).
"""

from __future__ import annotations

import functools
import itertools
import time
from dataclasses import dataclass

import numpy as np
import torch

from tidal.attention import get_backend
from tidal.batch import ForwardBatch, to_device, to_device_parts, with_device_tails
from tidal.config import DTYPES, EngineConfig
from tidal.graphs import CudaGraphs, PiecewiseGraphs, forward_rows
from tidal.kv_cache import NULL_PAGE
from tidal.layers.linear import heads_per_rank, tensor_parallel
from tidal.layers.sampler import SamplingTensors, compute_logprobs
from tidal.models.config import ModelConfig
from tidal.models.loader import load_model
from tidal.speculative.verify import verify
from tidal.step import Ahead, Drafts, Span, StepPlan, StepResult


def cache_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed cache tensor. On the CPU its memory comes from calloc (numpy's zeros): the
    kernel maps a large one to zero pages on first touch, so a cache of kv_cache_memory_gb
    costs nothing until its pages are used, where torch.zeros writes every byte first
    (half a second per gigabyte at start-up, and the whole of it resident however little
    is used). 64-byte aligned, as torch's own allocations are."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = dtype.itemsize
    for n in shape:
        nbytes *= n
    raw = torch.from_numpy(np.zeros(nbytes + 64, dtype=np.uint8))
    start = -raw.data_ptr() % 64
    return raw[start:start + nbytes].view(dtype).view(shape)


def resolve_dtype(name: str, model_config: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return DTYPES.get(model_config.torch_dtype) if model_config.torch_dtype in ("bfloat16", "float16") else torch.bfloat16


def on_every_rank(method):
    """A runner method that every tensor-parallel rank runs together (its forwards run
    collectives): called on rank 0, it has the other ranks make the same call first."""
    @functools.wraps(method)
    def call(self, *args):
        if self.tp is None or self.tp.rank != 0:
            return method(self, *args)
        with self.tp.collective():
            self.tp.call(method.__name__, *args)
            return method(self, *args)
    return call


@dataclass
class StepInputs:
    """What every rank needs to run a step's forward: made from the plan on rank 0 and sent
    to the other ranks as is (tokens that only the device knows travel as tensors)."""

    feeds: list[list[int]]   # each row's tokens (placeholders where the device's input ids hold them)
    contexts: list[int]      # tokens each row has in the KV cache before them
    pages: list[list[int]]   # each row's page table
    decode_only: bool        # every row feeds one token and its drafts: a decode graph fits
    sampled: bool            # some row samples, so the step takes logits


@dataclass
class TreeInputs:
    """A step's trees of drafts, on the device (`ModelRunner._tree_inputs`), built as if a
    step in flight committed all it can; `apply` moves them back with its rows."""

    shift: torch.Tensor   # [T] int64: how far each token's position lies before its index (a node's: index - depth)
    mask: torch.Tensor    # [T] int64: `ForwardBatch.tree_mask`
    starts: torch.Tensor  # [B] int32: `ForwardBatch.tree_start`, each row's root
    keys: torch.Tensor    # [B, W] int64: key indices of each row's root and nodes (past its nodes, its root's)
    slots: torch.Tensor | None = None  # [B, W] int64: their slots, once `apply` has seen the step's batch

    def apply(self, batch: ForwardBatch, rejected: torch.Tensor | None, page_size: int) -> None:
        """Set a batch's tree inputs: one built for the step, or a graph's (whose rows and
        tokens past the step's have no tree); rows move back by `rejected` (a step in flight's)."""
        n, b = len(self.shift), len(self.starts)
        starts, keys = self.starts, self.keys
        if rejected is not None:
            starts, keys = starts - rejected.to(starts.dtype), keys - rejected[:, None]
        batch.positions[:n].sub_(self.shift)
        if batch.tree_mask is None:
            batch.tree_mask, batch.tree_start = self.mask, starts
        else:
            batch.tree_mask[:n].copy_(self.mask)
            batch.tree_start[:b].copy_(starts)
        self.slots = batch.page_table[:b].gather(1, keys // page_size).long() * page_size + keys % page_size


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, max_model_len: int,
                 max_draft_len: int = 0, tp=None):
        """`tp`: this rank's `tidal.parallel.TensorParallel` (None: the whole model here)."""
        self.config = config
        self.max_model_len = max_model_len
        self.max_draft_len = max_draft_len  # the most drafts a row verifies (the speculation's K limit)
        spec = config.speculative_config
        self.tree_drafts = spec is not None and spec.topk > 1  # its graphs take tree inputs
        self.model_config = model_config
        self.tp = tp
        rank, size = (tp.rank, tp.size) if tp else (0, 1)
        self.device = torch.device("cuda", rank) if tp and config.device == "cuda" else torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device: 'cuda' was asked for but torch sees no CUDA device")
        self.dtype = resolve_dtype(config.dtype, model_config, self.device)
        self.page_size = config.page_size
        self.attn = get_backend(config.attention_backend or ("triton" if self.device.type == "cuda" else "torch"))
        self.attn.trees = self.tree_drafts
        with tensor_parallel(rank, size):
            self.model = load_model(config.model, self.dtype, self.device, self.attn, config.load_format)
        self.kv_heads = heads_per_rank(model_config.num_heads, model_config.num_kv_heads, size)[1]
        if rank == 0 and tp:
            tp.wait_ready()  # the other ranks built their slices meanwhile
        self.num_pages = 0
        self.kv_stack: torch.Tensor | None = None   # every layer's KV cache (`allocate_kv`)
        self.kv_caches: list[torch.Tensor] = []     # its layers
        self.aux_layer_ids: tuple[int, ...] = ()    # set by an EAGLE-3 proposer before allocation
        self.aux_cache: torch.Tensor | None = None  # target hidden states per KV slot, for EAGLE-3
        self.graphs: CudaGraphs | None = None        # decode and verification steps
        self.pieces: PiecewiseGraphs | None = None   # steps with prompt tokens
        self._sampling: list[tuple[list, SamplingTensors]] = []  # the last two built, newest first

    def sampling_tensors(self, reqs: list) -> SamplingTensors:
        """The sampling tensors of these requests' rows. A decode batch keeps its requests
        from one step to the next, so the last ones built are reused while the rows are the
        same requests (their parameters and seeds never change): five host-to-device
        copies fewer per step. Two sets are kept: a drafting step asks for its drafting
        rows (the proposer) and for its sampling rows (verification), which differ while
        some rows do not draft."""
        for i, (last, st) in enumerate(self._sampling):
            if len(last) == len(reqs) and all(a is b for a, b in zip(last, reqs)):
                self._sampling.insert(0, self._sampling.pop(i))
                return st
        simulated = [r.simulated_acceptance for r in reqs] if reqs[0].simulated_acceptance is not None else None
        st = SamplingTensors.build([r.params for r in reqs], [r.seed for r in reqs], self.device, simulated)
        self._sampling = [(list(reqs), st)] + self._sampling[:1]
        return st

    def bytes_per_page(self, extra_bytes_per_page: int = 0) -> int:
        """Cache bytes per page: the target's KV, EAGLE-3's hidden states and a drafter's
        `extra_bytes_per_page`."""
        aux_width = len(self.aux_layer_ids) * self.model_config.hidden_size
        return (self.kv_bytes_per_page(self.model_config, self.kv_heads) + extra_bytes_per_page
                + aux_width * self.page_size * self.dtype.itemsize)

    @on_every_rank
    def pages_that_fit(self, per_page: int, reserve: int) -> int:
        """Pages the memory left after the weights holds, keeping `reserve` bytes free for
        the largest step's activations: on cuda of the share gpu_memory_utilization allows
        (the rest also holds the CUDA graphs' memory pools), on cpu of kv_cache_memory_gb.
        Under tensor parallelism, the fewest any rank fits with rank 0's page size and
        reserve: rank 0's are the largest, as it also holds the drafter."""
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - (1 - self.config.gpu_memory_utilization) * total - reserve
        else:
            budget = self.config.kv_cache_memory_gb * 2**30
        pages = max(2, int(budget // per_page))
        return self.tp.min(pages) if self.tp else pages

    @on_every_rank
    def allocate_cache(self, num_pages: int) -> None:
        """Allocate the page pool's tensors (a smaller one before, for the start-up
        measurements, is given back first)."""
        self.kv_stack, self.kv_caches, self.aux_cache = None, [], None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.num_pages = num_pages
        self.kv_stack = self.allocate_kv(self.model_config, num_pages, self.kv_heads)
        self.kv_caches = list(self.kv_stack.unbind(0))  # per layer
        aux_width = len(self.aux_layer_ids) * self.model_config.hidden_size
        if aux_width:
            self.model.aux_layer_ids = self.aux_layer_ids
            self.aux_cache = cache_zeros((num_pages * self.page_size, aux_width), self.dtype, self.device)

    @on_every_rank
    def capture_graphs(self) -> None:
        """CUDA graphs for decode and verification steps, and the piecewise ones for steps
        with prompt tokens (cuda, unless enforce_eager)."""
        if self.device.type != "cuda" or self.config.enforce_eager:
            return
        self.graphs = CudaGraphs(lambda batch, state: self.model(batch.input_ids, batch, self.kv_caches),
                                 self.page_size, self.max_model_len, self.config.max_num_seqs,
                                 1 + self.max_draft_len, self.device, trees=self.tree_drafts)
        self.graphs.capture()
        self.pieces = PiecewiseGraphs(self.model, self.attn, self.kv_caches, self.config.max_num_batched_tokens,
                                      self.page_size, self.device)
        self.pieces.capture()

    # Shapes (requests, query tokens each, cached context) that reach every Triton kernel
    # variant eager steps use: decode, verification, chunked extend and prefill, with and
    # without split-KV, and token counts of each divisibility class Triton specialises on.
    WARMUP_SHAPES = ((1, 1, 0), (1, 1, 700), (3, 1, 40), (1, 5, 40), (3, 5, 700), (2, 7, 0), (1, 16, 0),
                     (4, 64, 300), (1, 300, 0), (1, 300, 900))

    def warmup_batches(self, max_tokens: int):
        """Dummy ForwardBatches of WARMUP_SHAPES (plus one full token budget) that read and
        write only the null page, so they can run on a live cache."""
        ps = self.page_size
        for n, q, ctx in self.WARMUP_SHAPES + ((1, max_tokens, 0),):
            if ctx + q > self.max_model_len or n * q > max_tokens:
                continue
            pages = [[NULL_PAGE] * (-(-(ctx + q) // ps))] * n
            yield ForwardBatch.build([[0] * q] * n, [ctx] * n, pages, ps, self.device)

    @on_every_rank
    @torch.inference_mode()
    def warmup(self) -> None:
        """Build the Triton kernels steps run outside graphs now rather than in a user's step
        (graphs cover decodes, verification and steps of up to `PIECEWISE_MAX_TOKENS`
        tokens; longer steps run eagerly, and so does everything with `enforce_eager`): the
        eager forwards, sampling and verification (`fused.build_sampling_variants`), and
        moving a batch's rows on the device. `tidal.compiles` logs any variant still missed."""
        if self.device.type != "cuda":
            return
        from tidal.layers import fused

        for batch in self.warmup_batches(self.config.max_num_batched_tokens):
            self.model(batch.input_ids, batch, self.kv_caches)
        fused.build_sampling_variants(self.model_config.vocab_size, 1 + self.max_draft_len, self.device,
                                      trees=self.tree_drafts)
        batch = ForwardBatch.build([[0]], [0], [[NULL_PAGE]], self.page_size, self.device)
        batch.move_back(torch.zeros(1, dtype=torch.int64, device=self.device), self.page_size)
        batch.advance(torch.zeros(1, dtype=torch.int64, device=self.device), self.page_size)
        torch.cuda.synchronize(self.device)

    def kv_bytes_per_page(self, mc: ModelConfig, kv_heads: int | None = None) -> int:
        """KV bytes per page of a model of config `mc` holding `kv_heads` of its kv heads
        (default all: a drafter, which is whole)."""
        return 2 * mc.num_layers * self.page_size * (kv_heads or mc.num_kv_heads) * mc.head_dim * self.dtype.itemsize

    def allocate_kv(self, mc: ModelConfig, num_pages: int, kv_heads: int | None = None) -> torch.Tensor:
        """Every layer's KV cache in one tensor [layers, 2, num_pages, page_size, kv heads,
        head_dim], so that a tree's accepted KV moves in every layer at once (`_keep_accepted`)."""
        shape = (mc.num_layers, 2, num_pages, self.page_size, kv_heads or mc.num_kv_heads, mc.head_dim)
        return cache_zeros(shape, self.dtype, self.device)

    @torch.inference_mode()
    def launch(self, plan: StepPlan, drafts: Drafts | None = None, ahead: Ahead | None = None) -> PendingStep:
        """Queue one step on the device; its `result()` waits for it. `drafts` holds what the
        proposer drafted for the rows with K_i > 0, still on the device. With `ahead`, the
        plan was made while the step before was still in flight (`Ahead`): each row feeds
        the last token that step commits for it, taken on the device, and is built as if
        every draft there were accepted, then moved back on the device by those rejected."""
        reqs = plan.requests
        carried = ahead.carried if ahead else 0  # rows fed the token the step in flight commits
        # Each row's tokens; its drafts are written on the device.
        feeds = [([0] if i < carried else r.token_ids[r.num_computed:r.num_computed + n]) + [0] * k
                 for i, (r, n, k) in enumerate(zip(reqs, plan.num_new_tokens, plan.draft_lens))]
        rows = [i for i in range(len(reqs)) if i < carried or plan.samples(i)]
        contexts = [r.num_computed + (ahead.computed[i] if ahead else 0) for i, r in enumerate(reqs)]
        step = PendingStep(plan, rows, 1 + plan.max_draft_len)
        logit_index, counters, ks, subset = self._sampling_indices(step, feeds, ahead) if rows else (None,) * 4
        inputs = StepInputs(feeds, contexts, [r.pages for r in reqs],
                            decode_only=len(rows) == len(reqs) and all(n == 1 for n in plan.num_new_tokens),
                            sampled=bool(rows))
        tree = self._tree_inputs(plan, feeds, contexts, drafts) if drafts is not None and drafts.tree is not None \
            else None
        logits = self.forward_step(inputs, self._device_inputs(plan, feeds, drafts, ahead),
                                   ahead.rejected if ahead else None, logit_index, tree)
        if rows:
            self._verify(step, logits, drafts, counters, ks, subset)
            if tree is not None:
                self._keep_accepted(step, tree.slots if len(rows) == len(reqs) else tree.slots[subset])
        if self.device.type == "cuda":
            step.done = torch.cuda.Event(enable_timing=True)
            step.done.record()
        return step

    @on_every_rank
    def forward_step(self, inputs: StepInputs, input_ids: torch.Tensor | None, rejected: torch.Tensor | None,
                     logit_index: torch.Tensor | None, tree: TreeInputs | None = None) -> torch.Tensor | None:
        """The step's forward, and its logits where some row samples: at `logit_index`, or at
        every token where that is None. `input_ids` (on the device) replace the fed tokens;
        rows are moved back by the drafts a step in flight `rejected`; trees of drafts take
        their nodes' positions and masks from `tree`. The logits are rank 0's; the other
        ranks' calls return None."""
        num_tokens = sum(len(f) for f in inputs.feeds)
        bucket = self.pieces.bucket(num_tokens) if self.pieces is not None and tree is None else None
        def adjust(batch: ForwardBatch) -> None:
            if rejected is not None:
                batch.move_back(rejected, self.page_size)
            if tree is not None:
                tree.apply(batch, rejected, self.page_size)
        out, slot_mapping = forward_rows(
            self.graphs if inputs.decode_only else None,
            lambda batch, _: self.model(batch.input_ids, batch, self.kv_caches) if bucket is None
            else self.pieces.run(batch, num_tokens),
            inputs.feeds, inputs.contexts, inputs.pages, self.page_size, self.device, input_ids=input_ids,
            pad_tokens=bucket or 0, adjust=adjust if rejected is not None or tree is not None else None)
        hidden = out
        if self.aux_cache is not None:
            hidden, aux = out
            self.aux_cache[slot_mapping] = aux
        if not inputs.sampled:
            return None
        return self.model.compute_logits(hidden if logit_index is None else hidden[logit_index])

    @staticmethod
    def _device_inputs(plan: StepPlan, feeds: list[list[int]], drafts: Drafts | None,
                       ahead: Ahead | None) -> torch.Tensor | None:
        """The step's input ids where some are only on the device (None where none are):
        the drafts, and, planned ahead, the tokens the step in flight commits."""
        if ahead is None:
            return with_device_tails(feeds, plan.draft_lens, drafts.tokens) if plan.max_draft_len else None
        if not plan.max_draft_len and ahead.carried == len(feeds):
            return ahead.last
        source = ahead.last[:, None] if not plan.max_draft_len else torch.cat([ahead.last[:, None], drafts.tokens], 1)
        return with_device_tails(feeds, [1 + k if i < ahead.carried else 0 for i, k in enumerate(plan.draft_lens)],
                                 source)

    def _sampling_indices(self, step: PendingStep, feeds: list[list[int]], ahead: Ahead | None):
        """Every index the sampling rows need, in one host-to-device copy (a host list as an
        index would sync): where their logits are (None in a plain decode step, where every
        token is a row's last), output counters, draft lengths and the rows that verify drafts."""
        plan, rows, width = step.plan, step.rows, step.width
        reqs = plan.requests
        every_token = width == 1 and len(rows) == len(reqs) == sum(len(f) for f in feeds)
        ends = [] if every_token else list(itertools.accumulate(len(f) for f in feeds))
        logit_index = [] if every_token else [ends[i] - 1 - plan.draft_lens[i] + min(j, plan.draft_lens[i])
                                               for i in rows for j in range(width)]
        counters = [reqs[i].num_output_tokens + (ahead.commits[i] if ahead else 0) for i in rows]
        ks = [plan.draft_lens[i] for i in rows] if width > 1 else []  # (at W = 1, none to copy)
        subset = rows if width > 1 and len(rows) < len(reqs) else []
        logit_index, counters, ks, subset = to_device_parts([logit_index, counters, ks, subset], torch.int64,
                                                            self.device)
        if ahead is not None and ahead.rejected is not None:
            counters = counters - ahead.rejected
        return None if every_token else logit_index, counters, ks, subset

    def _verify(self, step: PendingStep, logits: torch.Tensor, drafts: Drafts | None, counters: torch.Tensor,
                ks: torch.Tensor, subset: torch.Tensor) -> None:
        """The sampling rows' tokens: their logits at the last K_i + 1 positions (padded to the
        step's width W), verified against their drafts (K_i = 0: plain sampling), then queued
        for the one copy to the host."""
        plan, rows, width = step.plan, step.rows, step.width
        reqs = plan.requests
        logits = logits.view(len(rows), width, -1)
        tokens = drafts.tokens[:, :width - 1] if width > 1 else logits.new_zeros(len(rows), 0, dtype=torch.int64)
        if len(subset):
            tokens = tokens[subset]
        tree = None
        if drafts is not None and drafts.tree is not None:
            tree = drafts.tree.rows(subset) if len(subset) else drafts.tree
        sampled = [reqs[i] for i in rows]
        step.tokens, step.accepted, step.path = verify(logits, tokens, ks, self.sampling_tensors(sampled), counters,
                                                       tree)
        if width > 1:
            step.rejected = ks + 1 - step.accepted
        wanted = [r.params.logprobs for r in sampled]
        if any(n is not None for n in wanted):
            b, w, v = logits.shape
            step.logprobs = (wanted, compute_logprobs(logits.view(b * w, v), step.tokens.reshape(-1),
                                                      max(n or 0 for n in wanted)))
        step.copy_to_host(torch.cat([step.tokens] + ([step.path] if step.path is not None else [])
                                    + [step.accepted[:, None]], dim=1))

    def _tree_inputs(self, plan: StepPlan, feeds: list[list[int]], contexts: list[int], drafts: Drafts) -> TreeInputs:
        """A step's trees as its forward takes them: each node at its root's position plus its
        depth, seeing only its ancestors (`ForwardBatch.tree_mask`); and the key indices of
        every row's root and nodes, where the accepted path's KV is moved (`_keep_accepted`)."""
        depth, ancestors = drafts.tree.depth, drafts.tree.ancestors
        width = depth.shape[1]
        at, source, offset, starts, keys = [], [], [], [], []
        end = 0
        for i, (feed, ctx, k) in enumerate(zip(feeds, contexts, plan.draft_lens)):
            root = ctx + len(feed) - 1 - k  # the root's key index: the row's own last token
            starts.append(root if k else ctx + len(feed))
            root_at = end + len(feed) - 1 - k
            at += range(root_at, root_at + 1 + k)
            source += range(i * width, i * width + 1 + k)
            offset += range(1 + k)
            keys += list(range(root, root + 1 + k)) + [root] * (width - 1 - k)
            end += len(feed)
        at_t, source_t, offset_t, starts_t, keys_t = to_device_parts([at, source, offset, starts, keys], torch.int64,
                                                                     self.device)
        mask = torch.full((end,), -1, dtype=torch.int64, device=self.device)
        mask[at_t] = ancestors.reshape(-1)[source_t]
        shift = torch.zeros(end, dtype=torch.int64, device=self.device)
        shift[at_t] = offset_t - depth.reshape(-1)[source_t]
        return TreeInputs(shift, mask, starts_t.to(torch.int32), keys_t.view(len(feeds), width))

    def _keep_accepted(self, step: PendingStep, slots: torch.Tensor) -> None:
        """Move the KV (and hidden states) of each row's accepted nodes from their slots to the
        slots of the sequence positions they now hold: root + 1, root + 2, ... `slots`
        [rows, W] are each sampling row's root and node slots."""
        keep = torch.arange(slots.shape[1], device=slots.device)[None, :] < step.accepted[:, None]
        src = torch.where(keep, slots.gather(1, step.path), slots).view(-1)
        dst = slots.view(-1)
        layers = self.kv_stack.flatten(2, 3)  # [layers, 2, slots, kv heads, head_dim]
        layers[:, :, dst] = layers[:, :, src]
        if self.aux_cache is not None:
            self.aux_cache[dst] = self.aux_cache[src]


class PendingStep:
    """A step queued on the device. Its tokens come back through one non-blocking copy;
    `result()` waits for that copy alone, so the host can plan and queue the next step first."""

    def __init__(self, plan: StepPlan, rows: list[int], width: int):
        self.plan = plan
        self.rows = rows            # plan rows that sample
        self.width = width
        self.tokens: torch.Tensor | None = None  # [len(rows), W] on the device
        self.accepted: torch.Tensor | None = None  # [len(rows)] on the device: tokens committed
        self.path: torch.Tensor | None = None      # [len(rows), W] on the device: trees' accepted nodes
        self.rejected: torch.Tensor | None = None  # and drafts rejected (1 + K_i - accepted; None at W = 1)
        self.logprobs = None        # (logprobs wanted per sampled row, their device tensors)
        self.host: torch.Tensor | None = None
        self.done: torch.cuda.Event | None = None  # recorded after the step's last work on the device
        self.started = 0.0          # when the engine began it (proposing included)
        self.catch_up: Span | None = None  # its drafter's catch-up, where there was one (`Drafts.catch_up`)
        self.ready = 0.0            # when its tokens came back
        self.observation: tuple | None = None  # what the policy learns from it, until it has (`record_result`)

    def copy_to_host(self, out: torch.Tensor) -> None:
        """The step's one device-to-host copy: tokens, then how many are committed."""
        if out.device.type == "cuda":
            self.host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            self.host.copy_(out, non_blocking=True)
        else:
            self.host = out

    def record_result(self, result: StepResult, before: PendingStep | None) -> None:
        """Note what the policy is to learn from this step: its result, and what it added to
        the time line: on the device from the end of `before`, the step before it (so that a
        step launched late, after a prompt step's longer host work, pays for it, not the
        step it was launched behind); else the wall time since `before`'s tokens came back,
        or, with no step before (after an idle spell), since this one began."""
        self.ready = time.perf_counter()
        seconds = self.seconds_after(before) if before is not None else None
        if seconds is None:
            seconds = self.ready - (before.ready if before is not None else self.started)
        self.observation = (self.plan, result, seconds, self.catch_up and self.catch_up.seconds)

    def seconds_after(self, before: PendingStep) -> float | None:
        """Seconds from the end of `before` on the device to the end of this step: what
        this step added to the device's time line, a launch that came late included (and
        not the launch of a step queued behind it, which a host clock would count). None
        without events (cpu), or for a step with no sampling row, whose end is not waited for."""
        if self.done is None or before.done is None or not self.rows:
            return None
        return before.done.elapsed_time(self.done) / 1000

    def ahead_for(self, reqs: list) -> Ahead:
        """What a step planned for `reqs` while this one is in flight takes from it: rows of
        this step (every one of which samples), then any prompts admitted beside them."""
        own = self.plan
        assert len(self.rows) == len(own.requests), "a step planned ahead follows one whose rows all sample"
        row = {id(r): i for i, r in enumerate(own.requests)}
        index = []
        for r in reqs:  # this step's rows come first
            if id(r) not in row:
                break
            index.append(row[id(r)])
        carried = len(index)
        ks = [own.draft_lens[i] for i in index]
        tokens, accepted, rejected = self.tokens, self.accepted, self.rejected
        if index != list(range(len(own.requests))):
            index_t = to_device(index, torch.int64, tokens.device)
            tokens = tokens[index_t]
            accepted = accepted[index_t]
            rejected = None if rejected is None else rejected[index_t]
        computed = [own.num_new_tokens[i] + k for i, k in zip(index, ks)]
        last = tokens[:, 0] if self.width == 1 else tokens.gather(1, (accepted - 1)[:, None])[:, 0]
        commits = [1 + k for k in ks]
        fresh = len(reqs) - carried
        if fresh:
            computed, commits = computed + [0] * fresh, commits + [0] * fresh
            tokens = torch.cat([tokens, tokens.new_zeros(fresh, tokens.shape[1])])
            last = torch.cat([last, last.new_zeros(fresh)])
            rejected = None if rejected is None else torch.cat([rejected, rejected.new_zeros(fresh)])
        return Ahead(computed, commits, tokens, last, rejected, carried)

    def result(self) -> StepResult:
        b = len(self.plan.requests)
        token_ids = torch.zeros(b, self.width, dtype=torch.int64)
        accept_lens = torch.zeros(b, dtype=torch.int64)
        if not self.rows:
            return StepResult(token_ids, accept_lens)
        if self.done is not None:
            self.done.synchronize()
        w = self.width
        token_ids[self.rows], accept_lens[self.rows] = self.host[:, :w], self.host[:, -1]
        paths = None
        if self.path is not None:
            paths = torch.zeros(b, w, dtype=torch.int64)
            paths[self.rows] = self.host[:, w:2 * w]
        return StepResult(token_ids, accept_lens, self._logprobs(), paths)

    def _logprobs(self):
        if self.logprobs is None:
            return None
        wanted, lp = self.logprobs
        b, w = len(self.rows), self.width
        chosen = lp.token_logprobs.view(b, w).tolist()
        ids, tops = lp.top_ids.view(b, w, -1).tolist(), lp.top_logprobs.view(b, w, -1).tolist()
        flat_tokens = self.tokens.view(b, w).tolist()
        out: list = [None] * len(self.plan.requests)
        for r, i in enumerate(self.rows):
            n = wanted[r]
            if n is not None:
                out[i] = [{flat_tokens[r][j]: chosen[r][j], **dict(zip(ids[r][j][:n], tops[r][j][:n]))}
                          for j in range(w)]
        return out
