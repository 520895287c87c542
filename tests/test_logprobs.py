"""Log-probabilities of the output tokens: the target's own (log-softmax of its logits at each
committed token, float32), whatever the draft proposed, through both runners and the server."""

import pytest
import torch

from targets import build
from test_engine import _prompts
from test_speculative import random_draft
from dflash2.engine.engine import EngineConfig, LLMEngine
from dflash2.engine.request import Request
from dflash2.engine.steps import token_logprobs
from dflash2.target import TargetModel
from dflash2.verification import SamplingParams


def reference(target, prompt: list[int], output: list[int], k: int):
    """Teacher-forced: one HF forward over prompt + output, the rows that predict each output token."""
    ids = torch.tensor(prompt + output[:-1])[None]
    lp = torch.log_softmax(target.model(input_ids=ids, use_cache=False).logits[0].float(), -1)
    rows = lp[len(prompt) - 1 :]
    chosen = rows.gather(1, torch.tensor(output)[:, None])[:, 0]
    return chosen, rows.topk(k, -1) if k else None


def test_token_logprobs_is_log_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 9, generator=g)
    chosen, top = token_logprobs(logits, [3, 0, 8], 2)
    lp = torch.log_softmax(logits, -1)
    assert chosen == pytest.approx([lp[0, 3].item(), lp[1, 0].item(), lp[2, 8].item()])
    assert [t[0] for t in top[1]] == lp[1].topk(2).indices.tolist() and len(top) == 3


@pytest.mark.parametrize("runner", ["paged", "static"])
def test_engine_logprobs_equal_the_targets(runner):
    t = TargetModel(build("llama", seed=8), layer_ids=[0, 2])
    d = random_draft(t, 8).draft
    eng = LLMEngine(
        t,
        d,
        EngineConfig(max_running_requests=3, num_draft_tokens=5, context_length=128, runner=runner),
    )
    prompts = [p.tolist() for p in _prompts(4, seed=3)]
    params = [
        SamplingParams(max_new_tokens=20, logprobs=3),
        SamplingParams(max_new_tokens=17, temperature=1.0, top_p=0.9, seed=1, logprobs=0),
        SamplingParams(max_new_tokens=9),  # no logprobs in the same batch
        SamplingParams(max_new_tokens=15, temperature=0.7, seed=2, logprobs=1, stop_token_ids=(5, 9)),
    ]
    reqs = [eng.add_request(Request(p, sp)) for p, sp in zip(prompts, params)]
    eng.run_until_done()
    assert sum(r.verify_steps for r in reqs) < sum(len(r.output_ids) for r in reqs)  # drafts were accepted
    for p, sp, r in zip(prompts, params, reqs):
        if sp.logprobs is None:
            assert r.logprobs == [] and r.top_logprobs == []
            continue
        assert len(r.logprobs) == len(r.top_logprobs) == len(r.output_ids)
        chosen, top = reference(t, p, r.output_ids, sp.logprobs)
        assert torch.allclose(torch.tensor(r.logprobs), chosen, atol=1e-4)
        if top is not None:
            assert [[i for i, _ in row] for row in r.top_logprobs] == top.indices.tolist()
            assert torch.allclose(torch.tensor([[v for _, v in row] for row in r.top_logprobs]), top.values, atol=1e-4)


def test_logprobs_bound_is_checked():
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)


@pytest.mark.parametrize("runner", ["paged", "static"])
def test_prompt_logprobs_in_chunks(runner):
    """Prompt logprobs (tokens 1 .. n-1) from a prefill cut into chunks equal one forward's."""
    t = TargetModel(build("llama", seed=9), layer_ids=[0, 2])
    eng = LLMEngine(
        t,
        random_draft(t, 9).draft,
        EngineConfig(
            max_running_requests=2, num_draft_tokens=5, context_length=128, runner=runner, chunked_prefill_size=7
        ),
    )
    prompt = _prompts(1, seed=4)[0].tolist() + _prompts(1, seed=5)[0].tolist()
    r = eng.add_request(Request(prompt, SamplingParams(max_new_tokens=3, prompt_logprobs=2)))
    eng.run_until_done()
    lp = torch.log_softmax(t.model(input_ids=torch.tensor([prompt]), use_cache=False).logits[0].float(), -1)[:-1]
    assert len(r.prompt_logprobs) == len(prompt) - 1 > 14
    assert torch.allclose(
        torch.tensor(r.prompt_logprobs), lp.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0], atol=1e-4
    )
    assert [[i for i, _ in row] for row in r.prompt_top_logprobs] == lp.topk(2, -1).indices.tolist()
    assert r.logprobs == []  # output logprobs were not asked for
