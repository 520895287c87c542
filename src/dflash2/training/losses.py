"""The DFlash2 training objective (spec section 7) as functions over tensors.

Per sequence: random anchors ``a``; each builds a block ``[tok[a], MASK x (w-1)]`` whose
context is the target features of positions ``< a``. Loss = decay-weighted cross-entropy
through the frozen LM head on slots 1..w-1, plus the selector loss (cross-entropy over the
slot's top-k candidates scored with the true predecessor, where the true token is a candidate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..model import DFlash2DraftModel, build_block_mask


@dataclass
class Blocks:
    block_ids: torch.Tensor  # [B, N, w] anchor token then MASK ids
    positions: torch.Tensor  # [B, N, w]
    labels: torch.Tensor  # [B, N, w-1] true tokens of slots 1..w-1
    weights: torch.Tensor  # [B, N, w-1] decay x loss mask (0 = no loss)
    anchors: torch.Tensor  # [B, N]


def sample_blocks(
    ids: torch.Tensor,
    loss_mask: torch.Tensor,
    num_anchors: int,
    width: int,
    mask_token_id: int,
    gamma: float,
    generator: torch.Generator | None = None,
) -> Blocks:
    B, T = ids.shape
    device = ids.device
    # an anchor needs at least one context row and a response token right after it
    ok = torch.zeros_like(loss_mask)
    ok[:, 1 : T - 1] = loss_mask[:, 2:T]
    scores = torch.rand(B, T, generator=generator, device="cpu").to(device)
    scores = torch.where(ok, scores, torch.full_like(scores, -1.0))
    top = scores.topk(min(num_anchors, T), dim=1)
    anchors = top.indices  # [B, N]
    has = top.values >= 0
    offs = torch.arange(width, device=device)
    positions = anchors[..., None] + offs  # [B, N, w]
    lab_pos = positions[..., 1:].clamp(max=T - 1)
    labels = ids.gather(1, lab_pos.flatten(1)).view(B, -1, width - 1)
    decay = torch.exp(-(offs[1:] - 1).float() / gamma)
    in_range = positions[..., 1:] < T
    lm = loss_mask.gather(1, lab_pos.flatten(1)).view(B, -1, width - 1) & in_range & has[..., None]
    weights = decay * lm.float()
    block_ids = torch.full_like(positions, mask_token_id)
    block_ids[..., 0] = ids.gather(1, anchors)
    return Blocks(block_ids, positions, labels, weights, anchors)


@dataclass
class LossOutput:
    loss: torch.Tensor
    ce: torch.Tensor
    selector: torch.Tensor
    top1_acc: float
    cand_recall: float
    kl: torch.Tensor | None = None
    selector_kl: torch.Tensor | None = None


def block_hidden(
    draft: DFlash2DraftModel,
    features: torch.Tensor,
    valid: torch.Tensor,
    block_ids: torch.Tensor,
    positions: torch.Tensor,
    anchors: torch.Tensor,
    embed,
) -> torch.Tensor:
    """Teacher forcing: the drafter's hidden states of slots 1..w-1 of every block ``[B, N, w-1, H]``, each
    block (``block_ids`` / ``positions [B, N, w]`` at ``anchors [B, N]``) reading the true context of the
    target's ``features [B, T, F]`` (rows where ``valid``)."""
    cfg = draft.config
    B, T, _ = features.shape
    _, N, w = block_ids.shape
    ctx_pos = torch.arange(T, device=features.device).expand(B, T)
    ctx_lat = draft.context_latents(draft.fuse(features), ctx_pos)
    q_pos = positions.view(B, N * w)
    q_anchor = anchors[..., None].expand(B, N, w).reshape(B, N * w)
    q_block = torch.arange(N, device=features.device)[None, :, None].expand(B, N, w).reshape(B, N * w)
    mask = build_block_mask(q_pos, q_anchor, q_block, ctx_pos, valid, cfg.sliding_window, cfg.is_causal)
    with torch.no_grad():
        emb = embed(block_ids.view(B, N * w))
    return draft(emb, q_pos, ctx_lat, mask, w).view(B, N, w, -1)[:, :, 1:]


