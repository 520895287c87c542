"""Attention that reads only each row's live KV: decode, verify and prefill over a paged cache.

Why: the masked SDPA over a static buffer reads every position of it, live or not (on the H200 a
5-row verify over 1,029 positions took 4.6 ms at batch 1, 7.3 over 4,101), so the step's cost grew
with the buffer, not with what the requests hold. Here row ``b`` has ``L`` query tokens at
positions ``start[b] .. start[b]+L-1``; query ``i`` sees keys ``0 .. start[b]+i`` (causal), read
through ``block_table[b]`` from a pool of pages ``[num_pages, kv_heads, page, head_dim]``. A slot
buffer ``[slots, kv_heads, max_len, head_dim]`` is the same thing with one page per slot.

The Triton kernel is flash-decoding: every (row, KV head) splits its live keys into ``num_splits``
parts (the split length follows the row's live length, so short rows do not spread over empty
splits), each program keeps an online softmax over its part for all query heads of the group and
all ``L`` tokens at once (``G*L`` query rows per tile), and a second kernel merges the parts by
their log-sum-exp. Both read ``start`` and ``block_table`` from the device, so one CUDA graph
serves every length. :func:`live_attention_ref` is the plain torch reference: the CPU path, and
what the kernel is checked against on the GPU (``scripts/gpu.py attn``) and, under Triton's
interpreter, in the CPU tests.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

try:  # Triton ships with CUDA PyTorch; on the CPU it runs only under TRITON_INTERPRET=1 (the tests)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - the CI installs it
    triton = None


def live_attention_ref(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    start: torch.Tensor,
    scale: float,
    kv_len: int | None = None,
) -> torch.Tensor:
    """``q [B, H, L, d]`` -> ``[B, H, L, d]``: the pages of each row gathered into one sequence,
    keys past each query's position masked, SDPA (grouped heads). ``kv_len`` bounds the positions
    gathered (every query must lie below it); default: the whole table."""
    B, H, L, d = q.shape
    P = k_pool.shape[2]
    pages = block_table[:, : math.ceil((kv_len or block_table.shape[1] * P) / P)].long()
    S = pages.shape[1] * P
    k = k_pool[pages].transpose(1, 2).reshape(B, k_pool.shape[1], S, d)  # [B, kv, S, d]
    v = v_pool[pages].transpose(1, 2).reshape(B, v_pool.shape[1], S, d)
    pos = start.view(B, 1) + torch.arange(L, device=q.device)  # [B, L]
    visible = torch.arange(S, device=q.device) <= pos[..., None]  # [B, L, S]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible[:, None], scale=scale, enable_gqa=k.shape[1] != H)


def use_triton(device: torch.device) -> bool:
    """The kernel runs on CUDA, or anywhere under Triton's interpreter (the CPU tests)."""
    return triton is not None and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")


