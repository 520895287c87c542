"""End-to-end speculative decoding against tiny random transformers targets."""

import os
import warnings

import pytest
import torch
from scipy.stats import chisquare

from conftest import tiny_config
from targets import ARCHS, VOCAB, OracleProposer, build, sharp_v8_llama
from dflash2.engine import DFlashProposer, speculative_generate
from dflash2.model import DFlash2DraftModel
from dflash2.target import TargetModel
from dflash2.verification import SamplingParams, probs_from_logits

warnings.filterwarnings("ignore")


def random_draft(target: TargetModel, seed=0):
    torch.manual_seed(seed)
    cfg = tiny_config(
        hidden_size=target.config.hidden_size,
        vocab_size=VOCAB,
        mask_token_id=VOCAB - 1,
        target_layer_ids=[0, 2],
        num_target_layers=target.num_layers,
    )
    return DFlashProposer(DFlash2DraftModel(cfg).init_weights(std=0.2), target.embed, target.lm_head_weight)


@pytest.fixture(scope="module", params=ARCHS)
def target(request):
    return TargetModel(build(request.param), layer_ids=[0, 2])


def hf_greedy(target, prompt, n):
    out = target.model.generate(prompt[None], max_new_tokens=n, do_sample=False)
    return out[0, prompt.numel() :].tolist()


@pytest.mark.parametrize("width", [5, 8])
def test_greedy_equals_target(target, width):
    g = torch.Generator().manual_seed(width)
    for k in range(3):
        prompt = torch.randint(3, VOCAB, (int(torch.randint(3, 12, (), generator=g)),), generator=g)
        ref = hf_greedy(target, prompt, 24)
        sp = SamplingParams(max_new_tokens=24)
        for method in ("greedy", "token", "block"):
            for proposer in (OracleProposer(ref, len(prompt), seed=k), random_draft(target, k)):
                r = speculative_generate(target, proposer, prompt, sp, width=width, verify_method=method)
                assert r.token_ids == ref, (method, type(proposer).__name__)
                assert r.completion_tokens == len(ref)
                assert sum(r.accept_hist) == r.verify_steps
        # the oracle exercised full blocks and partial blocks
        r = speculative_generate(target, OracleProposer(ref, len(prompt), seed=k), prompt, sp, width=width)
    assert r.verify_steps < r.completion_tokens


def test_proposer_q_draft_by_temperature():
    """T=0: no q (the loop rebuilds a one-hot); T>0: the selector's sampled distribution, so a
    sampled request never gets the greedy shortcut (it would stay lossless but accept less)."""
    t = TargetModel(build("llama", seed=3), layer_ids=[0, 2])
    prop = random_draft(t, 2)
    prompt = torch.randint(3, VOCAB, (9,), generator=torch.Generator().manual_seed(0))
    _, feats = t.forward(t.new_state(), prompt)
    prop.begin(feats)
    u = torch.rand(4, generator=torch.Generator().manual_seed(1))
    toks, q = prop.propose(int(prompt[-1]), 9, 4, SamplingParams(), u)
    assert q is None and toks.shape == (4,)
    toks, cq = prop.propose(int(prompt[-1]), 9, 4, SamplingParams(temperature=1.0), u)
    q = cq.dense(VOCAB)
    assert q.shape == (4, VOCAB) and cq.ids.shape == cq.probs.shape == (4, prop.draft.candidate_selector.top_k)
    torch.testing.assert_close(q.sum(-1), torch.ones(4))
    assert (q > 0).sum(-1).min() > 1  # a spread distribution, not a one-hot
    assert (q[torch.arange(4), toks] > 0).all()


def test_plain_baseline_equals_target(target):
    prompt = torch.randint(3, VOCAB, (6,))
    ref = hf_greedy(target, prompt, 20)
    r = speculative_generate(target, None, prompt, SamplingParams(max_new_tokens=20), width=1)
    assert r.token_ids == ref and r.verify_steps == len(ref) - 1


def test_full_block_and_rollback_exercised():
    t = TargetModel(build("llama"), layer_ids=[0, 2])
    prompt = torch.randint(3, VOCAB, (5,))
    ref = hf_greedy(t, prompt, 40)
    r = speculative_generate(
        t, OracleProposer(ref, 5, error_rate=0.1), prompt, SamplingParams(max_new_tokens=40, ignore_eos=True), width=5
    )
    assert r.token_ids[: len(ref)] == ref
    assert r.accept_hist[4] > 0 and sum(r.accept_hist[:4]) > 0


