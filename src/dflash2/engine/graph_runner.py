"""The serving engine's model runner over static buffers, replayed as CUDA graphs per batch size.

Why: the paged runner rebuilds a left-padded Hugging Face cache every step and runs HF's
forward, which on the H200 is ~40 ms of host work a step for a 135M target (the GPU is idle).
Here each running request owns one slot of a :class:`StaticTarget` cache and of a draft latent
buffer, both over every position up to ``max_len``. Running requests fill slots ``0 .. n-1``
(a finished request's slot takes the last one's rows), so a step of ``n`` requests is one replay
of the graphs captured for the smallest bucket ``>= n``; the rows past ``n`` are idle slots.
Verify writes the target K/V and the draft latents of every block row at its position; rows
past what is accepted stay hidden (target: key <= query position; draft: key < anchor) and
are overwritten later, so commit only counts. A step is two replays (draft block + selector
walk; target verify + latents + verifier) whose math is :mod:`.steps`, shared with
:class:`ModelRunner`; sampled batches read per-request parameters and uniforms from slot
buffers. Graphs are keyed by batch bucket, attention prefix (``KV_BUCKETS``), greedy or
sampled, draft or verify. Same methods as :class:`ModelRunner` (the :class:`.steps.Runner` protocol).
"""
from __future__ import annotations

import time
import warnings

import torch

from ..model.attention import build_block_mask
from ..target import TargetModel
from ..target.static_llama import StaticTarget
from ..verification import VerifyResult
from . import steps
from .request import Request, prefill_ids
from .static_decode import Replay
from .steps import BatchSampling, StepOutput

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
ATTENTION = "sdpa"  # the target's attention over the slot buffers (StaticTarget: sdpa or matmul)
# Attention reads whole buffers, so a step attends over the shortest of these prefixes that holds
# every running request (on the H200 a 5-row verify took 4.6 ms over 1,029 positions, 7.3 over 4,101).
KV_BUCKETS = (1024,)


def static_bytes(target: TargetModel, draft, slots: int, max_len: int) -> int:
    """Memory the slot buffers take: target K and V plus the draft's latents, per position."""
    per_pos = target.kv_bytes_per_token
    if draft is not None:
        d = draft.config
        per_pos += d.num_hidden_layers * (d.kv_lora_rank + d.qk_rope_head_dim) * next(draft.parameters()).element_size()
    return slots * max_len * per_pos


