"""The static forward, and batch-1 decoding through the engine with one slot (the CUDA-graph runner,
run eagerly on the CPU): same tokens as the reference loop and as the target alone."""

import warnings

import pytest
import torch

from targets import VOCAB, build
from test_speculative import hf_greedy, random_draft
from dflash2.engine import speculative_generate
from dflash2.engine.engine import EngineConfig, LLMEngine, RequestError
from dflash2.engine.graph_runner import GraphModelRunner, cuda_graphs_apply
from dflash2.target import TargetModel
from dflash2.target.static_llama import StaticTarget, unsupported_reason
from dflash2.verification import SamplingParams

warnings.filterwarnings("ignore")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("attention", ["sdpa", "matmul"])
def test_static_forward_matches_hf_with_rollback(arch, attention):
    t = TargetModel(build(arch), layer_ids=[0, 2])
    assert StaticTarget(t, 64, attention=attention).check(length=20) < 1e-4


@pytest.mark.parametrize("attention", ["sdpa", "matmul"])
def test_static_forward_batched_slots_match_hf(attention):
    """Rows at different positions in different slots (the serving engine's layout): each row's
    logits equal HF's forward over that row's own sequence."""
    t = TargetModel(build("llama", seed=1), layer_ids=[0, 2])
    st = StaticTarget(t, 48, slots=3, attention=attention)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, VOCAB, (n,), generator=g) for n in (9, 14, 6)]
    for s, x in enumerate(seqs[:2]):  # prefill slots 1 and 2 with the first two prompts' heads
        st.forward(x[:-4], torch.zeros((), dtype=torch.long), slot=s + 1)
    st.forward(seqs[2][:2], torch.zeros((), dtype=torch.long), slot=0)
    # one batched pass over slots 0-2: 4 new tokens each, at positions 2, 5 and 10
    ids = torch.stack([seqs[2][2:6], seqs[0][-4:], seqs[1][-4:]])
    logits, _ = st.forward(ids, torch.tensor([2, 5, 10]))
    for row, x in zip(logits, [seqs[2], seqs[0], seqs[1]]):
        ref = t.model(input_ids=x[None], use_cache=False).logits[0].float()
        n = 6 if x is seqs[2] else len(x)
        assert (row - ref[n - 4 : n]).abs().max() < 1e-4


def test_static_forward_refuses_other_layouts():
    t = TargetModel(build("deepseek_v3"), layer_ids=[0, 2])
    assert "deepseek_v3" in unsupported_reason(t)
    with pytest.raises(ValueError, match="static forward does not support"):
        StaticTarget(t, 64)


def _one_slot(t, draft, width=5, block=False, context_length=96):
    """Batch-1 decoding as ``generate`` / ``run`` / ``bench speed`` do it: the engine with one slot."""
    eng = LLMEngine(
        t,
        draft,
        EngineConfig.for_models(
            t,
            draft,
            width,
            context_length=context_length,
            max_running_requests=1,
            block_verification=block,
            speculative_planner="off",
        ),
    )
    assert isinstance(eng.runner, GraphModelRunner)  # one slot on the CPU: static buffers, eager
    return eng


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("width", [4, 8])
def test_one_slot_greedy_equals_reference_loop_and_target(arch, width):
    t = TargetModel(build(arch, seed=width), layer_ids=[0, 2])
    prop = random_draft(t, width)
    dec, plain = _one_slot(t, prop.draft, width), _one_slot(t, None, 1)
    g = torch.Generator().manual_seed(width)
    for k in range(3):
        prompt = torch.randint(3, VOCAB, (int(torch.randint(3, 12, (), generator=g)),), generator=g)
        sp = SamplingParams(max_new_tokens=40)
        ref = hf_greedy(t, prompt, 40)
        dyn = speculative_generate(t, prop, prompt, sp, width=width)
        r = dec.generate([prompt.tolist()], sp)[0]
        assert r.token_ids == ref == dyn.token_ids
        assert r.accept_hist == dyn.accept_hist  # same drafts, same acceptances, step for step
        assert r.finish_reason == dyn.finish_reason and r.completion_tokens == len(ref)
        assert plain.generate([prompt.tolist()], sp)[0].token_ids == ref


@pytest.mark.parametrize("method", ["token", "block"])
def test_one_slot_sampled_equals_reference_loop(method):
    """Same seed, same uniforms in the same order: the sampled tokens are the reference loop's."""
    t = TargetModel(build("llama", seed=5), layer_ids=[0, 2])
    prop = random_draft(t, 1)
    dec, plain = _one_slot(t, prop.draft, 5, block=method == "block"), _one_slot(t, None, 1)
    for k in range(3):
        prompt = torch.randint(3, VOCAB, (7,), generator=torch.Generator().manual_seed(k))
        sp = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=40, seed=k, ignore_eos=True)
        dyn = speculative_generate(t, prop, prompt, sp, width=5, verify_method=method)
        r = dec.generate([prompt.tolist()], sp)[0]
        assert r.token_ids == dyn.token_ids and r.accept_hist == dyn.accept_hist
        base = speculative_generate(t, None, prompt, sp, width=1)
        assert plain.generate([prompt.tolist()], sp)[0].token_ids == base.token_ids


