"""The draft's fused latent attention (kernels/mla_attention.py) against its plain torch form, under
Triton's interpreter on the CPU, and through the draft's attention module against the path it replaces."""

import pytest
import torch

from conftest import tiny_config
from dflash2.kernels.mla_attention import CONFIGS, latent_attention, latent_attention_ref, use_kernel
from dflash2.model import DFlash2DraftModel, build_block_mask
from dflash2.model import attention as attention_mod

needs_interpreter = pytest.mark.skipif(
    not use_kernel(torch.empty(0)), reason="the kernel runs on the CPU only under TRITON_INTERPRET=1"
)


def _mask(B: int, Lq: int, Lc: int, window: int, g: torch.Generator) -> torch.Tensor:
    """Block rows at each row's anchor (some context rows padding, some past the window)."""
    anchors = torch.randint(Lc // 2, Lc + 1, (B,), generator=g)
    q_pos = anchors[:, None] + torch.arange(Lq)
    ctx_pos = anchors[:, None] - Lc + torch.arange(Lc)
    return build_block_mask(
        q_pos, anchors[:, None].expand(B, Lq), torch.zeros_like(q_pos), ctx_pos, ctx_pos >= 0, window, False
    )


@needs_interpreter
@pytest.mark.parametrize("config", ["small", "large"])
@pytest.mark.parametrize("B,heads,Lq,Lc,rank,rope", [(2, 3, 5, 40, 32, 16), (1, 2, 4, 70, 64, 16)])
def test_kernel_matches_reference(B, heads, Lq, Lc, rank, rope, config):
    g = torch.Generator().manual_seed(B * 100 + Lc)
    q = torch.randn(B, heads * Lq, rank + rope, generator=g)
    ctx = torch.randn(B, Lc, rank + rope, generator=g)
    blk = torch.randn(B, Lq, rank + rope, generator=g)
    mask = _mask(B, Lq, Lc, Lc - 7, g)
    got = latent_attention(q, ctx, blk, mask, 0.3, rank, CONFIGS[config])
    ref = latent_attention_ref(q, ctx, blk, mask, 0.3, rank)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # the mask matters: seeing every key gives another answer
    assert not torch.allclose(latent_attention_ref(q, ctx, blk, torch.ones_like(mask), 0.3, rank), ref, atol=1e-3)


@needs_interpreter
def test_draft_attention_through_the_kernel(monkeypatch):
    """The draft's attention module with the kernel forced on (as on CUDA in bf16) equals its torch path."""
    cfg = tiny_config(kv_lora_rank=32, qk_rope_head_dim=16, sliding_window=24)
    attn = DFlash2DraftModel(cfg).init_weights(std=0.2).layers[0].self_attn
    g = torch.Generator().manual_seed(0)
    B, Lq, Lc = 2, 5, 30
    h = torch.randn(B, Lq, cfg.hidden_size, generator=g)
    ctx_h = torch.randn(B, Lc, cfg.hidden_size, generator=g)
    mask = _mask(B, Lq, Lc, cfg.sliding_window, g)
    q_pos = torch.arange(Lc, Lc + Lq).expand(B, Lq)
    with torch.no_grad():
        lat = attn.latent(ctx_h, torch.arange(Lc).expand(B, Lc))
        ref = attn(h, q_pos, lat, mask)
        monkeypatch.setattr(attention_mod, "fused_applies", lambda q, rank: True)
        got = attn(h, q_pos, lat, mask)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
