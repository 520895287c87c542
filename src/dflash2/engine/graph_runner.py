"""The serving engine's model runner over static buffers, replayed as CUDA graphs per batch size.

Why: the paged runner rebuilds a left-padded Hugging Face cache every step and runs HF's
forward, which on the H200 is ~40 ms of host work a step for a 135M target (the GPU is idle).
Here each running request owns one slot of a :class:`StaticTarget` cache and of a draft latent
buffer, both over every position up to ``max_len``. Running requests fill slots ``0 .. n-1``
(a finished request's slot takes the last one's rows), so a step of ``n`` requests is one replay
of the graphs captured for the smallest bucket ``>= n``; the rows past ``n`` are idle slots.
Verify writes the target K/V and the draft latents of every block row at its position; rows
past what is accepted stay hidden (target: key <= query position; draft: key < anchor) and
are overwritten later, so commit only counts. The selector walk, sampling and acceptance stay
eager: their parameters differ per request. Same three methods as :class:`ModelRunner`.
"""
from __future__ import annotations

import warnings

import torch

from ..model.attention import build_block_mask
from ..model.context_cache import DraftBlockOutput, greedy_walk
from ..target import TargetModel
from ..target.static_llama import StaticTarget
from .request import Request
from .static_decode import Replay

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
ATTENTION = "sdpa"  # the target's attention over the slot buffers (StaticTarget: sdpa or matmul)


def static_bytes(target: TargetModel, draft, slots: int, max_len: int) -> int:
    """Memory the slot buffers take: target K and V plus the draft's latents, per position."""
    cfg = target.config
    kv = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_pos = 2 * cfg.num_hidden_layers * kv * head_dim * target.dtype.itemsize
    if draft is not None:
        d = draft.config
        per_pos += d.num_hidden_layers * (d.kv_lora_rank + d.qk_rope_head_dim) * next(draft.parameters()).element_size()
    return slots * max_len * per_pos