def draft_loss(
    draft: DFlash2DraftModel,
    features: torch.Tensor,
    valid: torch.Tensor,
    blocks: Blocks,
    embed: torch.nn.Module,
    lm_head_weight: torch.Tensor,
    selector_weight: float = 1.0,
    target_logits: torch.Tensor | None = None,
    kl_weight: float = 0.0,
    selector_kl_weight: float = 0.0,
) -> LossOutput:
    """``target_logits [B, N, w-1, V]``: the target's own next-token logits at each slot's label
    position; with ``kl_weight > 0`` the loss adds KL(p_target || q_draft) at temperature 1, a
    distillation term beyond the spec's recipe that teaches the whole distribution (what sampled
    acceptance, sum_x min(p_target, q_draft), rewards) rather than one sampled token.
    ``selector_kl_weight > 0`` does the same for the selector: its softmax over the k candidates
    (scored with the true predecessor) against p_target renormalised over those candidates. At
    temperature 1 the selector's distribution *is* q_draft, so this is the term that moves sampled
    acceptance; hard labels alone (half of them greedy answers) teach it to be too sharp."""
    hidden = block_hidden(draft, features, valid, blocks.block_ids, blocks.positions, blocks.anchors, embed)
    logits = draft.compute_logits(hidden, lm_head_weight)  # [B, N, w-1, V] fp32
    wsum = blocks.weights.sum().clamp_min(1e-6)
    ce_tok = F.cross_entropy(logits.flatten(0, 2), blocks.labels.flatten(), reduction="none")
    ce = (ce_tok * blocks.weights.flatten()).sum() / wsum
    kl = logits.new_zeros(())
    if kl_weight > 0 and target_logits is not None:
        kl = distill_kl(logits, target_logits, blocks.weights)
    # selector: candidates from the (detached) slot logits, scored with the true predecessor
    sel = draft.candidate_selector
    U, cand = sel.candidates(logits.detach())  # [B, N, w-1, k]
    pred = torch.cat([blocks.block_ids[..., :1], blocks.labels[..., :-1]], dim=-1)
    S = sel.scores(U, hidden, cand, pred)  # [B, N, w-1, k]
    hit = cand == blocks.labels[..., None]
    present = hit.any(-1)
    tgt = hit.float().argmax(-1)
    sel_tok = F.cross_entropy(S.flatten(0, 2), tgt.flatten(), reduction="none")
    sw = blocks.weights.flatten() * present.flatten().float()
    selector = (sel_tok * sw).sum() / sw.sum().clamp_min(1e-6)
    sel_kl = logits.new_zeros(())
    if selector_kl_weight > 0 and target_logits is not None:
        sel_kl = selector_distill(S, cand, target_logits, blocks.weights)
    with torch.no_grad():
        m = blocks.weights > 0
        top1 = ((logits.argmax(-1) == blocks.labels) & m).sum().item() / max(m.sum().item(), 1)
        recall = (present & m).sum().item() / max(m.sum().item(), 1)
    loss = ce + selector_weight * selector + kl_weight * kl + selector_kl_weight * sel_kl
    return LossOutput(loss, ce.detach(), selector.detach(), top1, recall, kl.detach(), sel_kl.detach())


def distill_kl(draft_logits: torch.Tensor, target_logits: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted mean over slots of KL(p_target || q_draft), both at temperature 1."""
    logp_target = torch.log_softmax(target_logits.float(), -1)
    kl_tok = (logp_target.exp() * (logp_target - torch.log_softmax(draft_logits.float(), -1))).sum(-1)
    return (kl_tok * weights).sum() / weights.sum().clamp_min(1e-6)


def selector_distill(
    scores: torch.Tensor, cand: torch.Tensor, target_logits: torch.Tensor, weights: torch.Tensor
) -> torch.Tensor:
    """Weighted mean over slots of KL(p_target | candidates || softmax(scores)): ``scores`` and
    ``cand`` ``[..., k]``; p_target at temperature 1, restricted to the candidates and renormalised
    (the best any distribution over these k tokens can do is match it there)."""
    logp_target = torch.log_softmax(target_logits.float(), -1).gather(-1, cand)
    logp_target = logp_target - torch.logsumexp(logp_target, -1, keepdim=True)
    kl_tok = (logp_target.exp() * (logp_target - torch.log_softmax(scores.float(), -1))).sum(-1)
    return (kl_tok * weights).sum() / weights.sum().clamp_min(1e-6)


def lr_at(step: int, total: int, warmup: int, base_lr: float, min_ratio: float = 0.1) -> float:
    if step < warmup:
        return base_lr * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return base_lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))
