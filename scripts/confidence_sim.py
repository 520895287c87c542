"""#22: how well does the draft's own confidence (``scripts/confidence_trace.py``) predict
acceptance, against what the planner uses now (each request's decayed past acceptance per position)?

    .venv/bin/python scripts/confidence_sim.py TRACE.jsonl [--costs 1:c1,2:c2,...,8:c8 --draft-ms D]

Prints, per temperature: (1) each estimator's log-loss and AUC of "draft i accepted, given drafts
< i were", online (every estimate uses only earlier steps; the logistic fits are refit from earlier
steps only); (2) with a step-cost model (ms of the verify at each width; the draft's ms), tokens per
ms of three policies over the same steps: the full width always, the width chosen before drafting
from past acceptance (the planner's model), and the width chosen after drafting from the
confidence-based estimate (the draft's cost is then spent whatever width is verified). Truncating a
step at width w' commits min(n, w' - 1) + 1 tokens of the full-width outcome n (exact for greedy
verification; token-level semantics for block verification, an approximation)."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np


def logit(p):
    p = np.clip(np.asarray(p, dtype=float), 1e-4, 1 - 1e-4)
    return np.log(p / (1 - p))


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    pos, neg = scores[labels == 1], scores[labels == 0]
    if not len(pos) or not len(neg):
        return float("nan")
    order = np.argsort(np.concatenate([pos, neg]), kind="stable")
    ranks = np.empty(len(order))
    ranks[order] = np.arange(1, len(order) + 1)
    return float((ranks[: len(pos)].sum() - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg)))


def fit_logistic(X: np.ndarray, y: np.ndarray, l2: float = 1e-2, iters: int = 25) -> np.ndarray:
    """Newton's method on the L2-penalised log-likelihood; ``X`` carries its own bias column."""
    w = np.zeros(X.shape[1])
    for _ in range(iters):
        p = 1 / (1 + np.exp(-X @ w))
        g = X.T @ (p - y) + l2 * w
        H = (X * (p * (1 - p))[:, None]).T @ X + l2 * np.eye(X.shape[1])
        w -= np.linalg.solve(H, g)
    return w


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("--costs", default="", help="verify ms by width, e.g. 1:30,2:33,...")
    ap.add_argument("--draft-ms", type=float, default=0.0)
    ap.add_argument("--refit-every", type=int, default=200, help="steps between the logistic refits")
    args = ap.parse_args()
    rows = [json.loads(line) for line in open(args.trace)]
    costs = {int(a): float(b) for a, b in (p.split(":") for p in args.costs.split(","))} if args.costs else {}
    for T in sorted({r["T"] for r in rows}):
        steps = [r for r in rows if r["T"] == T]  # in the order they ran (requests one after another)
        report(T, steps, costs, args.draft_ms, args.refit_every)


