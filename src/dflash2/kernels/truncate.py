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

:func:`fused_probs` (the graphs' sampler) gathers the entries that can matter (at or above the search's
lower end) into a scratch row as it writes the probabilities, and each pass of its search reads only
the entries still in the bracket, gathered down as the bracket narrows; the mass and count above the
final threshold come from the search. On the H100, 64-640 rows: 3-15% quicker than bisecting over
whole rows, the search's passes being a small part of the kernel (forty-sixth session).

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


def fused_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    k: torch.Tensor,
    tp: torch.Tensor,
    mp: torch.Tensor,
    greedy_below: float,
    candidates: int = 2,
    block: int | None = None,
    num_warps: int | None = None,
    shrink: bool = True,
) -> torch.Tensor:
    """``probs_from_logits(capturable=True, kernel="truncate")`` in one kernel: rows of ``logits [R,
    V]`` (any float dtype) -> float32 probabilities (``temperature``, ``k``, ``tp``, ``mp``: ``[R, 1]``).
    Why: that path is seven passes over every row in memory (the float copy, the temperature, the
    softmax, the truncation, the sum and the division of the renormalisation, the greedy rows'
    one-hot); here the logits are read twice, the row is written once, and the truncation's passes and
    the renormalisation stay with the row (in L2). Keeps what :func:`truncate` keeps, normalised over
    the kept values; a greedy row (``temperature < greedy_below``) is one-hot at its first argmax.
    ``shrink``: the threshold search passes over a scratch copy of the entries still in its bracket,
    gathered down as the bracket narrows (:func:`_threshold_shrink`); else it bisects over the whole
    row (the kernel of sessions 42-45). ``block`` entries a load and ``num_warps`` (None: by the row
    count, :func:`fused_launch`)."""
    if not use_triton(logits.device):
        raise RuntimeError("the fused sampler kernel needs Triton (CUDA, or TRITON_INTERPRET=1)")
    R, V = logits.shape
    auto_block, auto_warps = fused_launch(R)
    block, num_warps = block or auto_block, num_warps or auto_warps
    x = logits.contiguous()
    out = torch.empty(R, V, dtype=torch.float32, device=x.device)
    scratch = torch.empty(R if shrink else 1, V if shrink else 1, dtype=torch.float32, device=x.device)
    flat = [t.reshape(R).contiguous() for t in (temperature.float(), k.to(torch.int64), tp.float(), mp.float())]
    _fused_kernel[(R,)](
        x, out, scratch, *flat, V, greedy_below, BLOCK=block, NC=candidates, SHRINK=shrink, num_warps=num_warps
    )
    return out