@pytest.mark.parametrize("per_position", [True, False], ids=["per-position", "snapshot-replay"])
def test_hybrid_rollback_matches_fresh_target(per_position):
    """After a mid-block rejection, the next step equals a fresh target fed the committed tokens."""
    model = build("kimi_linear")
    t = TargetModel(model, layer_ids=[0, 2])
    assert t.is_hybrid and t.per_position_states
    t.per_position_states = per_position
    ids = torch.randint(3, VOCAB, (40,))
    with torch.no_grad():
        full = model(ids[None]).logits[0]
    state = t.new_state()
    t.forward(state, ids[:7])
    t.commit(state, 7)
    pos = 7
    for keep in [1, 5, 2, 3, 1, 4]:
        block = ids[pos : pos + 5].clone()
        block[keep:] = 3  # rejected drafts differ from the truth
        logits, feats = t.forward(state, block)
        torch.testing.assert_close(logits[:keep], full[pos : pos + keep], rtol=1e-4, atol=1e-4)
        t.commit(state, keep)
        pos += keep
    logits, _ = t.forward(state, ids[pos : pos + 1])
    torch.testing.assert_close(logits[0], full[pos], rtol=1e-4, atol=1e-4)


def test_features_are_layer_outputs():
    model = build("qwen3")
    t = TargetModel(model, layer_ids=[0, 2])
    ids = torch.randint(3, VOCAB, (9,))
    logits, feats = t.forward(t.new_state(), ids)
    with torch.no_grad():
        hs = model(ids[None], output_hidden_states=True).hidden_states
    torch.testing.assert_close(feats, torch.cat([hs[1][0], hs[3][0]], -1))


def test_seeded_sampling_reproduces():
    t = TargetModel(build("llama"), layer_ids=[0, 2])
    prompt = torch.randint(3, VOCAB, (6,))
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=16, seed=1234, ignore_eos=True)
    a = speculative_generate(t, random_draft(t), prompt, sp, width=5, verify_method="block")
    b = speculative_generate(t, random_draft(t), prompt, sp, width=5, verify_method="block")
    assert a.token_ids == b.token_ids


class NoisyProposer:
    """Draws drafts from a fixed random distribution (dense q): accepts some, rejects some."""

    def __init__(self, vocab, seed):
        self.q = torch.softmax(torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 2, -1)

    def begin(self, *a):
        pass

    def commit(self, *a):
        pass

    def propose(self, anchor, anchor_pos, num, sampling, uniforms):
        from dflash2.verification import sample_from_probs

        toks = sample_from_probs(self.q.expand(num, -1), uniforms)
        return toks, self.q.expand(num, -1).clone()


@pytest.mark.slow
@pytest.mark.parametrize("method,top_p", [("token", 1.0), ("block", 1.0), ("token", 0.8), ("block", 0.8)])
def test_sampled_first_tokens_match_target_distribution(method, top_p):
    """Temperature 1: the first two generated tokens follow the exact target distribution."""
    V = 8
    model = sharp_v8_llama(3)
    t = TargetModel(model, layer_ids=[0])
    prompt = torch.tensor([1, 2, 3])
    with torch.no_grad():
        p1 = probs_from_logits(model(prompt[None]).logits[0, -1], 1.0, top_p=top_p)
        joint = torch.zeros(V, V)
        for a in range(V):
            p2 = probs_from_logits(model(torch.cat([prompt, torch.tensor([a])])[None]).logits[0, -1], 1.0, top_p=top_p)
            joint[a] = p1[a] * p2
    sp = lambda s: SamplingParams(temperature=1.0, top_p=top_p, max_new_tokens=2, seed=s, ignore_eos=True)
    n = 3000
    counts = torch.zeros(V * V)
    proposer = NoisyProposer(V, 0)
    for s in range(n):
        toks = speculative_generate(t, proposer, prompt, sp(s), width=4, verify_method=method).token_ids
        counts[toks[0] * V + toks[1]] += 1
    exp = joint.flatten() * n
    keep = exp > 5
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    ex = torch.cat([exp[keep], exp[~keep].sum()[None]])
    if ex[-1] == 0:
        obs, ex = obs[:-1], ex[:-1]
    assert chisquare(obs.numpy(), ex.numpy() * obs.sum().item() / ex.sum().item()).pvalue > 1e-4


