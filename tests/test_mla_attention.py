"""The draft's fused latent attention (kernels/mla_attention.py) against its plain torch form, under
Triton's interpreter on the CPU, and through the draft's attention module against the path it replaces."""

import pytest
import torch

from conftest import tiny_config
from dflash2.kernels.mla_attention import CONFIGS, gather_rows, latent_attention, latent_attention_ref, use_kernel
from dflash2.model import DFlash2DraftModel, build_block_mask
from dflash2.model import attention as attention_mod

needs_interpreter = pytest.mark.skipif(
    not use_kernel(torch.empty(0)), reason="the kernel runs on the CPU only under TRITON_INTERPRET=1"
)


def _mask(B: int, Lq: int, Lc: int, window: int, g: torch.Generator, is_causal: bool = False) -> torch.Tensor:
    """Block rows at each row's anchor (some context rows padding, some past the window)."""
    anchors = torch.randint(Lc // 2, Lc + 1, (B,), generator=g)
    q_pos = anchors[:, None] + torch.arange(Lq)
    ctx_pos = anchors[:, None] - Lc + torch.arange(Lc)
    return build_block_mask(
        q_pos, anchors[:, None].expand(B, Lq), torch.zeros_like(q_pos), ctx_pos, ctx_pos >= 0, window, is_causal
    )


@needs_interpreter
@pytest.mark.parametrize("config", ["small", "large"])
@pytest.mark.parametrize("B,heads,Lq,Lc,rank,rope", [(2, 3, 5, 40, 32, 16), (1, 2, 4, 70, 64, 16)])
def test_kernel_matches_reference(B, heads, Lq, Lc, rank, rope, config, monkeypatch):
    g = torch.Generator().manual_seed(B * 100 + Lc)
    q = torch.randn(B, heads * Lq, rank + rope, generator=g)
    ctx = torch.randn(B, Lc, rank + rope, generator=g)
    blk = torch.randn(B, Lq, rank + rope, generator=g)
    mask = _mask(B, Lq, Lc, Lc - 7, g)
    monkeypatch.setitem(CONFIGS, "small", CONFIGS[config])  # (these batches launch "small")
    got = latent_attention(q, ctx, blk, mask, 0.3, rank)
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


@needs_interpreter
@pytest.mark.parametrize("config", ["small", "large"])
def test_kernel_reads_paged_rows_in_place(config, monkeypatch):
    """With ``ctx_idx`` the kernel reads context rows of a pool through the index: as the gathered copy."""
    g = torch.Generator().manual_seed(7)
    B, heads, Lq, Lc, rank, rope = 2, 3, 5, 37, 32, 16
    pool = torch.randn(100, rank + rope, generator=g)
    idx = torch.randperm(100, generator=g)[: B * Lc].view(B, Lc)
    q = torch.randn(B, heads * Lq, rank + rope, generator=g)
    blk = torch.randn(B, Lq, rank + rope, generator=g)
    mask = _mask(B, Lq, Lc, Lc - 5, g)
    monkeypatch.setitem(CONFIGS, "small", CONFIGS[config])
    got = latent_attention(q, pool, blk, mask, 0.3, rank, ctx_idx=idx)
    ref = latent_attention_ref(q, gather_rows(pool, idx), blk, mask, 0.3, rank)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@needs_interpreter
def test_draft_block_over_paged_context(monkeypatch):
    """The draft's attention over ``(pool, rows)``: the torch path (gathering) and the kernel (in place)
    both equal the attention over the gathered latents; ``paged_context`` hands pairs only to the kernel,
    and gathers for it too under ``PAGED_READ = False``."""
    cfg = tiny_config(kv_lora_rank=32, qk_rope_head_dim=16, sliding_window=24)
    model = DFlash2DraftModel(cfg).init_weights(std=0.2)
    attn = model.layers[0].self_attn
    g = torch.Generator().manual_seed(1)
    B, Lq, Lc = 2, 5, 30
    h = torch.randn(B, Lq, cfg.hidden_size, generator=g)
    pool = torch.randn(cfg.num_hidden_layers, 80, cfg.kv_lora_rank + cfg.qk_rope_head_dim, generator=g)
    rows = torch.randperm(80, generator=g)[: B * Lc].view(B, Lc)
    mask = _mask(B, Lq, Lc, cfg.sliding_window, g)
    q_pos = torch.arange(Lc, Lc + Lq).expand(B, Lq)
    with torch.no_grad():
        gathered = attention_mod.paged_context(pool, rows, cfg)  # the CPU: gathered [layers, B, Lc, D]
        assert torch.is_tensor(gathered) and torch.equal(gathered[0], gather_rows(pool[0], rows))
        ref = attn(h, q_pos, gathered[0], mask)
        torch_paged = attn(h, q_pos, (pool[0], rows), mask)
        monkeypatch.setattr(attention_mod, "fused_applies", lambda q, rank: True)
        pairs = attention_mod.paged_context(pool, rows, cfg)
        assert isinstance(pairs, list) and len(pairs) == cfg.num_hidden_layers
        fused = attn(h, q_pos, pairs[0], mask)
        monkeypatch.setattr(attention_mod, "PAGED_READ", False)  # the kernel over the gathered latents
        regathered = attention_mod.paged_context(pool, rows, cfg)
        assert torch.is_tensor(regathered) and torch.equal(regathered, gathered)
        fused_gathered = attn(h, q_pos, regathered[0], mask)
    torch.testing.assert_close(torch_paged, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_gathered, ref, rtol=1e-5, atol=1e-5)