class GraphModelRunner:
    def __init__(self, target: TargetModel, draft, width: int, num_slots: int, max_len: int,
                 cuda_graph: bool = True, block_verification: bool = False, attention: str = ATTENTION,
                 kv_buckets: tuple[int, ...] | None = None):
        self.target, self.draft, self.w, self.max_len = target, draft, width, max_len
        self.block = block_verification
        self.static = StaticTarget(target, max_len, slots=num_slots, attention=attention)
        self.static.check()  # refuse a layout the hand-written forward does not reproduce
        dev = target.device
        self.use_graph = cuda_graph and dev.type == "cuda"
        self.buckets = [b for b in BUCKETS if b < num_slots] + [num_slots]
        self.kv_buckets = sorted({b for b in (kv_buckets or KV_BUCKETS) if b < max_len} | {max_len})
        lng = dict(dtype=torch.long, device=dev)
        self.ids = torch.zeros(num_slots, width, **lng)    # per slot: [anchor, drafts...]
        self.start = torch.zeros(num_slots, **lng)         # per slot: the anchor's position
        self.ar = torch.arange(width, **lng)
        self.occupant: list[Request] = []                  # occupant[s] holds slot s
        # per slot, for sampled batches: parameters, uniforms, and q_draft from the draft graph
        # (idle slots keep a previous occupant's values: valid inputs whose results nobody reads)
        f32 = dict(dtype=torch.float32, device=dev)
        g, V = width - 1, target.lm_head_weight.shape[0]
        self.sampling = BatchSampling(torch.ones(num_slots, **f32), torch.full((num_slots,), -1, **lng),
                                      torch.ones(num_slots, **f32), torch.zeros(num_slots, **f32),
                                      torch.full((num_slots, g), 0.5, **f32), torch.full((num_slots, g), 0.5, **f32),
                                      torch.full((num_slots,), 0.5, **f32))
        self.q_draft = torch.zeros(num_slots, g, V, **f32)
        if draft is not None:
            d = draft.config
            p = next(draft.parameters())
            self.lat = torch.zeros(d.num_hidden_layers, num_slots, max_len, d.kv_lora_rank + d.qk_rope_head_dim,
                                   dtype=p.dtype, device=dev)
            self.ctx_pos = torch.arange(max_len, **lng)[None]
            self.ctx_valid = torch.ones(1, max_len, dtype=torch.bool, device=dev)  # k < anchor decides
        self.pool = torch.cuda.graph_pool_handle() if self.use_graph else None
        self.graphs: dict[tuple[str, int, bool, int], tuple[Replay, dict]] = {}  # (kind, B, greedy, kv_len)
        # Capture every bucket now, largest first so smaller ones reuse its memory (a capture inside a
        # step would cost that step ~0.1 s); the idle slots the warm-up calls write into are
        # overwritten by each request's prefill.
        # Greedy graphs first; a failed capture leaves that kind of step eager over the same buffers
        # (slower, still correct) rather than the engine down.
        self.graphed = {True: self.use_graph, False: self.use_graph}  # by "greedy batch"
        for greedy in (True, False):
            if not self.use_graph:
                break
            try:
                for kv_len in reversed(self.kv_buckets):
                    for B in reversed(self.buckets):
                        self._graph("verify", B, greedy, kv_len)
                        if draft is not None:
                            self._graph("draft", B, greedy, kv_len)
            except RuntimeError as e:
                warnings.warn(f"CUDA graph capture failed ({type(e).__name__}: {e}); "
                              f"{'greedy' if greedy else 'sampled'} steps run eagerly")
                self.graphed[greedy] = False
                self.graphs = {k: v for k, v in self.graphs.items() if k[2] != greedy}

    # ---- slots --------------------------------------------------------------------------------
    def _index(self, reqs: list[Request]) -> tuple[torch.Tensor, int, int]:
        """Slot of each request (a device index), the batch bucket that covers every occupied slot,
        and the buffer prefix that holds every occupant's next block."""
        idx = torch.tensor([r.slot for r in reqs], device=self.target.device)
        n = len(self.occupant)
        end = max(r.num_committed for r in self.occupant) + self.w
        return idx, next(b for b in self.buckets if b >= n), next(k for k in self.kv_buckets if k >= end)

    def release(self, req: Request) -> None:
        req.draft_cache = req.target_state = None
        req.prefill_pos = 0
        if req.slot is None:
            return
        s, last = req.slot, len(self.occupant) - 1
        req.slot = None
        if s != last:  # keep occupied slots contiguous: the last occupant moves into the hole
            mover = self.occupant[last]
            n = min(mover.num_committed + self.w, self.max_len)
            for cache in (self.static.k_cache, self.static.v_cache):
                cache[:, s, :, :n] = cache[:, last, :, :n]
            if self.draft is not None:
                self.lat[:, s, :n] = self.lat[:, last, :n]
            self.occupant[s], mover.slot = mover, s
        self.occupant.pop()

    # ---- the captured functions ---------------------------------------------------------------
    def _graph(self, kind: str, B: int, greedy: bool, kv_len: int) -> tuple[Replay, dict]:
        """The buckets' graph (captured at start-up on CUDA; eager functions otherwise)."""
        key = (kind, B, greedy, kv_len)
        if key not in self.graphs:
            out: dict = {}
            fn = self._verify_fn if kind == "verify" else self._draft_fn
            with torch.no_grad():
                self.graphs[key] = (Replay(lambda: fn(B, greedy, kv_len, out), self.graphed[greedy], self.pool), out)
        return self.graphs[key]

    def _rows(self, B: int, greedy: bool) -> BatchSampling | None:
        """The first ``B`` slots' sampling buffers (None: a greedy batch)."""
        if greedy:
            return None
        return BatchSampling(*(getattr(self.sampling, f)[:B] for f in BatchSampling.__dataclass_fields__))

    def _verify_fn(self, B: int, greedy: bool, kv_len: int, out: dict) -> None:
        logits, feats = self.static.forward(self.ids[:B], self.start[:B], kv_len=kv_len)
        if self.draft is not None:  # every row's latent at its position (rows past the accepted ones stay masked)
            pos = self.start[:B, None] + self.ar
            rows = torch.arange(B, device=pos.device)[:, None].expand_as(pos)
            self.lat[:, rows, pos] = self.draft.context_rows(feats, pos).to(self.lat.dtype)
        res = steps.accept(logits, self.ids[:B, 1:], self.q_draft[:B], self._rows(B, greedy), self.block,
                           capturable=True)
        out["n"], out["tokens"] = res.num_accepted, res.tokens

    def _draft_fn(self, B: int, greedy: bool, kv_len: int, out: dict) -> None:
        d, w = self.draft, self.w
        apos = self.start[:B]
        q_pos = apos[:, None] + self.ar
        mask = build_block_mask(q_pos, apos[:, None].expand(B, w), torch.zeros_like(q_pos),
                                self.ctx_pos[:, :kv_len].expand(B, -1), self.ctx_valid[:, :kv_len].expand(B, -1),
                                d.config.sliding_window, d.config.is_causal)
        block = self.ids[:B].clone()
        block[:, 1:] = d.config.mask_token_id
        hidden = d(self.target.embed(block), q_pos, self.lat[:, :B, :kv_len], mask, w)[:, 1:]
        tokens, q = steps.propose(d, hidden, self.ids[:B, 0], self.target.lm_head_weight, self._rows(B, greedy),
                                  capturable=True)
        if q is not None:
            self.q_draft[:B].copy_(q)
        self.ids[:B, 1:].copy_(tokens)  # the verify graph reads them there

    # ---- the runner's methods -----------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, req: Request, max_tokens: int | None = None) -> torch.Tensor | None:
        """The next ``max_tokens`` (default: all) of ``prefill_ids(req)`` into the request's slot,
        eagerly; the last row's logits once the whole prompt is in, else None. The slot is taken at
        the first chunk: a decode step meanwhile runs it as an idle row, whose writes land at
        ``start`` = the prompt's end, rows its own first verify overwrites."""
        ids, p, dev = prefill_ids(req), req.prefill_pos, self.target.device
        if p == 0:
            req.slot = len(self.occupant)
            self.occupant.append(req)
        s = req.slot
        assert s is not None
        self.start[s] = len(ids)
        chunk = ids[p: p + (max_tokens or len(ids))]
        logits, feats = self.static.forward(torch.tensor(chunk, device=dev),
                                            torch.full((), p, dtype=torch.long, device=dev), slot=s)
        if self.draft is not None:
            pos = torch.arange(p, p + len(chunk), device=dev)
            self.lat[:, s, p:p + len(chunk)] = self.draft.context_rows(feats, pos).to(self.lat.dtype)
        req.prefill_pos = req.num_committed = p + len(chunk)
        return logits[-1] if req.prefill_pos == len(ids) else None

    def _load(self, reqs: list[Request], blocks: torch.Tensor, sampling: BatchSampling | None):
        """Each request's block (or anchor), position and sampling rows into its slot."""
        idx, B, kv_len = self._index(reqs)
        self.ids[idx, :blocks.shape[1]] = blocks
        self.start[idx] = torch.tensor([r.num_committed for r in reqs], device=idx.device)
        if sampling is not None:
            for f in BatchSampling.__dataclass_fields__:
                getattr(self.sampling, f)[idx] = getattr(sampling, f).to(getattr(self.sampling, f).dtype)
        return idx, B, kv_len

    @torch.no_grad()
    def step(self, reqs: list[Request], sampling: BatchSampling | None) -> StepOutput:
        """Two replays: the draft block + selector walk writes the drafts beside the anchors in the
        slots' id buffer (and q_draft into its slot buffer); the verify graph runs the target over
        them, writes K/V and draft latents in place and runs the verifier. A commit only counts."""
        t0 = time.perf_counter()
        anchors = torch.tensor([r.all_ids[-1] for r in reqs], device=self.ids.device)
        idx, B, kv_len = self._load(reqs, anchors[:, None], sampling)
        greedy = sampling is None
        if self.w > 1:
            self._graph("draft", B, greedy, kv_len)[0]()
        t1 = time.perf_counter()
        replay, out = self._graph("verify", B, greedy, kv_len)
        replay()
        res = steps.finish_step(VerifyResult(out["n"][idx], out["tokens"][idx]), t0, t1)
        for r, tokens in zip(reqs, res.tokens):
            r.num_committed += len(tokens)
        return res
