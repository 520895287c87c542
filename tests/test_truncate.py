"""The sort-free truncation kernel (kernels/truncate.py) against the sort-based reference, under
Triton's interpreter on the CPU, and the static runner sampling through it."""

import pytest
import torch

from targets import build
from test_engine import _run
from test_speculative import random_draft
from dflash2.kernels.live_attention import use_triton
from dflash2.kernels.truncate import truncate
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
def test_static_runner_samples_through_the_kernel():
    """Same seeds: the static runner with --sampler-backend triton gives the sort's tokens (sampled
    rows at T=1, top-p 0.9)."""
    t = TargetModel(build("llama", seed=12), layer_ids=[0, 2])
    d = random_draft(t, 12).draft
    from test_engine import _prompts

    prompts = _prompts(3, seed=6)
    kw = dict(sampled=True, max_new=(9, 6, 7), max_running=2, block=True)
    _, ref = _run(t, d, prompts, "static", **kw)
    _, got = _run(t, d, prompts, "static", sampler_backend="triton", **kw)
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]


def test_backend_is_checked():
    from dflash2.engine.engine import EngineConfig, LLMEngine

    with pytest.raises(ValueError, match="--sampler-backend must be"):
        EngineConfig(sampler_backend="flashinfer")
    t = TargetModel(build("deepseek_v3"), layer_ids=[0, 2])
    with pytest.raises(ValueError, match="static-slot runner's graphs only"):
        LLMEngine(t, None, EngineConfig(speculative=False, sampler_backend="triton", context_length=64))
