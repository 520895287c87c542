"""The model card's acceptance metrics over a suite of requests (spec section 5)."""

from __future__ import annotations


def aggregate(C: list[int], V: list[int]) -> dict:
    """Per request ``C`` completion tokens and ``V`` verification steps ->
    ``acc_len`` = mean(C/V), ``weighted_al`` = sum(C * L) / sum(C), ``pooled_al`` = sum(C) / sum(V)."""
    pairs = [(c, v) for c, v in zip(C, V) if v > 0]
    if not pairs:
        return {"samples": 0, "acc_len": 0.0, "weighted_al": 0.0, "pooled_al": 0.0}
    L = [c / v for c, v in pairs]
    sc = sum(c for c, _ in pairs)
    return {
        "samples": len(pairs),
        "acc_len": sum(L) / len(L),
        "weighted_al": sum(c * l for (c, _), l in zip(pairs, L)) / sc,
        "pooled_al": sc / sum(v for _, v in pairs),
    }


def per_position(hist: list[int]) -> list[float]:
    """``hist[n]`` = steps that accepted n drafts -> fraction of steps accepting position i (1-based)."""
    steps = max(sum(hist), 1)
    return [sum(hist[i:]) / steps for i in range(1, len(hist))]
