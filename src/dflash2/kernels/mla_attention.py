"""The draft's absorbed-MLA attention in one kernel: scores, mask, softmax and the value product
without the scores ever reaching memory.

Why: in the draft block every head reads the same latent keys (``kv_lora + rope`` wide, the MQA form
of absorbed MLA), so the reference (``model/attention.py``) runs one fp32 score matmul over all
``heads * block`` query rows, a masked softmax and a value matmul. At batch 64 on the H200 the
scores are ``64 x 480 x 1,032`` floats a layer: written, read twice and written again as bf16
probabilities, the softmax's kernels took 1.7 ms and the concatenation of context and block
latents 0.6 ms of a 6.3 ms draft block at the 8B shape (docs/benchmarks.md, thirtieth session).

Here one program holds ``BLOCK_M`` query rows and ``BLOCK_V`` of the ``rank`` output columns, walks
the context keys and then the block's own keys (two inputs: nothing is concatenated) with an
online softmax, scores in fp32 and probabilities rounded to the keys' dtype before the value
product, as the reference does on tensor cores. Query row ``m`` is head ``m // Lq``, block row
``m % Lq`` (the reference's ``[B, heads, Lq]`` order); ``mask [B, Lq, Lc + Lq]`` says which keys
each block row sees. :func:`latent_attention_ref` is the plain torch form it is checked against
(on the GPU in ``scripts/gpu.py``, under Triton's interpreter in the CPU tests).
"""

from __future__ import annotations

import os

import torch

try:  # Triton ships with CUDA PyTorch; on the CPU it runs only under TRITON_INTERPRET=1 (the tests)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CI installs it
    triton = None


