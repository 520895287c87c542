"""The sort-free truncation kernel (kernels/truncate.py) against the sort-based reference, under
Triton's interpreter on the CPU, and the static runner sampling through it."""

import pytest
import torch

from targets import build
from test_engine import _run
from test_speculative import random_draft
from dflash2.kernels.live_attention import use_triton
from dflash2.kernels.truncate import fused_probs, truncate
from dflash2.sampling import GREEDY_BELOW, probs_from_logits
from dflash2.sampling import truncate_sorted as truncate_ref
from dflash2.target import TargetModel

needs_interpreter = pytest.mark.skipif(
    not use_triton(torch.device("cpu")), reason="the kernel runs on the CPU only under TRITON_INTERPRET=1"
)


@needs_interpreter
def test_kernel_keeps_what_the_sort_keeps():
    """Rows from peaked to flat, bf16-rounded logits (many exact ties, also at the boundary), every
    mix of top-k (off, 1, inside, the whole vocabulary), top-p and min-p: the same entries kept."""
    g = torch.Generator().manual_seed(0)
    R, V = 24, 3000
    logits = (torch.randn(R, V, generator=g) * torch.linspace(0.3, 6, R)[:, None]).to(torch.bfloat16).float()
    probs = torch.softmax(logits, -1)
    k = torch.tensor([-1, 0, 1, 5, 50, 3000, 2999, 7] * 3)[:, None]
    tp = torch.tensor([0.95, 0.5, 1.0, 0.9, 0.99, 0.3, 0.8, 1.0] * 3)[:, None]
    mp = torch.tensor([0.0, 0.0, 0.05, 0.0, 0.0, 0.1, 0.0, 0.2] * 3)[:, None]
    out, ref = truncate(probs, k, tp, mp), truncate_ref(probs, k, tp, mp)
    assert torch.equal(out, ref)
    # a row of exact ties: top-k keeps the lowest ids, top-p as many as its mass allows
    flat = torch.full((2, 64), 1 / 64)
    out = truncate(flat, torch.tensor([[5], [-1]]), torch.tensor([[1.0], [0.25]]), torch.zeros(2, 1))
    assert torch.equal(
        out, truncate_ref(flat, torch.tensor([[5], [-1]]), torch.tensor([[1.0], [0.25]]), torch.zeros(2, 1))
    )
    assert out[0, :5].gt(0).all() and out[0, 5:].eq(0).all() and int(out[1].gt(0).sum()) == 17


@needs_interpreter
@pytest.mark.parametrize("dtype,shrink", [(torch.bfloat16, True), (torch.float32, True), (torch.bfloat16, False)])
def test_fused_kernel_equals_the_unfused_path(dtype, shrink):
    """fused_probs (temperature, softmax, truncation, renormalisation, greedy rows in one kernel) against
    probs_from_logits' graph path through the truncation kernel and through the sort: the same entries
    kept, the same probabilities to float32 rounding; greedy rows one-hot at the first argmax (an exact
    tie at the top included); -inf logits (suppressed stop ids) get nothing. ``shrink``: the threshold
    search over the entries left in its bracket (a wrong count or mass carried for those that left it
    moves the threshold and fails the kept sets); else over the whole row."""
    g = torch.Generator().manual_seed(1)
    R, V = 16, 3000  # the interpreter takes time per row: each (top-k, top-p, min-p, T) setting at two scales
    logits = (torch.randn(R, V, generator=g) * torch.linspace(0.3, 6, R)[:, None]).to(torch.bfloat16).to(dtype)
    logits[2, [700, 900, 2000]] = logits[2].max() + 1  # a tie at the top of a greedy row: the lowest id wins
    logits[5, :50] = float("-inf")
    k = torch.tensor([-1, 0, 1, 5, 50, 3000, 2999, 7] * 2)
    tp = torch.tensor([0.95, 0.5, 1.0, 0.9, 0.99, 0.3, 0.8, 1.0] * 2)
    mp = torch.tensor([0.0, 0.0, 0.05, 0.0, 0.0, 0.1, 0.0, 0.2] * 2)
    T = torch.tensor([1.0, 0.7, 0.0, 1.3] * 4)
    # 512 entries a load: the softmax's running sums, the argmax and the tie rank carried across blocks
    got = fused_probs(logits, T[:, None], k[:, None], tp[:, None], mp[:, None], GREEDY_BELOW, block=512, shrink=shrink)
    for kernel in ("truncate", None):
        ref = probs_from_logits(logits, T, k, tp, mp, capturable=True, kernel=kernel)
        assert torch.equal(got > 0, ref > 0)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-7)
    assert got[2, 700] == 1 and got[2].sum() == 1
    assert (got[T == 0].gt(0).sum(-1) == 1).all() and (got[5, :50] == 0).all()
    torch.testing.assert_close(got.sum(-1), torch.ones(R))
    # nothing to truncate (top-k off, top-p 1, min-p 0): the softmax of logits / T
    off = (torch.full((R, 1), -1), torch.ones(R, 1), torch.zeros(R, 1))
    none = fused_probs(logits, T[:, None], *off, GREEDY_BELOW, block=512, shrink=shrink)
    want = probs_from_logits(logits, T, -1, 1.0, 0.0, capturable=True, kernel="truncate")
    torch.testing.assert_close(none, want, rtol=1e-5, atol=1e-7)


@needs_interpreter
@pytest.mark.parametrize("backend", ["triton", "triton-fused"])
def test_static_runner_samples_through_the_kernel(backend):
    """Same seeds: the static runner with --sampler-backend triton (or triton-fused) gives the sort's
    tokens (sampled rows at T=1, top-p 0.9; the first tokens and every verify)."""
    t = TargetModel(build("llama", seed=12), layer_ids=[0, 2])
    d = random_draft(t, 12).draft
    from test_engine import _prompts

    prompts = _prompts(3, seed=6)
    kw = dict(sampled=True, max_new=(9, 6, 7), max_running=2, block=True)
    _, ref = _run(t, d, prompts, "static", **kw)
    _, got = _run(t, d, prompts, "static", sampler_backend=backend, **kw)
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]


def test_backend_is_checked():
    from dflash2.engine.engine import EngineConfig, LLMEngine

    with pytest.raises(ValueError, match="--sampler-backend must be"):
        EngineConfig(sampler_backend="flashinfer")
    t = TargetModel(build("deepseek_v3"), layer_ids=[0, 2])
    for backend in ("triton", "triton-fused"):
        with pytest.raises(ValueError, match=f"{backend}: the kernel serves the static-slot runner's graphs only"):
            LLMEngine(t, None, EngineConfig(speculative=False, sampler_backend=backend, context_length=64))
