"""Lossless verifiers as pure functions over ``(draft_tokens, q_draft, p_target, uniforms)``.

Shapes: ``draft_tokens [B, g]``; ``q_draft [B, g, V]`` (row i: the draft distribution that
token i was drawn from), or the same as a :class:`~dflash2.sampling.CandidateQ` (values at a few
token ids a row, zero elsewhere: what the DFlash2 selector draws from, read without building the
``[B, g, V]`` rows); ``p_target [B, g+1, V]`` (row i: the processed target distribution
for the token after ``i`` drafts, so row g is the bonus row). Each verifier returns how many
drafts each row accepts and the tokens it emits: the accepted drafts, then one target token.

A ``q_draft`` row that is not a distribution (a NaN or inf from a broken drafter) is never
trusted: the sampled verifiers treat it as a rejection and emit from ``p_target`` itself, so a
bad drafter can only cost speed, never change the output's distribution.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sampling import CandidateQ, sample_from_probs

QDraft = torch.Tensor | CandidateQ


@dataclass
class VerifyResult:
    num_accepted: torch.Tensor  # [B] drafts accepted (0..g)
    tokens: torch.Tensor  # [B, g+1] accepted drafts then the emitted token; -1 after that

    def row(self, b: int) -> list[int]:
        return self.tokens[b, : int(self.num_accepted[b]) + 1].tolist()


def _assemble(draft_tokens: torch.Tensor, n: torch.Tensor, bonus: torch.Tensor) -> VerifyResult:
    B, g = draft_tokens.shape
    slots = torch.arange(g + 1, device=draft_tokens.device).expand(B, g + 1)
    padded = torch.cat([draft_tokens, draft_tokens.new_full((B, 1), -1)], dim=1)
    tokens = torch.where(slots < n[:, None], padded, torch.full_like(padded, -1))
    tokens = tokens.scatter(1, n[:, None], bonus[:, None].to(tokens.dtype))
    return VerifyResult(n, tokens)


def _first_false(ok: torch.Tensor) -> torch.Tensor:
    """Length of the all-True prefix of each row."""
    return ok.to(torch.long).cumprod(dim=1).sum(dim=1)


def _bad_q(q_draft: torch.Tensor) -> torch.Tensor:
    """``[B, g]``: draft rows that are not a distribution (any non-finite or negative entry)."""
    return ~(torch.isfinite(q_draft) & (q_draft >= 0)).all(dim=-1)


def _q_parts(q_draft: QDraft) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(ids, values)``: ``ids`` None for a dense ``q_draft``."""
    if isinstance(q_draft, CandidateQ):
        return q_draft.ids, q_draft.probs.float()
    return None, q_draft.float()


