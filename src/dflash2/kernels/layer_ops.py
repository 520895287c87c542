"""The static target forward's elementwise work in three kernels per layer: residual add + RMSNorm,
RoPE + the KV cache write, and SiLU x up.

Why: at small batch a CUDA-graphed step is bound by how many kernels it launches, not by bytes.
Hugging Face's RMSNorm is seven kernels (cast, pow, mean, add, rsqrt, mul, mul), RoPE about ten,
the cache write through a block table five more; with the three projections and the MLP a Llama
layer launched ~42 kernels. On the H200 a SmolLM2-135M step took 2.9 ms for 0.07 ms of weights and
the 8B shape 7.2 ms against a 3.8 ms weight-read floor (docs/benchmarks.md, thirteenth session).
With these and the projections concatenated (q|k|v, gate|up) a layer is ten kernels.

Each kernel rounds where the eager ops round (after the residual add, after ``x * rsqrt``, after
each RoPE product, after SiLU), so in float32 and bfloat16 the outputs equal the torch reference
that runs on the CPU: :func:`add_rms_norm_ref`, :func:`rope_kv_write_ref`, :func:`silu_mul_ref`.
The CPU tests check each kernel against its reference under Triton's interpreter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .live_attention import triton, use_triton

if triton is not None:
    import triton.language as tl


# ---- references (the CPU path, and what the kernels are checked against) ----------------------------
def add_rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(h) * weight, h)`` with ``h = residual + x`` (or ``x``), as Hugging Face's LlamaRMSNorm:
    float32 statistics, ``h * rsqrt`` cast back to the input dtype before the weight."""
    h = x if residual is None else residual + x
    hf = h.float()
    normed = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    return weight * normed, h


def rope_kv_write_ref(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    table: torch.Tensor,
    start: torch.Tensor,
    n_heads: int,
    n_kv: int,
) -> torch.Tensor:
    """``qkv [B, L, (H + 2 KV) * d]`` (q | k | v) -> rotated ``q [B, H, L, d]``; rotated k and v are
    written into the pools ``[pages, KV, P, d]`` at each row's positions ``start[b] + i`` through
    ``table [B, pages]``. ``cos``/``sin``: ``[B, L, d]`` (Hugging Face's rotary embedding)."""
    B, L, _ = qkv.shape
    d = cos.shape[-1]
    q, k, v = qkv.view(B, L, n_heads + 2 * n_kv, d).split([n_heads, n_kv, n_kv], 2)
    c, s = cos[:, :, None], sin[:, :, None]

    def rotate(x):
        half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
        return x * c + half * s

    P = k_pool.shape[2]
    pos = start[:, None] + torch.arange(L, device=qkv.device)
    page, off = table.gather(1, pos // P).long(), pos % P
    k_pool[page, :, off] = rotate(k)
    v_pool[page, :, off] = v
    return rotate(q).transpose(1, 2)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate_up [..., 2 I]`` (gate | up)."""
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate) * up


# ---- dispatch ---------------------------------------------------------------------------------------
def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`add_rms_norm_ref`, one kernel where Triton runs."""
    if not use_triton(x.device):
        return add_rms_norm_ref(x, weight, eps, residual)
    shape, n = x.shape, x.shape[-1]
    x2 = x.reshape(-1, n)
    out = torch.empty_like(x2)
    h = torch.empty_like(x2) if residual is not None else x2
    r2 = residual.reshape(-1, n) if residual is not None else x2
    _add_rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, out, h, x2.stride(0), r2.stride(0), n, eps,
        HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(n),
    )  # fmt: skip
    return out.view(shape), h.view(shape)


