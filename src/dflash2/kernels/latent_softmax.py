"""The draft attention's masked softmax over two score blocks (context keys, then the block's own
keys) in one pass, each row's probabilities written as two blocks in the values' dtype.

Why: in the compiled draft block at batch 64 on the H200 (8B shape, 96 heads x 5 rows over 1,032
keys), Inductor ran the scale, mask and softmax as a reduction and a pointwise pass over the fp32
scores, 1.69 ms of a 6.26 ms block (~1 TB/s), and concatenated context and block latents into one
key tensor for another 0.79 ms (docs/benchmarks.md, thirty-fourth session). Here the context and
block scores come from two matmuls (no concatenated keys, no padding keys), one program reads a
row of each once, and the value product runs as two matmuls over the two probability blocks.

Query row ``m`` of batch row ``b`` is head ``m // Lq``, block row ``m % Lq`` (the attention's
``[B, heads, Lq]`` order); ``mask [B, Lq, Lc + Lq]`` says which keys each block row sees. A row that
sees no key gets zeros (torch's softmax would give NaN; the draft's rows always see their own key).
:func:`latent_softmax_ref` is the plain torch form it is checked against (on the GPU in
``scripts/gpu.py``, under Triton's interpreter in the CPU tests).
"""

from __future__ import annotations

import torch

from .mla_attention import triton, use_kernel

if triton is not None:
    import triton.language as tl

# a context row longer than this goes the torch way (one program holds a whole row in registers)
MAX_KEYS = 8192


def latent_softmax_ref(
    s_ctx: torch.Tensor, s_blk: torch.Tensor, mask: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``softmax(scale * cat(s_ctx [B, M, Lc], s_blk [B, M, Lq]))`` under ``mask [B, Lq, Lc + Lq]`` (query
    row m reads mask row m % Lq), in float32, split back into ``[B, M, Lc]`` and ``[B, M, Lq]`` of ``dtype``."""
    B, M, Lc = s_ctx.shape
    Lq = s_blk.shape[-1]
    scores = torch.cat([s_ctx, s_blk], -1).float() * scale
    rows = mask[:, torch.arange(M, device=mask.device) % Lq]
    probs = scores.masked_fill(~rows, float("-inf")).softmax(-1).nan_to_num(0.0).to(dtype)
    return probs[..., :Lc], probs[..., Lc:]


def applies(s_ctx: torch.Tensor) -> bool:
    return use_kernel(s_ctx) and s_ctx.shape[-1] <= MAX_KEYS


@torch.library.custom_op("dflash2::latent_softmax", mutates_args=())
def latent_softmax(
    s_ctx: torch.Tensor, s_blk: torch.Tensor, mask: torch.Tensor, scale: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`latent_softmax_ref`, by the kernel (fp32 scores; an operator ``torch.compile`` keeps whole)."""
    B, M, Lc = s_ctx.shape
    Lq = s_blk.shape[-1]
    s_ctx, s_blk = s_ctx.contiguous(), s_blk.contiguous()
    p_ctx = torch.empty(B, M, Lc, dtype=dtype, device=s_ctx.device)
    p_blk = torch.empty(B, M, Lq, dtype=dtype, device=s_ctx.device)
    m8 = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    block = max(16, triton.next_power_of_2(Lc))
    _latent_softmax_kernel[(B * M,)](
        s_ctx, s_blk, m8, p_ctx, p_blk, *m8.stride(), scale, M, Lq, Lc,
        BLOCK=block, BLOCK_Q=max(16, triton.next_power_of_2(Lq)), num_warps=4 if block <= 2048 else 8,
    )  # fmt: skip
    return p_ctx, p_blk


@latent_softmax.register_fake
def _(s_ctx, s_blk, mask, scale, dtype):
    return s_ctx.new_empty(s_ctx.shape, dtype=dtype), s_blk.new_empty(s_blk.shape, dtype=dtype)


if triton is not None:

    @triton.jit
    def _latent_softmax_kernel(
        S_CTX, S_BLK, MASK, P_CTX, P_BLK, sm_b, sm_l, sm_k, scale, M, Lq, Lc,
        BLOCK: tl.constexpr, BLOCK_Q: tl.constexpr,
    ):  # fmt: skip
        r = tl.program_id(0).to(tl.int64)  # row r: batch row r // M, block row r % Lq
        mrow = MASK + (r // M) * sm_b + (r % Lq) * sm_l
        k = tl.arange(0, BLOCK)
        k_ok = k < Lc
        seen = tl.load(mrow + k * sm_k, mask=k_ok, other=0)
        s = tl.load(S_CTX + r * Lc + k, mask=k_ok, other=0.0)
        s = tl.where(k_ok & (seen != 0), s * scale, float("-inf"))
        j = tl.arange(0, BLOCK_Q)
        j_ok = j < Lq
        seen_j = tl.load(mrow + (Lc + j) * sm_k, mask=j_ok, other=0)
        t = tl.load(S_BLK + r * Lq + j, mask=j_ok, other=0.0)
        t = tl.where(j_ok & (seen_j != 0), t * scale, float("-inf"))
        top = tl.maximum(tl.max(s, 0), tl.max(t, 0))
        top = tl.where(top == float("-inf"), 0.0, top)  # a row that sees nothing: zeros, not NaN
        e_s = tl.exp(s - top)
        e_t = tl.exp(t - top)
        total = tl.sum(e_s, 0) + tl.sum(e_t, 0)
        inv = 1.0 / tl.where(total > 0, total, 1.0)
        tl.store(P_CTX + r * Lc + k, (e_s * inv).to(P_CTX.dtype.element_ty), mask=k_ok)
        tl.store(P_BLK + r * Lq + j, (e_t * inv).to(P_BLK.dtype.element_ty), mask=j_ok)
