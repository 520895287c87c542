"""Adaptive speculation: each step, the verify width that maximises expected committed tokens per
second of step time, 1 (the target alone: no draft forward at all) included. Lossless whatever it
picks: every step is a complete speculative step at its width.

- Step cost per (batch bucket, width): a profile measured at start-up (the graph runner's replays)
  or injected, then an online average of the steps actually run, so host overhead counts too.
- Acceptance per request and draft position: ``a[r, i]``, the probability that draft ``i`` is
  accepted once drafts ``1 .. i-1`` were, an exponentially weighted count of (accepted, reached)
  per position, shrunk toward every request's rate at that position (cold start: an optimistic
  prior, so new traffic verifies full blocks until the counts say otherwise; where every width can
  run, width 2 first, the cheapest step that sees acceptance). Expected committed
  tokens at width ``w``: ``1 + sum_{j < w} prod_{i <= j} a[r, i]``. Per position, not one rate:
  a greedy streak makes later drafts likelier to pass (the one-rate model under-counted them).
- Decisions are keyed on the decode requests only (prefills do not count) and switch only when the
  other width is ``hysteresis`` better. Every ``probe_every`` steps at one width, one step runs the
  other (width 1 observes no acceptance, and an unused width's cost goes stale as contexts grow;
  width 1 only where it is within ``probe_reach`` of winning).
  A width never run at a bucket is costed from the other width there and the latest ratio of the
  two seen anywhere, else between the nearest buckets where it ran, so each new batch size does not
  have to try both (graphs; widths between the two ends: linear between them). Where the runner can
  run any width (the eager paged runner), a shape that has not run is priced by its tokens (a fixed
  part and a part per token, fitted over what ran), and the best of every width is taken. A
  one-token step is never priced above a wider one at the same bucket.
- Whether a new request drafts at all (:meth:`Planner.speculate_new`), once, at admission: where
  the best drafting width cannot beat the target alone at that load, it does not, and keeps no
  draft context (no drafter work in its prefill or its steps, one token of KV lookahead). Width 1
  of a drafting request still writes its draft context (15% over the target alone's step on the
  H200 at 8-64 rows, docs/benchmarks.md), so per-step choices alone cannot reach the target's
  speed under load; a batch of such requests runs the target alone (cost key width 0). When the
  load drops, new ones draft again.
- Whether running requests stop drafting (:meth:`Planner.retire`): the requests admitted at the
  cold start draft, and where drafting then turns out not to pay at the load (every request's
  acceptance, the measured costs), the drafting requests of a batch stop for good rather than
  drain as they finish. A batch that mixes drafting and non-drafting requests cannot draft (one
  width a step), so its drafting ones stop too where a new request would not draft: else they
  pay their drafter upkeep at width 1 for nothing (0.85x of the target alone on the H200 at 8
  requests, T=1, docs/benchmarks.md, eighteenth session). Either stop for good waits, where the
  target alone's step would be priced off a start-up replay (graphs), until a one-token step has
  run at that bucket (a width-1 probe: :attr:`PlannerConfig.plain_probes`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

MODES = ("auto", "off")


def parse_schedule(text: str | None, width: int) -> tuple[tuple[int, int], ...]:
    """``"8:8,32:5"`` -> ((8, 8), (32, 5)): up to 8 decode requests width 8, up to 32 width 5, more:
    width 1 (TensorRT-LLM's ``draft_len_schedule``). Widths must be 1 or the engine's width."""
    if not text:
        return ()
    pairs = []
    for part in text.split(","):
        try:
            b, w = (int(x) for x in part.split(":"))
        except ValueError:
            raise ValueError(f"--speculative-width-schedule: {part!r} is not BATCH:WIDTH") from None
        if b < 1 or w not in (1, width):
            raise ValueError(
                f"--speculative-width-schedule: {part!r}: batch >= 1 and width 1 or {width} "
                f"(the verify widths the runner has)"
            )
        pairs.append((b, w))
    return tuple(sorted(pairs))


def parse_widths(text: str | None, width: int) -> tuple[int, ...]:
    """``"2,3"`` -> (2, 3): verify widths between 1 and the full ``width`` for the planner to pick among
    (``--speculative-planner-widths``: the graph runner captures them too)."""
    if not text:
        return ()
    try:
        widths = tuple(sorted({int(x) for x in text.split(",")}))
    except ValueError:
        raise ValueError(f"--speculative-planner-widths: {text!r} is not a list of widths, e.g. 3 or 2,3") from None
    if any(not 1 < w < width for w in widths):
        raise ValueError(
            f"--speculative-planner-widths: {text!r}: each width must lie between 1 and the full width {width} "
            f"(both are always there)"
        )
    return widths


@dataclass
class PlannerConfig:
    mode: str = "off"  # auto: plan each step; off: always the full width (the default: docs/benchmarks.md)
    schedule: tuple[tuple[int, int], ...] = ()  # pinned (max batch, width) pairs; overrides auto
    hysteresis: float = 0.05  # the other width must promise this much more tokens/s
    probe_every: int = 32  # steps at one width between probes of the other
    # width 1 is probed only where its estimated tokens/s is within this much of the current width's:
    # each probe costs a step's drafts (on the H200 at T=0, one step in 32 at one token where drafting
    # gave 3.4: ~2% of the fixed width's speed, docs/benchmarks.md, nineteenth session). The upper end
    # is always probed (width 1 observes no acceptance): the full width, or width 2 where every width can
    # run and the batch sits at width 1
    probe_reach: float = 0.5
    prior: float = 0.9  # per-draft acceptance before anything is observed
    # pseudo-drafts of every request's rates in one request's estimate. Why 8: a request's last steps
    # predict its next one weakly (after two empty steps a draft is still accepted 43% of the time against
    # 50% overall, held-out chat at T=1), and with 2 a few bad steps sent one request to width 1 for ~10
    # steps (on the H100 at one held-out request, T=1, auto served 5% under the fixed width, in part other
    # sampled texts: 4 requests a round). Over traced CPU steps (scripts/cpu_planner_replay.py, 60
    # held-out and 12 GSM8K requests, T=0 and 1) 8 predicts the next step better than 2 everywhere
    # (log-loss 0.687 against 0.702 held-out T=1) and keeps auto within 1% of the fixed width at one
    # request; a request that never accepts still goes to width 1 (docs/benchmarks.md, forty-sixth session)
    prior_weight: float = 8.0
    prior_drafts: float = 20.0  # pseudo-drafts of the prior in every request's estimate, per position
    decay: float = 0.9  # per step, on a request's counts (recent steps matter most)
    cost_decay: float = 0.8  # weight of the old average when a step's time comes in
    # the same for a second, slower average of each measured cost, which prices the lifetime decisions
    # (admission, retirement: :meth:`Planner.drafting_gain`); the per-step width keeps the fast one. Why:
    # a step's cost grows with its requests' contexts, and those decisions fall where the contexts are
    # longest (a request, or a wave of them, finishing) and hold for requests that start short: on the H100
    # at 64 GSM8K requests, T=1, the fast average of the full width stood at 6.09 ms (its last 16 steps
    # 5.1-6.4 ms) against 5.52 over the row, and admission stopped drafting at a priced 1.05x where the
    # fixed widths served 1.13-1.22x; at one held-out request each retirement read 3.15 ms against a mean
    # of 2.99 (docs/benchmarks.md, forty-ninth session)
    decision_cost_decay: float = 0.98
    # a width between 1 and the full one must beat both ends by this much more: its cost is interpolated
    # until it runs (measured with the one-rate acceptance model of session 15: without a margin, greedy
    # at 16 requests on the CPU fell from 1.5x to 1.2x of the target alone)
    between_margin: float = 0.15
    # per request-step, on every request's per-position counts (the prior's): the same window in drafts
    # at every load (~500 request-steps). Why: decayed per step, one request's estimate was its last ~50
    # steps alone, and on the H200 at one request a run of bad drafts admitted the next request
    # without drafting (1.09x of the target alone where the fixed width gave 1.32x). Why 0.998, not
    # 0.995: at one request the window is the last few prompts, and the next prompt is another (held-out
    # chat prompts differ widely); replayed over traced steps with admission (scripts/cpu_planner_replay.py
    # --plain-ms, held-out and GSM8K, T=0 and 1) 0.998 predicts the next step better everywhere (log-loss
    # 0.6857 against 0.6869 held-out T=1) and held-out T=1 where drafting pays 1.17-1.29x goes from
    # 0.978-0.989 of the fixed width to 0.996-1.004, where it loses no worse (forty-seventh session)
    global_decay: float = 0.998
    # per step of the target alone, on what every request's drafts showed (the prior's pseudo-drafts come
    # back in its place: :meth:`AcceptanceCounts.fade`), so a load that stopped drafting tries it again.
    # Why 0.998 (~500 steps, ~4 requests of 128 tokens at one request): replayed as above (held-out T=1,
    # one-request costs with drafting at 0.81-1.25x of the target alone), auto stays within 0.4% of the
    # fixed width where drafting pays and within 2% of the target alone where it loses; 0.995 lost 4% of
    # the target alone's speed at 0.81x, 0.999 kept 20 more requests from drafting at break-even. Without
    # it, 141 of 180 requests never drafted (0.88 of the fixed width; on the H100 at one held-out request,
    # width 8, T=1: 1.00x of the target alone, 1.08x with it, forty-seventh session). Per step, not per
    # request-step: a batch that does not draft keeps admitting requests that do not (one width a step),
    # so the load tries again when it next drains, a whole wave drafting at once; per request-step that
    # was every burst at 16 requests (~30 steps), where a wave that cannot pay costs ~8 one-token steps
    plain_fade: float = 0.998
    # drafting's break-even is checked every this many steps (retirement is for good, so a few steps
    # late costs little; checked every step it was ~15-35 us of host work a step on the CPU)
    retire_every: int = 8
    # retirement reads the batch's gain averaged over its checks (this the old average's weight; the average
    # starts again with a batch of new requests; not at one request, whose stop ends with it). Why: for good,
    # on a batch's own acceptance, whose estimate at 8 held-out requests, T=1, has a spread (sd 0.066) the
    # size of the gain (1.07): checked every 8 steps, one check below break-even came within ~300 steps and
    # the batch ran the target alone for the rest of a steady queue. Replayed over traced steps (the engine's
    # rules, 8 and 32 requests, held-out T=1), 0.96 of the fixed width before, 1.00 with it (and
    # LLMEngine._joins), and a batch at a true 0.93-0.95 still stops within ~200 steps
    # (scripts/cpu_planner_replay.py --batch, fifty-first session)
    retire_smoothing: float = 0.9
    # steps measured at a bucket at one token (width 1 of the drafting requests, or the target alone)
    # before drafting stops there for good (retirement; admission that would mix the batch): a
    # probe at width 1 takes them (at most twice as many tries, where mixed prompts void the times).
    # Why: priced from its start-up replay times the live scale of other shapes, the target alone at
    # 128 requests read 15-25% cheaper than it ran (per-request host work is not in the replays), and
    # on the H200 the planner stopped drafting where the fixed width served 1.18x (T=1) and 1.27x
    # (held-out, T=0) of the target alone (docs/benchmarks.md, forty-second session)
    plain_probes: int = 2
    # a measured step cost not refreshed in this many steps is dropped: its shape reads the profile
    # times the live scale again. Why: on the H200 at 8 requests, T=1, the target alone's cost came
    # from a few steps at a transition (2.11 ms, where its steps cost 1.68) and priced width 0 for the
    # rest of the run, so the planner drafted at a loss (docs/benchmarks.md, twenty-first session)
    stale_after: int = 256
    # eager runners (every width can run): after the draft, verify only the drafts its confidence pays
    # for (:meth:`Planner.trim`); the calibration's counts decay by this per request-step
    trim: bool = False
    confidence_decay: float = 0.998
    widths: tuple[int, ...] = ()  # widths between 1 and the full one that auto may pick (parse_widths)

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"--speculative-planner must be one of {MODES}, got {self.mode!r}")
        names = (
            "hysteresis",
            "prior",
            "decay",
            "cost_decay",
            "decision_cost_decay",
            "between_margin",
            "global_decay",
            "probe_reach",
            "plain_fade",
            "retire_smoothing",
        )
        for name in (*names, "confidence_decay"):
            v = getattr(self, name)
            if not 0 <= v < 1 + (name == "hysteresis") * 9:
                raise ValueError(f"planner {name} out of range: {v}")
        if self.prior_drafts <= 0:
            raise ValueError(f"planner prior_drafts must be > 0, got {self.prior_drafts}")
        if min(self.retire_every, self.probe_every, self.stale_after, self.plain_probes) < 1:
            raise ValueError(
                "planner retire_every, probe_every, stale_after and plain_probes must be >= 1: "
                f"{self.retire_every}, {self.probe_every}, {self.stale_after}, {self.plain_probes}"
            )


class AcceptanceCounts:
    """Decayed (accepted, reached) counts per request and draft position, as one ``[rows, 2, W-1]``
    array (one gather and one scatter a step, not a Python loop over requests x positions on the
    hot path), and every request's, for the prior."""

    def __init__(self, positions: int, prior: float, prior_weight: float, prior_drafts: float):
        self.P, self.prior, self.k = positions, prior, prior_weight
        self.row: dict[str, int] = {}
        self.free: list[int] = []
        self._last: tuple[list[str], np.ndarray] = ([], np.zeros(0, dtype=np.int64))
        self.cnt = np.zeros((0, 2, positions))  # [row, (accepted, reached), position]
        # every request's counts start as the prior's pseudo-drafts (``prior_drafts`` reached at each
        # position), which decay with the rest: at first the prior, then what was seen. Why: kept for
        # good, the prior's 0.9 held the H200's held-out first-draft rate at 0.60 against ~0.4 seen at
        # one request (docs/benchmarks.md, seventeenth session), so drafting went on where it lost.
        # The pseudo-drafts of position i > 0 take the rate of position i - 1, not the prior: a position
        # seldom reached (the eager cold start's width 2 sees only the first) is guessed from the one
        # before it. Why: with 0.9 there, a first-draft rate of ~0.4 still priced a full block at 3.8
        # tokens a row, and the CPU planner ran 16-row full blocks at T=1 that cost 5x a one-token step
        # (docs/benchmarks.md, twenty-ninth session).
        self.pseudo = self.prior_drafts = float(prior_drafts)
        self.total = np.zeros((2, positions))  # [(accepted, reached), P], observed, decayed
        self._prior_rates = self._rates_of_total()
        # every row's P(draft i accepted) (the cumulative product of its rates), kept between steps so
        # the planner's choice is a gather and a sum; None: to be computed (the counts changed)
        self._reach: np.ndarray | None = None
        # what a step adds per request, by the step's drafts g and its accepted count n: position i
        # accepted when n > i, reached when n >= i and i < g. Why tables: the per-step update is a
        # gather, not a few comparisons per step (planner host work is a share of a 3 ms step)
        pos, n = np.arange(positions)[None], np.arange(positions + 1)[:, None]
        self._add = [np.stack([pos < n, (pos <= n) & (pos < g)], axis=1).astype(float) for g in range(positions + 1)]

    def rows(self, rids: list[str]) -> np.ndarray:
        if rids == self._last[0]:  # the same batch as the last call (most steps): its rows as they were
            return self._last[1]
        for rid in rids:
            if rid not in self.row:
                if not self.free:  # grow: double the rows
                    n, m = len(self.cnt), max(2 * len(self.cnt), 8)
                    self.free = list(range(m - 1, n - 1, -1))
                    self.cnt = np.concatenate([self.cnt, np.zeros((m - n, 2, self.P))])
                    self._reach = None
                self.row[rid] = self.free.pop()
        out = np.fromiter((self.row[r] for r in rids), dtype=np.int64, count=len(rids))
        self._last = (list(rids), out)
        return out

    def _rates_of_total(self) -> np.ndarray:
        w = self.pseudo + 1e-6  # (decayed for long enough, the pseudo-drafts underflow)
        rates, prev = np.empty(self.P), self.prior
        for i in range(self.P):  # a position no longer reached keeps the one before it's rate
            prev = rates[i] = (self.total[0, i] + prev * w) / (self.total[1, i] + w)
        return rates

    def prior_rates(self) -> np.ndarray:
        """Every request's rate per position (the prior until observed drafts outweigh it)."""
        return self._prior_rates

    def rates(self, rids: list[str]) -> np.ndarray:
        """``[len(rids), W-1]``: each request's conditional acceptance per position."""
        r = self.rows(rids)  # first: it may grow ``cnt``
        return self._rates_of(self.cnt[r])

    def _rates_of(self, c: np.ndarray) -> np.ndarray:
        """Rows of counts ``[n, 2, P]`` -> their rates, shrunk toward every request's."""
        return (c[:, 0] + self.k * self._prior_rates) / (c[:, 1] + self.k)

    def reach(self, rids: list[str]) -> np.ndarray:
        """``[len(rids), W-1]``: each request's probability that draft ``i`` is accepted (the
        cumulative product of its rates), from the table :meth:`refresh` keeps."""
        r = self.rows(rids)  # first: it may grow ``cnt``
        if self._reach is None:
            self.refresh()
        assert self._reach is not None
        return self._reach[r]

    def refresh(self) -> None:
        """Every row's reach, at once (a free row's counts are zero: the prior's)."""
        self._reach = np.cumprod(self._rates_of(self.cnt), axis=1)

    def observe(self, rids: list[str], accepted: list[int], drafts: int, decay: float, global_decay: float) -> None:
        """A step of ``drafts`` drafts per request: position ``i`` (0-based) was reached when the ``i``
        drafts before it were accepted, and accepted when ``accepted > i``."""
        r, n, add = self.rows(rids), np.asarray(accepted, dtype=np.int64), self._add[drafts]
        self.cnt[r] = decay * self.cnt[r] + add[n]
        # every request's totals from the histogram of accepted counts, not a sum over rows
        hist = np.bincount(n, minlength=self.P + 1)
        self.total = global_decay ** len(rids) * self.total + (hist @ add.reshape(len(hist), -1)).reshape(2, -1)
        self.pseudo *= global_decay ** len(rids)
        self._prior_rates = self._rates_of_total()
        self._reach = None

    def fade(self, factor: float) -> None:
        """A step without drafts: every request's observed counts fade by ``factor`` and the prior's
        pseudo-drafts come back in their place, so a load that stopped drafting tries it again once
        what it saw is old. Why: without drafts nothing was observed, and one stop at admission was for
        good: on the H100 at one held-out request, T=1, width 8, the first ten prompts' rates (0.42)
        stopped drafting for every later one, 1.00x of the target alone where the fixed width served
        1.16x (docs/benchmarks.md, forty-seventh session)."""
        self.total *= factor
        self.pseudo = factor * self.pseudo + (1 - factor) * self.prior_drafts
        self._prior_rates = self._rates_of_total()
        self._reach = None

    def age(self, rids: list[str], decay: float) -> None:
        """A step that saw no drafts of these requests (width 1): their counts fade as if it had, so
        each estimate drifts back toward every request's. Why: a request that lost a few drafts in a
        row and went to width 1 kept its low estimate until the next probe, 32 steps on (on the H200
        at one request, 21% of GSM8K steps drafted where drafting paid 1.26x)."""
        r = self.rows(rids)  # first: it may grow ``cnt``
        self.cnt[r] *= decay
        self._reach = None

    def forget(self, rid: str) -> None:
        i = self.row.pop(rid, None)
        if i is not None:
            self._last = ([], self._last[1][:0])
            self.cnt[i] = 0.0
            self.free.append(i)
            if self._reach is not None:  # the row a new request takes reads the prior (no recompute)
                self._reach[i] = np.cumprod(self._prior_rates)


class ConfidenceCalibration:
    """``P(draft i accepted | the drafts before it were)`` from the draft's confidence at slot ``i``
    (the draft head's probability of its top token, ``scored_candidates``): per position a logistic
    fit in ``logit(confidence)``, over counts (accepted, reached) binned by confidence and decayed per
    request-step, refit every ``refit_every`` steps, shrunk toward the position's own rate where the
    counts are few. Not fitted (:attr:`fitted` False) until ``min_reached`` first drafts were seen.
    Why: what the draft knows before verification predicts its acceptance far better than the
    request's past: on held-out chat and GSM8K (CPU, one request, width 8) the AUC of the first
    draft's acceptance was 0.84 against 0.63 at T=0, 0.73 against 0.61 at T=1 (docs/benchmarks.md,
    thirty-eighth session, ``scripts/confidence_sim.py``)."""

    EDGES = np.linspace(-3.0, 7.0, 21)[1:-1]  # bin edges in logit(confidence): 20 bins
    CENTERS = np.concatenate([[-3.25], (EDGES[1:] + EDGES[:-1]) / 2, [7.25]])

    def __init__(self, positions: int, decay: float, min_reached: float = 40.0, refit_every: int = 8):
        self.P, self.decay, self.min_reached, self.refit_every = positions, decay, min_reached, refit_every
        self.cnt = np.zeros((2, positions, len(self.CENTERS)))  # [(accepted, reached), position, bin]
        self.coef = np.zeros((positions, 2))  # (bias, slope) on logit(confidence), per position
        self.fitted = False
        self._since = 0

    @staticmethod
    def _logit(conf: np.ndarray) -> np.ndarray:
        c = np.clip(conf, 1e-4, 1 - 1e-4)
        return np.log(c / (1 - c))

    def rates(self, conf: np.ndarray) -> np.ndarray:
        """``conf [B, g]`` -> each slot's conditional acceptance ``[B, g]``."""
        g = min(conf.shape[1], self.P)
        z = self.coef[None, :g, 0] + self.coef[None, :g, 1] * self._logit(conf[:, :g])
        return 1 / (1 + np.exp(-z))

    def observe(self, conf: np.ndarray, accepted: list[int], drafts: int) -> None:
        """A step that verified ``drafts`` drafts a row (of the ``conf.shape[1]`` drafted), each row's
        accepted count in ``accepted``."""
        g = min(drafts, conf.shape[1], self.P)
        if g < 1:
            return
        n = np.asarray(accepted)[:, None]
        pos = np.broadcast_to(np.arange(g)[None], (len(n), g))
        bins = np.searchsorted(self.EDGES, self._logit(conf[:, :g]))
        self.cnt *= self.decay ** len(n)
        np.add.at(self.cnt[0], (pos, bins), (pos < n).astype(float))
        np.add.at(self.cnt[1], (pos, bins), (pos <= n).astype(float))
        self._since += 1
        if self._since >= self.refit_every:
            self.refit()

    def refit(self, iters: int = 6, l2: float = 1.0) -> None:
        """Newton steps on every position's penalised log-likelihood at once; a position with too few
        counts of its own takes the one before it's fit (late positions are seldom reached)."""
        self._since = 0
        acc, reach = self.cnt
        seen = reach.sum(1)
        self.fitted = bool(seen[0] >= self.min_reached)
        if not self.fitted:
            return
        rate = (acc.sum(1) + 1) / (seen + 2)
        prior = np.stack([np.log(rate / (1 - rate)), np.zeros(self.P)], 1)  # the position's rate, no slope
        w, x = prior.copy(), self.CENTERS[None]
        for _ in range(iters):
            p = 1 / (1 + np.exp(-(w[:, :1] + w[:, 1:] * x)))
            r = reach * p * (1 - p)
            g = np.stack([(reach * p - acc).sum(1), ((reach * p - acc) * x).sum(1)], 1) + l2 * (w - prior)
            h00, h01, h11 = r.sum(1) + l2, (r * x).sum(1), (r * x * x).sum(1) + l2
            det = h00 * h11 - h01 * h01
            w -= np.stack([h11 * g[:, 0] - h01 * g[:, 1], h00 * g[:, 1] - h01 * g[:, 0]], 1) / det[:, None]
        for i in range(self.P):
            self.coef[i] = w[i] if seen[i] >= self.min_reached or i == 0 else self.coef[i - 1]

    def state(self) -> list[list[float]]:
        """Each position's (bias, slope), for ``/metrics`` and benchmark rows."""
        return [[round(float(b), 3), round(float(a), 3)] for b, a in self.coef]


@dataclass
class Planner:
    width: int  # the full width (the runner's)
    cfg: PlannerConfig = field(default_factory=PlannerConfig)
    costs: dict[tuple[int, int], float] = field(default_factory=dict)  # (bucket, width) -> seconds, run or given
    # the measured ones' slow averages (PlannerConfig.decision_cost_decay): what admission and retirement read
    slow_costs: dict[tuple[int, int], float] = field(default_factory=dict)
    # the start-up profile (graph replays), read where a shape has not run, scaled by what the run
    # shapes of that width cost live over their profile (:meth:`cost`)
    profile: dict[tuple[int, int], float] = field(default_factory=dict)
    scale: dict[int, float] = field(default_factory=dict)  # width -> live / profiled, over the run shapes
    _log_ratio: dict[int, dict[int, float]] = field(default_factory=dict)  # width -> bucket -> log(live / profiled)
    _borrowed: float = 1.0  # the geometric mean of ``scale``: an unrun width's (:meth:`_scale_of`)
    current: int = 0  # the width of the last step (0: none yet)
    steps: int = 0
    last_run: dict[int, int] = field(default_factory=dict)  # width -> the step it last ran
    probed: int = 0  # the step of the last drafting step after a step at width 1 (the upper end's probe)
    measured_at: dict[tuple[int, int], int] = field(default_factory=dict)  # (bucket, width) -> step of its last run
    samples: dict[tuple[int, int], int] = field(default_factory=dict)  # (bucket, width) -> steps in its cost
    ratio: float | None = None  # cost(width 1) / cost(full width), latest seen
    # the widths a step can run (the runner's: every width eagerly, the captured ones in graphs);
    # () = 1 and the full width
    widths: tuple[int, ...] = ()
    trim_widths: tuple[int, ...] = ()  # the widths a drafted step may be cut to (the runner's): :meth:`trim`
    # trim's costs, the draft's and the verify's apart: bucket -> the draft's seconds, (bucket, width
    # verified) -> the verify's (width 1: a drafting request's step without a draft)
    draft_costs: dict[int, float] = field(default_factory=dict)
    verify_costs: dict[tuple[int, int], float] = field(default_factory=dict)
    counts: AcceptanceCounts = field(init=False)  # per request and position
    calibration: ConfidenceCalibration = field(init=False)  # acceptance from the draft's confidence (trim)
    # a step observed, not folded yet: (requests, accepted, width, the draft's confidence, bucket, seconds)
    _pending: tuple[list[str], list[int], int, np.ndarray | None, int, float | None] | None = None
    _pending_plain: tuple[int, float | None, bool] | None = None  # a step of the target alone, not folded yet
    _gone: list[str] = field(default_factory=list)  # finished requests whose rows :meth:`fold` frees
    _fit: tuple[float, float] | None = None  # eager: (fixed, per token) seconds, see _token_cost
    _fit_sig: tuple[int, float] = (-1, 0.0)  # the costs it was fitted on
    _every_width: tuple[tuple[int, ...] | None, bool] = (None, False)  # (widths, _any_width's answer for them)
    # the last decisions about drafting at all (a retirement; admission turning drafting or not) with
    # what they were priced on, for :meth:`state`. Why: on the H200 at 128 requests a stop that the
    # planner's own later state priced at a 55% loss left no trace of why (docs/benchmarks.md, fortieth session)
    decisions: list[dict] = field(default_factory=list)
    _admitting: bool | None = None  # speculate_new's last answer
    # buckets where a stop waits for the one-token step to be measured (cfg.plain_probes), and the
    # width-1 steps tried there for it
    want_plain: set[int] = field(default_factory=set)
    plain_tries: dict[int, int] = field(default_factory=dict)
    # bucket -> (the requests of its last retirement check, the gain averaged over its checks)
    retire_gain: dict[int, tuple[frozenset, float]] = field(default_factory=dict)
    # the last step times measured, (bucket, width, seconds), kept with each decision. Why: on the H100 at one
    # held-out request the full width's running average stood 5-11% over its steps' mean at every retirement,
    # which neither the acceptance nor noisy costs explained in the replay (docs/benchmarks.md, forty-eighth
    # session)
    recent: deque = field(default_factory=lambda: deque(maxlen=16))

    def __post_init__(self):
        self.counts = AcceptanceCounts(
            max(self.width - 1, 1), self.cfg.prior, self.cfg.prior_weight, self.cfg.prior_drafts
        )
        self.calibration = ConfidenceCalibration(max(self.width - 1, 1), self.cfg.confidence_decay)

    def fresh(self) -> "Planner":
        """This planner as it started: its config, start-up profile and widths, nothing it learnt."""
        return Planner(self.width, self.cfg, profile=self.profile, widths=self.widths, trim_widths=self.trim_widths)

    @property
    def adapts(self) -> bool:
        """Whether widths are chosen from costs and acceptance (not fixed, not pinned)."""
        return self.width > 1 and self.cfg.mode == "auto" and not self.cfg.schedule

    def can_pick(self, width: int) -> bool:
        if width == self.width:
            return True
        if self.cfg.schedule:
            return any(w == width for _, w in self.cfg.schedule) or width == 1
        return self.adapts and (width == 1 or width in self.cfg.widths)

    # ---- estimates -------------------------------------------------------------------------------
    def prior_alpha(self) -> float:
        """Every request's acceptance rate of the first draft (``/metrics``' calibration line)."""
        return float(self.counts.prior_rates()[0])

    def alpha(self, rid: str) -> float:
        """This request's estimated acceptance rate of its first draft."""
        return float(self.counts.rates([rid])[0, 0])

    def expected_by_width(self, rids: list[str]) -> np.ndarray:
        """``[W]``: expected committed tokens of one step at widths ``1 .. W`` (accepted drafts + the
        emitted token), summed over ``rids``."""
        return _tokens_by_width(self.counts.reach(rids).sum(0), len(rids))[: self.width]

    def expected_tokens(self, rids: list[str], width: int) -> float:
        return float(self.expected_by_width(rids)[width - 1])

    # ---- the decision ----------------------------------------------------------------------------
    def choose(self, rids: list[str], bucket: int) -> int:
        """The width of the next step for these decode requests (``bucket``: the runner's batch bucket)."""
        W, cfg = self.width, self.cfg
        if W == 1:
            return W
        if cfg.schedule:  # pinned, whatever the mode
            return next((w for b, w in cfg.schedule if len(rids) <= b), 1)
        if cfg.mode == "off":
            return W
        return self._choose(rids, bucket, self.current, self.steps, self.probed)

    def choose_ahead(self, rids: list[str], bucket: int, running: int) -> int | None:
        """:meth:`choose` for the step after the one running now at width ``running`` (not observed
        yet), made while the device runs it: the engine calls it from the step's overlap, so the next
        step starts without planner work on the host. Its cost and acceptance come one step late (as
        the deferred counts do already). None where the running step is the first of its shape (its
        cost is what the choice waits for) or the planner does not adapt. Why: on the H200 at 32-64
        requests, T=1, the planner's steps had 0.10-0.13 ms more host work than the fixed width's (2-3%
        of a step), the choice most of what ran before the step; in the CPU engine at 64 requests the
        host work outside the step fell from 0.74-1.10 to 0.59-0.71 ms (docs/benchmarks.md,
        twenty-fifth session)."""
        if not self.adapts or self.cost(bucket, running) is None:
            return None
        step = self.steps + 1
        return self._choose(rids, bucket, running, step, self._probed_after(running, step))

    @property
    def trims(self) -> bool:
        """Whether a drafting step's verify width is cut after the draft (:meth:`trim`): auto, where
        the runner can cut it (``trim_widths``: its eager steps; a CUDA graph's width is the draft's)."""
        return self.adapts and self.cfg.trim and bool(self.trim_widths)

    def trim(self, bucket: int, width: int, confidence: np.ndarray) -> int:
        """After a draft at ``width`` (``confidence [B, width - 1]``, :class:`ConfidenceCalibration`):
        the width to verify, 2 .. ``width``, that promises the most committed tokens per second of the
        step; ``width`` itself until the calibration is fitted (the cold start verifies what it
        drafts). Lossless: the confidence depends on the block's hidden states, not on what a sampled
        walk drew, so the cut is as if the step had drafted fewer (the drafts' distribution and the
        verifier's are unchanged)."""
        draft = self._draft_cost(bucket)
        if not self.calibration.fitted or width <= 2 or draft is None:
            return width
        reach = np.cumprod(self.calibration.rates(confidence[:, : width - 1]), axis=1).sum(0)
        tokens = _tokens_by_width(reach, confidence.shape[0])
        best, best_rate = width, 0.0
        for w in sorted({w for w in self.trim_widths if w < width} | {width}):
            c = self._verify_cost(bucket, w)
            if c is None:
                return width
            if tokens[w - 1] / (draft + c) > best_rate:
                best, best_rate = w, tokens[w - 1] / (draft + c)
        return best

    def _draft_cost(self, bucket: int) -> float | None:
        return self.draft_costs.get(bucket)

    def _verify_cost(self, bucket: int, width: int) -> float | None:
        """The verify's seconds at ``width`` (the draft's apart: it is spent when :meth:`trim` chooses):
        measured at ``bucket``, else linear between the nearest widths measured there. Why apart: priced
        from whole steps, a width between 1 (no draft) and the full one (with it) was read off a line
        from a step without the draft to one with it, too cheap by most of the draft's cost, and the
        CPU's one-request steps were cut where verifying every draft cost little more (docs/benchmarks.md,
        thirty-eighth session)."""
        if (bucket, width) in self.verify_costs:
            return self.verify_costs[(bucket, width)]
        lo, hi = _neighbours([(w, c) for (b, w), c in self.verify_costs.items() if b == bucket], width)
        return _on_line(lo, hi, width) if lo and hi else None

    def observe_split(self, bucket: int, width: int, draft_s: float, verify_s: float) -> None:
        """A drafting request's step, its draft and its verify timed apart (:meth:`trim`'s costs)."""
        new = 1 - self.cfg.cost_decay  # (the weight of the new time, as in the step costs)
        if width > 1:
            d = self.draft_costs.get(bucket)
            self.draft_costs[bucket] = draft_s if d is None else (1 - new) * d + new * draft_s
        v = self.verify_costs.get((bucket, width))
        self.verify_costs[(bucket, width)] = verify_s if v is None else (1 - new) * v + new * verify_s

    def _probed_after(self, width: int, step: int) -> int:
        """``probed`` once a step at ``width`` runs as step ``step``: a drafting step after width 1 is a probe."""
        return step if width > 1 and self.current == 1 else self.probed

    def _choose(self, rids: list[str], bucket: int, current: int, steps: int, probed: int) -> int:
        """The choice of an adapting planner, with ``current`` the width of the last step, ``steps`` the
        steps run by then (it ran at ``steps``) and ``probed`` the step of the last drafting probe."""
        W, cfg = self.width, self.cfg
        cost = {w: self.cost(bucket, w) for w in sorted(set(self.widths) | {1, W})}
        if cost[W] is None:
            # cold start: full blocks, which learn their cost and acceptance; where every width can run
            # (eager), width 2 once and then width 1 once, after which every shape is priced by its tokens
            # (:meth:`_token_cost`). Why: on the CPU at T=1 (held-out chat, 16 requests) full-width cold
            # starts cost 3-6x a one-token step each, ~2.5 s of a 63 s run that ended at 0.96x of the
            # target alone (docs/benchmarks.md, twenty-ninth session)
            if not self._any_width():
                return W
            return 2 if self._never_ran(2) else 1
        if cost[1] is None:  # try width 1 once, to learn what it costs
            return 1
        if bucket in self.want_plain and not self._plain_known(bucket):  # a stop waits on its price
            return 1
        keep = current if current in cost else W
        rate = self._rates(rids, cost)
        for end in (1, W):  # a probe keeps each end's cost (and, at the full width, acceptance) fresh
            last = max(self.last_run.get(W, 0), probed) if end == W else self.last_run.get(1, 0)
            if end != keep and steps - last >= cfg.probe_every:
                if end == 1 and rate[1] * (1 + cfg.probe_reach) >= rate[keep]:
                    return 1
                if end == W:
                    # a batch at width 1 probes drafting at width 2 where every width can run (the eager
                    # runner): the cheapest step that sees acceptance (the first draft's decides whether
                    # any drafting pays). Why: on the CPU at 16 requests, T=1, a full-width step cost ~4x
                    # a one-token one, and the full-width probes and cold starts were ~15 s of a 79 s run
                    # at 0.89x of the target alone (docs/benchmarks.md, twenty-fifth session)
                    return 2 if keep == 1 and 2 in cost else W
        return self._next_width(rate, keep, bucket)

    def _rates(self, rids: list[str], cost: dict[int, float | None]) -> dict[int, float]:
        """Expected committed tokens per second of ``rids``' step at each width whose ``cost`` is known."""
        tokens = self.expected_by_width(rids)
        return {w: tokens[w - 1] / c for w, c in cost.items() if c is not None}

    def _next_width(self, rate: dict[int, float], keep: int, bucket: int) -> int:
        """The width a batch at ``keep`` runs next, probes aside: the best counted width where it beats
        ``keep``'s tokens/s by the hysteresis, else ``keep``."""
        ok = self._counted(rate, rate[1], bucket)
        best = max(ok, key=lambda w: rate[w])
        if keep not in ok:
            # a width between that no longer clears the margin is left for the best end, whatever the
            # hysteresis. Why: the eager runner's probe at width 2 then kept width 2 at an estimated
            # 1.05-1.1x of width 1, where the drafter's prefill share and the after-effect of wider steps
            # (neither in the step costs) made it a loss: 0.86-0.93x of the target alone on the CPU at 16
            # requests, T=1 (docs/benchmarks.md, twenty-sixth and twenty-seventh sessions)
            return best
        return best if rate[best] > rate[keep] * (1 + self.cfg.hysteresis) else keep

    def speculate_new(self, n_running: int, bucket: int) -> bool:
        """Whether a request admitted now, making ``n_running`` decode requests at ``bucket``, drafts
        for its lifetime: the planner off, always; a pinned schedule, where it gives a width above 1
        at ``n_running``; auto, where the best drafting width's expected tokens/s (every request's
        acceptance per position) beats the target alone's (width 0 measured, else width 1), or
        nothing is measured yet (cold start: draft, and learn)."""
        W, cfg = self.width, self.cfg
        if W == 1:
            return False
        if cfg.schedule:
            return next((w for b, w in cfg.schedule if n_running <= b), 1) > 1
        if cfg.mode == "off":
            return True
        gain = self.drafting_gain(bucket, strict=True)
        # by the hysteresis, from not drafting (admitted so last, or retired since): near break-even the
        # target alone is the safe side (on the H200 at 8 requests, T=1, an estimated gain of ~1.05 served
        # 0.88x with the fixed width, the tail of a finishing wave and the drafter's prefill upkeep not in
        # the step costs, nineteenth session). From drafting, break-even: at a steady queue this answer holds
        # until the batch drains, and on the H100 at 8 held-out requests, T=1, a round admitted at a priced
        # 1.033 after a round that drafted ran the target alone where the fixed width served 1.09x
        # (fifty-first session)
        drafts = gain is None or bool(gain >= (1 if self._admitting else 1 + cfg.hysteresis))
        if not drafts and not self._plain_known(bucket):  # draft on until the target alone is measured there
            self.want_plain.add(bucket)
            drafts = True
        if drafts != self._admitting:
            self._admitting = drafts
            self._note("admit drafting" if drafts else "admit not drafting", bucket, gain)
        return drafts

    def drafting_gain(self, bucket: int, strict: bool = False, rids: list[str] | None = None) -> float | None:
        """Expected tokens/s of the best drafting width at ``bucket`` (every request's acceptance per
        position, or ``rids``' own: a running batch's) over the target alone's (width 0 measured, else
        width 1); None before both costs are known. ``strict`` (admission): a width between counts only
        where it clears the margin over both ends, as :meth:`_choose` takes it; retirement, which is for
        good, counts every width. Priced on the slow cost averages (the decision holds for a request's
        lifetime: :attr:`PlannerConfig.decision_cost_decay`)."""
        plain = self.cost(bucket, 0, lifetime=True) or self.cost(bucket, 1, lifetime=True)
        cost = {w: self.cost(bucket, w, lifetime=True) for w in sorted(set(self.widths) | {self.width}) if w > 1}
        if plain is None or cost[self.width] is None:
            return None
        if rids:
            tokens = self.expected_by_width(rids) / len(rids)
        else:
            tokens = _tokens_by_width(np.cumprod(self.counts.prior_rates()), 1)
        rate = {w: tokens[w - 1] / c for w, c in cost.items() if c is not None}
        return float(max(rate[w] for w in (self._counted(rate, 1 / plain, bucket) if strict else rate)) * plain)

    def _counted(self, rate: dict[int, float], one: float, bucket: int) -> set[int]:
        """The widths of ``rate`` (tokens/s by width) that count: the full width (and 1), a width
        between with step graphs of its own (``profile``: its cost replayed at ``bucket`` at start-up,
        as the ends' are), and any other width between only where it beats both ends (``one``: width
        1's rate) by ``between_margin`` (eager: priced by its tokens until it runs, see the field)."""
        ends = max(one, rate[self.width]) * (1 + self.cfg.between_margin)
        return {w for w, r in rate.items() if w in (1, self.width) or (bucket, w) in self.profile or r > ends}

    def _plain_known(self, bucket: int) -> bool:
        """Whether the one-token step at ``bucket`` rests on what ran there: ``plain_probes`` steps of
        width 1 or of the target alone, or a given cost (injected); also where it is not read off a
        start-up replay where every width runs (the eager runner's: fitted by tokens over what ran, every
        batch size a bucket of its own, so waiting at each would hold drafting requests at width 1 through
        every size a wave passes: 58 such steps in one CPU run at 16 requests, T=1), where width 1 cannot
        run, or where its probes were tried ``2 x plain_probes`` times (prompts mixed into them void their
        times). Not a static runner without graphs (no replays): its one-token step was read off the
        full width's by another bucket's ratio, and at 128 requests on the CPU (the one-token step 0.3x
        a full one at a few requests, 0.55x at 128) drafting stopped in half the runs at a priced gain
        of 1.05 where it served 1.55x the target alone (forty-fourth session)."""
        if (bucket, 0) not in self.profile and (bucket, 1) not in self.profile and self._any_width():
            return True
        if self.widths and 1 not in self.widths:
            return True
        if self.plain_tries.get(bucket, 0) >= 2 * self.cfg.plain_probes:
            return True
        for key in ((bucket, 0), (bucket, 1)):
            if key in self.costs and self.samples.get(key, self.cfg.plain_probes) >= self.cfg.plain_probes:
                return True
        return False

    def retire(self, bucket: int, rids: list[str] | None = None) -> bool:
        """Whether the drafting requests of a batch at ``bucket`` stop drafting for good: auto only,
        after ``probe_every`` steps (eagerly ``retire_every``; step costs measured; acceptance is the optimistic prior until
        drafts are seen, so this errs toward drafting), where the best drafting width falls short of
        the target alone (no hysteresis: retirement is for good, so it cannot flap; and the tail of a
        finishing wave and the drafter's prefill upkeep, not in the step costs, make break-even a
        loss). Why: the requests admitted at
        the cold start draft for their lifetime, and a drafting request's width 1 costs 15-18% over
        the target alone; on the H200 at 32-64 requests that first wave held the planner at
        0.55-0.85x of the target alone while it chose width 1 for every step (docs/benchmarks.md,
        seventeenth session). One way: a request without a draft context cannot draft again.
        ``rids``: the batch's requests, priced on their own acceptance (each shrunk toward every
        request's, so under load about the same). Why: at one request a request admitted to try drafting
        again (``plain_fade``) went to width 1 on its own rates while every request's, still near the
        prior, never fell below break-even: it kept the drafter's upkeep for the rest of its output."""
        # eager, the cold start's width 2 has seen acceptance by its second step: from retire_every on.
        # Why: a first wave that could not pay kept drafting (its width 1 writes latents) for 32-40 steps
        # on the CPU at 16 requests, T=1 (docs/benchmarks.md, twenty-ninth session)
        first = self.cfg.retire_every if self._any_width() else self.cfg.probe_every
        if not self.adapts or self.steps < first or self.steps % self.cfg.retire_every:
            return False
        if 1 in (self.widths or (1,)) and not any(w in (0, 1) for _, w in self.costs):
            return False  # for good, so only once a one-token step has a cost of its own (a probe)
        gain = self.drafting_gain(bucket, rids=rids)
        if gain is None:
            return False
        gain = min(gain, self._held_at_one(bucket, rids) or gain)
        if not self._plain_known(bucket):  # first measure the one-token step here (nothing averaged till then)
            if gain < 1:
                self.want_plain.add(bucket)
            return False
        # (one request: not averaged; its batch ends with it, so a stop costs that request's rest alone)
        batch, a = frozenset(rids or ()), self.cfg.retire_smoothing if bucket > 1 else 0.0
        last = self.retire_gain.get(bucket)
        if last is not None and (last[0] & batch or not batch):  # (the same batch, or some of it, as last time)
            gain = a * last[1] + (1 - a) * gain
        self.retire_gain[bucket] = (batch, gain)
        if gain >= 1:
            return False
        del self.retire_gain[bucket]
        self._admitting = False  # (so drafting is admitted again by the hysteresis: speculate_new)
        self._note("retire", bucket, gain)
        return True

    def _held_at_one(self, bucket: int, rids: list[str] | None) -> float | None:
        """The gain of drafting on where :meth:`_choose` holds the batch at width 1 (its last step ran there
        and no drafting width beats width 1 by the hysteresis): the target alone's step over width 1's, which
        pays the drafter's upkeep (below 1); None where the batch would draft wider. Why: retirement priced
        the best drafting width, near break-even, while the batch ran width 1 at its upkeep: on the H100 at 32
        held-out requests, T=1, width 1 (1.83-1.87 ms) and width 5 (3.4 ms at AL 1.9) were within the
        hysteresis, the batch held width 1 for ~1,400 steps of a round where the target alone's step was
        1.74 ms, and auto served 0.96x of the target alone (fixed w5: 0.98x; fifty-second session)."""
        if self.current != 1 or not rids:
            return None
        cost = {w: self.cost(bucket, w) for w in sorted(set(self.widths) | {1, self.width})}
        if any(c is None for c in cost.values()) or self._next_width(self._rates(rids, cost), 1, bucket) != 1:
            return None
        plain, one = self.cost(bucket, 0, lifetime=True), self.cost(bucket, 1, lifetime=True)
        return None if plain is None or one is None else plain / one

    def _note(self, kind: str, bucket: int, gain: float | None, keep: int = 16) -> None:
        """One entry of :attr:`decisions`: the step, the decision, and what priced it at ``bucket``."""

        def priced(w: int) -> list:  # [ms, how: steps measured here, else "given", "profile" or "derived"]
            c, key = self.cost(bucket, w, lifetime=True), (bucket, w)
            how = self.samples.get(key) or next(
                (name for name, d in (("given", self.costs), ("profile", self.profile)) if key in d), "derived"
            )
            return [None if c is None else round(1e3 * c, 3), how]

        self.decisions.append(
            {
                "step": self.steps,
                "decision": kind,
                "bucket": bucket,
                "gain": None if gain is None else round(gain, 3),
                "full": priced(self.width),
                "plain": priced(0) if self.cost(bucket, 0, lifetime=True) is not None else priced(1),
                "rates": [round(float(x), 3) for x in self.counts.prior_rates()],
                "recent_ms": [[f"{b}x{w}", round(1e3 * t, 3)] for b, w, t in self.recent],  # oldest first
            }
        )
        del self.decisions[:-keep]

    def observe_plain(self, bucket: int, seconds: float | None, fade: bool = False, defer: bool = False) -> None:
        """A step of requests that do not draft: the target alone's cost at ``bucket`` (width 0), and
        (``fade``, the engine's steps) every request's acceptance fading toward the prior
        (:attr:`PlannerConfig.plain_fade`); ``defer``: both at the next :meth:`fold`, as :meth:`observe`'s.
        Why: a drafting engine's step of the target alone had this work between steps where the target's
        own engine has none (forty-ninth session)."""
        if not self.adapts:
            return
        if defer:
            self._fold_pending()
            self._pending_plain = (bucket, seconds, fade)
            return
        if seconds is not None:
            self._measure((bucket, 0), seconds)
        if fade:
            self.counts.fade(self.cfg.plain_fade)

    def _measure(self, key: tuple[int, int], seconds: float) -> None:
        # the plain mean of the first samples, then the moving average (a cost given without samples, an
        # injected one: the moving average). Why: the first sample alone stood for a shape that seldom
        # runs (a probe's) until many probes had run (see :meth:`cost`)
        n = self.samples.get(key, 0) + 1 if key in self.samples or key not in self.costs else None
        if n is not None:
            self.samples[key] = n
        w = 1 - self.cfg.cost_decay if n is None else max(1 / n, 1 - self.cfg.cost_decay)
        self.costs[key] = (1 - w) * self.costs.get(key, 0.0) + w * seconds
        if n is not None:  # (an injected cost stays as given for the decisions too)
            w = max(1 / n, 1 - self.cfg.decision_cost_decay)
            self.slow_costs[key] = (1 - w) * self.slow_costs.get(key, 0.0) + w * seconds
        self.recent.append((*key, seconds))
        self.measured_at[key] = self.steps
        self._rescale(key)

    def _expire(self) -> None:
        """Drop the measured costs not refreshed in ``stale_after`` steps (given ones stay), and their
        part of the live scale."""
        for key in [k for k, at in self.measured_at.items() if self.steps - at > self.cfg.stale_after]:
            del self.costs[key], self.measured_at[key]
            self.slow_costs.pop(key, None)
            self.samples.pop(key, None)
            if self._log_ratio.get(key[1], {}).pop(key[0], None) is not None:
                self._rescore(key[1])

    def _rescale(self, key: tuple[int, int]) -> None:
        """``scale[width]``: the geometric mean, over the shapes of this width that ran, of their live
        cost over their profiled one (``key`` has just run)."""
        if self.profile.get(key):
            self._log_ratio.setdefault(key[1], {})[key[0]] = math.log(self.costs[key] / self.profile[key])
            self._rescore(key[1])

    def _rescore(self, width: int) -> None:
        """``scale[width]`` and the borrowed mean from the log ratios (a width with none left has no scale)."""
        r = self._log_ratio.get(width)
        if r:
            self.scale[width] = math.exp(sum(r.values()) / len(r))
        else:
            self.scale.pop(width, None)
            self._log_ratio.pop(width, None)
        logs = [math.log(v) for v in self.scale.values()]
        self._borrowed = math.exp(sum(logs) / len(logs)) if logs else 1.0

    def _scale_of(self, width: int) -> float:
        """Live / profiled for ``width``; a width with no run shape yet borrows the geometric mean of
        the others'. Why: the replays' bias (shortest context, no host work) is the whole step's, and
        an unrun target alone read unscaled against a scaled drafting width looked 1.3x cheaper than
        it was: on the H200 at 64 requests, T=0, the drafting requests retired for good at the first
        check where the fixed width served 1.12x (docs/benchmarks.md, twentieth session)."""
        if width not in self.scale and width in (0, 1) and 1 - width in self.scale:
            # the one-token steps (the target alone; width 1 of drafting requests, which adds the latents)
            # replay almost the same graph with the same host work, so one borrows the other's scale.
            # Why not the mean: the drafting width's scale priced the target alone 15-20% too cheap (host
            # work is a larger share of a cheap step), and on the H200 at 64 requests, T=1, the planner
            # retired drafting at an estimated break-even where it served 1.03x, then ran at 0.89x
            # (docs/benchmarks.md, twenty-third session)
            return self.scale[1 - width]
        return self.scale.get(width, self._borrowed)

    def _measured(self, key: tuple[int, int], lifetime: bool = False) -> float | None:
        """The cost measured (or given) for ``key``; ``lifetime``: its slow average where it has one."""
        c = self.costs.get(key)
        return self.slow_costs.get(key, c) if lifetime and c is not None else c

    def cost(self, bucket: int, width: int, lifetime: bool = False) -> float | None:
        """:meth:`_cost` with a one-token step capped by the wider steps measured at ``bucket`` (the
        target alone, by width 1 of drafting requests): a wider step verifies more tokens and runs the
        draft, so anything else is noise. Why: on the CPU at 16 requests, T=1, two width-1 steps measured
        at 350 ms (the width-2 steps beside them: 250-330 ms) priced the target alone at 1.7x what it
        cost; width 1 was then never within reach of a probe, and drafting went on at a 2x estimated
        gain where it lost (docs/benchmarks.md, twenty-fourth session)."""
        c = self._cost(bucket, width, lifetime)
        if c is None or width > 1:
            return c
        caps = [self._measured((bucket, w), lifetime) for w in (self.widths or (self.width,)) if w > 1]
        if width == 0:
            caps.append(self.cost(bucket, 1, lifetime))
        return min([c] + [x for x in caps if x is not None])

    def _cost(self, bucket: int, width: int, lifetime: bool = False) -> float | None:
        """Seconds of a step at ``width`` (0: the target alone beside a drafter): measured at this
        bucket; else profiled, times what the shapes of that width that ran cost live over their
        profile (:meth:`_scale_of`: the other widths' where none has run); eager, by its tokens
        (:meth:`_token_cost`); else derived from the
        other end (1 or the full width) measured there and the latest ratio between the two; a width
        between the ends, linear between their costs (tokens per row grow linearly; None: nothing to
        go on). Why the scale: the replays run at the shortest context and leave out host work, and a
        drafting shape that had not run was costed 1.3-1.5x below live on the H200 at 32-64 requests
        (T=1), so requests were admitted drafting at 48 running that drafting could not pay for at 64
        (docs/benchmarks.md, nineteenth session)."""
        key = (bucket, width)
        if key in self.costs:
            return self._measured(key, lifetime)
        twin = (bucket, 1 - width)  # the other one-token step
        ran = self._measured(twin, lifetime) if width in (0, 1) else None
        if ran is not None and key in self.profile and self.profile.get(twin):
            # the other one-token step ran at this bucket: the same host work per request, so its live
            # time scaled by the two replays. Why: a scale borrowed from other buckets missed per-request
            # host work at 128 requests (see PlannerConfig.plain_probes)
            return ran * self.profile[key] / self.profile[twin]
        if key in self.profile:
            return self.profile[key] * self._scale_of(width)
        if width == 0:
            return self._between_buckets(bucket, 0)
        if self._any_width():  # eager: by its tokens
            return self._token_cost(bucket * width)
        if 1 < width < self.width:
            lo, hi = self.cost(bucket, 1, lifetime), self.cost(bucket, self.width, lifetime)
            return None if lo is None or hi is None else lo + (hi - lo) * (width - 1) / (self.width - 1)
        other = self._measured((bucket, self.width if width == 1 else 1), lifetime)
        if other is None or self.ratio is None:
            return self._between_buckets(bucket, width)
        return other * self.ratio if width == 1 else other / self.ratio

    def _never_ran(self, width: int) -> bool:
        return not any(w == width for _, w in self.costs)

    def _any_width(self) -> bool:
        """Whether a step can run every width up to the full one (the eager runner); derived again
        only when ``widths`` changes (the engine sets it once), not at every :meth:`cost`."""
        if self._every_width[0] != self.widths:
            every = self.width > 2 and set(range(1, self.width + 1)) <= set(self.widths)
            self._every_width = (self.widths, every)
        return self._every_width[1]

    def _token_cost(self, tokens: int) -> float | None:
        """Eager: seconds of a drafting step of ``tokens`` rows x width, a fixed part plus a part per
        token fitted (least squares) over every drafting shape measured; None before two token counts
        ran (or where the fit does not grow with tokens). Why: the eager step's cost follows its tokens
        across batch sizes, where the ratio of two widths or a neighbour's cost does not: on the CPU a
        full block cost 1.7x a one-token step at 1 row and 5.7x at 16, and priced from a 1-row ratio or
        from widths 1 and 2 at one size, 16-row blocks of 5-8 drafts ran at T=1 where they lost
        (docs/benchmarks.md, twenty-ninth session)."""
        sig = (len(self.costs), sum(self.costs.values()))
        if self._fit_sig != sig:
            pts = np.array([(b * w, c) for (b, w), c in self.costs.items() if w >= 1], dtype=float).reshape(-1, 2)
            fit = None
            if len(np.unique(pts[:, 0])) >= 2:
                per_token, fixed = np.polyfit(pts[:, 0], pts[:, 1], 1)
                fit = (max(float(fixed), 0.0), float(per_token)) if per_token > 0 else None
            self._fit_sig, self._fit = sig, fit
        return None if self._fit is None else self._fit[0] + self._fit[1] * tokens

    def _between_buckets(self, bucket: int, width: int) -> float | None:
        """A bucket with no profile where ``width`` has not run (the eager runner's: every batch size is
        one): linear between the nearest buckets where it ran, else the nearest one's; None where it
        never ran. Why: costed as unknown, each new batch size began with a full-width step and a
        width-1 step; on the CPU at 16 requests, T=1, that was ~20 full-width steps of a run (3x a
        one-token step each) as waves drained through the batch sizes (docs/benchmarks.md,
        twenty-fourth session)."""
        ran = [(b, c) for (b, w), c in self.costs.items() if w == width]
        lo, hi = _neighbours(ran, bucket)
        if lo and hi:
            return _on_line(lo, hi, bucket)
        near = lo or hi
        return None if near is None else near[1]

    def observe(
        self,
        rids: list[str],
        accepted: list[int],
        width: int,
        bucket: int,
        seconds: float | None,
        defer: bool = False,
        confidence: np.ndarray | None = None,
    ) -> None:
        """One step's outcome: each request's accepted drafts, and the step's wall time (nothing to
        learn when the width is fixed or pinned: no per-request work on the hot path; None: a time
        that is not the width's alone, a prompt ran with the step); ``width``: the width verified,
        ``confidence``: the draft's per slot, where the step was trimmed. ``defer``: the acceptance counts
        wait for :meth:`fold` (the engine calls it while the GPU runs the next step, so the next
        choice sees them one step late, and so does the step's cost); the step and its width count now.
        Why the cost too: at one request on the H100 the planner's host work between steps was 0.03-0.04 ms
        over the fixed width's (plan ms a step), ~2% of a 2 ms step (docs/benchmarks.md, forty-ninth
        session); the choice made while the next step runs has seen the cost already (it folds first)."""
        if not self.adapts:
            return
        self._fold_pending()  # an earlier deferred step first, in order (the finished requests' rows
        # are freed by the next fold, off the critical path: this step's counts leave them out)
        self.steps += 1
        self.probed = self._probed_after(width, self.steps)
        self.last_run[width], self.current = self.steps, width
        self._pending = (list(rids), list(accepted), width, confidence, bucket, seconds)
        if not defer:
            self.fold()

    def fold(self) -> None:
        """The deferred step's acceptance into the counts, and every request's reach recomputed for the
        next choice; then the finished requests' rows freed. Why deferred: on the H200 at T=0 the
        planner's host work between steps made its steps 2.6-3.9% dearer than the fixed width's
        (docs/benchmarks.md, twenty-first session); done while the GPU runs the next step, it costs no
        wall time."""
        self._fold_pending()
        for rid in self._gone:  # after the step that saw them: its counts must not land in a reused row
            self.counts.forget(rid)
        self._gone.clear()

    def _fold_pending(self) -> None:
        if self._pending_plain is not None:  # (at most one of the two waits: each observe folds the other first)
            plain, self._pending_plain = self._pending_plain, None
            self.observe_plain(*plain)
        if self._pending is not None:
            rids, accepted, width, confidence, bucket, seconds = self._pending
            self._pending = None
            if seconds is not None:
                self._measure((bucket, width), seconds)
            if width == 1 and bucket in self.want_plain:
                self.plain_tries[bucket] = self.plain_tries.get(bucket, 0) + 1
            if self.steps % self.cfg.retire_every == 0:
                self._expire()
            if (bucket, 1) in self.costs and (bucket, self.width) in self.costs:
                self.ratio = self.costs[(bucket, 1)] / self.costs[(bucket, self.width)]
            if confidence is not None:  # (its rows are ``rids``')
                self.calibration.observe(confidence, accepted, width - 1)
            if width > 1:
                self.counts.observe(rids, accepted, width - 1, self.cfg.decay, self.cfg.global_decay)
            else:
                self.counts.age(rids, self.cfg.decay)
            self.counts.refresh()

    def forget(self, rid: str) -> None:
        """A finished request's counts are dropped at the next :meth:`fold` (while the device runs the
        next step). Why not now: at 128 requests ~4-13 finish a step, ~6 us each on the CPU, on the
        step's critical path (the engine's commit; forty-fourth session). Bounded: where no step
        folds (requests that finish at their first token), every 256th does it here."""
        self._gone.append(rid)
        if len(self._gone) >= 256:
            self.fold()

    def state(self) -> dict:
        """What the planner knows (benchmark rows): step costs in ms by "bucket x width" (the fast average,
        and the slow one the decisions about drafting at all read), every request's acceptance per draft
        position, and the steps run at each width."""
        self.fold()
        return {
            "cost_ms": {f"{b}x{w}": round(1e3 * t, 3) for (b, w), t in sorted(self.costs.items())},
            "decision_cost_ms": {f"{b}x{w}": round(1e3 * t, 3) for (b, w), t in sorted(self.slow_costs.items())},
            "profile_scale": {w: round(x, 3) for w, x in sorted(self.scale.items())},
            "prior_rates": [round(float(x), 3) for x in self.counts.prior_rates()],
            "confidence_fit": self.calibration.state() if self.calibration.fitted else None,
            "steps": self.steps,
            "decisions": list(self.decisions),
        }


def _neighbours(points: list[tuple[int, float]], x: int) -> tuple[tuple[int, float] | None, tuple[int, float] | None]:
    """The points ``(at, cost)`` nearest below and above ``x`` (None where there is none)."""
    lo = max((p for p in points if p[0] < x), default=None)
    hi = min((p for p in points if p[0] > x), default=None)
    return lo, hi


def _on_line(lo: tuple[int, float], hi: tuple[int, float], x: int) -> float:
    """The cost at ``x`` on the line through ``lo`` and ``hi``."""
    return lo[1] + (hi[1] - lo[1]) * (x - lo[0]) / (hi[0] - lo[0])


def _tokens_by_width(reach: np.ndarray, rows: int) -> np.ndarray:
    """``[P]`` expected accepted drafts by position, summed over ``rows`` requests (each request's
    ``prod_{i <= j} rate_i``) -> ``[P + 1]`` expected committed tokens of a step at widths ``1 .. P + 1``
    (every request emits one token, plus its accepted drafts)."""
    return rows + np.concatenate([[0.0], np.cumsum(reach)])


def _cache_dir() -> Path:
    return Path(os.environ.get("DFLASH2_CACHE", Path.home() / ".cache" / "dflash2")) / "step_costs"


def cached_profile(runner, target, draft) -> dict[tuple[int, int], float]:
    """``runner.profile()``, kept on disk per (target, drafter, device, dtype, buckets, widths), so a
    restart does not profile again."""
    import torch

    dev = torch.cuda.get_device_name(target.device) if target.device.type == "cuda" else "cpu"
    ident = {
        "target": target.config.to_dict() if hasattr(target.config, "to_dict") else str(target.config),
        "draft": draft.config.to_dict() if draft is not None and hasattr(draft.config, "to_dict") else None,
        "device": dev,
        "dtype": str(target.dtype),
        "buckets": list(runner.buckets),
        "widths": list(runner.verify_widths),
        "kv": runner.kv_buckets[0],
        "graphs": runner.use_graph,
        "plain": getattr(runner, "plain_graphs", False),  # width 0 (the target alone) profiled too
        "greedy": True in getattr(runner, "batch_kinds", (True,)),  # else sampled steps were timed
    }
    tp = getattr(target, "tp", None)  # split over ranks: rank 0's file and clock serve every rank
    if tp is not None:
        ident["tp"] = tp.size
    key = hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:24]
    path = _cache_dir() / f"{key}.json"
    costs = None
    if tp is None or tp.leader:
        try:
            costs = {(int(b), int(w)): float(t) for b, w, t in json.loads(path.read_text())["costs"]}
        except (OSError, ValueError, KeyError, TypeError):
            pass
    if tp is not None:  # every rank profiles (each replay sums over the ranks) or none does
        costs = tp.share(costs)
    if costs is not None:
        return costs
    costs = runner.profile()
    if tp is not None:
        costs = tp.share(costs)
    if tp is None or tp.leader:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(
                json.dumps({"ident": ident, "costs": [[b, w, t] for (b, w), t in costs.items()]}, default=str)
            )
        except OSError:  # a read-only home: profile again next time
            pass
    return costs
