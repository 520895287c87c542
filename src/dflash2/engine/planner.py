"""Adaptive speculation: each step, the verify width that maximises expected committed tokens per
second of step time, 1 (the target alone: no draft forward at all) included. Lossless whatever it
picks: every step is a complete speculative step at its width.

- Step cost per (batch bucket, width): a profile measured at start-up (the graph runner's replays)
  or injected, then an online average of the steps actually run, so host overhead counts too.
- Acceptance per request: the probability that each next draft is accepted, an exponentially
  weighted count of accepted / tried drafts with a prior from every request's (cold start: the
  prior is optimistic, so new traffic verifies full blocks until the counts say otherwise).
  Expected committed tokens at width ``w``: ``sum_{i < w} alpha^i``.
- Decisions are keyed on the decode requests only (prefills do not count) and switch only when the
  other width is ``hysteresis`` better. Every ``probe_every`` steps at one width, one step runs the
  other (width 1 observes no acceptance, and an unused width's cost goes stale as contexts grow).
  A width never run at a bucket is costed from the other width there and the latest ratio of the
  two seen anywhere, so each new batch size does not have to try both. Where the runner can run
  any width (the eager paged runner), the widths between 1 and the full one are costed linearly
  between the two ends until they have run, and the best of them all is taken.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

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


@dataclass
class PlannerConfig:
    mode: str = "off"  # auto: plan each step; off: always the full width (the default: docs/benchmarks.md)
    schedule: tuple[tuple[int, int], ...] = ()  # pinned (max batch, width) pairs; overrides auto
    hysteresis: float = 0.05  # the other width must promise this much more tokens/s
    probe_every: int = 32  # steps at one width between probes of the other
    prior: float = 0.9  # per-draft acceptance before anything is observed
    prior_weight: float = 2.0  # pseudo-drafts of the prior in a request's estimate
    decay: float = 0.9  # per step, on a request's counts (recent steps matter most)
    cost_decay: float = 0.8  # weight of the old average when a step's time comes in
    # a width between 1 and the full one must beat both ends by this much more: its cost is interpolated
    # until it runs, and acceptance is modelled as geometric, which under-counts long greedy streaks
    # (measured: without it, greedy at 16 requests on the CPU fell from 1.5x to 1.2x of the target alone)
    between_margin: float = 0.15

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"--speculative-planner must be one of {MODES}, got {self.mode!r}")
        for name in ("hysteresis", "prior", "decay", "cost_decay", "between_margin"):
            v = getattr(self, name)
            if not 0 <= v < 1 + (name == "hysteresis") * 9:
                raise ValueError(f"planner {name} out of range: {v}")


@dataclass
class _Counts:
    accepted: float = 0.0
    tried: float = 0.0


@dataclass
class Planner:
    width: int  # the full width (the runner's)
    cfg: PlannerConfig = field(default_factory=PlannerConfig)
    costs: dict[tuple[int, int], float] = field(default_factory=dict)  # (bucket, width) -> seconds
    current: int = 0  # the width of the last step (0: none yet)
    steps: int = 0
    last_run: dict[int, int] = field(default_factory=dict)  # width -> the step it last ran
    ratio: float | None = None  # cost(width 1) / cost(full width), latest seen
    counts: dict[str, _Counts] = field(default_factory=dict)  # per request id
    # the widths a step can run (the runner's: every width eagerly, the captured ones in graphs);
    # () = 1 and the full width
    widths: tuple[int, ...] = ()
    total: _Counts = field(default_factory=_Counts)  # every request's, for the prior

    @property
    def adapts(self) -> bool:
        """Whether widths are chosen from costs and acceptance (not fixed, not pinned)."""
        return self.width > 1 and self.cfg.mode == "auto" and not self.cfg.schedule

    def can_pick(self, width: int) -> bool:
        if width == self.width:
            return True
        if self.cfg.schedule:
            return any(w == width for _, w in self.cfg.schedule) or width == 1
        return self.adapts and width == 1

    # ---- estimates -------------------------------------------------------------------------------
    def prior_alpha(self) -> float:
        t, c = self.total, self.cfg
        return (t.accepted + c.prior * 10 * c.prior_weight) / (t.tried + 10 * c.prior_weight)

    def alpha(self, rid: str) -> float:
        c, k = self.counts.get(rid, _Counts()), self.cfg.prior_weight
        return (c.accepted + k * self.prior_alpha()) / (c.tried + k)

    def expected_tokens(self, rids: list[str], width: int) -> float:
        """Expected committed tokens of one step at ``width`` (accepted drafts + the emitted token)."""
        out = 0.0
        for rid in rids:
            a = min(self.alpha(rid), 1 - 1e-9)
            out += (1 - a**width) / (1 - a)
        return out

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
        cost = {w: self.cost(bucket, w) for w in sorted(set(self.widths) | {1, W})}
        if cost[W] is None:  # cold start: full blocks (and their cost and acceptance are learned)
            return W
        if cost[1] is None:  # try width 1 once, to learn what it costs
            return 1
        keep = self.current if self.current in cost else W
        for end in (1, W):  # a probe keeps each end's cost (and, at the full width, acceptance) fresh
            if end != keep and self.steps - self.last_run.get(end, 0) >= cfg.probe_every:
                return end
        rate = {w: self.expected_tokens(rids, w) / c for w, c in cost.items() if c is not None}
        ends = max(rate[1], rate[W])
        best = max(rate, key=lambda w: rate[w] if w in (1, W) or rate[w] > ends * (1 + cfg.between_margin) else 0.0)
        return best if rate[best] > rate[keep] * (1 + cfg.hysteresis) else keep

    def cost(self, bucket: int, width: int) -> float | None:
        """Seconds of a step at ``width``: measured at this bucket, or derived from the other end
        (1 or the full width) measured there and the latest ratio between the two; a width between
        the ends, linear between their costs (tokens per row grow linearly; None: nothing to go on)."""
        if (bucket, width) in self.costs:
            return self.costs[(bucket, width)]
        if 1 < width < self.width:
            lo, hi = self.cost(bucket, 1), self.cost(bucket, self.width)
            return None if lo is None or hi is None else lo + (hi - lo) * (width - 1) / (self.width - 1)
        other = self.costs.get((bucket, self.width if width == 1 else 1))
        if other is None or self.ratio is None:
            return None
        return other * self.ratio if width == 1 else other / self.ratio

    def observe(self, rids: list[str], accepted: list[int], width: int, bucket: int, seconds: float) -> None:
        """One step's outcome: each request's accepted drafts, and the step's wall time (nothing to
        learn when the width is fixed or pinned: no per-request work on the hot path)."""
        if not self.adapts:
            return
        key, d = (bucket, width), self.cfg.cost_decay
        self.costs[key] = seconds if key not in self.costs else d * self.costs[key] + (1 - d) * seconds
        self.steps += 1
        self.last_run[width], self.current = self.steps, width
        if (bucket, 1) in self.costs and (bucket, self.width) in self.costs:
            self.ratio = self.costs[(bucket, 1)] / self.costs[(bucket, self.width)]
        g = width - 1
        if g == 0:
            return
        for rid, n in zip(rids, accepted):
            c = self.counts.setdefault(rid, _Counts())
            tried = n + (n < g)  # drafts accepted, plus the one rejected (none when the block was accepted whole)
            c.accepted, c.tried = self.cfg.decay * c.accepted + n, self.cfg.decay * c.tried + tried
            self.total.accepted, self.total.tried = 0.99 * self.total.accepted + n, 0.99 * self.total.tried + tried

    def forget(self, rid: str) -> None:
        self.counts.pop(rid, None)


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
    }
    key = hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()[:24]
    path = _cache_dir() / f"{key}.json"
    try:
        return {(int(b), int(w)): float(t) for b, w, t in json.loads(path.read_text())["costs"]}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    costs = runner.profile()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"ident": ident, "costs": [[b, w, t] for (b, w), t in costs.items()]}, default=str))
    except OSError:  # a read-only home: profile again next time
        pass
    return costs
