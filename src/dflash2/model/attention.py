"""MLA attention of the draft (queries from block rows; keys/values from context + block rows)
and the block-causal sliding-window mask builder."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import DFlash2Config
from ..kernels import latent_softmax as split_softmax
from ..kernels.mla_attention import gather_rows, kernel_shapes_ok, latent_attention
from .rope import RotaryEmbedding, apply_interleaved_rope


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def build_block_mask(
    q_pos: torch.Tensor,  # [B, Lq] absolute positions of block rows
    q_anchor: torch.Tensor,  # [B, Lq] anchor position of each row's block
    q_block: torch.Tensor,  # [B, Lq] block id (unique per block within a batch row)
    ctx_pos: torch.Tensor,  # [B, Tc] absolute positions of context rows
    ctx_valid: torch.Tensor,  # [B, Tc] False for padding
    window: int,
    is_causal: bool,
    q_seq: torch.Tensor | None = None,  # [B, Lq] request id (packed layouts); None = one request per row
    ctx_seq: torch.Tensor | None = None,  # [B, Tc]
) -> torch.Tensor:
    """Boolean ``[B, Lq, Tc + Lq]``: True where a block query may attend (context keys first).

    Context key k is visible to query q iff same request, ``k < anchor`` and ``q - k < window``.
    Block keys are visible only within the same block (and only ``k <= q`` when causal).
    """
    qp, kp = q_pos.unsqueeze(-1), ctx_pos.unsqueeze(-2)
    ctx = ctx_valid.unsqueeze(-2) & (kp < q_anchor.unsqueeze(-1)) & (qp - kp < window)
    if q_seq is not None and ctx_seq is not None:
        ctx = ctx & (q_seq.unsqueeze(-1) == ctx_seq.unsqueeze(-2))
    blk = q_block.unsqueeze(-1) == q_block.unsqueeze(-2)
    if is_causal:
        blk = blk & (q_pos.unsqueeze(-2) <= qp)
    return torch.cat([ctx, blk], dim=-1)


# On CUDA with bf16 weights, the attention matmuls read bf16 and write fp32 (tensor cores, fp32
# accumulation); otherwise both operands are cast to fp32 first. Module-level so a benchmark can
# time one against the other; the draft's precision moves acceptance only, never the output.
TENSOR_CORE_SCORES = True


# On CUDA in half precision, without grad (serving: the kernel has no backward), the attention can be
# the fused kernel (kernels/mla_attention.py). Off: alone it beat the torch path (batch 64: 0.60 against
# 0.63 ms a layer; batch 1: 0.10 against 0.17), but in the compiled draft block, reading the paged
# latents in place, it lost at every batch (1: 4.13 against 3.34 ms; 64: 6.29 against 5.77) and the 8B
# engine rows fell (c=1 2.83x -> 2.80x, c=64 1.28x -> 1.24x; docs/benchmarks.md, thirty-first
# session). PAGED_READ False hands it the gathered latents instead, to tell whether the in-place read
# (a dependent index load before every key tile) is what loses. Module-level so a benchmark can set them.
FUSED_ATTENTION = False
PAGED_READ = True
# On CUDA without grad (serving), the torch path scores context and block keys in two matmuls, takes
# their masked softmax in one kernel pass (kernels/latent_softmax.py) and the value product as two
# matmuls: no concatenated, padded keys, and no Inductor softmax passes over the fp32 scores.
SPLIT_SOFTMAX = True


def split_applies(ctx: torch.Tensor) -> bool:
    """Whether the torch path's softmax over context latents ``ctx [B, Lc, D]`` is the split kernel's."""
    return SPLIT_SOFTMAX and ctx.is_cuda and not torch.is_grad_enabled() and split_softmax.applies(ctx)


def fused_applies(q: torch.Tensor, rank: int) -> bool:
    """Whether the attention over ``q [..., rank + rope]`` (or a latent pool of that width) is the kernel's."""
    rope = q.shape[-1] - rank
    return (
        FUSED_ATTENTION
        and q.is_cuda
        and q.dtype in (torch.bfloat16, torch.float16)
        and not torch.is_grad_enabled()
        and kernel_shapes_ok(rank, rope)
    )


