"""min_tokens: no EOS (nor stop id, nor stop string) before that many output tokens, by taking the
stop ids out of the target's distribution, as Hugging Face's min_new_tokens does: greedy output equals
``generate(min_new_tokens=...)`` through both runners, drafts or not."""

import pytest
import torch

from targets import VOCAB, build
from test_speculative import random_draft
from dflash2.engine.engine import EngineConfig, LLMEngine
from dflash2.engine.request import Request
from dflash2.target import TargetModel
from dflash2.verification import SamplingParams


def _early_eos_prompts(target, n, max_new=24):
    """Prompts whose greedy answer ends with EOS (id 2) within a few tokens."""
    g = torch.Generator().manual_seed(1)
    found = []
    for _ in range(400):
        p = torch.randint(3, VOCAB, (int(torch.randint(3, 12, (), generator=g)),), generator=g)
        out = target.model.generate(p[None], max_new_tokens=max_new, do_sample=False)[0, len(p) :].tolist()
        if 2 in out and out.index(2) < 12:
            found.append(p.tolist())
            if len(found) == n:
                return found
    pytest.skip("no prompt with an early EOS for this seed")


@pytest.mark.parametrize("runner", ["paged", "static"])
def test_greedy_with_min_tokens_equals_hf(runner):
    t = TargetModel(build("llama", seed=13), layer_ids=[0, 2])
    prompts = _early_eos_prompts(t, 3)
    eng = LLMEngine(
        t,
        random_draft(t, 13).draft,
        EngineConfig(max_running_requests=3, num_draft_tokens=5, context_length=128, runner=runner),
    )
    mins = [0, 14, 20]
    reqs = [eng.add_request(Request(p, SamplingParams(max_new_tokens=20, min_tokens=m))) for p, m in zip(prompts, mins)]
    eng.run_until_done()
    for p, m, r in zip(prompts, mins, reqs):
        ref = t.model.generate(torch.tensor([p]), max_new_tokens=20, min_new_tokens=m, do_sample=False)
        ref = ref[0, len(p) :].tolist()
        assert r.output_ids == ref[: len(r.output_ids)] and len(r.output_ids) >= m
        assert 2 not in r.output_ids[:m]
    assert 2 in reqs[0].output_ids  # without min_tokens it does stop early


def test_sampled_with_min_tokens_never_stops_early():
    t = TargetModel(build("llama", seed=13), layer_ids=[0, 2])
    prompts = _early_eos_prompts(t, 2)
    eng = LLMEngine(
        t,
        random_draft(t, 13).draft,
        EngineConfig(
            max_running_requests=4, num_draft_tokens=5, context_length=128, runner="static", block_verification=True
        ),
    )
    reqs = [
        eng.add_request(Request(p, SamplingParams(max_new_tokens=16, min_tokens=12, temperature=1.0, seed=s)))
        for s in range(4)
        for p in prompts
    ]
    eng.run_until_done()
    assert all(len(r.output_ids) >= 12 and 2 not in r.output_ids[:12] for r in reqs)


def test_min_tokens_bound():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_new_tokens=4, min_tokens=5)
