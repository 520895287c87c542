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


def test_shapes_are_the_real_models_sizes():
    """Each named shape has its real model's parameter count (built on the meta device: no memory)."""
    import transformers as tf

    from dflash2.benchmark.shapes import SHAPES, target_config

    expect = {  # parameters, as the real checkpoints have them
        "smollm2-135m": (134_515_008, "LlamaForCausalLM"),
        "llama-1b": (1_235_814_400, "LlamaForCausalLM"),
        "llama-8b": (8_030_261_248, "LlamaForCausalLM"),
        "kimi-linear-48b-a3b": (49_133_074_464, "KimiLinearForCausalLM"),
        "published-draft": (2_947_445_760, "LlamaForCausalLM"),  # a stand-in: only its drafter is real
    }
    assert set(SHAPES) == set(expect)
    for name, (params, cls) in expect.items():
        with torch.device("meta"):
            model = tf.AutoModelForCausalLM.from_config(target_config(name))
        assert type(model).__name__ == cls and sum(p.numel() for p in model.parameters()) == params, name
    cfg = target_config("kimi-linear-48b-a3b")  # the hybrid: 3 linear-attention layers to 1 MLA, 8 of 256 experts
    assert cfg.layer_types.count("full_attention") == 6 and cfg.num_experts_per_token == 8


def test_published_draft_shape_carries_the_published_drafter():
    """The stand-in shape's drafter is the published one: its parameter count and target layer ids."""
    import json

    from dflash2.benchmark.shapes import PUBLISHED_DRAFT, draft_config
    from dflash2.model import DFlash2DraftModel

    cfg = draft_config("published-draft", 5)
    raw = json.loads(PUBLISHED_DRAFT.read_text())
    assert cfg.target_layer_ids == raw["dflash_config"]["target_layer_ids"]
    with torch.device("meta"):
        draft = DFlash2DraftModel(cfg)
    assert sum(p.numel() for p in draft.parameters()) == 2_784_811_008


def test_hybrid_shape_builds_a_target_and_drafter(monkeypatch):
    """The hybrid shape's path (its config class, the drafter at its width and vocabulary, the target
    wrapped with its recurrent-state recorder), at a tiny size; the engine steps it with synthetic
    acceptance."""
    from dflash2.benchmark import shapes

    tiny = dict(config_class="KimiLinearConfig", **_KIMI_TINY)
    monkeypatch.setitem(shapes.SHAPES, "kimi-tiny", tiny)
    target, draft = shapes.random_models("kimi-tiny", "cpu", torch.float32, 5, None)
    assert type(target.model).__name__ == "KimiLinearForCausalLM"
    assert draft.config.hidden_size == 32 and draft.config.vocab_size == VOCAB
    assert target.layer_ids == draft.config.target_layer_ids and max(target.layer_ids) < 4
    eng = LLMEngine(target, draft, EngineConfig(num_draft_tokens=5, synthetic_acceptance=(0.9,), context_length=64))
    req = Request([5, 6, 7, 8], SamplingParams(max_new_tokens=12))
    eng.add_request(req)
    eng.run_until_done()
    assert req.finish_reason == "length" and len(req.output_ids) == 12 and eng.stats.drafts_proposed > 0


_KIMI_TINY = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=4, moe_intermediate_size=16, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
    v_head_dim=8, qk_nope_head_dim=8, num_experts=4, num_experts_per_token=2, num_shared_experts=1,
    linear_head_dim=8, linear_num_heads=4, first_k_dense_replace=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
)  # fmt: skip


def test_bench_flags_refuse_misuse():
    from test_cli import run

    p = run("bench", "speed", "--target-shape", "llama-8b", check=False)
    assert p.returncode != 0 and "needs --synthetic-acceptance" in p.stderr
    p = run("bench", "speed", "--synthetic-acceptance", "1.5", check=False)
    assert p.returncode != 0 and "every rate must lie in [0, 1]" in p.stderr
    p = run("serve", "--synthetic-acceptance", "0.9", check=False)  # never on a server
    assert p.returncode != 0 and "--synthetic-acceptance" in p.stderr