def num_splits_for(batch: int, kv_heads: int, max_len: int, sms: int = 132) -> int:
    """Splits per (row, KV head) for about two programs per SM, at most one per 64 positions of
    the longest possible row (fixed when a graph is captured: the split length then follows each
    row's live length inside the kernel)."""
    return max(1, min(triton_cdiv(2 * sms, batch * kv_heads), triton_cdiv(max_len, 64), 64))


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def live_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_table: torch.Tensor,
    start: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    kv_len: int | None = None,
) -> torch.Tensor:
    """As :func:`live_attention_ref` (``[B, H, L, d]``), by the Triton kernel where it runs.
    ``num_splits``: see :func:`num_splits_for` (default: from the shapes)."""
    if not use_triton(q.device):
        return live_attention_ref(q, k_pool, v_pool, block_table, start, scale, kv_len)
    B, H, L, d = q.shape
    KV, P = k_pool.shape[1], k_pool.shape[2]
    G = H // KV
    M = G * L
    BLOCK_M = max(16, triton.next_power_of_2(M))
    BLOCK_N = 64 if d <= 128 else 32
    if P % BLOCK_N:
        raise ValueError(f"page size {P} must be a multiple of {BLOCK_N}")
    BLOCK_D = max(16, triton.next_power_of_2(d))  # head dims like 80 or 8 are padded, masked lanes
    n_split = num_splits or num_splits_for(B, KV, block_table.shape[1] * P)
    o_part = torch.empty(B, KV, n_split, BLOCK_M, BLOCK_D, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(B, KV, n_split, BLOCK_M, dtype=torch.float32, device=q.device)
    out = torch.empty(B, L, H, d, dtype=q.dtype, device=q.device)  # what o_proj reads, transposed below
    table = block_table if block_table.dtype == torch.int32 else block_table.int()
    _split_kernel[(B * KV, n_split)](
        q, k_pool, v_pool, table, start, o_part, lse_part,
        *q.stride(), *k_pool.stride(), *v_pool.stride(), table.stride(0),
        *o_part.stride()[:4], *lse_part.stride()[:3],
        scale, L, KV, G, M,
        PAGE=P, NSPLIT=n_split, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, D=BLOCK_D, HEAD_D=d,
        # float32 stays float32 (tl.dot's default is TF32, which moved fp32 logits by 0.06 on the H200)
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    _merge_kernel[(B * KV,)](
        o_part, lse_part, out,
        *o_part.stride()[:4], *lse_part.stride()[:3], *out.stride()[:3],
        L, KV, G, M,
        NSPLIT=n_split, BLOCK_M=BLOCK_M, D=BLOCK_D, HEAD_D=d,
    )  # fmt: skip
    return out.transpose(1, 2)


if triton is not None:

    @triton.jit
    def _split_kernel(
        Q, K, V, TABLE, START, O_PART, LSE_PART,
        sq_b, sq_h, sq_l, sq_d, sk_p, sk_h, sk_s, sk_d, sv_p, sv_h, sv_s, sv_d, st_b,
        so_b, so_h, so_s, so_m, sl_b, sl_h, sl_s,
        scale, L, KV, G, M,
        PAGE: tl.constexpr, NSPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
        HEAD_D: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        bh, split = tl.program_id(0), tl.program_id(1)
        b, kvh = bh // KV, bh % KV
        rows = tl.arange(0, BLOCK_M)  # query row m = g * L + i: head kvh * G + g, token i
        g, i = rows // L, rows % L
        row_ok = rows < M
        dd = tl.arange(0, D)
        d_ok = dd < HEAD_D
        start = tl.load(START + b)
        q_pos = start + i
        q = tl.load(
            Q + b * sq_b + (kvh * G + g)[:, None] * sq_h + i[:, None] * sq_l + dd[None, :] * sq_d,
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        live = start + L
        part = tl.cdiv(tl.cdiv(live, NSPLIT), BLOCK_N) * BLOCK_N
        lo = split * part
        hi = tl.minimum(lo + part, live)
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: a fully masked tile adds exp(-inf) = 0
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        for n in range(lo, hi, BLOCK_N):
            k_pos = n + tl.arange(0, BLOCK_N)
            k_ok = k_pos < hi
            page = tl.load(TABLE + b * st_b + k_pos // PAGE, mask=k_ok, other=0)
            off = k_pos % PAGE
            k = tl.load(
                K + page[:, None] * sk_p + kvh * sk_h + off[:, None] * sk_s + dd[None, :] * sk_d,
                mask=k_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            v = tl.load(
                V + page[:, None] * sv_p + kvh * sv_h + off[:, None] * sv_s + dd[None, :] * sv_d,
                mask=k_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            s = tl.where(k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None]), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        safe = tl.where(l_i > 0, l_i, 1.0)
        o_ptr = O_PART + b * so_b + kvh * so_h + split * so_s + rows[:, None] * so_m + dd[None, :]
        tl.store(o_ptr, acc / safe[:, None])
        lse = tl.where(l_i > 0, m_i + tl.log(safe), float("-inf"))
        tl.store(LSE_PART + b * sl_b + kvh * sl_h + split * sl_s + rows, lse)

    @triton.jit
    def _merge_kernel(
        O_PART, LSE_PART, OUT,
        so_b, so_h, so_s, so_m, sl_b, sl_h, sl_s, sout_b, sout_l, sout_h,
        L, KV, G, M,
        NSPLIT: tl.constexpr, BLOCK_M: tl.constexpr, D: tl.constexpr, HEAD_D: tl.constexpr,
    ):  # fmt: skip
        bh = tl.program_id(0)
        b, kvh = bh // KV, bh % KV
        rows = tl.arange(0, BLOCK_M)
        dd = tl.arange(0, D)
        m_all = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        for s in range(NSPLIT):
            m_all = tl.maximum(m_all, tl.load(LSE_PART + b * sl_b + kvh * sl_h + s * sl_s + rows))
        den = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
        for s in range(NSPLIT):
            w = tl.exp(tl.load(LSE_PART + b * sl_b + kvh * sl_h + s * sl_s + rows) - m_all)
            o = tl.load(O_PART + b * so_b + kvh * so_h + s * so_s + rows[:, None] * so_m + dd[None, :])
            den += w
            acc += w[:, None] * o
        g, i = rows // L, rows % L
        out = acc / tl.where(den > 0, den, 1.0)[:, None]
        ptr = OUT + b * sout_b + i[:, None] * sout_l + (kvh * G + g)[:, None] * sout_h + dd[None, :]
        tl.store(ptr, out.to(OUT.dtype.element_ty), mask=(rows < M)[:, None] & (dd < HEAD_D)[None, :])