def report(T: float, steps: list[dict], costs: dict[int, float], draft_ms: float, refit_every: int) -> None:
    g = len(steps[0]["sel"])
    # --- online estimates, per step and position: P(draft i accepted | drafts < i accepted) ---
    hist_cnt: dict[tuple, np.ndarray] = {}
    glob = np.zeros((2, g))  # decayed every request's (accepted, reached)
    est = {k: np.zeros((len(steps), g)) for k in ("position", "history", "sel", "sel+history", "top", "margin")}
    feats = {"sel": [], "top": [], "margin": []}
    fits: dict[str, list] = {}
    X_hist: list[np.ndarray] = []
    y_hist: list[np.ndarray] = []
    reach_hist: list[np.ndarray] = []
    for s_i, s in enumerate(steps):
        key = (s["suite"], s["prompt"])
        c = hist_cnt.setdefault(key, np.zeros((2, g)))
        prior = (glob[0] + 0.9 * 20) / (glob[1] + 20)  # the planner's pseudo-drafts toward a 0.9 prior
        pos_rate = prior
        hist = (c[0] + 2 * prior) / (c[1] + 2)  # shrunk toward every request's rate (prior_weight 2)
        est["position"][s_i] = pos_rate
        est["history"][s_i] = hist
        f = {k: np.asarray(s[k], dtype=float) for k in feats}
        xs = {
            "sel": np.stack([np.ones(g), logit(f["sel"])], 1),
            "top": np.stack([np.ones(g), logit(f["top"])], 1),
            "margin": np.stack([np.ones(g), f["margin"]], 1),
            "sel+history": np.stack([np.ones(g), logit(f["sel"]), logit(hist)], 1),
        }
        for name, X in xs.items():
            if name not in fits or not fits[name]:
                est[name][s_i] = hist if name == "sel+history" else pos_rate
            else:
                # one fit per position (a column of weights each), refit from earlier steps only
                W = fits[name]
                est[name][s_i] = [1 / (1 + math.exp(-X[i] @ W[min(i, len(W) - 1)])) for i in range(g)]
        n = s["n"]
        acc = (np.arange(g) < n).astype(float)
        reached = (np.arange(g) <= n).astype(float)
        X_hist.append(np.stack([xs[k] for k in ("sel", "top", "margin")], 0))
        y_hist.append(acc)
        reach_hist.append(reached)
        c *= 0.9
        c += np.stack([acc, reached])
        glob *= 0.995
        glob += np.stack([acc, reached])
        if (s_i + 1) % refit_every == 0:  # refit every logistic model on every step so far, per position
            Y, R = np.array(y_hist), np.array(reach_hist)
            for name in ("sel", "top", "margin", "sel+history"):
                W = []
                for i in range(g):
                    m = R[:, i] > 0
                    if name == "sel+history":
                        Xi = np.stack(
                            [
                                np.ones(m.sum()),
                                logit([st["sel"][i] for st, mm in zip(steps, m) if mm]),
                                logit(est["history"][: len(m)][m, i]),
                            ],
                            1,
                        )
                    else:
                        j = ("sel", "top", "margin").index(name)
                        Xi = np.array(X_hist)[m, j, i]
                    W.append(fit_logistic(Xi, Y[m, i]) if m.sum() > 20 else np.zeros(Xi.shape[1]))
                fits[name] = W
    n_all = np.array([s["n"] for s in steps])
    reached = np.arange(g)[None] <= n_all[:, None]
    accepted = np.arange(g)[None] < n_all[:, None]
    warm = np.arange(len(steps)) >= refit_every  # every estimator compared after the first fit
    print(
        f"\nT={T}: {len(steps)} steps, {len({(s['suite'], s['prompt']) for s in steps})} requests, AL at width {g + 1}: "
        f"{(n_all + 1).mean():.3f}; scored steps (after the first {refit_every}): {warm.sum()}"
    )
    print("estimator     | log-loss (conditional, all positions) | AUC pos 1 | AUC pos 2 | AUC pos 3")
    for name, e in est.items():
        m = reached & warm[:, None]
        p = np.clip(e[m], 1e-4, 1 - 1e-4)
        y = accepted[m]
        ll = -(y * np.log(p) + (1 - y) * np.log(1 - p)).mean()
        aucs = [auc(e[m[:, i], i], accepted[m[:, i], i]) for i in range(3)]
        print(f"{name:13s} | {ll:.4f} | " + " | ".join(f"{a:.3f}" for a in aucs))
    if not costs:
        return
    # --- policies over the warm steps: tokens / ms ---
    W = max(costs)
    widths = sorted(w for w in costs if w <= g + 1)

    def committed(n: int, w: int) -> int:
        return min(n, w - 1) + 1

    def expected(rates: np.ndarray, w: int) -> float:  # 1 + sum_{j < w-1} prod_{i <= j} a_i
        return 1 + float(np.cumprod(rates)[: w - 1].sum())

    idx = np.nonzero(warm)[0]
    out = {}
    full = sum(committed(int(n_all[i]), W) for i in idx), len(idx) * (costs[W] + draft_ms)
    out[f"full width {W}"] = full
    plain = len(idx), len(idx) * costs[1]
    out["target alone"] = plain

    def before(a: np.ndarray) -> int:  # before drafting: every width, 1 (no draft) included
        return max(widths, key=lambda w: expected(a, w) / (costs[w] + (draft_ms if w > 1 else 0)))

    def after(a: np.ndarray) -> int:  # after drafting: the draft is spent; among the widths >= 2
        return max([w for w in widths if w > 1], key=lambda w: expected(a, w) / (costs[w] + draft_ms))

    policies = {
        "history, before drafting": lambda i: before(est["history"][i]),
        "sel, after drafting": lambda i: after(est["sel"][i]),
        "sel+history, after drafting": lambda i: after(est["sel+history"][i]),
        "history then sel+history": lambda i: before(est["history"][i]) > 1 and after(est["sel+history"][i]),
        "oracle width, after drafting": lambda i: min(int(n_all[i]) + 1, W),
    }
    for name, pick in policies.items():
        tok = ms = 0.0
        for i in idx:
            w = int(pick(i)) or 1
            tok += committed(int(n_all[i]), w)
            ms += costs[w] + (draft_ms if w > 1 else 0)
        out[name] = (tok, ms)
    base = plain[0] / plain[1]
    for k, (tok, ms) in out.items():
        print(f"  {k:32s} {tok / ms * 1000:8.1f} tok/s  {tok / ms / base:.3f}x  (tokens/step {tok / len(idx):.2f})")


if __name__ == "__main__":
    main()