@pytest.mark.parametrize("onednn", ["1", "0"])
def test_fast_cpu_linears_keep_greedy_exact(onednn, monkeypatch):
    monkeypatch.setenv("DFLASH2_ONEDNN", onednn)  # the packed path, and the fallback without oneDNN
    monkeypatch.delenv("TRANSFORMERS_SDPA_FORCE_GQA", raising=False)
    model = build("llama", seed=5)  # 4 query heads over 2 K/V heads: the masked GQA path runs
    t = TargetModel(model, layer_ids=[0, 2])
    assert t.use_fast_cpu_kernels() > 0
    assert os.environ["TRANSFORMERS_SDPA_FORCE_GQA"] == "1"
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        prompt = torch.randint(3, VOCAB, (7,), generator=g)
        with torch.no_grad():
            ref = model.generate(prompt[None], max_new_tokens=24, do_sample=False)[0, 7:].tolist()
        for w in (5, 8):
            r = speculative_generate(t, OracleProposer(ref, 7), prompt, SamplingParams(max_new_tokens=24), width=w)
            assert r.token_ids == ref


def test_fast_cpu_matmul_matches_linear_and_is_contiguous():
    """The CPU fp32 path for 2-64 rows equals ``F.linear`` and hands back contiguous rows: a
    transposed view sent every verify-pass attention call to the slow math SDPA kernel."""
    from dflash2.model.draft import lm_head_matmul

    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 48, generator=g)
    for shape in ((1, 48), (8, 48), (1, 8, 48), (2, 5, 48), (65, 48)):
        x = torch.randn(*shape, generator=g)
        out = lm_head_matmul(x, w)
        assert out.shape == (*shape[:-1], 300) and out.is_contiguous()
        torch.testing.assert_close(out, torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5)


def test_packed_cpu_linear_matches_linear():
    """oneDNN-packed weights compute ``F.linear`` at every row count, follow an in-place weight
    update (repack on ``_version``), and leave autograd to ``F.linear``."""
    from dflash2.model.cpu_linear import PackedWeight, onednn_available, pack_linears

    if not onednn_available():
        pytest.skip("this torch build has no oneDNN linear")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 48, generator=g)
    packed = PackedWeight(w)
    for shape in ((1, 48), (5, 48), (8, 48), (2, 5, 48), (130, 48)):
        x = torch.randn(*shape, generator=g)
        out = packed(x)
        assert out.shape == (*shape[:-1], 300) and out.is_contiguous()
        torch.testing.assert_close(out, torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        w.mul_(-2.0)  # e.g. an optimizer step or load_state_dict after packing
    x = torch.randn(8, 48, generator=g)
    torch.testing.assert_close(packed(x), torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5)
    lin = torch.nn.Linear(48, 16, bias=False)
    assert pack_linears(torch.nn.Sequential(lin)) == 1
    x = torch.randn(4, 48, generator=g)
    lin(x).sum().backward()  # grad enabled + trainable weight: PyTorch's path, gradients flow
    torch.testing.assert_close(lin.weight.grad, x.sum(0).expand(16, 48).contiguous())


def test_packed_draft_keeps_logits():
    """A draft with packed Linears and token map gives the same block logits as without."""
    from dflash2.model.context_cache import DraftContextCache, draft_block

    cfg = tiny_config()
    draft = DFlash2DraftModel(cfg).init_weights(generator=torch.Generator().manual_seed(3)).eval()
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    draft.set_token_map(torch.arange(0, cfg.vocab_size, 2), head.weight)
    feats = torch.randn(1, 9, cfg.fc_in_features)
    with torch.no_grad():
        draft.candidate_selector.successor_codebook.normal_(0, 0.1)

    def run():
        cache = DraftContextCache(draft)
        cache.append(draft, feats[0], 0)
        return draft_block(
            draft, [cache], torch.tensor([5]), torch.tensor([9]), cfg.block_size, embed, head.weight
        ).logits

    with torch.no_grad():
        ref = run()
        assert draft.pack_cpu_linears() > 0
        draft.set_token_map(torch.arange(0, cfg.vocab_size, 2), head.weight)
        torch.testing.assert_close(run(), ref, rtol=1e-4, atol=1e-4)


def test_int8_cpu_linear_is_close_and_follows_updates():
    """w8a8_int8 weights approximate ``F.linear`` (per-channel int8, dynamic activations), repack
    after an in-place update, and leave autograd to ``F.linear``."""
    from dflash2.model.cpu_linear import Int8Weight, int8_available, packed_or_none

    if not int8_available():
        pytest.skip("this torch build has no fbgemm/x86 quantized engine")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 64, generator=g)
    q = Int8Weight(w)
    for shape in ((1, 64), (5, 64), (2, 8, 64)):
        x = torch.randn(*shape, generator=g)
        ref = torch.nn.functional.linear(x, w)
        out = q(x)
        assert out.shape == ref.shape
        err = (out - ref).norm() / ref.norm()
        assert 0 < err < 0.03, err  # quantised (not exact), but close
    with torch.no_grad():
        w.mul_(-2.0)
    x = torch.randn(4, 64, generator=g)
    ref = torch.nn.functional.linear(x, w)
    assert (q(x) - ref).norm() / ref.norm() < 0.03
    wt = torch.randn(8, 64, requires_grad=True)
    x = torch.randn(3, 64)
    Int8Weight(wt)(x).sum().backward()  # trainable weight: exact F.linear, gradients flow
    torch.testing.assert_close(wt.grad, x.sum(0).expand(8, 64).contiguous())
    with pytest.raises(ValueError, match="unknown quantization"):
        packed_or_none(w, "int3")