class GraphModelRunner:
    def __init__(self, target: TargetModel, draft, width: int, num_slots: int, max_len: int,
                 cuda_graph: bool = True, attention: str = ATTENTION):
        self.target, self.draft, self.w, self.max_len = target, draft, width, max_len
        self.static = StaticTarget(target, max_len, slots=num_slots, attention=attention)
        self.static.check()  # refuse a layout the hand-written forward does not reproduce
        dev = target.device
        self.use_graph = cuda_graph and dev.type == "cuda"
        self.buckets = [b for b in BUCKETS if b < num_slots] + [num_slots]
        lng = dict(dtype=torch.long, device=dev)
        self.ids = torch.zeros(num_slots, width, **lng)    # per slot: [anchor, drafts...]
        self.start = torch.zeros(num_slots, **lng)         # per slot: the anchor's position
        self.ar = torch.arange(width, **lng)
        self.occupant: list[Request] = []                  # occupant[s] holds slot s
        if draft is not None:
            d = draft.config
            p = next(draft.parameters())
            self.lat = torch.zeros(d.num_hidden_layers, num_slots, max_len, d.kv_lora_rank + d.qk_rope_head_dim,
                                   dtype=p.dtype, device=dev)
            self.ctx_pos = torch.arange(max_len, **lng)[None]
            self.ctx_valid = torch.ones(1, max_len, dtype=torch.bool, device=dev)  # k < anchor decides
        self.pool = torch.cuda.graph_pool_handle() if self.use_graph else None
        self.graphs: dict[tuple[str, int], tuple[Replay, dict]] = {}
        # Capture every bucket now, largest first so smaller ones reuse its memory (a capture inside a
        # step would cost that step ~0.1 s); the idle slots the warm-up calls write into are
        # overwritten by each request's prefill.
        if self.use_graph:
            try:
                for B in reversed(self.buckets):
                    self._graph("verify", B)
                    if draft is not None:
                        self._graph("draft", B)
                        self._graph("draft_greedy", B)
            except RuntimeError as e:  # serve eagerly over the same buffers rather than not at all
                warnings.warn(f"CUDA graph capture failed ({type(e).__name__}: {e}); this engine runs eagerly")
                self.use_graph, self.graphs = False, {}

    # ---- slots --------------------------------------------------------------------------------
    def _index(self, reqs: list[Request]) -> tuple[torch.Tensor, int]:
        """Slot of each request (a device index) and the bucket that covers every occupied slot."""
        idx = torch.tensor([r.slot for r in reqs], device=self.target.device)
        n = len(self.occupant)
        return idx, next(b for b in self.buckets if b >= n)

    def release(self, req: Request) -> None:
        req.draft_cache = req.target_state = None
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
    def _graph(self, kind: str, B: int) -> tuple[Replay, dict]:
        """The bucket's graph (captured at start-up on CUDA; eager functions otherwise)."""
        if (kind, B) not in self.graphs:
            out: dict = {}
            fn = {"verify": self._verify_fn, "draft": self._draft_fn, "draft_greedy": self._draft_greedy_fn}[kind]
            fn = (lambda f=fn: f(B, out))
            with torch.no_grad():
                self.graphs[kind, B] = (Replay(fn, self.use_graph, self.pool), out)
        return self.graphs[kind, B]

    def _verify_fn(self, B: int, out: dict) -> None:
        logits, feats = self.static.forward(self.ids[:B], self.start[:B])
        if self.draft is not None:  # every row's latent at its position (rows past the accepted ones stay masked)
            pos = self.start[:B, None] + self.ar
            rows = torch.arange(B, device=pos.device)[:, None].expand_as(pos)
            d = self.draft
            self.lat[:, rows, pos] = d.context_latents(d.fuse(feats), pos).to(self.lat.dtype)
        out["logits"] = logits

    def _draft_fn(self, B: int, out: dict) -> None:
        d, w = self.draft, self.w
        apos = self.start[:B]
        q_pos = apos[:, None] + self.ar
        mask = build_block_mask(q_pos, apos[:, None].expand(B, w), torch.zeros_like(q_pos),
                                self.ctx_pos.expand(B, -1), self.ctx_valid.expand(B, -1),
                                d.config.sliding_window, d.config.is_causal)
        block = self.ids[:B].clone()
        block[:, 1:] = d.config.mask_token_id
        out["hidden"] = d(self.target.embed(block), q_pos, self.lat[:, :B], mask, w)[:, 1:]

    def _draft_greedy_fn(self, B: int, out: dict) -> None:
        self._draft_fn(B, out)
        out["tokens"] = greedy_walk(self.draft, out["hidden"], self.ids[:B, 0], self.target.lm_head_weight)

    # ---- the runner's methods -----------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, req: Request) -> torch.Tensor:
        """The prompt (or ``all_ids[:-1]`` of a resumed request) into a new slot, eagerly."""
        ids = req.prompt_ids if not req.output_ids else req.all_ids[:-1]
        s = len(self.occupant)
        dev = self.target.device
        logits, feats = self.static.forward(torch.tensor(ids, device=dev), torch.zeros((), dtype=torch.long, device=dev), slot=s)
        if self.draft is not None:
            pos = torch.arange(len(ids), device=dev)
            d = self.draft
            self.lat[:, s, :len(ids)] = d.context_latents(d.fuse(feats[None]), pos[None])[:, 0].to(self.lat.dtype)
        self.occupant.append(req)
        req.slot, req.num_committed = s, len(ids)
        return logits[-1]

    def _draft(self, reqs: list[Request], kind: str) -> tuple[dict, torch.Tensor, torch.Tensor]:
        dev = self.target.device
        anchors = torch.tensor([r.all_ids[-1] for r in reqs], device=dev)
        idx, B = self._index(reqs)
        self.ids[idx, 0] = anchors
        self.start[idx] = torch.tensor([r.num_committed for r in reqs], device=dev)
        step, out = self._graph(kind, B)
        step()
        return out, idx, anchors

    @torch.no_grad()
    def draft_logits(self, reqs: list[Request], width: int):
        out, idx, anchors = self._draft(reqs, "draft")
        return DraftBlockOutput(out["hidden"][idx], self.draft, self.target.lm_head_weight), anchors

    @torch.no_grad()
    def draft_greedy(self, reqs: list[Request], width: int) -> torch.Tensor:
        """Draft tokens ``[B, width-1]`` of an all-greedy batch: block, candidates and walk in one replay."""
        out, idx, _ = self._draft(reqs, "draft_greedy")
        return out["tokens"][idx]

    @torch.no_grad()
    def verify(self, reqs: list[Request], blocks: torch.Tensor):
        idx, B = self._index(reqs)
        self.ids[idx] = blocks.to(self.ids.device)
        self.start[idx] = torch.tensor([r.num_committed for r in reqs], device=self.ids.device)
        step, out = self._graph("verify", B)
        step()
        return out["logits"][idx], None, None

    def commit(self, reqs: list[Request], handle, keep: list[int], feats=None) -> None:
        """Everything is already in place (K/V and latents written by the verify pass): count."""
        for r, n in zip(reqs, keep):
            r.num_committed += n
