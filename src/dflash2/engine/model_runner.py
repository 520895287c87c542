"""Owns the forward passes: prefill, batched target verify over a paged KV pool, batched draft.

Target KV lives in a pool of fixed-size blocks (``[num_blocks, kv_heads, block_size, head_dim]``
per layer for K and V); a verify step gathers each request's blocks into one left-padded batch
cache, runs one forward for all requests, and only the accepted rows are written back, so a
rejection needs no rollback. Targets whose cache is not plain per-layer K/V (hybrid linear
attention / state space, sliding windows) run one request at a time through the target
adapter, each with its own cache and recurrent-state snapshots. On CUDA, dense Llama-family
targets use :class:`GraphModelRunner` instead (static buffers, CUDA graphs per batch size).
"""

from __future__ import annotations

import functools
import time

import numpy as np
import torch
from transformers import Cache, DynamicCache
from transformers.cache_utils import DynamicLayer

from ..model.context_cache import DraftContextCache, append_many, draft_block
from ..sampling import CandidateQ
from . import steps
from ..target import TargetModel
from .block_manager import BlockManager
from .request import Request, prefill_ids
from .steps import BatchSampling, StepOutput


@functools.cache
def tune_cpu_malloc() -> bool:
    """Keep freed memory in glibc's heap (``mallopt``: allocations under 32 MiB from the heap, a
    trim threshold of 1 GiB, 64 MiB of top padding), once a process; False where the C library is
    not glibc. Why: by default glibc maps each large activation afresh and unmaps it when freed, so
    every CPU forward page-faults its buffers in again. On the 2-core EPYC at 16 rows, SmolLM2's
    one-token forward took 196 ms before a 3-token one and 377 ms right after it (its buffers
    unmapped in between); with this, 148 and 162 ms, and the 3-token one 274 -> 244 ms. Those after-
    effects made the planner's one-token steps look 1.4x dearer among drafting steps than in a run of
    the target alone, so it drafted at a loss (docs/benchmarks.md, twenty-fifth session)."""
    try:
        import ctypes

        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl): its allocator as it is
        return False
    M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
    done = [mallopt(M_MMAP_THRESHOLD, 32 << 20), mallopt(M_TRIM_THRESHOLD, 1 << 30), mallopt(M_TOP_PAD, 64 << 20)]
    return all(x == 1 for x in done)


