"""The math of one batched speculative step, shared by both model runners: the paged runner
calls these eagerly, the static-slot runner inside its CUDA graphs (``capturable=True``: no
host reads). Greedy batches need only argmaxes; sampled ones carry per-request parameters and
uniforms as ``[B]`` / ``[B, n]`` tensors (:class:`BatchSampling`)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ..model.context_cache import greedy_walk
from ..verification import VerifyResult, block_verify, greedy_verify, probs_from_logits, token_level_verify


@dataclass
class BatchSampling:
    temperature: torch.Tensor  # [B] float (0: a greedy row in a sampled batch)
    top_k: torch.Tensor        # [B] long (-1 or 0: off)
    top_p: torch.Tensor        # [B] float
    min_p: torch.Tensor        # [B] float
    propose_u: torch.Tensor    # [B, g] the selector's draws
    accept_u: torch.Tensor     # [B, g] the verifier's acceptance draws
    emit_u: torch.Tensor       # [B] the draw of the emitted token

    @classmethod
    def draw(cls, reqs, g: int, device) -> "BatchSampling":
        """Parameters of each request, and its uniforms from its own generator in the order the
        single-request loop uses (propose g, accept g, emit 1), so a seed gives the same tokens."""
        params = [torch.tensor([getattr(r.sampling, f) for r in reqs], device=device)
                  for f in ("temperature", "top_k", "top_p", "min_p")]
        u = torch.stack([torch.cat([torch.rand(g, generator=r.generator), torch.rand(g, generator=r.generator),
                                    torch.rand(1, generator=r.generator)]) for r in reqs]).to(device)
        return cls(params[0].float(), params[1], params[2].float(), params[3].float(),
                   u[:, :g], u[:, g:2 * g], u[:, 2 * g])

    def params(self) -> tuple[torch.Tensor, ...]:
        return self.temperature, self.top_k, self.top_p, self.min_p


@dataclass
class StepOutput:
    """What one batched step gave each request: its accepted drafts, then the emitted token."""
    tokens: list[list[int]]
    draft_s: float = 0.0       # draft forward + selector walk (0 without a draft)
    verify_s: float = 0.0      # target verify + verifier + the read-back
    num_accepted: list[int] = field(init=False)

    def __post_init__(self):
        self.num_accepted = [len(t) - 1 for t in self.tokens]


class Runner(Protocol):
    """What the engine asks of a model runner (width and verifier are fixed when it is built)."""

    def prefill(self, req, max_tokens: int | None = None) -> torch.Tensor | None: ...

    def step(self, reqs: list, sampling: BatchSampling | None) -> StepOutput: ...

    def release(self, req) -> None: ...


def finish_step(res: VerifyResult, t0: float, t1: float) -> StepOutput:
    """One read-back of the verifier's result for the whole batch, split per request."""
    keep = (res.num_accepted + 1).tolist()
    rows = res.tokens.tolist()
    return StepOutput([row[:k] for row, k in zip(rows, keep)], t1 - t0, time.perf_counter() - t1)


def propose(draft, hidden: torch.Tensor, anchors: torch.Tensor, lm_head_weight: torch.Tensor,
            sampling: BatchSampling | None, capturable: bool = False):
    """Draft tokens ``[B, g]`` from the block's hidden states, and ``q_draft [B, g, V]`` (None when
    the batch is greedy: argmax acceptance does not read it)."""
    if sampling is None:
        return greedy_walk(draft, hidden, anchors, lm_head_weight), None
    sel = draft.candidate_selector.walk(draft.candidates(hidden, lm_head_weight), hidden, anchors,
                                        sampling.temperature, sampling.propose_u, *sampling.params()[1:],
                                        all_greedy=False, capturable=capturable)
    return sel.tokens, sel.dense_q(lm_head_weight.shape[0])


def accept(logits: torch.Tensor, drafts: torch.Tensor, q_draft: torch.Tensor | None,
           sampling: BatchSampling | None, block: bool, capturable: bool = False) -> VerifyResult:
    """The verifier over the target's ``logits [B, g+1, V]``: greedy for a greedy batch, else
    token-level or block verification against the processed ``p_target``."""
    if sampling is None:
        return greedy_verify(drafts, logits)
    if q_draft is None:
        raise ValueError("a sampled batch needs q_draft")
    temperature, top_k, top_p, min_p = sampling.params()
    p_target = probs_from_logits(logits, temperature, top_k, top_p, min_p, capturable=capturable)
    verify = block_verify if block else token_level_verify
    return verify(drafts, q_draft, p_target, sampling.accept_u, sampling.emit_u)