def _q_at(ids: torch.Tensor | None, q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``[B, g]``: each row's q at its token ``x [B, g]``."""
    if ids is None:
        return q.gather(-1, x[..., None]).squeeze(-1)
    return (q * (ids == x[..., None])).sum(-1)


def _q_row(ids: torch.Tensor | None, q: torch.Tensor, at: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[B, V]``: row ``at[b]`` of each q, dense; a zero row at ``at == g`` (after a full block)."""
    B, g = q.shape[:2]
    rows = torch.arange(B, device=q.device)
    vals = torch.cat([q, q.new_zeros(B, 1, q.shape[-1])], dim=1)[rows, at]
    if ids is None:
        return vals
    cols = torch.cat([ids, ids.new_zeros(B, 1, ids.shape[-1])], dim=1)[rows, at]
    return torch.zeros(B, vocab_size, dtype=q.dtype, device=q.device).scatter_(-1, cols, vals)


def _residual_mass(P: torch.Tensor, p: torch.Tensor, ids: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """``sum_v max(P p(v) - q(v), 0)`` per row (``P [B, g]``, ``p [B, g, V]``): with candidates, q is 0
    off them, where the terms add up to ``P`` times p's mass there."""
    if ids is None:
        return (P[..., None] * p - q).clamp_min(0).sum(-1)
    p_c = p.gather(-1, ids)
    off = (p.sum(-1) - p_c.sum(-1)).clamp_min(0)
    return P * off + (P[..., None] * p_c - q).clamp_min(0).sum(-1)


def greedy_verify(draft_tokens: torch.Tensor, p_target: torch.Tensor) -> VerifyResult:
    """Accept the longest prefix with ``x_i == argmax p_{i-1}``; bonus = argmax of the next row.
    ``p_target`` may be raw logits: only its argmax is read."""
    best = p_target.argmax(dim=-1)  # [B, g+1]
    n = _first_false(draft_tokens == best[:, :-1])
    return _assemble(draft_tokens, n, best.gather(1, n[:, None]).squeeze(1))


def _residual_sample(p_rows: torch.Tensor, residual: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Sample ``norm(residual)``, falling back to ``p_rows`` where the residual has no mass."""
    empty = residual.sum(-1, keepdim=True) <= 0
    return sample_from_probs(torch.where(empty, p_rows, residual), uniforms)


def _no_drafts(draft_tokens: torch.Tensor, p_target: torch.Tensor, emit_uniforms: torch.Tensor) -> VerifyResult:
    """A block of no drafts (the target alone's step): its token is a draw from ``p_target``'s only row.
    What both verifiers compute then, without their residual's passes over the vocabulary."""
    n = torch.zeros(draft_tokens.shape[0], dtype=torch.long, device=draft_tokens.device)
    return _assemble(draft_tokens, n, sample_from_probs(p_target[:, 0].float(), emit_uniforms))


def token_level_verify(
    draft_tokens: torch.Tensor,
    q_draft: QDraft,
    p_target: torch.Tensor,
    accept_uniforms: torch.Tensor,
    emit_uniforms: torch.Tensor,
) -> VerifyResult:
    """Leviathan/Chen rejection sampling: accept ``x_i`` while ``u_i * q_i(x_i) < p_i(x_i)``;
    at the first rejection emit from ``norm(max(p_i - q_i, 0))``; after a full block, from ``p_{g+1}``.
    A bad ``q_draft`` row (see :func:`_bad_q`) stops acceptance there and emits from ``p_i``: exact,
    since position ``i`` then ignores the draft entirely."""
    B, g = draft_tokens.shape
    if g == 0:
        return _no_drafts(draft_tokens, p_target, emit_uniforms)
    ids, q = _q_parts(q_draft)
    px = p_target[:, :g].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1).float()
    qx = _q_at(ids, q, draft_tokens)
    good = ~_bad_q(q)
    n = _first_false((accept_uniforms * qx < px) & good)
    rows = torch.arange(B, device=draft_tokens.device)
    p_n = p_target[rows, n].float()
    q_n = _q_row(ids, q, n, p_target.shape[-1])  # zero after a full block
    stopped_by_bad = torch.cat([~good, good.new_zeros(B, 1)], dim=1)[rows, n]
    q_n = torch.where(stopped_by_bad[:, None], torch.zeros_like(q_n), q_n)
    bonus = _residual_sample(p_n, (p_n - q_n).clamp_min(0), emit_uniforms)
    return _assemble(draft_tokens, n, bonus)


def block_verify(
    draft_tokens: torch.Tensor,
    q_draft: QDraft,
    p_target: torch.Tensor,
    accept_uniforms: torch.Tensor,
    emit_uniforms: torch.Tensor,
) -> VerifyResult:
    """Block verification (Sun et al., ICLR 2025), spec section 4. No early stop: ``tau`` is the
    largest ``i`` with ``u_i <= h_i``. A row with any bad ``q_draft`` entry (see :func:`_bad_q`)
    accepts nothing and emits from ``p_0`` (exact when, as with broken weights, the badness does not
    depend on which tokens were drawn)."""
    B, g = draft_tokens.shape
    if g == 0:
        return _no_drafts(draft_tokens, p_target, emit_uniforms)
    ids, q = _q_parts(q_draft)
    bad_row = _bad_q(q).any(dim=1)
    p_t = p_target.float()
    q_d = torch.where(bad_row[:, None, None], torch.zeros((), device=p_t.device), q)
    px = p_t[:, :g].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)
    qx = _q_at(ids, q_d, draft_tokens)
    ratio = torch.where(qx > 0, px / qx.clamp_min(1e-30), torch.zeros_like(px))
    weights = [torch.ones(B, device=p_t.device)]  # P_0 .. P_g
    for i in range(g):
        weights.append(torch.clamp(weights[-1] * ratio[:, i], max=1.0))
    P = torch.stack(weights, dim=1)  # [B, g+1]
    # R_i for i = 0..g-1 uses rows i of p_target / q_draft (the distributions of token i+1)
    R = _residual_mass(P[:, :g], p_t[:, :g], ids, q_d)  # [B, g]
    denom = R + 1 - P[:, :g]
    h = torch.where(denom > 0, R / denom.clamp_min(1e-30), torch.ones_like(R))
    h = torch.cat([h[:, 1:], P[:, g:]], dim=1)  # h_1..h_{g-1}, h_g = P_g
    passed = accept_uniforms <= h  # [B, g] for i = 1..g
    idx = torch.arange(1, g + 1, device=p_t.device)
    # largest passing i, 0 if none (a 0 column keeps a block of no drafts, g = 0, well defined)
    tau = torch.where(bad_row, 0, torch.cat([passed * idx, passed.new_zeros(B, 1)], dim=1).amax(dim=1))
    rows = torch.arange(B, device=p_t.device)
    p_next = p_t[rows, tau]
    q_next = _q_row(ids, q_d, tau, p_t.shape[-1])
    residual = (P[rows, tau][:, None] * p_next - q_next).clamp_min(0)
    residual = torch.where(((tau == g) | bad_row)[:, None], p_next, residual)
    bonus = _residual_sample(p_next, residual, emit_uniforms)
    return _assemble(draft_tokens, tau, bonus)


def synthetic_verify(
    draft_tokens: torch.Tensor,
    p_target: torch.Tensor,
    rates: torch.Tensor,
    accept_uniforms: torch.Tensor,
    emit_uniforms: torch.Tensor | None,
) -> VerifyResult:
    """Benchmark only, **not lossless**: draft position ``i`` passes with probability ``rates[i]``
    (``accept_uniforms [B, g] < rates``) whatever the target says, the accepted prefix ends at the
    first failure, and the token after it is the target's: drawn from ``p_target`` with
    ``emit_uniforms``, or its argmax when those are None (``p_target`` may then be logits). vLLM's
    ``synthetic`` rejection method: the engine runs at a chosen acceptance profile on random weights."""
    g = draft_tokens.shape[1]
    n = _first_false(accept_uniforms < rates[:g])
    rows = p_target[torch.arange(draft_tokens.shape[0], device=n.device), n]
    bonus = rows.argmax(-1) if emit_uniforms is None else sample_from_probs(rows, emit_uniforms)
    return _assemble(draft_tokens, n, bonus)
