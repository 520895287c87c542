"""The speculative decode loop for one request (gpt-fast style: one readable function).

prefill -> [draft block -> selector path -> one target verify forward -> accept -> commit /
roll back] until EOS, a stop token or ``max_new_tokens``. With no proposer the same loop is
the plain autoregressive baseline (one token per target forward).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..target import TargetModel
from ..verification import (SamplingParams, block_verify, greedy_verify, probs_from_logits,
                            sample_from_probs, token_level_verify)

VERIFY_METHODS = ("greedy", "token", "block")
SAMPLED_VERIFIERS = {"token": token_level_verify, "block": block_verify}


@dataclass
class GenerationResult:
    token_ids: list[int]
    completion_tokens: int                       # C (the first token, from prefill, included)
    verify_steps: int                            # V (target forwards after prefill)
    accept_hist: list[int] = field(default_factory=list)  # accept_hist[n] = steps that accepted n drafts
    finish_reason: str = "length"                # "stop" (EOS / stop token) or "length"
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0

    @property
    def accept_length(self) -> float:
        return self.completion_tokens / max(self.verify_steps, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.total_s if self.total_s > 0 else 0.0

    def per_position_acceptance(self) -> list[float]:
        """Fraction of steps whose draft position i (1-based) was accepted."""
        from ..benchmark.metrics import per_position
        return per_position(self.accept_hist)


def eos_ids(target: TargetModel) -> set[int]:
    ids = getattr(getattr(target.model, "generation_config", None), "eos_token_id", None)
    ids = ids if ids is not None else getattr(target.config, "eos_token_id", None)
    if ids is None:
        return set()
    return set(ids) if isinstance(ids, (list, tuple)) else {int(ids)}


def stop_ids(target: TargetModel, sampling: SamplingParams) -> set[int]:
    return set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else eos_ids(target))


def resolve_verify_method(sampling: SamplingParams, verify_method: str | None) -> str:
    """The verifier to use (default: greedy at temperature 0, token-level otherwise), checked."""
    if verify_method is None:
        verify_method = "greedy" if sampling.greedy else "token"
    if verify_method not in VERIFY_METHODS:
        raise ValueError(f"verify_method must be one of {VERIFY_METHODS}, got {verify_method!r}")
    if verify_method == "greedy" and not sampling.greedy:
        raise ValueError("the greedy verifier is only lossless at temperature 0")
    return verify_method


def check_width(has_draft: bool, width: int) -> None:
    if has_draft and width < 2:
        raise ValueError(f"width must be >= 2 with a draft, got {width}")


def first_token(logits_row: torch.Tensor, sampling: SamplingParams, gen: torch.Generator) -> int:
    """The token the prefill emits, from the prompt's last logits row (one uniform of ``gen``)."""
    p_last = probs_from_logits(logits_row, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)
    return int(sample_from_probs(p_last, torch.rand((), generator=gen).to(p_last.device)))


def make_generator(seed: int | None) -> torch.Generator:
    gen = torch.Generator()
    gen.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, ()).item()))
    return gen


def _verify(method: str, drafts, q_draft, logits, sampling: SamplingParams, gen):
    g = drafts.shape[-1]
    if method == "greedy":
        return greedy_verify(drafts[None], logits[None])
    p_target = probs_from_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)
    if q_draft is None:  # a proposer at temperature 0 skips it: its q is one-hot at each draft token
        q_draft = torch.nn.functional.one_hot(drafts, logits.shape[-1]).float()
    return SAMPLED_VERIFIERS[method](drafts[None], q_draft[None].to(p_target.device), p_target[None],
              torch.rand(1, g, generator=gen).to(p_target.device), torch.rand(1, generator=gen).to(p_target.device))


@torch.no_grad()
def speculative_generate(target: TargetModel, proposer, prompt_ids: list[int] | torch.Tensor,
                         sampling: SamplingParams, width: int = 5, verify_method: str | None = None) -> GenerationResult:
    verify_method = resolve_verify_method(sampling, verify_method)
    check_width(proposer is not None, width)
    gen = make_generator(sampling.seed)
    stops = stop_ids(target, sampling)
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).view(-1)
    L = prompt.numel()
    state = target.new_state()
    res = GenerationResult([], 0, 0, [0] * (width if proposer is not None else 1))
    t0 = time.perf_counter()

    logits, feats = target.forward(state, prompt, logits_to_keep=1)
    target.commit(state, L)
    out = [first_token(logits[-1], sampling, gen)]
    if proposer is not None:
        proposer.begin(feats)
    res.prefill_s = time.perf_counter() - t0
    anchor_pos = L

    def finished() -> bool:
        return out[-1] in stops or len(out) >= sampling.max_new_tokens

    while not finished():
        g = width - 1 if proposer is not None else 0
        t1 = time.perf_counter()
        if g:
            drafts, q_draft = proposer.propose(out[-1], anchor_pos, g, sampling, torch.rand(g, generator=gen))
            drafts = drafts.to(target.device)
        else:
            drafts = torch.empty(0, dtype=torch.long, device=target.device)
            q_draft = torch.empty(0, logits.shape[-1])
        t2 = time.perf_counter()
        block = torch.cat([torch.tensor([out[-1]], device=target.device), drafts])
        logits, feats = target.forward(state, block)
        result = _verify(verify_method, drafts, q_draft, logits, sampling, gen)
        n = int(result.num_accepted[0])
        target.commit(state, n + 1)
        if proposer is not None:
            proposer.commit(feats[: n + 1], anchor_pos)
        anchor_pos += n + 1
        res.verify_steps += 1
        res.accept_hist[n] += 1
        res.draft_s += t2 - t1
        res.verify_s += time.perf_counter() - t2
        for tok in result.row(0):
            out.append(tok)
            if finished():
                break
    res.total_s = time.perf_counter() - t0
    res.token_ids = out
    res.completion_tokens = len(out)
    res.finish_reason = "stop" if out[-1] in stops else "length"
    return res