def test_one_slot_refuses_too_long():
    t = TargetModel(build("llama"), layer_ids=[0, 2])
    with pytest.raises(RequestError, match="context length is 16"):
        _one_slot(t, None, 1, context_length=16).generate([list(range(3, 23))], SamplingParams(max_new_tokens=4))


class _OracleRunner(GraphModelRunner):
    """The real draft forward and selector walk, then the drafts replaced by the target's own
    continuation (wrong at a quarter of the positions): full blocks, partial blocks and rollbacks
    all happen, which a random draft almost never gives."""

    oracle = torch.zeros(1, dtype=torch.long)

    def _draft_fn(self, B, greedy, kv_len, out):
        super()._draft_fn(B, greedy, kv_len, out)
        self.ids[:B, 1:] = self.oracle[self.start[:B, None] + 1 + self.ar[: self.w - 1]]


@pytest.mark.parametrize("width", [4, 8])
def test_one_slot_greedy_with_long_acceptances(width, monkeypatch):
    from dflash2.engine import engine as engine_mod

    monkeypatch.setattr(engine_mod, "GraphModelRunner", _OracleRunner)
    t = TargetModel(build("llama", seed=1), layer_ids=[0, 2])
    eng = LLMEngine(
        t,
        random_draft(t, 0).draft,
        EngineConfig(max_running_requests=1, num_draft_tokens=width, context_length=128, speculative_planner="off"),
    )
    hist = [0] * width
    for k in range(4):
        prompt = torch.randint(3, VOCAB, (5 + k,), generator=torch.Generator().manual_seed(k))
        sp = SamplingParams(max_new_tokens=60, ignore_eos=True)
        ref = speculative_generate(t, None, prompt, sp, width=1).token_ids
        cont = torch.tensor(ref)
        wrong = torch.rand(len(cont), generator=torch.Generator().manual_seed(k)) < 0.25
        seq = torch.zeros(eng.runner.max_len + width, dtype=torch.long)
        seq[len(prompt) : len(prompt) + len(cont)] = torch.where(wrong, (cont + 1) % VOCAB, cont)
        _OracleRunner.oracle = seq
        r = eng.generate([prompt.tolist()], sp)[0]
        assert r.token_ids == ref
        hist = [a + b for a, b in zip(hist, r.accept_hist)]
    assert hist[0] and hist[-1] and sum(hist[2:-1])  # rejections, full blocks and partial blocks


def test_capturable_probs_equal_default_path():
    """The graph-safe filtering (full sort, no host reads) gives the default path's rows, including
    flat rows whose top-p set reaches past the top-1024 shortcut."""
    from dflash2.verification import probs_from_logits

    torch.manual_seed(0)
    logits = torch.randn(6, 3000) * torch.tensor([0.1, 1.0, 3.0, 0.01, 5.0, 1.0])[:, None]
    for temp, k, top_p, min_p in [
        (1.0, -1, 0.95, 0.0),
        (0.7, 50, 1.0, 0.0),
        (1.3, -1, 1.0, 0.1),
        (1.0, -1, 1.0, 0.0),
        (0.0, -1, 0.9, 0.0),
        (1.0, 2000, 0.99, 0.0),
    ]:
        ref = probs_from_logits(logits, temp, k, top_p, min_p)
        torch.testing.assert_close(probs_from_logits(logits, temp, k, top_p, min_p, capturable=True), ref)
    # per-row tensors (the serving engine's graphs): every row as the default path gives it
    temp = torch.tensor([1.0, 0.7, 0.0, 1.3, 1.0, 1.0])
    k = torch.tensor([-1, 50, -1, -1, 2000, -1])
    top_p, min_p = torch.tensor([0.95, 1.0, 0.9, 1.0, 0.99, 1.0]), torch.tensor([0.0, 0.0, 0.0, 0.1, 0.0, 0.0])
    torch.testing.assert_close(
        probs_from_logits(logits, temp, k, top_p, min_p, capturable=True),
        probs_from_logits(logits, temp, k, top_p, min_p),
    )
    # top_p 1 drops nothing, even where the cumulative sum rounds past 1 in a row's tail
    flat = torch.zeros(1, 3000)
    assert (probs_from_logits(flat, 1.0, torch.tensor([-1]), torch.tensor([1.0]), capturable=True) > 0).all()


def test_cuda_graphs_only_on_cuda():
    t = TargetModel(build("llama"), layer_ids=[0, 2])
    assert not cuda_graphs_apply(t) and not cuda_graphs_apply(t, disable_cuda_graph=True)
