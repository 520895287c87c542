"""The static-buffer decoder (CUDA-graph path) run eagerly on the CPU: same tokens as the
dynamic loop and as the target alone."""
import warnings

import pytest
import torch

from targets import VOCAB, build
from test_speculative import hf_greedy, random_draft
from dflash2.engine import speculative_generate
from dflash2.engine.static_decode import StaticDecoder
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
        assert (row - ref[n - 4:n]).abs().max() < 1e-4


def test_static_forward_refuses_other_layouts():
    t = TargetModel(build("deepseek_v3"), layer_ids=[0, 2])
    assert "deepseek_v3" in unsupported_reason(t)
    with pytest.raises(ValueError, match="static forward does not support"):
        StaticTarget(t, 64)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("width", [4, 8])
def test_static_greedy_equals_dynamic_loop_and_target(arch, width):
    t = TargetModel(build(arch, seed=width), layer_ids=[0, 2])
    prop = random_draft(t, width)
    dec = StaticDecoder(t, prop.draft, width=width, max_len=96, cuda_graph=False)
    plain = StaticDecoder(t, None, max_len=96, cuda_graph=False)
    g = torch.Generator().manual_seed(width)
    for k in range(3):
        prompt = torch.randint(3, VOCAB, (int(torch.randint(3, 12, (), generator=g)),), generator=g)
        sp = SamplingParams(max_new_tokens=40)
        ref = hf_greedy(t, prompt, 40)
        dyn = speculative_generate(t, prop, prompt, sp, width=width)
        r = dec.generate(prompt, sp)
        assert r.token_ids == ref == dyn.token_ids
        assert r.accept_hist == dyn.accept_hist  # same drafts, same acceptances, step for step
        assert plain.generate(prompt, sp).token_ids == ref


@pytest.mark.parametrize("method", ["token", "block"])
def test_static_sampled_equals_dynamic_loop(method):
    """Same seed, same uniforms in the same order: the sampled tokens are the dynamic loop's."""
    t = TargetModel(build("llama", seed=5), layer_ids=[0, 2])
    prop = random_draft(t, 1)
    dec = StaticDecoder(t, prop.draft, width=5, max_len=96, cuda_graph=False)
    plain = StaticDecoder(t, None, max_len=96, cuda_graph=False)
    for k in range(3):
        prompt = torch.randint(3, VOCAB, (7,), generator=torch.Generator().manual_seed(k))
        sp = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=40, seed=k, ignore_eos=True)
        dyn = speculative_generate(t, prop, prompt, sp, width=5, verify_method=method)
        r = dec.generate(prompt, sp, verify_method=method)
        assert r.token_ids == dyn.token_ids and r.accept_hist == dyn.accept_hist
        base = speculative_generate(t, None, prompt, sp, width=1)
        assert plain.generate(prompt, sp).token_ids == base.token_ids


def test_static_decoder_refuses_too_long():
    t = TargetModel(build("llama"), layer_ids=[0, 2])
    dec = StaticDecoder(t, None, max_len=32, cuda_graph=False)
    with pytest.raises(ValueError, match="max_len 32"):
        dec.generate(torch.arange(3, 23), SamplingParams(max_new_tokens=16))


class _OracleStatic(StaticDecoder):
    """The real draft forward and selector walk, with slot t's top candidate replaced by the
    target's own continuation (wrong at a quarter of the positions): full blocks, partial
    blocks and rollbacks all happen, which a random draft almost never gives."""

    def set_oracle(self, prompt_len, continuation, seed):
        g = torch.Generator().manual_seed(seed)
        seq = torch.zeros(self.max_len, dtype=torch.long)
        cont = torch.tensor(continuation)
        wrong = torch.rand(len(cont), generator=g) < 0.25
        seq[prompt_len:prompt_len + len(cont)] = torch.where(wrong, (cont + 1) % VOCAB, cont)
        self.oracle = seq

    def _draft_forward(self):
        super()._draft_forward()
        want = self.oracle[self.apos + 1 + self.ar[:self.w - 1]]       # the token at each slot's position
        self.cand[0, :, 0] = want
        self.U[0, :, 0] = self.U[0].max() + 10.0


@pytest.mark.parametrize("width", [4, 8])
def test_static_greedy_with_long_acceptances(width):
    t = TargetModel(build("llama", seed=1), layer_ids=[0, 2])
    dec = _OracleStatic(t, random_draft(t, 0).draft, width=width, max_len=128, cuda_graph=False)
    hist = [0] * width
    for k in range(4):
        prompt = torch.randint(3, VOCAB, (5 + k,), generator=torch.Generator().manual_seed(k))
        sp = SamplingParams(max_new_tokens=60, ignore_eos=True)
        ref = speculative_generate(t, None, prompt, sp, width=1).token_ids
        dec.set_oracle(len(prompt), ref, k)
        r = dec.generate(prompt, sp)
        assert r.token_ids == ref
        hist = [a + b for a, b in zip(hist, r.accept_hist)]
    assert hist[0] and hist[-1] and sum(hist[2:-1])  # rejections, full blocks and partial blocks


def test_capturable_probs_equal_default_path():
    """The graph-safe filtering (full sort, no host reads) gives the default path's rows, including
    flat rows whose top-p set reaches past the top-1024 shortcut."""
    from dflash2.verification import probs_from_logits
    torch.manual_seed(0)
    logits = torch.randn(6, 3000) * torch.tensor([0.1, 1.0, 3.0, 0.01, 5.0, 1.0])[:, None]
    for temp, k, top_p, min_p in [(1.0, -1, 0.95, 0.0), (0.7, 50, 1.0, 0.0), (1.3, -1, 1.0, 0.1),
                                  (1.0, -1, 1.0, 0.0), (0.0, -1, 0.9, 0.0), (1.0, 2000, 0.99, 0.0)]:
        ref = probs_from_logits(logits, temp, k, top_p, min_p)
        torch.testing.assert_close(probs_from_logits(logits, temp, k, top_p, min_p, capturable=True), ref)
    # per-row tensors (the serving engine's graphs): every row as the default path gives it
    temp = torch.tensor([1.0, 0.7, 0.0, 1.3, 1.0, 1.0])
    k = torch.tensor([-1, 50, -1, -1, 2000, -1])
    top_p, min_p = torch.tensor([0.95, 1.0, 0.9, 1.0, 0.99, 1.0]), torch.tensor([0.0, 0.0, 0.0, 0.1, 0.0, 0.0])
    torch.testing.assert_close(probs_from_logits(logits, temp, k, top_p, min_p, capturable=True),
                               probs_from_logits(logits, temp, k, top_p, min_p))
    # top_p 1 drops nothing, even where the cumulative sum rounds past 1 in a row's tail
    flat = torch.zeros(1, 3000)
    assert (probs_from_logits(flat, 1.0, torch.tensor([-1]), torch.tensor([1.0]), capturable=True) > 0).all()


def test_static_decoder_only_on_cuda():
    """The CLI's choice: None (the eager loop) on the CPU or when disabled."""
    from dflash2.engine.static_decode import maybe_static_decoder
    t = TargetModel(build("llama"), layer_ids=[0, 2])
    assert maybe_static_decoder(t, None, 1) is None
    assert maybe_static_decoder(t, None, 1, disable_cuda_graph=True) is None
