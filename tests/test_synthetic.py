"""Synthetic acceptance (benchmarks only): the pure verifier, the engine at rates 0 and 1, the
flags' checks, and the random real-shape models of ``bench speed --target-shape``."""

import math

import pytest
import torch

from targets import VOCAB, build
from test_engine import _prompts
from test_speculative import hf_greedy, random_draft
from dflash2.engine.engine import EngineConfig, LLMEngine
from dflash2.engine.request import Request
from dflash2.sampling import sample_from_probs
from dflash2.target import TargetModel
from dflash2.verification import SamplingParams, synthetic_verify


def test_synthetic_verify_rates_decide_the_prefix():
    g = torch.Generator().manual_seed(0)
    B, k, V = 40000, 4, 11
    drafts = torch.randint(0, V, (B, k), generator=g)
    logits = torch.randn(B, k + 1, V, generator=g)
    rates = torch.tensor([0.9, 0.5, 0.2, 0.8])
    res = synthetic_verify(drafts, logits, rates, torch.rand(B, k, generator=g), None)
    for i in range(1, k + 1):  # P(n >= i) = rates[0] * ... * rates[i-1], independent draws
        p = math.prod(rates[:i].tolist())
        got = (res.num_accepted >= i).float().mean().item()
        assert abs(got - p) < 4 * math.sqrt(p * (1 - p) / B) + 1e-9, (i, got, p)
    n = res.num_accepted
    rows = torch.arange(B)
    assert torch.equal(res.tokens[rows, n], logits[rows, n].argmax(-1))  # the target's token after the prefix
    assert all(torch.equal(res.tokens[b, : n[b]], drafts[b, : n[b]]) for b in range(50))
    # sampled: the token after the prefix is drawn from p_target with the emit uniforms
    p_target = torch.softmax(logits[:64], -1)
    u = torch.rand(64, k, generator=g)
    emit = torch.rand(64, generator=g)
    res = synthetic_verify(drafts[:64], p_target, rates, u, emit)
    m = res.num_accepted
    assert torch.equal(res.tokens[torch.arange(64), m], sample_from_probs(p_target[torch.arange(64), m], emit))


@pytest.fixture(scope="module")
def llama():
    t = TargetModel(build("llama", seed=6), layer_ids=[0, 2])
    return t, random_draft(t, 6).draft


@pytest.mark.parametrize("runner", ["paged", "static"])
def test_engine_at_rates_zero_and_one(llama, runner):
    """Rate 0: no draft is ever accepted, every token is the target's own (its greedy output).
    Rate 1: every step accepts all its drafts, whatever they are."""
    t, d = llama
    prompts = _prompts(4, seed=2)
    for rate in (0.0, 1.0):
        cfg = EngineConfig(
            max_running_requests=2,
            num_draft_tokens=5,
            context_length=128,
            runner=runner,
            synthetic_acceptance=(rate,),
            speculative_planner="off",
        )
        eng = LLMEngine(t, d, cfg)
        sp = SamplingParams(max_new_tokens=21, ignore_eos=rate == 1.0)
        reqs = [eng.add_request(Request(p.tolist(), sp)) for p in prompts]
        eng.run_until_done()
        for p, r in zip(prompts, reqs):
            if rate == 0.0:
                assert r.output_ids == hf_greedy(t, p, 21) and sum(r.accept_hist[1:]) == 0
            else:  # 1 token from the prefill, then 4 steps of 4 drafts + the target's token
                assert r.accept_hist == [0, 0, 0, 0, 4] and len(r.output_ids) == 21


def test_flags_are_checked():
    with pytest.raises(ValueError, match="--synthetic-acceptance"):
        EngineConfig(num_draft_tokens=5, synthetic_acceptance=(0.9, 0.8))
    with pytest.raises(ValueError, match="--synthetic-acceptance"):
        EngineConfig(num_draft_tokens=5, synthetic_acceptance=(1.5,))
    EngineConfig(num_draft_tokens=5, synthetic_acceptance=(0.9, 0.8, 0.7, 0.6))


def test_random_shape_models():
    from dflash2.benchmark.shapes import SHAPES, random_models

    assert {"llama-1b", "llama-8b"} <= set(SHAPES)
    with pytest.raises(SystemExit, match="known shapes"):
        random_models("llama-70b", "cpu", torch.float32, 5, None)
    target, draft = random_models("smollm2-135m", "cpu", torch.bfloat16, 5, None)
    cfg = draft.config
    assert cfg.hidden_size == target.config.hidden_size == 576 and cfg.vocab_size == 49152
    assert cfg.num_attention_heads == 96 and cfg.kv_lora_rank == 512  # the published architecture
    assert target.layer_ids == cfg.target_layer_ids and max(cfg.target_layer_ids) < 30
    assert next(target.model.parameters()).dtype == torch.bfloat16 and VOCAB


def test_bench_flags_refuse_misuse():
    from test_cli import run

    p = run("bench", "speed", "--target-shape", "llama-8b", check=False)
    assert p.returncode != 0 and "needs --synthetic-acceptance" in p.stderr
    p = run("bench", "speed", "--synthetic-acceptance", "1.5", check=False)
    assert p.returncode != 0 and "every rate must lie in [0, 1]" in p.stderr
    p = run("serve", "--synthetic-acceptance", "0.9", check=False)  # never on a server
    assert p.returncode != 0 and "--synthetic-acceptance" in p.stderr
