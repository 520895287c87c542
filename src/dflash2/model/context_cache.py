"""Draft-side context cache in latent form, and the batched draft step over it.

Per request and layer we keep ``[c_kv | roped k_pe]`` (kv_lora + rope values) per committed
token, so each step projects only newly committed rows. Rows that no future block can see
(``k <= anchor - sliding_window``) are dropped: memory is bounded by the window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import build_block_mask
from .draft import DFlash2DraftModel


class DraftContextCache:
    """The committed prefix of one request, contiguous positions ``start .. end-1``. Positions are
    Python ints, so trimming never reads a GPU tensor back (one sync per request per step otherwise)."""

    def __init__(self, draft: DFlash2DraftModel):
        cfg = draft.config
        p = next(draft.parameters())
        self.window = cfg.sliding_window
        self.latents = torch.empty(
            cfg.num_hidden_layers, 0, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype=p.dtype, device=p.device
        )
        self.start = self.end = 0

    def __len__(self) -> int:
        return self.end - self.start

    @property
    def positions(self) -> torch.Tensor:
        return torch.arange(self.start, self.end, device=self.latents.device)

    @torch.no_grad()
    def append(self, draft: DFlash2DraftModel, target_features: torch.Tensor, start: int) -> None:
        """Project newly committed target features ``[T, K*H]`` of positions ``start .. start+T-1``."""
        if target_features.shape[0] == 0:
            return
        pos = torch.arange(start, start + target_features.shape[0], device=target_features.device)
        self.extend(draft.context_rows(target_features, pos), start)

    def extend(self, latents: torch.Tensor, start: int) -> None:
        """Add rows already projected (``[num_layers, T, D]``, positions from ``start``), e.g. by
        :func:`append_many`. The context must stay contiguous."""
        if len(self) and start != self.end:
            raise ValueError(
                f"draft context holds positions {self.start}..{self.end - 1}; "
                f"new rows must start at {self.end}, not {start}"
            )
        if not len(self):
            self.start = start
        self.latents = torch.cat([self.latents, latents], dim=1)
        self.end = start + latents.shape[1]

    def trim(self, anchor_pos: int) -> None:
        """Drop rows no block anchored at ``anchor_pos`` or later can see (``k <= anchor - window``)."""
        drop = min(len(self), anchor_pos - self.window + 1 - self.start)
        if drop > 0:
            self.latents = self.latents[:, drop:]
            self.start += drop


@torch.no_grad()
def append_many(
    draft: DFlash2DraftModel, caches: list[DraftContextCache], features: list[torch.Tensor], starts: list[int]
) -> None:
    """:meth:`DraftContextCache.append` for many requests in one projection: the latent rows are
    per token (fuse, kv_a, norm, rope at the token's own position), so packing every request's new
    rows into one sequence gives the same rows with one launch per kernel instead of one per request."""
    sizes = [int(f.shape[0]) for f in features]
    if not sum(sizes):
        return
    device = features[0].device
    positions = torch.cat([torch.arange(s, s + n, device=device) for s, n in zip(starts, sizes)])
    lat = draft.context_rows(torch.cat(features), positions)
    for cache, rows, start, n in zip(caches, lat.split(sizes, dim=1), starts, sizes):
        if n:
            cache.extend(rows, start)


@dataclass
class DraftBlockOutput:
    hidden: torch.Tensor  # [B, width-1, H] final-normed hidden of slots 1..width-1
    draft: DFlash2DraftModel
    lm_head_weight: torch.Tensor

    @property
    def logits(self) -> torch.Tensor:
        """``[B, width-1, V]`` fp32 (built on demand: decoding needs only :meth:`candidates`)."""
        return self.draft.compute_logits(self.hidden, self.lm_head_weight)

    def candidates(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The selector's top-k ``(logits, ids)`` per slot, ``[B, width-1, k]`` each."""
        return self.draft.candidates(self.hidden, self.lm_head_weight)


def greedy_walk(
    draft: DFlash2DraftModel,
    hidden: torch.Tensor,
    anchors: torch.Tensor,
    lm_head_weight: torch.Tensor,
    candidates: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The selector's argmax path ``[B, g]`` over the slots' candidates (no host reads: capturable)."""
    zeros = torch.zeros(anchors.shape[0], device=anchors.device)
    cands = candidates if candidates is not None else draft.candidates(hidden, lm_head_weight)
    return draft.candidate_selector.walk(cands, hidden, anchors, zeros, all_greedy=True).tokens


@torch.no_grad()
def draft_block(
    draft: DFlash2DraftModel,
    caches: list[DraftContextCache],
    anchors: torch.Tensor,
    anchor_pos: torch.Tensor,
    width: int,
    embed: torch.nn.Module,
    lm_head_weight: torch.Tensor,
) -> DraftBlockOutput:
    """One batched draft forward: block ``[anchor, MASK x (width-1)]`` per request."""
    cfg = draft.config
    device = anchors.device
    B = len(caches)
    for c, p in zip(caches, anchor_pos.tolist()):
        c.trim(p)
    Tc = max(1, max(len(c) for c in caches))
    D = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    if B == 1 and len(caches[0]):  # batch 1 (the CPU loop): no padding, so no copy of the context
        lat, ctx_pos = caches[0].latents.unsqueeze(1), caches[0].positions[None]
        ctx_valid = torch.ones(1, Tc, dtype=torch.bool, device=device)
    else:
        lat = torch.zeros(cfg.num_hidden_layers, B, Tc, D, dtype=caches[0].latents.dtype, device=device)
        ctx_pos = torch.zeros(B, Tc, dtype=torch.long, device=device)
        ctx_valid = torch.zeros(B, Tc, dtype=torch.bool, device=device)
        for b, c in enumerate(caches):
            n = len(c)
            lat[:, b, :n], ctx_pos[b, :n], ctx_valid[b, :n] = c.latents, c.positions, True
    hidden = block_hidden(draft, embed, anchors, anchor_pos, lat, ctx_pos, ctx_valid, width)
    return DraftBlockOutput(hidden, draft, lm_head_weight)


def block_hidden(
    draft: DFlash2DraftModel,
    embed: torch.nn.Module,
    anchors: torch.Tensor,
    anchor_pos: torch.Tensor,
    ctx_latents: torch.Tensor | list,
    ctx_pos: torch.Tensor,
    ctx_valid: torch.Tensor,
    width: int,
) -> torch.Tensor:
    """The draft block, defined here only: ``[anchor, MASK x (width-1)]`` per row at positions
    ``anchor_pos ..``, under the block-causal sliding-window mask over context latents
    ``[layers, B, T, D]`` at ``ctx_pos [B, T]`` (``ctx_valid`` False: padding); the hidden states of
    the ``width - 1`` draft rows. No host reads: the graph runner captures it."""
    cfg = draft.config
    B = anchors.shape[0]
    block_ids = torch.full((B, width), cfg.mask_token_id, dtype=torch.long, device=anchors.device)
    block_ids[:, 0] = anchors
    q_pos = anchor_pos[:, None] + torch.arange(width, device=anchors.device)
    mask = build_block_mask(
        q_pos,
        anchor_pos[:, None].expand(B, width),
        torch.zeros_like(q_pos),
        ctx_pos,
        ctx_valid,
        cfg.sliding_window,
        cfg.is_causal,
    )
    return draft(embed(block_ids), q_pos, ctx_latents, mask, width)[:, 1:]
