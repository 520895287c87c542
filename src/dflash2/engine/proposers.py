"""Proposers: what fills a block with draft tokens. The DFlash2 draft is the real one; the
decode loop accepts any object with the same three methods (tests use an oracle)."""

from __future__ import annotations

from typing import Protocol

import torch

from ..model import DFlash2DraftModel
from ..model.context_cache import DraftContextCache, draft_block
from ..sampling import CandidateQ, SamplingParams


class Proposer(Protocol):
    def begin(self, features: torch.Tensor) -> None: ...  # the prompt's features, from position 0
    def propose(
        self, anchor: int, anchor_pos: int, num: int, sampling: SamplingParams, uniforms: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | CandidateQ | None]: ...  # q_draft [num, V] or [num, k]; None: one-hot
    def commit(self, features: torch.Tensor, start: int) -> None: ...  # accepted rows from ``start``


class DFlashProposer:
    """The DFlash2 draft over one request: latent context cache, one block forward, selector walk."""

    def __init__(self, draft: DFlash2DraftModel, embed: torch.nn.Module, lm_head_weight: torch.Tensor):
        self.draft, self.embed, self.lm_head_weight = draft, embed, lm_head_weight
        self.vocab_size = lm_head_weight.shape[0]
        self.cache = DraftContextCache(draft)

    def begin(self, features: torch.Tensor) -> None:
        """A new request: the prompt's features, positions from 0."""
        self.cache = DraftContextCache(self.draft)
        self.commit(features, 0)

    def commit(self, features: torch.Tensor, start: int) -> None:
        self.cache.append(self.draft, features, start)

    @torch.no_grad()
    def propose(self, anchor, anchor_pos, num, sampling, uniforms):
        device = self.lm_head_weight.device
        out = draft_block(
            self.draft,
            [self.cache],
            torch.tensor([anchor], device=device),
            torch.tensor([anchor_pos], device=device),
            num + 1,
            self.embed,
            self.lm_head_weight,
        )
        sel = self.draft.candidate_selector.walk(
            out.candidates(),
            out.hidden,
            torch.tensor([anchor], device=device),
            torch.tensor([sampling.temperature], device=device),
            uniforms[None].to(device),
            sampling.top_k,
            sampling.top_p,
            sampling.min_p,
            all_greedy=sampling.greedy,
        )
        # at temperature 0 q is one-hot at each token (the decode loop rebuilds it if a non-greedy
        # verifier asks)
        return sel.tokens[0], None if sampling.greedy else CandidateQ(sel.cand_ids[0], sel.q_draft[0])
