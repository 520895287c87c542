"""Candidate selector: turns per-slot top-k candidates into one coherent draft path.

``S_t(a, b) = U_t(b) + < A[a] * hidden_projection(h_t), B[b] >`` in fp32; walk left to right
(slot 1's predecessor is the anchor). Greedy rows take the argmax (exact ties: lower token id);
sampled rows draw from ``q_t = softmax(S_t / T)`` and keep ``q_t`` for the verifier.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..sampling import CandidateQ, probs_from_logits, sample_from_probs


@dataclass
class SelectorOutput:
    tokens: torch.Tensor  # [B, g] the chosen path
    cand_ids: torch.Tensor  # [B, g, k] candidate token ids per slot
    q_draft: torch.Tensor  # [B, g, k] the distribution each token was chosen from (one-hot when greedy)

    def candidate_q(self) -> CandidateQ:
        """``q_draft`` as the verifiers read it: values at the candidates, zero elsewhere."""
        return CandidateQ(self.cand_ids, self.q_draft)


class CandidateSelector(nn.Module):
    """``rows``: the codebooks' rows (``selector_vocab_size``); None: one per token. Fewer: the buffer
    ``codebook_rows [vocab]`` (saved with the weights) maps each token id to its row."""

    codebook_rows: torch.Tensor | None

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int, rows: int | None = None):
        super().__init__()
        self.top_k = top_k
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(rows or vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(rows or vocab_size, rank))
        self.register_buffer("codebook_rows", None if rows is None else torch.zeros(vocab_size, dtype=torch.long))
        self.reset_parameters()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The codebook row of each token id."""
        return ids if self.codebook_rows is None else self.codebook_rows[ids]

    def predecessor(self, ids: torch.Tensor) -> torch.Tensor:
        """``A[ids]``: the codebook of tokens as a slot's predecessor."""
        return self.predecessor_codebook[self.rows(ids)]

    def reset_parameters(self) -> None:
        # B = 0 makes a fresh selector plain top-1
        nn.init.normal_(self.predecessor_codebook, std=0.02)
        nn.init.zeros_(self.successor_codebook)

    def candidates(self, logits: torch.Tensor, finish=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k per slot, ordered by logit (ties: lower id first), values in fp32. topk, then a
        stable sort of the k survivors by id and value, avoids sorting the whole vocabulary.
        ``finish``: a monotone map of the fp32 values (the draft's multiplier and softcap), applied
        to the k survivors only."""
        vals, ids = logits.topk(self.top_k, dim=-1)
        vals = vals.float() if finish is None else finish(vals.float())
        ids, order = ids.sort(dim=-1)
        vals = vals.gather(-1, order)
        vals, order = vals.sort(dim=-1, descending=True, stable=True)
        return vals, ids.gather(-1, order)

    def pair_weights(self, hidden: torch.Tensor, cand_ids: torch.Tensor) -> torch.Tensor:
        """``B[cand] * hidden_projection(h_t)``: ``[B, g, k, r]`` in fp32, so that
        ``S_t(a, .) = U_t + W_t @ A[a]``."""
        g_t = self.hidden_projection(hidden).float()
        return self.successor_codebook[self.rows(cand_ids)].float() * g_t.unsqueeze(-2)

    def scores(self, U: torch.Tensor, hidden: torch.Tensor, cand: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
        """``S = U + W @ A[pred]`` per slot, ``[..., k]`` in fp32: each slot's candidates scored after a known
        predecessor ``pred [...]`` (training and teacher-forced checks; decoding walks its own draws)."""
        W = self.pair_weights(hidden, cand)
        return U + torch.einsum("...kr,...r->...k", W, self.predecessor(pred).float())

    @torch.no_grad()
    def walk(
        self,
        candidates: tuple[torch.Tensor, torch.Tensor],
        hidden: torch.Tensor,
        anchor: torch.Tensor,
        temperature: torch.Tensor,
        uniforms: torch.Tensor | None = None,
        top_k=-1,
        top_p=1.0,
        min_p=0.0,
        all_greedy: bool | None = None,
        capturable: bool = False,
    ) -> SelectorOutput:
        """``candidates``: ``(U, cand)`` per slot, ``[B, g, k]`` each (:meth:`candidates` of the slot
        logits, or ``DFlash2DraftModel.candidates``); ``hidden [B, g, H]`` of the draft slots;
        ``anchor [B]``; ``temperature [B]`` (0 = greedy row); ``uniforms [B, g]``, required when a row samples.
        ``all_greedy``: whether every temperature is 0, when the caller knows it (reading it from a
        GPU tensor would stall the launch queue each step). ``capturable``: filtering without host
        reads (see ``probs_from_logits``), for a CUDA graph."""
        U, cand = candidates
        W = self.pair_weights(hidden, cand)
        B, g, k = U.shape
        if all_greedy is None:
            all_greedy = bool((temperature == 0).all())
        # Every score the walk can need, in two batched products: slot 1 after the anchor, and
        # slot t+1 after each of slot t's k candidates. The walk itself is then only indexing
        # (scoring, filtering and sampling slot by slot, ~50 small ops a slot, cost 3 ms more a sampled
        # CPU propose at w=8: 31 against 28 ms).
        S_first = U[:, 0] + torch.einsum("bkr,br->bk", W[:, 0], self.predecessor(anchor).float())  # [B, k]
        S_next = U[:, 1:, None] + torch.einsum(
            "btkr,btjr->btjk", W[:, 1:], self.predecessor(cand[:, :-1]).float()
        )  # [B, g-1, k, k]
        # greedy: argmax with exact ties going to the lower token id
        g_first, g_next = _argmax_lowest_id(S_first, cand[:, 0]), _argmax_lowest_id(S_next, cand[:, 1:, None])
        if not all_greedy:
            if uniforms is None:  # q_draft must be the distribution each token was drawn from
                raise ValueError("the selector walk needs uniforms [B, g] when a row samples (temperature > 0)")
            q_first = probs_from_logits(S_first, temperature, top_k, top_p, min_p, capturable)
            q_next = probs_from_logits(S_next, temperature, top_k, top_p, min_p, capturable)
            greedy_row = temperature == 0
        rows = torch.arange(B, device=U.device)
        js, qs = [], []
        for t in range(g):
            greedy_j = g_first if t == 0 else g_next[rows, t - 1, js[-1]]
            if all_greedy:  # the common CPU batch-1 case: skip filtering and sampling
                j = greedy_j
            else:
                q = q_first if t == 0 else q_next[rows, t - 1, js[-1]]
                j = torch.where(greedy_row, greedy_j, sample_from_probs(q, uniforms[:, t]))
                qs.append(q)
            js.append(j)
        j = torch.stack(js, 1)  # [B, g]
        tokens = cand.gather(-1, j[..., None]).squeeze(-1)
        q_draft = torch.nn.functional.one_hot(j, k).float()
        if not all_greedy:
            q_draft = torch.where(greedy_row[:, None, None], q_draft, torch.stack(qs, 1))
        return SelectorOutput(tokens, cand, q_draft)


def _argmax_lowest_id(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Index of the maximum of each row of ``scores``; among exact ties, the one with the lowest id."""
    is_max = scores == scores.max(dim=-1, keepdim=True).values
    return torch.where(is_max, ids, torch.full_like(ids, torch.iinfo(torch.long).max)).argmin(-1)