def paged_context(pool: torch.Tensor, rows: torch.Tensor, cfg: DFlash2Config) -> list:
    """Each draft layer's context latents from ``pool [layers, N, D]`` at ``rows [B, Lc]``: as
    ``(pool[i], rows)`` pairs where the fused kernel will read them in place (no gathered copy: 0.57 ms
    of a 6.3 ms batch-64 draft block at the 8B shape on the H200, docs/benchmarks.md, thirtieth
    session), else gathered, ``[layers, B, Lc, D]``."""
    if PAGED_READ and fused_applies(pool, cfg.kv_lora_rank):
        return [(pool[i], rows) for i in range(pool.shape[0])]
    return gather_rows(pool, rows)


def _tensor_cores(x: torch.Tensor) -> bool:
    return TENSOR_CORE_SCORES and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


def _fp32_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (batched) as fp32. On the H200 with 1,029 keys (a row stride not a multiple of 8)
    cuBLAS ran this as an unaligned sm75 kernel: 2.3 ms of a 10.4 ms batch-64 draft block at the 8B
    shape (docs/benchmarks.md, twenty-ninth session), hence the key padding in the caller."""
    if _tensor_cores(a) and a.dtype == b.dtype:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.matmul(a.float(), b.float())


class MLAttention(nn.Module):
    def __init__(self, cfg: DFlash2Config, rotary: RotaryEmbedding):
        super().__init__()
        self.cfg, self.rotary = cfg, rotary
        n, H = cfg.num_attention_heads, cfg.hidden_size
        self.q_a_proj = nn.Linear(H, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, n * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, n * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        self.o_proj = nn.Linear(n * cfg.v_head_dim, H, bias=False)
        self.scale = cfg.softmax_scale()

    def latent(self, y: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The per-token cache entry: ``[kv_a_layernorm(c_kv) (kv_lora) | roped k_pe (rope)]``. Both
        are per token, so a context row is normed and roped once, when it enters the cache, not
        again at every step that reads it."""
        c, k_pe = self.kv_a_proj_with_mqa(y).split([self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim], -1)
        cos, sin = self.rotary.cos_sin(positions, k_pe.dtype)
        return torch.cat([self.kv_a_layernorm(c), apply_interleaved_rope(k_pe, cos, sin)], dim=-1)

    def forward(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        ctx_latent: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """``ctx_latent``: the context's latents ``[B, Lc, D]``, or ``(pool [N, D], rows [B, Lc])``
        (:func:`paged_context`): the fused kernel reads those rows in place, the torch path gathers them."""
        cfg = self.cfg
        B, Lq, _ = h.shape
        n = cfg.num_attention_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(h))).view(B, Lq, n, cfg.qk_head_dim)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], -1)
        cos, sin = self.rotary.cos_sin(positions, q.dtype)
        q_pe = apply_interleaved_rope(q_pe, cos.unsqueeze(-2), sin.unsqueeze(-2))
        blk = self.latent(h, positions)  # the block's own keys, after the context's
        # Absorbed MLA: fold kv_b's key half into the queries and its value half into the output, so
        # attention runs over the latent (kv_lora + rope values per token, shared by all heads)
        # instead of expanding every context row to n heads each step. Same function as
        # k_nope, v = kv_b(c) per head; the test against the float64 reference checks that.
        w_kv = self.kv_b_proj.weight.view(n, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
        w_uk, w_uv = w_kv[:, : cfg.qk_nope_head_dim], w_kv[:, cfg.qk_nope_head_dim :]
        q_lat = torch.einsum("blhd,hdc->bhlc", q_nope, w_uk)
        q = torch.cat([q_lat, q_pe.transpose(1, 2)], -1).reshape(B, n * Lq, -1)  # rows [heads, Lq]
        paged = isinstance(ctx_latent, tuple)  # (pool [N, D], rows [B, Lc]): read in place by the kernel
        if fused_applies(q, cfg.kv_lora_rank) and (not paged or ctx_latent[0].dtype == q.dtype):
            ctx, idx = ctx_latent if paged else (ctx_latent.to(h.dtype), None)
            out_lat = latent_attention(q, ctx, blk, mask, self.scale, cfg.kv_lora_rank, idx)
        else:
            ctx = gather_rows(*ctx_latent) if paged else ctx_latent
            out_lat = self._attend(q, ctx.to(h.dtype), blk, mask)
        out_lat = out_lat.view(B, n, Lq, cfg.kv_lora_rank).to(h.dtype)
        out = torch.einsum("bhlc,hvc->blhv", out_lat, w_uv)
        return self.o_proj(out.reshape(B, Lq, n * cfg.v_head_dim))

    def _attend(self, q: torch.Tensor, ctx: torch.Tensor, blk: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The plain torch form of ``kernels/mla_attention.py``: ``q [B, n*Lq, D]`` -> ``[B, n*Lq, rank]``."""
        if split_applies(ctx):
            return self._attend_split(q, ctx, blk, mask)
        B, M, _ = q.shape
        n, Lq = M // blk.shape[1], blk.shape[1]
        parts = [ctx, blk]
        pad = (-(ctx.shape[1] + Lq)) % 8
        if pad:  # masked zero keys: a row stride of 8 lets cuBLAS pick aligned kernels (see _fp32_matmul)
            parts.append(blk.new_zeros(B, pad, blk.shape[-1]))
            mask = F.pad(mask, (0, pad), value=False)
        lat = torch.cat(parts, dim=1)
        c = lat[..., : self.cfg.kv_lora_rank]
        # Every head reads the same latent keys/values (MQA form), so all n*Lq query rows go through
        # one matmul against [B, Lk, D]; SDPA over the head-expanded (stride-0) k/v took 3 ms a layer
        # on the CPU, mostly scaling the expanded keys. Scores and softmax in fp32; on CUDA the
        # probabilities enter the value matmul as bf16, as in flash attention (H200, 8B shape, batch
        # 64: the block 14.9 -> 9.2 ms, GSM8K acceptance unchanged).
        scores = _fp32_matmul(q, lat.transpose(1, 2)).view(B, n, Lq, -1)
        scores = (scores * self.scale).masked_fill(~mask.unsqueeze(1), float("-inf"))
        probs = scores.softmax(-1).view(B, M, -1)
        # on tensor cores the product is accumulated in fp32 and rounded to bf16 once, as the fp32
        # result cast to h.dtype was
        return torch.bmm(probs.to(c.dtype), c) if _tensor_cores(c) else torch.matmul(probs, c.float())

    def _attend_split(self, q: torch.Tensor, ctx: torch.Tensor, blk: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """:meth:`_attend` with context and block keys kept apart: two score matmuls, one softmax pass
        (``kernels/latent_softmax.py``), two value matmuls. The same function; on tensor cores the block
        keys' small value product is rounded to bf16 before the context's is added to it in fp32."""
        rank = self.cfg.kv_lora_rank
        tc = _tensor_cores(ctx)
        s_ctx = _fp32_matmul(q, ctx.transpose(1, 2))
        s_blk = _fp32_matmul(q, blk.transpose(1, 2))
        p_ctx, p_blk = split_softmax.latent_softmax(s_ctx, s_blk, mask, self.scale, ctx.dtype if tc else torch.float32)
        c_ctx, c_blk = ctx[..., :rank], blk[..., :rank]
        if tc:
            return torch.baddbmm(torch.bmm(p_blk, c_blk), p_ctx, c_ctx)
        return torch.matmul(p_ctx, c_ctx.float()) + torch.matmul(p_blk, c_blk.float())
