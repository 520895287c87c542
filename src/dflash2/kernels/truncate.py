"""Top-k / top-p / min-p truncation without sorting: one Triton program per row.

Why: inside a CUDA graph the sampler cannot read a device value on the host, so
``probs_from_logits(capturable=True)`` stable-sorts every row of the vocabulary. On the H200 at
batch 64, width 5, that sort plus block verification made a sampled verify cost 7.4 ms against
4.2 ms greedy (docs/benchmarks.md, thirteenth session).

Here each row finds its boundary instead. The kept set under "sorted descending, ties by id" is a
prefix. Its last token has value ``t*``, the smallest value ``x`` with ``mass(p > x) <= top_p`` and
``count(p > x) < top_k``. ``t*`` is found by a search over the bits of a float (positive floats
order like their bit patterns), from (1 - top_p) / V up. Each pass over the row (it stays in L2)
tests 2 thresholds at once, 4,096 entries a load (16 warps): 18 passes where bisection took 32,
each with more loads in flight. On the H200, 320 rows: 0.45 ms against 0.91 ms for the
bisection and 2.3 ms for the sort (more thresholds a pass cost more than the passes they save;
docs/benchmarks.md, seventeenth session). Of the tokens tied at
``t*``, the lowest ids are kept while the rule still holds. min-p is a plain threshold.

Same keep rule as :func:`dflash2.sampling._drop`. Sums are in a different order than the
sort-then-cumsum reference, so a row whose cumulative mass lands within rounding of ``top_p`` may
keep one token more or less. Every path that serves a request uses the same function, so sampling
stays exact for that function.

:func:`dflash2.sampling.truncate_sorted` is the sort-based reference. CPU tests check the kernel
against it under Triton's interpreter.
"""

from __future__ import annotations

import torch

from .live_attention import triton, use_triton

if triton is not None:
    import triton.language as tl


def truncate(
    probs: torch.Tensor,
    k: torch.Tensor,
    tp: torch.Tensor,
    mp: torch.Tensor,
    candidates: int = 2,
    block: int = 4096,
    num_warps: int = 16,
) -> torch.Tensor:
    """``probs [R, V]`` with what top-k / top-p / min-p drop zeroed (``k``, ``tp``, ``mp``: ``[R, 1]``),
    as :func:`dflash2.sampling.truncate_sorted`, where Triton runs (CUDA, or its interpreter).
    ``candidates`` thresholds are tried per pass over a row (a power of two); ``block`` entries a load."""
    if not use_triton(probs.device):
        raise RuntimeError("the truncation kernel needs Triton (CUDA, or TRITON_INTERPRET=1)")
    R, V = probs.shape
    p = probs.contiguous()
    out = torch.empty_like(p)
    kk = k.reshape(R).to(torch.int64).contiguous()
    _truncate_kernel[(R,)](
        p,
        out,
        kk,
        tp.reshape(R).float().contiguous(),
        mp.reshape(R).float().contiguous(),
        V,
        BLOCK=block,
        NC=candidates,
        num_warps=num_warps,
    )
    return out


if triton is not None:

    @triton.jit
    def _row_stats(P, V, x, BLOCK: tl.constexpr):
        """mass and count of the row's entries strictly above ``x``."""
        mass = tl.zeros([BLOCK], dtype=tl.float32)
        count = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            v = tl.load(P + cols, mask=cols < V, other=0.0)
            above = v > x
            mass += tl.where(above, v, 0.0)
            count += above.to(tl.int32)
        return tl.sum(mass, 0), tl.sum(count, 0)

    @triton.jit
    def _truncate_kernel(PROBS, OUT, K, TP, MP, V, BLOCK: tl.constexpr, NC: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        P = PROBS + row * V
        O = OUT + row * V
        k = tl.load(K + row)
        tp = tl.load(TP + row)
        mp = tl.load(MP + row)
        top_k = (k > 0) & (k < V)
        top_p = tp < 1.0
        pmax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            pmax = tl.maximum(pmax, tl.load(P + cols, mask=cols < V, other=0.0))
        vmax = tl.max(pmax, 0)
        # the smallest x (as float bits) with mass(p > x) <= tp and count(p > x) < k: true at x = vmax.
        # Below (1 - tp) / V it is false under top-p (the entries at or below x hold at most V * x),
        # so the search starts there (halved: rounding).
        hi = vmax.to(tl.int32, bitcast=True)
        x0 = tl.where(top_p, 0.5 * (1.0 - tp) / V, 0.0)
        lo = tl.minimum(x0.to(tl.int32, bitcast=True), hi)
        js = tl.arange(0, NC)
        no_p = (~top_p).to(tl.int32)
        no_k = (~top_k).to(tl.int32)
        while lo < hi:  # NC candidates per pass over the row: the interval shrinks NC + 1 times
            mids = lo + ((hi - lo).to(tl.int64) * (js + 1) // (NC + 1)).to(tl.int32)
            xs = mids.to(tl.float32, bitcast=True)
            mass = tl.zeros([NC, BLOCK], dtype=tl.float32)
            count = tl.zeros([NC, BLOCK], dtype=tl.int32)
            for start in range(0, V, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                v = tl.load(P + cols, mask=cols < V, other=0.0)
                above = v[None, :] > xs[:, None]
                mass += tl.where(above, v[None, :], 0.0)
                count += above.to(tl.int32)
            m = tl.sum(mass, 1)
            c = tl.sum(count, 1)
            # monotone in x: False .. False True .. True (as ints: the interpreter's | needs equal dtypes)
            ok = (((m <= tp).to(tl.int32) | no_p) & ((c < k).to(tl.int32) | no_k)) != 0
            hi = tl.min(tl.where(ok, mids, hi), 0)
            lo = tl.max(tl.where(ok, lo, mids + 1), 0)
        t = hi.to(tl.float32, bitcast=True)
        mass, count = _row_stats(P, V, t, BLOCK)
        # of the tokens tied at t, the lowest ids while the rule holds: j-th tie (from 0) kept iff
        # mass + j * t <= tp and count + j < k
        allowed = tl.where(top_k, k - count, V).to(tl.float32)
        allowed = tl.where(top_p & (t > 0), tl.minimum(allowed, tl.floor((tp - mass) / t) + 1.0), allowed)
        floor_m = vmax * mp  # min-p: keep p >= max * min_p
        seen = tl.zeros([], dtype=tl.int32)  # ties met in the blocks before
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < V
            v = tl.load(P + cols, mask=inside, other=0.0)
            tie = (v == t) & inside
            rank = seen + tl.cumsum(tie.to(tl.int32), 0) - 1
            keep = ((v > t) | (tie & (rank.to(tl.float32) < allowed))) & (v >= floor_m)
            tl.store(O + cols, tl.where(keep, v, 0.0), mask=inside)
            seen += tl.sum(tie.to(tl.int32), 0)