def fused_launch(rows: int) -> tuple[int, int]:
    """(entries a load, warps) of :func:`fused_probs` for ``rows`` rows. Why: on the H100 (forty-sixth
    session) 4,096 entries and 16 warps were quickest at 64-128 rows (0.145 / 0.154 ms against 0.153 /
    0.172 for 2,048 and 8), 2,048 and 8 at 320-640 (0.338 / 0.580 ms against 0.357 / 0.688): more
    programs fit an SM once every SM has rows to run."""
    return (2048, 8) if rows >= 256 else (4096, 16)


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
    def _ok(mass, count, tp, k, no_p, no_k):
        """The search's test at a threshold: mass(p > x) <= tp (top-p) and count(p > x) < k (top-k)."""
        # (as ints: the interpreter's | needs equal dtypes)
        return (((mass <= tp).to(tl.int32) | no_p) & ((count < k).to(tl.int32) | no_k)) != 0

    @triton.jit
    def _lower_end(V, tp, top_p):
        """The threshold search's lower end as a float: (1 - tp) / 2V under top-p (see :func:`_bracket`), else 0."""
        return tl.where(top_p, 0.5 * (1.0 - tp) / V, 0.0)

    @triton.jit
    def _bracket(V, tp, top_k, top_p, vmax):
        """The threshold search's start (float bits): ``hi`` at the row's largest entry, where the test
        passes; ``lo`` at (1 - tp) / 2V under top-p (below (1 - tp) / V it fails: the entries at or
        below x hold at most V * x; halved for rounding), else 0; and the rules that are off, as ints."""
        hi = vmax.to(tl.int32, bitcast=True)
        lo = tl.minimum(_lower_end(V, tp, top_p).to(tl.int32, bitcast=True), hi)
        return lo, hi, (~top_p).to(tl.int32), (~top_k).to(tl.int32)

    @triton.jit
    def _split(P, V, lo, hi, js, BLOCK: tl.constexpr, NC: tl.constexpr):
        """One pass of the threshold search: ``NC`` points splitting ``(lo, hi]`` (float bits) evenly, and
        the mass and count of the row's entries above each."""
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
        return mids, tl.sum(mass, 1), tl.sum(count, 1)

    @triton.jit
    def _threshold(P, V, k, tp, top_k, top_p, vmax, BLOCK: tl.constexpr, NC: tl.constexpr):
        """The kept set's last value ``t*``: the smallest x (as float bits) with mass(p > x) <= tp and
        count(p > x) < k, bisected from :func:`_bracket`'s ends."""
        lo, hi, no_p, no_k = _bracket(V, tp, top_k, top_p, vmax)
        js = tl.arange(0, NC)
        while lo < hi:  # NC candidates per pass over the row: the interval shrinks NC + 1 times
            mids, m, c = _split(P, V, lo, hi, js, BLOCK, NC)
            ok = _ok(m, c, tp, k, no_p, no_k)  # monotone in x: False .. False True .. True
            hi = tl.min(tl.where(ok, mids, hi), 0)
            lo = tl.max(tl.where(ok, lo, mids + 1), 0)
        return hi.to(tl.float32, bitcast=True)

    @triton.jit
    def _write_kept(P, O, V, t, mass, count, k, tp, top_k, top_p, floor_m, BLOCK: tl.constexpr):
        """``O`` = the entries of ``P`` that are kept, 0 elsewhere (``O`` may be ``P``); returns their sum.
        ``mass``, ``count``: the row's entries above t. Of the tokens tied at t, the lowest ids while the
        rule holds: the j-th tie (from 0) is kept iff mass + j * t <= tp and count + j < k; min-p keeps p
        >= floor_m."""
        allowed = tl.where(top_k, k - count, V).to(tl.float32)
        allowed = tl.where(top_p & (t > 0), tl.minimum(allowed, tl.floor((tp - mass) / t) + 1.0), allowed)
        seen = tl.zeros([], dtype=tl.int32)  # ties met in the blocks before
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < V
            v = tl.load(P + cols, mask=inside, other=0.0)
            tie = (v == t) & inside
            rank = seen + tl.cumsum(tie.to(tl.int32), 0) - 1
            keep = ((v > t) | (tie & (rank.to(tl.float32) < allowed))) & (v >= floor_m)
            kept = tl.where(keep, v, 0.0)
            tl.store(O + cols, kept, mask=inside)
            total += kept
            seen += tl.sum(tie.to(tl.int32), 0)
        return tl.sum(total, 0)

    @triton.jit
    def _row_max(P, V, BLOCK: tl.constexpr):
        pmax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            pmax = tl.maximum(pmax, tl.load(P + cols, mask=cols < V, other=0.0))
        return tl.max(pmax, 0)

    @triton.jit
    def _truncate_row(P, O, V, k, tp, mp, top_k, top_p, BLOCK: tl.constexpr, NC: tl.constexpr):
        """``O`` = what top-k (where ``top_k``) / top-p (where ``top_p``) / min-p keep of ``P``; their sum."""
        vmax = _row_max(P, V, BLOCK)
        t = _threshold(P, V, k, tp, top_k, top_p, vmax, BLOCK, NC)
        mass, count = _row_stats(P, V, t, BLOCK)
        return _write_kept(P, O, V, t, mass, count, k, tp, top_k, top_p, vmax * mp, BLOCK)

    @triton.jit
    def _truncate_kernel(PROBS, OUT, K, TP, MP, V, BLOCK: tl.constexpr, NC: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        k, tp = tl.load(K + row), tl.load(TP + row)
        _truncate_row(
            PROBS + row * V, OUT + row * V, V, k, tp, tl.load(MP + row), (k > 0) & (k < V), tp < 1.0, BLOCK, NC
        )

    @triton.jit
    def _append_selected(S, m, v, sel):
        """``S[m:]`` = the entries of ``v`` where ``sel``, in order (each written where the cumsum says);
        returns the new length."""
        tl.store(S + m + tl.cumsum(sel.to(tl.int32), 0) - 1, v, mask=sel)
        return m + tl.sum(sel.to(tl.int32), 0)

    @triton.jit
    def _gather(P, S, n, lo, hi, BLOCK: tl.constexpr):
        """``S[:m]`` = the entries of ``P[:n]`` whose float bits lie in ``[lo, hi]``, in order; returns m.
        ``S`` may be ``P``: an entry moves only down, and a block's stores wait on its cumsum, which
        waits on every warp's load of that block."""
        m = tl.zeros([], dtype=tl.int32)
        for start in range(0, n, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < n
            v = tl.load(P + cols, mask=inside, other=0.0)
            bits = v.to(tl.int32, bitcast=True)
            m = _append_selected(S, m, v, inside & (bits >= lo) & (bits <= hi))
        return m

    @triton.jit
    def _threshold_shrink(S, n, k, tp, no_p, no_k, lo, hi, BLOCK: tl.constexpr, NC: tl.constexpr):
        """:func:`_threshold`'s answer (the smallest x, as float bits, that passes :func:`_ok`) with the
        mass and count of the row above it, each pass over ``S[:n]`` only: the row's entries in the
        bracket ``[lo, hi]`` (gathered by the caller). Entries below the bracket are never above a
        threshold tried; those above it are counted once, when they leave it. Whenever the bracket holds
        at most half of ``S``, ``S`` is gathered down to it. Why: bisecting over the whole row is ~17
        passes of 49,152 entries; this way the fused kernel was 3-15% quicker on the H100 at 64-640 rows
        (docs/benchmarks.md, forty-sixth session)."""
        js = tl.arange(0, NC)
        c_base = tl.zeros([], dtype=tl.int32)  # the entries above S's bracket: count, mass
        m_base = tl.zeros([], dtype=tl.float32)
        c_hi = tl.zeros([], dtype=tl.int32)  # entries above hi (the row's largest at first: none)
        m_hi = tl.zeros([], dtype=tl.float32)
        c_lo = n  # entries at or above lo
        while lo < hi:
            mids, m, c = _split(S, n, lo, hi, js, BLOCK, NC)
            m += m_base
            c += c_base
            ok = _ok(m, c, tp, k, no_p, no_k)  # monotone in x: False .. False True .. True
            j_hi = tl.min(tl.where(ok, js, NC), 0)  # the first that passes: the new hi
            j_lo = tl.max(tl.where(ok, -1, js), 0)  # the last that fails: the new lo is just above it
            c_hi = tl.where(j_hi < NC, tl.sum(tl.where(js == j_hi, c, 0), 0), c_hi)
            m_hi = tl.where(j_hi < NC, tl.sum(tl.where(js == j_hi, m, 0.0), 0), m_hi)
            c_lo = tl.where(j_lo >= 0, tl.sum(tl.where(js == j_lo, c, 0), 0), c_lo)
            hi = tl.min(tl.where(ok, mids, hi), 0)
            lo = tl.max(tl.where(ok, lo, mids + 1), 0)
            if (lo < hi) & (2 * (c_lo - c_hi) <= n):
                n = _gather(S, S, n, lo, hi, BLOCK)
                c_base, m_base = c_hi, m_hi
        return hi.to(tl.float32, bitcast=True), m_hi, c_hi

    @triton.jit
    def _fused_kernel(
        LOGITS, OUT, S, TEMP, K, TP, MP, V, greedy_below, BLOCK: tl.constexpr, NC: tl.constexpr, SHRINK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        X, O, S = LOGITS + row * V, OUT + row * V, S + row * V
        temp, k, tp, mp = tl.load(TEMP + row), tl.load(K + row), tl.load(TP + row), tl.load(MP + row)
        greedy = temp < greedy_below
        tdiv = tl.where(greedy, 1.0, temp)  # divided, not multiplied by 1 / T: the unfused path's rounding
        top_k = (k > 0) & (k < V) & ~greedy
        top_p = (tp < 1.0) & ~greedy
        cut = top_k | top_p | ((mp > 0.0) & ~greedy)
        # pass 1: per lane the running max of x / T and the sum of exp below it; the first argmax
        lane_m = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
        lane_s = tl.zeros([BLOCK], dtype=tl.float32)
        best = tl.full([], float("-inf"), dtype=tl.float32)
        best_i = tl.zeros([], dtype=tl.int32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(X + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
            y = x / tdiv
            new_m = tl.maximum(lane_m, y)
            ref = tl.where(new_m == float("-inf"), 0.0, new_m)  # (a lane of -inf so far: no inf - inf)
            lane_s = lane_s * tl.exp(lane_m - ref) + tl.exp(y - ref)
            lane_m = new_m
            bm = tl.max(x, 0)
            bi = tl.argmax(x, 0, tie_break_left=True).to(tl.int32) + start
            best_i = tl.where(bm > best, bi, best_i)  # strictly: a tie in a later block keeps the first
            best = tl.maximum(best, bm)
        m = tl.max(lane_m, 0)
        s = tl.sum(tl.where(lane_m == float("-inf"), 0.0, lane_s * tl.exp(lane_m - m)), 0)
        # pass 2: the probabilities into the row (a greedy row: one-hot at the first argmax); SHRINK: the
        # entries at or above the search's lower end gathered into S as they go (below it, an entry is
        # never above a threshold the search tries: see _bracket)
        gather_from = tl.where(top_k | top_p, _lower_end(V, tp, top_p), float("inf"))  # (no search: none)
        n = tl.zeros([], dtype=tl.int32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < V
            x = tl.load(X + cols, mask=inside, other=float("-inf")).to(tl.float32)
            p = tl.exp(x / tdiv - m) / s
            p = tl.where(greedy, tl.where(cols == best_i, 1.0, 0.0), p)
            tl.store(O + cols, p, mask=inside)
            if SHRINK:
                n = _append_selected(S, n, p, inside & (p >= gather_from))
        if cut:
            # the row is read back by other threads of the program than wrote it: make the writes seen
            tl.debug_barrier()
            # the row's largest probability is the first argmax's, written above: one load, not a pass
            # (x / T and the softmax are monotone, so no entry lies above it)
            vmax = tl.load(O + best_i)
            if SHRINK:
                lo, hi, no_p, no_k = _bracket(V, tp, top_k, top_p, vmax)
                hi = tl.where(top_k | top_p, hi, lo)  # min-p alone: every x passes, so the answer is lo
                t, mass, count = _threshold_shrink(S, n, k, tp, no_p, no_k, lo, hi, BLOCK, NC)
            else:
                t = _threshold(O, V, k, tp, top_k, top_p, vmax, BLOCK, NC)
                mass, count = _row_stats(O, V, t, BLOCK)
            inv = 1.0 / _write_kept(O, O, V, t, mass, count, k, tp, top_k, top_p, vmax * mp, BLOCK)
            tl.debug_barrier()
            for start in range(0, V, BLOCK):  # the kept values renormalised (the row is in L2)
                cols = start + tl.arange(0, BLOCK)
                inside = cols < V
                tl.store(O + cols, tl.load(O + cols, mask=inside, other=0.0) * inv, mask=inside)
