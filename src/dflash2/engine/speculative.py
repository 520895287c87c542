"""The reference decode loop for one request (gpt-fast style: one readable function), and the
test oracle the engine is checked against. Built from :mod:`.steps`, as the engine's runners are:
the draw order, the first token, the stop rule and the verifier choice are the engine's own.

prefill -> [draft block -> selector path -> one target verify forward -> accept -> commit /
roll back] until EOS, a stop token or ``max_new_tokens``. With no proposer the same loop is
the plain autoregressive baseline (one token per target forward).
"""

from __future__ import annotations

import time

import torch

from ..sampling import CandidateQ, SamplingParams
from ..target import TargetModel
from .steps import (
    BatchSampling,
    GenerationResult,
    accept,
    draw_uniforms,
    eos_ids,
    first_token,
    make_generator,
    resolve_verify_method,
    stop_reason,
)


def check_width(has_draft: bool, width: int) -> None:
    if has_draft and width < 2:
        raise ValueError(f"width must be >= 2 with a draft, got {width}")


@torch.no_grad()
def speculative_generate(
    target: TargetModel,
    proposer,
    prompt_ids: list[int] | torch.Tensor,
    sampling: SamplingParams,
    width: int = 5,
    verify_method: str | None = None,
) -> GenerationResult:
    method = resolve_verify_method(sampling, verify_method)
    check_width(proposer is not None, width)
    gen, eos, dev = make_generator(sampling.seed), eos_ids(target), target.device
    g = width - 1 if proposer is not None else 0
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).view(-1)
    state = target.new_state()
    res = GenerationResult([], 0, 0, [0] * (g + 1))
    t0 = time.perf_counter()

    logits, feats = target.forward(state, prompt, logits_to_keep=1)
    target.commit(state, prompt.numel())
    out = [first_token(logits[-1], sampling, gen)]
    if proposer is not None:
        proposer.begin(feats)
    res.prefill_s = time.perf_counter() - t0
    anchor_pos, reason = prompt.numel(), stop_reason(out[0], 1, sampling, eos)

    while reason is None:
        t1 = time.perf_counter()
        rows = None if method == "greedy" else BatchSampling.of([sampling], draw_uniforms(gen, g)[None], dev)
        drafts, q_draft = torch.empty(0, dtype=torch.long, device=dev), None
        if g:
            u = rows.propose_u[0] if rows is not None else torch.zeros(g)
            drafts, q_draft = proposer.propose(out[-1], anchor_pos, g, sampling, u)
            drafts = drafts.to(dev)
        if rows is not None and q_draft is None:  # a greedy proposer: q is one-hot at each draft token
            q_draft = CandidateQ(drafts[:, None], torch.ones(len(drafts), 1, device=dev))
        if isinstance(q_draft, CandidateQ):  # one request's rows as a batch of one
            q_draft = CandidateQ(q_draft.ids[None], q_draft.probs[None]).to(dev)
        elif q_draft is not None:
            q_draft = q_draft[None].to(dev)
        t2 = time.perf_counter()
        logits, feats = target.forward(state, torch.cat([torch.tensor([out[-1]], device=dev), drafts]))
        result = accept(
            logits[None],
            drafts[None],
            q_draft,
            rows,
            block=method == "block",
        )
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
            if (reason := stop_reason(tok, len(out), sampling, eos)) is not None:
                break
    res.total_s = time.perf_counter() - t0
    res.token_ids, res.completion_tokens, res.finish_reason = out, len(out), reason
    return res
