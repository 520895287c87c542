"""The live-KV attention (kernels/live_attention.py): the torch reference against a plain per-row
softmax, the Triton kernel (under Triton's interpreter on the CPU) against the reference, and the
static forward and the serving engine through the kernel: greedy output equals the target's."""

import math
import os

import pytest
import torch

from targets import VOCAB, build
from test_engine import _prompts, _run
from test_speculative import hf_greedy, random_draft
from dflash2.kernels.live_attention import live_attention, live_attention_ref, use_triton
from dflash2.target import TargetModel
from dflash2.target.static_llama import StaticTarget

triton = pytest.importorskip("triton")
needs_interpreter = pytest.mark.skipif(
    not use_triton(torch.device("cpu")), reason="the kernel runs on the CPU only under TRITON_INTERPRET=1"
)


def paged_case(B, H, KV, L, d, page, pages_per_row, starts, dtype=torch.float32, seed=0):
    """Random queries and a pool of pages in shuffled order (plus one page nobody owns)."""
    g = torch.Generator().manual_seed(seed)
    n_pages = B * pages_per_row + 1
    k = torch.randn(n_pages, KV, page, d, generator=g).to(dtype)
    v = torch.randn(n_pages, KV, page, d, generator=g).to(dtype)
    table = torch.randperm(n_pages, generator=g)[: B * pages_per_row].view(B, pages_per_row).int()
    q = torch.randn(B, H, L, d, generator=g).to(dtype)
    return q, k, v, table, torch.tensor(starts)


def naive(q, k, v, table, start, scale):
    """Row by row, head by head: keys 0 .. position through the table, softmax, weighted values."""
    B, H, L, d = q.shape
    KV, P = k.shape[1], k.shape[2]
    out = torch.zeros(B, H, L, d, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            kvh = h // (H // KV)
            for i in range(L):
                n = int(start[b]) + i + 1
                keys = torch.stack([k[table[b, j // P], kvh, j % P] for j in range(n)]).double()
                vals = torch.stack([v[table[b, j // P], kvh, j % P] for j in range(n)]).double()
                w = torch.softmax(keys @ q[b, h, i].double() * scale, 0)
                out[b, h, i] = w @ vals
    return out


def test_reference_matches_naive():
    q, k, v, table, start = paged_case(3, 6, 2, 4, 8, 4, 5, [0, 7, 15])
    ref = live_attention_ref(q, k, v, table, start, 0.3)
    assert (ref.double() - naive(q, k, v, table, start, 0.3)).abs().max() < 1e-5
    # kv_len bounds what is gathered; the result is the same while every query lies below it
    assert torch.equal(live_attention_ref(q, k, v, table, start, 0.3, kv_len=20), ref)


@needs_interpreter
@pytest.mark.parametrize(
    "B,H,KV,L,d,page,pages,starts",
    [
        (2, 9, 3, 5, 64, 64, 4, [10, 190]),  # SmolLM2's heads, a 5-token verify
        (3, 4, 2, 1, 16, 128, 2, [0, 63, 200]),  # decode, a row at position 0 and one at a tile's edge
        (1, 8, 2, 8, 32, 64, 3, [120]),  # a width-8 block across a page boundary
        (2, 4, 4, 3, 16, 64, 2, [64, 5]),  # no grouping (KV = H)
        (2, 4, 2, 2, 8, 64, 2, [7, 70]),  # head dims off the power-of-two grid: padded, masked lanes
        (1, 6, 2, 3, 80, 64, 2, [90]),
    ],
)
@pytest.mark.parametrize("splits", [1, 3, 7])
def test_kernel_matches_reference(B, H, KV, L, d, page, pages, starts, splits):
    q, k, v, table, start = paged_case(B, H, KV, L, d, page, pages, starts, seed=splits)
    scale = 1 / math.sqrt(d)
    ref = live_attention_ref(q, k, v, table, start, scale)
    out = live_attention(q, k, v, table, start, scale, num_splits=splits)
    assert out.shape == ref.shape and (out - ref).abs().max() < 1e-5


@needs_interpreter
def test_kernel_ignores_stale_and_unowned_keys():
    """Keys past each row's position (a rejected block's rows) and pages outside the row's table
    change nothing: NaN there would poison any read of them."""
    q, k, v, table, start = paged_case(2, 4, 2, 5, 16, 64, 2, [20, 70], seed=3)
    ref = live_attention(q, k, v, table, start, 0.25, num_splits=2)
    k2, v2 = k.clone(), v.clone()
    for b in range(2):
        last = int(start[b]) + 5
        for j in range(last, 128):
            k2[table[b, j // 64], :, j % 64] = float("nan")
            v2[table[b, j // 64], :, j % 64] = float("nan")
    spare = sorted(set(range(k.shape[0])) - set(table.flatten().tolist()))
    k2[spare], v2[spare] = float("nan"), float("nan")
    assert torch.equal(live_attention(q, k2, v2, table, start, 0.25, num_splits=2), ref)


def test_kernel_refuses_shapes_it_cannot_tile():
    if not use_triton(torch.device("cpu")):
        pytest.skip("kernel not runnable here")
    q, k, v, table, start = paged_case(1, 2, 1, 1, 16, 48, 2, [3])
    with pytest.raises(ValueError, match="page size 48"):
        live_attention(q, k, v, table, start, 0.25)


@needs_interpreter
@pytest.mark.parametrize("arch", ["llama_hd16", "llama"])  # head dims 16 and 8 (padded lanes)
def test_static_forward_live_matches_hf(arch):
    t = TargetModel(build(arch), layer_ids=[0, 2])
    assert StaticTarget(t, 64, attention="live").check(length=20) < 1e-4


@needs_interpreter
@pytest.mark.parametrize("sampled", [False, True])
def test_engine_through_the_kernel(sampled):
    """The static runner with --attention-backend triton: greedy rows are the target's own greedy
    output; sampled rows (same seeds) equal the masked-SDPA runner's, token for token."""
    t = TargetModel(build("llama_hd16", seed=4), layer_ids=[0, 2])
    d = random_draft(t, 4).draft
    prompts = _prompts(4, seed=5)
    kw = dict(max_new=(9, 4, 6), sampled=sampled, max_running=2)
    eng, live = _run(t, d, prompts, "static", attention_backend="triton", **kw)
    assert eng.runner.static.attention == "live"
    _, sdpa = _run(t, d, prompts, "static", attention_backend="torch_native", **kw)
    assert [r.output_ids for r in live] == [r.output_ids for r in sdpa]
    if not sampled:
        for p, r in zip(prompts, live):
            assert r.output_ids == hf_greedy(t, p, r.sampling.max_new_tokens)


def test_backend_flag_is_checked():
    from dflash2.engine.engine import EngineConfig, LLMEngine

    with pytest.raises(ValueError, match="--attention-backend must be one of"):
        EngineConfig(attention_backend="flashinfer")
    t = TargetModel(build("deepseek_v3"), layer_ids=[0, 2])
    with pytest.raises(ValueError, match="static-slot runner only"):
        LLMEngine(t, None, EngineConfig(speculative=False, attention_backend="triton", context_length=64))
    if os.environ.get("TRITON_INTERPRET") != "1":
        lt = TargetModel(build("llama_hd16"), layer_ids=[0, 2])
        with pytest.raises(ValueError, match="Triton cannot run"):
            LLMEngine(lt, None, EngineConfig(speculative=False, attention_backend="triton", runner="static"))
    assert VOCAB