def layer_kv(layer) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[B, h, T, d]`` of a plain attention cache layer (the only kind the paged pool holds)."""
    k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
    if k is None or v is None:
        raise TypeError(f"{type(layer).__name__} is not a plain K/V cache layer")
    return k, v


class PagedLayer(DynamicLayer):
    """One layer of a verify forward's cache over the paged pool: the batch's past K/V are gathered
    when the layer's attention asks for them (:meth:`update`), into one buffer with the new rows, and
    dropped with the layer's activations; only the new rows are kept (``new``, for the commit). Why:
    a DynamicCache of gathered copies held every layer's past and its concatenation with the new rows
    until the forward ended (SmolLM2 at 16 rows x 425 positions: ~630 MB live), and each time a batch
    or its context outgrew that peak the heap grew by first-touch page faults: steps of 1-3 s in the
    ramp-up of CPU runs, which also priced the planner's widths (docs/benchmarks.md, twenty-eighth
    session)."""

    def __init__(self, k_pool: torch.Tensor, v_pool: torch.Tensor, length: int, gather):
        super().__init__()
        self.k_pool, self.v_pool, self.length, self.gather = k_pool, v_pool, length, gather
        self.is_initialized = True  # nothing to allocate lazily: the pool is the storage
        self.new: tuple[torch.Tensor, torch.Tensor] | None = None

    def get_seq_length(self) -> int:
        return self.length

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.new = (key_states, value_states)
        return self.gather(self.k_pool, key_states), self.gather(self.v_pool, value_states)


class ModelRunner:
    def __init__(
        self,
        target: TargetModel,
        draft,
        block_manager: BlockManager,
        width: int = 1,
        block_verification: bool = False,
        synthetic_acceptance: tuple[float, ...] | None = None,
    ):
        self.target, self.draft, self.bm = target, draft, block_manager
        self.synthetic = steps.synthetic_rates(synthetic_acceptance, width, target.device)
        self.eos = steps.eos_ids(target)
        self.kv = block_manager  # what the scheduler admits against: pages of the pool
        self.use_graph = False
        self.w, self.block = width, block_verification
        self.paged = not target.is_hybrid and not getattr(target.config, "sliding_window", None)
        self.k_pool: list[torch.Tensor] = []
        self.v_pool: list[torch.Tensor] = []
        self.clock = steps.OverlapClock(target.device)
        self.timer: steps.GraphTimer | None = None  # benchmarks: each step's forwards timed (device_s)

    # ---- pool ---------------------------------------------------------------------------------
    def _ensure_pool(self, cache: DynamicCache) -> None:
        if self.k_pool:
            return
        bs = self.bm.block_size
        for layer in cache.layers:
            k, v = layer_kv(layer)  # [1, h, T, d]
            self.k_pool.append(
                torch.zeros(self.bm.num_blocks, k.shape[1], bs, k.shape[3], dtype=k.dtype, device=k.device)
            )
            self.v_pool.append(
                torch.zeros(self.bm.num_blocks, v.shape[1], bs, v.shape[3], dtype=v.dtype, device=v.device)
            )

    def _slots(self, req: Request, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, start + n)
        table = torch.tensor(req.block_table, dtype=torch.long)
        return table[pos // self.bm.block_size], pos % self.bm.block_size

    def _write(self, req: Request, layer_kv: list[tuple[torch.Tensor, torch.Tensor]], start: int) -> None:
        """Rows ``[h, n, d]`` per layer into ``req``'s blocks from token ``start``."""
        n = layer_kv[0][0].shape[1]
        blk, off = self._slots(req, start, n)
        for l, (k, v) in enumerate(layer_kv):
            self.k_pool[l][blk, :, off] = k.transpose(0, 1)
            self.v_pool[l][blk, :, off] = v.transpose(0, 1)

    # ---- prefill ------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, req: Request, max_tokens: int | None = None) -> torch.Tensor | None:
        """The next ``max_tokens`` (default: all) of ``prefill_ids(req)`` into the request's cache and
        draft context; when the last chunk is in, its KV goes to the pool and the last row's logits are
        returned (used only for a new request), else None. Chunks let the engine step the running
        requests between the chunks of a long prompt."""
        ids, t, p = prefill_ids(req), self.target, req.prefill_pos
        if p == 0:
            req.target_state = t.new_state()
            drafts = self.draft is not None and req.speculate  # a request that does not draft keeps no context
            req.draft_cache = DraftContextCache(self.draft) if drafts else None
        chunk = ids[p : p + (max_tokens or len(ids))]
        state = req.target_state
        keep = 0 if req.sampling.prompt_logprobs is not None else 1  # 0: every row
        logits, feats = t.forward(state, torch.tensor(chunk), logits_to_keep=keep)
        if keep == 0:
            steps.record_prompt_logprobs(req, logits, p)
        t.commit(state, len(chunk))
        if req.draft_cache is not None:
            req.draft_cache.append(self.draft, feats, p)
        req.prefill_pos = p + len(chunk)
        if req.prefill_pos < len(ids):
            return None
        if self.paged:
            self._ensure_pool(state.cache)
            self._write(req, [(k[0], v[0]) for k, v in map(layer_kv, state.cache.layers)], 0)
            req.target_state = None
        req.num_committed = len(ids)
        return logits[-1]

    # ---- the step -------------------------------------------------------------------------------
    @torch.no_grad()
    def step(
        self,
        reqs: list[Request],
        sampling: BatchSampling | None,
        width: int | None = None,
        overlap=None,
        prefill: tuple[Request, int] | None = None,
        trim=None,
    ) -> StepOutput:
        """Draft ``w - 1`` tokens per request, verify ``[anchor, drafts]`` in one target forward, keep
        what the verifier accepted (its K/V into the pool, its features into the draft context).
        ``width`` 1: the target alone this step (no draft forward). ``prefill``: ignored (prompts run in
        their own forwards here; --enable-mixed-chunk is the static runner's). ``trim``: the draft's
        confidence per slot -> the width to verify (the drafts after it are dropped unverified)."""
        t0 = time.perf_counter()
        anchors = torch.tensor([r.last_id for r in reqs], device=self.target.device)
        w, conf = width or self.w, None
        if self.timer is not None:
            self.timer.start()
        if w > 1:
            drafts, q_draft, conf = self.propose(reqs, anchors, sampling, w, confidence=trim is not None)
            if conf is not None and trim is not None and (w := trim(conf)) < drafts.shape[1] + 1:
                drafts, q_draft = drafts[:, : w - 1], None if q_draft is None else q_draft.head(w - 1)
                sampling = None if sampling is None else sampling.trimmed(w - 1)
        else:
            drafts, q_draft = anchors[:, None][:, :0], None
            if sampling is not None:
                empty = torch.empty(len(reqs), 0, 1, device=anchors.device)
                q_draft = CandidateQ(empty.long(), empty)
        t1 = time.perf_counter()
        blocks = torch.cat([anchors[:, None], drafts], dim=1)
        logits, feats, kv = self._forward(reqs, blocks)
        left = [steps.min_tokens_left(r) for r in reqs]
        if any(left):  # min_tokens: the stop ids are -inf on the rows that are still owed
            mask = torch.zeros(len(reqs), logits.shape[-1], dtype=torch.bool, device=logits.device)
            for b, r in enumerate(reqs):
                mask[b, steps.stop_ids(r.sampling, self.eos)] = True
            logits = steps.suppress_stops(logits, mask, torch.tensor(left, device=logits.device))
        res = steps.accept(logits, drafts, q_draft, sampling, self.block, synthetic=self.synthetic)
        if self.timer is not None:
            self.timer.stop()
        self.clock.run(overlap)  # (eager: nothing runs meanwhile; called where the graph runner calls it)
        out = steps.finish_step(steps.result_rows(res), t0, t1, self.clock)
        if self.timer is not None:
            out.device_s = self.timer.seconds()
        out.logits = logits if steps.wants_logprobs(reqs) else None
        if conf is not None:
            out.width, out.confidence = w, conf
        self._commit(reqs, kv, feats, [len(t) for t in out.tokens])
        return out

    def _forward(self, reqs: list[Request], blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, object]:
        """Logits ``[B, k, V]``, features ``[B, k, K*H]`` and the new rows' K/V."""
        t = self.target
        if not self.paged:
            outs = [t.forward(r.target_state, blocks[i]) for i, r in enumerate(reqs)]
            return torch.stack([o[0] for o in outs]), torch.stack([o[1] for o in outs]), None
        B, k = blocks.shape
        lens = [r.num_committed for r in reqs]
        L = max(lens)
        # pool slot -> (row, left-padded column), shared by every layer's gather (:class:`PagedLayer`)
        src = [self._slots(r, 0, n) for r, n in zip(reqs, lens)]
        dev = self.k_pool[0].device
        src_blk, src_off = torch.cat([b for b, _ in src]).to(dev), torch.cat([o for _, o in src]).to(dev)
        dst_b = torch.repeat_interleave(torch.arange(B), torch.tensor(lens)).to(dev)
        dst_t = torch.cat([torch.arange(L - n, L) for n in lens]).to(dev)
        pad_b = torch.repeat_interleave(torch.arange(B), torch.tensor([L - n for n in lens])).to(dev)
        pad_t = torch.cat([torch.arange(L - n) for n in lens]).to(dev)

        def gather(pool: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
            """``[B, h, L + k, d]``: the batch's past rows from ``pool``, left-padded with zeros, then ``new``."""
            x = new.new_empty(B, pool.shape[1], L + k, pool.shape[3])
            x[pad_b, :, pad_t] = 0  # masked out, but must be finite (masked scores still meet V)
            x[dst_b, :, dst_t] = pool[src_blk, :, src_off]
            x[:, :, L:] = new
            return x

        layers = [PagedLayer(kp, vp, L, gather) for kp, vp in zip(self.k_pool, self.v_pool)]
        lens_t = torch.tensor(lens, device=t.device)
        mask = (torch.arange(L + k, device=t.device) >= (L - lens_t)[:, None]).long()  # left padding off
        pos = lens_t[:, None] + torch.arange(k, device=t.device)
        logits, feats = t.batched_forward(blocks, mask, pos, Cache(layers=[*layers]))
        new_kv = [layer.new for layer in layers]
        return logits.float(), feats, new_kv

    def _commit(self, reqs: list[Request], new_kv, feats: torch.Tensor, keep: list[int]) -> None:
        """Keep the first ``keep[b]`` verified rows of each request: their K/V, and their target
        features in the draft context."""
        starts = [r.num_committed for r in reqs]
        if self.paged and any(keep):
            dev = self.k_pool[0].device
            dst = [self._slots(r, r.num_committed, n) for r, n in zip(reqs, keep)]
            blk, off = torch.cat([b for b, _ in dst]).to(dev), torch.cat([o for _, o in dst]).to(dev)
            rows = torch.repeat_interleave(torch.arange(len(reqs)), torch.tensor(keep)).to(dev)
            cols = torch.cat([torch.arange(n) for n in keep]).to(dev)
            for l, (k, v) in enumerate(new_kv):  # k, v: [B, h, width, d]
                self.k_pool[l][blk, :, off] = k[rows, :, cols]
                self.v_pool[l][blk, :, off] = v[rows, :, cols]
        for b, r in enumerate(reqs):
            if not self.paged:
                self.target.commit(r.target_state, keep[b])
            r.num_committed += keep[b]
        drafting = [b for b, r in enumerate(reqs) if r.draft_cache is not None]
        if drafting:
            append_many(
                self.draft,
                [reqs[b].draft_cache for b in drafting],
                [feats[b, : keep[b]] for b in drafting],
                [starts[b] for b in drafting],
            )

    # ---- draft --------------------------------------------------------------------------------
    @property
    def widths(self) -> tuple[int, ...]:
        """The verify widths a step can run: any up to the full one (eager forwards of any length)."""
        return tuple(range(1, self.w + 1))

    @property
    def trim_widths(self) -> tuple[int, ...]:
        """The widths a drafted step may be cut to after its draft: any from 2 (eager forwards)."""
        return tuple(range(2, self.w + 1))

    def propose(
        self,
        reqs: list[Request],
        anchors: torch.Tensor,
        sampling: BatchSampling | None,
        width: int,
        confidence: bool = False,
    ) -> tuple[torch.Tensor, CandidateQ | None, np.ndarray | None]:
        """Draft tokens ``[B, width-1]``, ``q_draft`` (None for a greedy batch) and, with ``confidence``,
        each slot's (``scored_candidates``, read to the host): a draft block of ``width`` positions (a
        shorter block than the drafter's is still a valid proposal; with ``is_causal`` its slots are
        exactly the longer block's first ones)."""
        pos = torch.tensor([r.num_committed for r in reqs], device=anchors.device)
        out = draft_block(
            self.draft,
            [r.draft_cache for r in reqs],
            anchors,
            pos,
            width,
            self.target.embed,
            self.target.lm_head_weight,
        )
        head = self.target.lm_head_weight
        if not confidence:
            return (*steps.propose(self.draft, out.hidden, anchors, head, sampling), None)
        vals, ids, conf = self.draft.scored_candidates(out.hidden, head)
        drafts, q_draft = steps.propose(self.draft, out.hidden, anchors, head, sampling, candidates=(vals, ids))
        return drafts, q_draft, conf.float().cpu().numpy()

    def bucket(self, n: int) -> int:
        """The batch size a step of ``n`` requests is costed under: ``n`` (eager steps cost what their rows do)."""
        return n

    def release(self, req: Request) -> None:
        req.draft_cache = None
        req.target_state = None
        req.prefill_pos = 0