def gather_rows(pool: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Paged context latents as one tensor: rows ``idx [B, Lc]`` of ``pool [..., N, D]`` ->
    ``[..., B, Lc, D]`` (one index over the flattened pages: indexing pages and offsets as two tensors
    took 1.0 ms at batch 64 on the H200, 5x the bytes it moved; docs/benchmarks.md, twenty-ninth session)."""
    return pool.index_select(-2, idx.flatten()).view(*pool.shape[:-2], *idx.shape, pool.shape[-1])


def latent_attention_ref(
    q: torch.Tensor, ctx: torch.Tensor, blk: torch.Tensor, mask: torch.Tensor, scale: float, rank: int
) -> torch.Tensor:
    """``q [B, M, D]`` over keys ``cat(ctx [B, Lc, D], blk [B, Lq, D])`` (values: their first ``rank``
    columns), ``mask [B, Lq, Lc + Lq]`` per block row, in float32 -> ``[B, M, rank]`` float32."""
    B, M, _ = q.shape
    Lq = blk.shape[1]
    keys = torch.cat([ctx, blk], 1).float()
    scores = torch.matmul(q.float(), keys.transpose(1, 2)) * scale
    rows = mask[:, torch.arange(M, device=q.device) % Lq]  # [B, M, Lk]
    probs = scores.masked_fill(~rows, float("-inf")).softmax(-1)
    return torch.matmul(probs, keys[..., :rank])


def use_kernel(x: torch.Tensor) -> bool:
    """The kernel runs on CUDA, or anywhere under Triton's interpreter (the CPU tests)."""
    return triton is not None and (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def kernel_shapes_ok(rank: int, rope: int) -> bool:
    """The kernel's tiles: ``rank`` and ``rope`` powers of two, ``rope`` at least 16 (tl.dot's least K)."""
    return rank >= 16 and rope >= 16 and not rank & (rank - 1) and not rope & (rope - 1)


# The launch, by load: rows and keys a tile, output columns a program, warps, pipeline stages. The
# fastest of a sweep on the H200 (gpu.py mla, 54 launches that fit, docs/benchmarks.md, thirtieth
# session): at batch 1, 0.097 ms against 0.165 for the torch path; at batch 64 0.65 against 0.69
# (128-row tiles: the 480 query rows of a batch row share every key). "large" needs one pipeline
# stage: with two it ran out of shared memory. Module-level so a sweep (or a test) can set them.
CONFIGS: dict[str, dict] = {
    "small": {"block_m": 32, "block_n": 64, "block_v": 128, "num_warps": 8, "num_stages": 2},
    "large": {"block_m": 128, "block_n": 64, "block_v": 256, "num_warps": 8, "num_stages": 1},
}


def launch_config(B: int, M: int) -> dict:
    """``small`` while 32-row tiles give fewer than two programs per SM of an H200, else ``large``."""
    return CONFIGS["small" if B * -(-M // 32) < 264 else "large"]


@torch.library.custom_op("dflash2::latent_attention", mutates_args=())
def latent_attention(
    q: torch.Tensor,
    ctx: torch.Tensor,
    blk: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    rank: int,
    ctx_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """As :func:`latent_attention_ref`, by the kernel: ``[B, M, rank]`` in ``q``'s dtype. With
    ``ctx_idx [B, Lc]``, ``ctx`` is a pool of rows ``[N, D]`` and context key ``j`` of row ``b`` is
    ``ctx[ctx_idx[b, j]]`` (:func:`gather_rows`), read in place: no gathered copy. An operator that
    ``torch.compile`` keeps whole (the draft's layers are compiled with ``fullgraph=True``); its
    launch is :func:`launch_config`'s."""
    B, M, D = q.shape
    Lc, Lq = (ctx.shape[1] if ctx_idx is None else ctx_idx.shape[1]), blk.shape[1]
    rope = D - rank
    if not kernel_shapes_ok(rank, rope):
        raise ValueError(f"latent attention kernel: rank {rank} and rope {rope} must be powers of two (rope >= 16)")
    out = torch.empty(B, M, rank, dtype=q.dtype, device=q.device)
    m8 = mask.view(torch.uint8) if mask.dtype == torch.bool else mask
    cfg = launch_config(B, M)
    BLOCK_M, BLOCK_N = cfg["block_m"], cfg["block_n"]
    # each program a slice of the output columns (each slice recomputes the scores: cheap beside
    # reading the keys, and more programs at a small batch)
    BLOCK_V = min(rank, cfg["block_v"])
    grid = (B, triton.cdiv(M, BLOCK_M), rank // BLOCK_V)
    if ctx_idx is None:  # a [B, Lc, D] tensor: row b's key j at b * stride(0) + j * stride(1)
        idx, s_idx, (sc_b, sc_n, sc_d) = ctx, (0, 0), ctx.stride()
    else:  # a pool: key j of row b at ctx_idx[b, j] * stride(0)
        idx, s_idx, (sc_b, sc_n, sc_d) = ctx_idx, ctx_idx.stride(), (0, ctx.stride(0), ctx.stride(1))
    _latent_attention_kernel[grid](
        q, ctx, idx, blk, m8, out,
        *q.stride(), sc_b, sc_n, sc_d, *s_idx, *blk.stride(), *m8.stride(), *out.stride(),
        scale, M, Lc, Lq,
        PAGED=ctx_idx is not None, RANK=rank, ROPE=rope, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_V=BLOCK_V,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip
    return out


if triton is not None:

    @triton.jit
    def _keys_tile(
        acc, m_i, l_i, q_c, q_r, KEYS, IDX, MASK, b, n0, n_end, mask_off, l, row_ok, sk_b, sk_n, sk_d,
        si_b, si_n, sm_b, sm_l, sm_k, scale, v0,
        PAGED: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        """One tile of ``BLOCK_N`` keys ``n0 ..`` (below ``n_end``) of ``KEYS`` folded into the
        online softmax; ``mask_off``: the tile's first column in ``MASK``. ``PAGED``: key ``j`` is
        row ``IDX[b, j]`` of ``KEYS``."""
        kn = n0 + tl.arange(0, BLOCK_N)
        k_ok = kn < n_end
        if PAGED:
            rows = tl.load(IDX + b * si_b + kn * si_n, mask=k_ok, other=0).to(tl.int64)
            base = KEYS + rows[:, None] * sk_n
        else:
            base = KEYS + b * sk_b + kn[:, None] * sk_n
        dc = tl.arange(0, RANK)
        dr = tl.arange(0, ROPE)
        k_c = tl.load(base + dc[None, :] * sk_d, mask=k_ok[:, None], other=0.0)
        k_r = tl.load(base + (RANK + dr)[None, :] * sk_d, mask=k_ok[:, None], other=0.0)
        s = tl.dot(q_c, tl.trans(k_c), input_precision=PRECISION)
        s = tl.dot(q_r, tl.trans(k_r), s, input_precision=PRECISION) * scale
        seen = tl.load(
            MASK + b * sm_b + l[:, None] * sm_l + (mask_off + kn - n0)[None, :] * sm_k,
            mask=row_ok[:, None] & k_ok[None, :],
            other=0,
        )
        s = tl.where(seen != 0, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        dv = v0 + tl.arange(0, BLOCK_V)
        v = tl.load(base + dv[None, :] * sk_d, mask=k_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return acc, m_new, l_i

    @triton.jit
    def _latent_attention_kernel(
        Q, CTX, IDX, BLK, MASK, OUT,
        sq_b, sq_m, sq_d, sc_b, sc_n, sc_d, si_b, si_n, sb_b, sb_n, sb_d, sm_b, sm_l, sm_k, so_b, so_m, so_d,
        scale, M, Lc, Lq,
        PAGED: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        b, mb, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        l = rows % Lq  # noqa: E741 - the block row of query row m (head m // Lq)
        q_base = Q + b * sq_b + rows[:, None] * sq_m
        q_c = tl.load(q_base + tl.arange(0, RANK)[None, :] * sq_d, mask=row_ok[:, None], other=0.0)
        q_r = tl.load(q_base + (RANK + tl.arange(0, ROPE))[None, :] * sq_d, mask=row_ok[:, None], other=0.0)
        v0 = vb * BLOCK_V
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: a fully masked tile adds exp(-inf) = 0
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
        for n in range(0, Lc, BLOCK_N):  # the context window, then the block's own rows
            acc, m_i, l_i = _keys_tile(
                acc, m_i, l_i, q_c, q_r, CTX, IDX, MASK, b, n, Lc, n, l, row_ok, sc_b, sc_n, sc_d, si_b, si_n,
                sm_b, sm_l, sm_k, scale, v0, PAGED, RANK, ROPE, BLOCK_N, BLOCK_V, PRECISION,
            )  # fmt: skip
        for n in range(0, Lq, BLOCK_N):
            acc, m_i, l_i = _keys_tile(
                acc, m_i, l_i, q_c, q_r, BLK, IDX, MASK, b, n, Lq, Lc + n, l, row_ok, sb_b, sb_n, sb_d, 0, 0,
                sm_b, sm_l, sm_k, scale, v0, False, RANK, ROPE, BLOCK_N, BLOCK_V, PRECISION,
            )  # fmt: skip
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        dv = v0 + tl.arange(0, BLOCK_V)
        tl.store(OUT + b * so_b + rows[:, None] * so_m + dv[None, :] * so_d, out.to(OUT.dtype.element_ty),
                 mask=row_ok[:, None])  # fmt: skip


@latent_attention.register_fake
def _(q, ctx, blk, mask, scale, rank, ctx_idx=None):
    return q.new_empty(q.shape[0], q.shape[1], rank)
