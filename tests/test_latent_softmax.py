"""The draft attention's split masked softmax (kernels/latent_softmax.py) against its plain torch form,
under Triton's interpreter on the CPU, and the attention's split path against the path it replaces."""

import pytest
import torch

from conftest import tiny_config
from dflash2.kernels.latent_softmax import latent_softmax, latent_softmax_ref
from dflash2.model import DFlash2DraftModel
from dflash2.model import attention as attention_mod
from test_mla_attention import _mask as _mla_mask
from test_mla_attention import needs_interpreter


def _mask(B: int, Lq: int, Lc: int, window: int, g: torch.Generator) -> torch.Tensor:
    return _mla_mask(B, Lq, Lc, window, g, is_causal=True)


@needs_interpreter
@pytest.mark.parametrize("B,heads,Lq,Lc", [(2, 3, 5, 40), (1, 2, 8, 70), (3, 1, 1, 17)])
def test_kernel_matches_reference(B, heads, Lq, Lc):
    g = torch.Generator().manual_seed(B * 100 + Lc)
    M = heads * Lq
    s_ctx, s_blk = torch.randn(B, M, Lc, generator=g) * 4, torch.randn(B, M, Lq, generator=g) * 4
    mask = _mask(B, Lq, Lc, Lc - 7, g)
    got = latent_softmax(s_ctx, s_blk, mask, 0.3, torch.float32)
    ref = latent_softmax_ref(s_ctx, s_blk, mask, 0.3, torch.float32)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # the rows sum to one, and the mask matters (rows that see every key give another answer)
    torch.testing.assert_close(got[0].sum(-1) + got[1].sum(-1), torch.ones(B, M))
    assert not torch.allclose(latent_softmax_ref(s_ctx, s_blk, torch.ones_like(mask), 0.3, torch.float32)[0], ref[0])
    # half-precision output: the float32 probabilities rounded once
    half = latent_softmax(s_ctx, s_blk, mask, 0.3, torch.bfloat16)
    for a, b in zip(half, ref):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.to(torch.bfloat16).float(), rtol=0, atol=2e-3)


@needs_interpreter
def test_a_row_that_sees_no_key_gets_zeros():
    g = torch.Generator().manual_seed(3)
    s_ctx, s_blk = torch.randn(1, 4, 12, generator=g), torch.randn(1, 4, 2, generator=g)
    mask = torch.ones(1, 2, 14, dtype=torch.bool)
    mask[0, 1] = False  # block row 1 (query rows 1 and 3) sees nothing
    p_ctx, p_blk = latent_softmax(s_ctx, s_blk, mask, 1.0, torch.float32)
    assert torch.equal(p_ctx[0, 1::2], torch.zeros(2, 12)) and torch.equal(p_blk[0, 1::2], torch.zeros(2, 2))
    torch.testing.assert_close(p_ctx[0, 0::2].sum(-1) + p_blk[0, 0::2].sum(-1), torch.ones(2))


@needs_interpreter
@pytest.mark.parametrize("is_causal", [True, False])
def test_draft_block_through_the_split_path(is_causal, monkeypatch):
    """The whole draft block with the split path forced on (as on CUDA without grad) equals the padded,
    concatenated torch path; so does one attention module."""
    cfg = tiny_config(kv_lora_rank=32, qk_rope_head_dim=16, sliding_window=24, is_causal=is_causal)
    model = DFlash2DraftModel(cfg).init_weights(std=0.2)
    g = torch.Generator().manual_seed(0)
    B, W, Lc = 2, 5, 30
    ctx = torch.randn(cfg.num_hidden_layers, B, Lc, cfg.kv_lora_rank + cfg.qk_rope_head_dim, generator=g)
    embeds = torch.randn(B, W, cfg.hidden_size, generator=g)
    positions = torch.arange(Lc, Lc + W).expand(B, W)
    mask = _mask(B, W, Lc, cfg.sliding_window, g)
    with torch.no_grad():
        ref = model(embeds, positions, ctx, mask, W)
        monkeypatch.setattr(attention_mod, "split_applies", lambda c: True)
        got = model(embeds, positions, ctx, mask, W)
        monkeypatch.setattr(attention_mod, "split_applies", lambda c: False)
        assert torch.equal(model(embeds, positions, ctx, mask, W), ref)  # (the switch is what changed it)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_the_split_path_is_for_serving_on_cuda_only():
    """Training (grad on) and the CPU keep the padded torch path: the kernel has no backward."""
    assert not attention_mod.split_applies(torch.empty(1, 4, 8))
    if torch.cuda.is_available():  # pragma: no cover - CI has no GPU
        x = torch.empty(1, 4, 8, device="cuda")
        assert not attention_mod.split_applies(x) and torch.no_grad()(attention_mod.split_applies)(x)
