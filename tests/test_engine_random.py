"""The engine under random traffic (mostly the static-slot runner, sometimes the paged one): requests arrive while others decode, prompts of many
lengths (some cut by the prefill budget, some run inside steps), a KV pool small enough to preempt,
the planner on or off, greedy and sampled requests in one batch. Each greedy request's output must
be the target's own. Why: the mixed-chunk bug
of the thirty-fifth session (a step asking for a graph never captured) lived where features meet,
and each feature's own test passed."""

import random
import warnings

import pytest
import torch

from targets import VOCAB, build
from test_speculative import hf_greedy, random_draft
from dflash2.engine import graph_runner
from dflash2.engine.engine import EngineConfig, LLMEngine
from dflash2.engine.request import Request
from dflash2.target import TargetModel
from dflash2.verification import SamplingParams

warnings.filterwarnings("ignore")


@pytest.fixture(scope="module")
def models():
    t = TargetModel(build("llama", seed=9), layer_ids=[0, 2])
    return t, random_draft(t, 9).draft


@pytest.mark.parametrize("seed", range(12))
def test_random_traffic_greedy_equals_target(models, seed, monkeypatch):
    t, draft = models
    rng = random.Random(seed)
    width = rng.choice((3, 5))
    slots = rng.choice((2, 3, 4))
    runner = rng.choice(("static", "static", "paged"))
    knobs = dict(
        chunked_prefill_size=rng.choice((8, 24, -1)),
        enable_mixed_chunk=runner == "static" and rng.choice((True, False)),
        speculative_planner=rng.choice(("off", "auto")),
        max_total_tokens=rng.choice((192, 4096)),  # (static) 3 pages of 64, (paged) 24 of 8: preemption
    )
    # the step-size cap for mixing, so that growing into the next bucket crosses it at these sizes
    monkeypatch.setattr(graph_runner, "MIXED_MAX_STEP_TOKENS", rng.choice((width, 2 * width, 3 * width, 128)))
    eng = LLMEngine(
        t,
        draft,
        EngineConfig(
            max_running_requests=slots,
            num_draft_tokens=width,
            context_length=128,
            page_size=8,
            runner=runner,
            **knobs,
        ),
    )
    g = torch.Generator().manual_seed(seed)
    hot = dict(temperature=1.0, top_p=0.9, seed=seed)  # every third request: sampled batches, greedy rows in them
    pending = [
        Request(
            torch.randint(3, VOCAB, (rng.randint(2, 40),), generator=g).tolist(),
            SamplingParams(max_new_tokens=rng.randint(1, 60), **(hot if i % 3 == 2 else {})),
        )
        for i in range(10)
    ]
    reqs = list(pending)
    steps = 0
    while pending or eng.has_work():
        while pending and (not eng.has_work() or rng.random() < 0.3):  # arrivals between steps
            eng.add_request(pending.pop(0))
        eng.step()
        steps += 1
        assert steps < 2000, "the engine stopped making progress"
    assert all(r.finish_reason in ("stop", "length") for r in reqs), (runner, knobs, [r.error for r in reqs])
    for r in reqs:
        if r.sampling.temperature:
            continue
        assert r.output_ids == hf_greedy(t, torch.tensor(r.prompt_ids), r.sampling.max_new_tokens), knobs
    assert eng.pool_usage()[0] == 0  # every page back