def test_int8_draft_stays_lossless_and_keeps_fc_exact():
    """The w8a8_int8 drafter: layers and head rows quantised (logits move a little), ``fc`` left in
    fp32 (its input has outlier channels), and greedy decoding still equals the target's."""
    from dflash2.model.cpu_linear import Int8Weight, int8_available

    if not int8_available():
        pytest.skip("this torch build has no fbgemm/x86 quantized engine")
    t = TargetModel(build("llama", seed=5), layer_ids=[0, 2])
    prop = random_draft(t, 1)
    draft = prop.draft.eval()
    draft.set_token_map(torch.arange(0, VOCAB, 2), t.lm_head_weight)
    with pytest.raises(ValueError, match="unknown draft quantization"):
        draft.pack_cpu_linears("fp4")
    feats = torch.randn(3, draft.config.fc_in_features)
    with torch.no_grad():
        fc_ref = torch.nn.functional.linear(feats, draft.fc.weight)
        x = torch.randn(5, draft.config.hidden_size)
        up_ref = torch.nn.functional.linear(x, draft.layers[0].mlp.up_proj.weight)
        assert draft.pack_cpu_linears("w8a8_int8") > 0
        assert isinstance(draft._token_map[3], Int8Weight)
        torch.testing.assert_close(draft.fc(feats), fc_ref, rtol=1e-5, atol=1e-5)
        up = draft.layers[0].mlp.up_proj(x)
        assert 0 < (up - up_ref).norm() / up_ref.norm() < 0.03
    g = torch.Generator().manual_seed(2)
    for _ in range(2):
        prompt = torch.randint(3, VOCAB, (8,), generator=g)
        ref = hf_greedy(t, prompt, 20)
        for method in ("greedy", "block"):
            r = speculative_generate(t, prop, prompt, SamplingParams(max_new_tokens=20), width=5, verify_method=method)
            assert r.token_ids == ref


def test_kda_per_position_states_match_reference():
    """The recording kernel equals transformers' own recurrent KDA, and its state after i tokens
    equals the reference run on the first i tokens."""
    from transformers.models.kimi_linear import modeling_kimi_linear as mk
    from dflash2.target.recurrent import kda_states

    ref = getattr(mk.recurrent_kimi_delta_attention, "_dflash2_original", mk.recurrent_kimi_delta_attention)
    torch.manual_seed(0)
    B, L, H, dk, dv = 2, 6, 3, 4, 5
    q, k = torch.randn(B, L, H, dk), torch.randn(B, L, H, dk)
    v, g = torch.randn(B, L, H, dv), -torch.rand(B, L, H, dk)
    beta, s0 = torch.rand(B, L, H), torch.randn(B, H, dk, dv)
    out, states = kda_states(q, k, v, g, beta, s0, use_qk_l2norm_in_kernel=True)
    ref_out, ref_final = ref(
        q, k, v, g=g, beta=beta, initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(states[-1], ref_final)
    torch.testing.assert_close(states[0], s0)
    for i in range(1, L):
        _, s_i = ref(
            q[:, :i],
            k[:, :i],
            v[:, :i],
            g=g[:, :i],
            beta=beta[:, :i],
            initial_state=s0,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        torch.testing.assert_close(states[i], s_i)


def test_hybrid_rollback_uses_per_position_states():
    """KimiLinear rolls back from the recorded per-position states (no replay forward)."""
    model = build("kimi_linear")
    t = TargetModel(model, layer_ids=[0, 2])
    assert t.per_position_states
    calls = []
    model.register_forward_pre_hook(lambda m, a, kw: calls.append(1), with_kwargs=True)
    state = t.new_state()
    ids = torch.randint(3, VOCAB, (12,))
    t.forward(state, ids[:7])
    t.commit(state, 7)
    t.forward(state, ids[7:12])
    assert state.positions is not None and len(state.positions.states) == 2  # both linear layers recorded
    t.commit(state, 2)
    assert len(calls) == 2 and state.length == 9