def rope_kv_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    table: torch.Tensor,
    start: torch.Tensor,
    n_heads: int,
    n_kv: int,
) -> torch.Tensor:
    """As :func:`rope_kv_write_ref`, one kernel where Triton runs (one program per token and head)."""
    if not use_triton(qkv.device):
        return rope_kv_write_ref(qkv, cos, sin, k_pool, v_pool, table, start, n_heads, n_kv)
    B, L, _ = qkv.shape
    d = cos.shape[-1]
    if d % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {d}")
    q_out = torch.empty(B, n_heads, L, d, dtype=qkv.dtype, device=qkv.device)
    tab = table if table.dtype == torch.int32 else table.int()
    c, s = cos.expand(B, L, d), sin.expand(B, L, d)
    _rope_kv_kernel[(B * L, n_heads + 2 * n_kv)](
        qkv, c, s, k_pool, v_pool, tab, start, q_out,
        qkv.stride(0), qkv.stride(1), c.stride(0), c.stride(1), s.stride(0), s.stride(1),
        *k_pool.stride()[:3], *v_pool.stride()[:3], tab.stride(0), *q_out.stride()[:3],
        L, n_heads, n_kv, k_pool.shape[2],
        D=d, BLOCK_D=max(2, triton.next_power_of_2(d // 2)),
    )  # fmt: skip
    return q_out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """As :func:`silu_mul_ref`, one kernel where Triton runs."""
    if not use_triton(gate_up.device):
        return silu_mul_ref(gate_up)
    n2 = gate_up.shape[-1]
    g2 = gate_up.reshape(-1, n2)
    out = torch.empty(g2.shape[0], n2 // 2, dtype=gate_up.dtype, device=gate_up.device)
    BLOCK = 1024
    _silu_mul_kernel[(g2.shape[0], triton.cdiv(n2 // 2, BLOCK))](g2, out, g2.stride(0), n2 // 2, BLOCK=BLOCK)
    return out.view(*gate_up.shape[:-1], n2 // 2)


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(X, R, W, OUT, H, sx, sr, N, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < N
        x = tl.load(X + row * sx + cols, mask=ok, other=0.0)
        if HAS_RES:  # the residual add, rounded to the activations' dtype as the eager add is
            x = (x.to(tl.float32) + tl.load(R + row * sr + cols, mask=ok, other=0.0).to(tl.float32)).to(
                OUT.dtype.element_ty
            )
            tl.store(H + row * N + cols, x, mask=ok)
        xf = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
        normed = (xf * inv).to(OUT.dtype.element_ty).to(tl.float32)
        w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(OUT + row * N + cols, (w * normed).to(OUT.dtype.element_ty), mask=ok)

    @triton.jit
    def _rotate(X, C, S, half, ok, D: tl.constexpr, dt: tl.constexpr):
        """``x * cos + rotate_half(x) * sin`` for the two halves ``x1 = X[half]``, ``x2 = X[half + D/2]``,
        each product rounded to ``dt`` as the eager ops round."""
        x1 = tl.load(X + half, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(X + half + D // 2, mask=ok, other=0.0).to(tl.float32)
        c1 = tl.load(C + half, mask=ok, other=0.0).to(tl.float32)
        c2 = tl.load(C + half + D // 2, mask=ok, other=0.0).to(tl.float32)
        s1 = tl.load(S + half, mask=ok, other=0.0).to(tl.float32)
        s2 = tl.load(S + half + D // 2, mask=ok, other=0.0).to(tl.float32)
        lo = (x1 * c1).to(dt).to(tl.float32) + (-x2 * s1).to(dt).to(tl.float32)
        hi = (x2 * c2).to(dt).to(tl.float32) + (x1 * s2).to(dt).to(tl.float32)
        return lo.to(dt), hi.to(dt)

    @triton.jit
    def _rope_kv_kernel(
        QKV, COS, SIN, KP, VP, TABLE, START, QO,
        s_b, s_l, sc_b, sc_l, ss_b, ss_l,
        sk_p, sk_h, sk_s, sv_p, sv_h, sv_s, st_b, sq_b, sq_h, sq_l,
        L, H, KV, PAGE, D: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        tok, head = tl.program_id(0), tl.program_id(1)
        b, i = tok // L, tok % L
        half = tl.arange(0, BLOCK_D)
        ok = half < D // 2
        src = QKV + b.to(tl.int64) * s_b + i * s_l + head * D
        dt = QO.dtype.element_ty
        pos = tl.load(START + b) + i
        page = tl.load(TABLE + b * st_b + pos // PAGE).to(tl.int64)
        off = pos % PAGE
        if head < H:  # a query head: rotated into q_out [B, H, L, d]
            lo, hi = _rotate(src, COS + b * sc_b + i * sc_l, SIN + b * ss_b + i * ss_l, half, ok, D, dt)
            dst = QO + b.to(tl.int64) * sq_b + head * sq_h + i * sq_l
            tl.store(dst + half, lo, mask=ok)
            tl.store(dst + half + D // 2, hi, mask=ok)
        elif head < H + KV:  # a key head: rotated into its page
            lo, hi = _rotate(src, COS + b * sc_b + i * sc_l, SIN + b * ss_b + i * ss_l, half, ok, D, dt)
            dst = KP + page * sk_p + (head - H) * sk_h + off * sk_s
            tl.store(dst + half, lo, mask=ok)
            tl.store(dst + half + D // 2, hi, mask=ok)
        else:  # a value head: copied into its page
            dst = VP + page * sv_p + (head - H - KV) * sv_h + off * sv_s
            tl.store(dst + half, tl.load(src + half, mask=ok), mask=ok)
            tl.store(dst + half + D // 2, tl.load(src + half + D // 2, mask=ok), mask=ok)

    @triton.jit
    def _silu_mul_kernel(GU, OUT, s_r, N, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < N
        g = tl.load(GU + row * s_r + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(GU + row * s_r + N + cols, mask=ok, other=0.0).to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(OUT.dtype.element_ty).to(tl.float32)
        tl.store(OUT + row * N + cols, (act * u).to(OUT.dtype.element_ty), mask=ok)
