"""#22 at one request, offline: the planner (engine/planner.py, the real class) replayed over traced
full-width steps (``scripts/confidence_trace.py --width 5``), each request alone and in turn, with
given step costs (ms of a width-1 and a full-width step at one request, e.g. the H100's live ones).
A step the planner runs at width 1 commits one token and uses up the traced step it stands for;
a full-width step commits the traced step's ``n + 1``. Prints tokens per ms of the fixed width and
of each planner config, and how often acceptance recovers after a run of empty steps. Why: on the
H100 at one held-out request, T=1, auto served 5% under the fixed width (1.13x against 1.19x of the
target alone, docs/benchmarks.md, forty-fifth session) by going to width 1 after bad steps.

    .venv/bin/python scripts/cpu_planner_replay.py docs/cpu_2026-12-06_planner_replay/trace_w5.jsonl \\
        --suite heldout --temperature 1 --costs 1.82,2.71 --configs "prior_weight=2;default;prior_weight=16"
    .venv/bin/python scripts/cpu_planner_replay.py docs/cpu_2026-12-06d_widths_between/trace_w8.jsonl --width 8 \\
        --suite heldout --temperature 1 --costs 1.80,2.896 --between 5:2.70 --plain-ms 1.747
        # a verify width between (with graphs of its own, as --speculative-planner-widths 5 captures), and the
        # fixed width 5 read off the width-8 trace (its first 4 drafts: exact at T=0)
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
INT_FIELDS = ("probe_every", "retire_every", "stale_after", "plain_probes")


def load(path: str, temperature: float | None, suite: str | None) -> list[list[int]]:
    """Each traced request's accepted counts, in trace order (``suite``: those whose suite starts so)."""
    reqs: dict[tuple, list[int]] = collections.OrderedDict()
    for line in open(path):
        s = json.loads(line)
        if (temperature is None or s["T"] == temperature) and (suite is None or s["suite"].startswith(suite)):
            reqs.setdefault((s["T"], s["suite"], s["prompt"]), []).append(int(s["n"]))
    return list(reqs.values())


def replay(
    reqs: list[list[int]],
    width: int,
    costs: tuple[float, float],
    overrides: dict | None,
    stay: bool = False,
    plain_ms: float | None = None,
    fade: bool = True,
    retire_global: bool = False,
    between: dict[int, float] | None = None,
    fixed: int | None = None,
    noise: float = 0.0,
    seed: int = 0,
    growth: float = 0.0,
    lag: bool = False,
) -> dict:
    """Tokens per ms over every request in turn: the fixed width (``overrides`` None) or the planner.
    ``stay``: a width-1 step leaves the traced step it stood for to the next step (the text moved on by
    one token only: a run of bad steps is not skipped), a bound on the other side. ``plain_ms``: the
    target alone's step, and the planner's admission and retirement with it (a request that does not
    draft, or stops, runs its text's remaining tokens at that cost; ``fade``: those steps fade what
    was seen toward the prior, as in the engine; ``retire_global``: retirement priced on every request's
    rates, the rule before the forty-seventh session, not on the request's own). ``between``: verify widths
    between 1 and the full one (ms of each step) that the planner may pick too, a step at width ``w`` taking
    the traced step's first ``w - 1`` drafts (exact at T=0, where the drafts are the block's); ``fixed``: the
    fixed width replayed (``overrides`` None), one of ``between`` or the full one. ``noise`` > 0: the planner
    is given no costs but learns them from each step's time, the true cost times ``exp(noise * N(0, 1))``,
    starting from a start-up profile at 1/1.3 of the true costs (the replays leave out host work). ``growth``:
    every step costs ``1 + growth * f`` times its width's, ``f`` the share of its request's text already out
    (contexts grow: the GPU's steps cost more toward a request's end). ``lag``: as the engine runs it, each
    step's acceptance and cost folded while the next step runs (``observe(defer=True)``, then ``fold``), the
    next width chosen then (``choose_ahead``) and the retirement checked then, acted on a step later."""
    import math
    import random
    from dflash2.engine.planner import Planner, PlannerConfig

    between = between or {}
    ms_of = {1: costs[0], width: costs[1], **between}
    planner = None
    if overrides is not None:
        cfg = PlannerConfig(mode="auto", widths=tuple(sorted(between)), **overrides)
        given = {(1, w): c / 1e3 for w, c in ms_of.items()} | ({(1, 0): plain_ms / 1e3} if plain_ms else {})
        # (the widths' costs as a start-up profile too: with graphs of their own, widths between count as the
        # ends do, Planner._counted)
        if noise:
            planner = Planner(width, cfg, profile={k: c / 1.3 for k, c in given.items()})
        else:
            planner = Planner(width, cfg, costs=given, profile=given)
        planner.widths = tuple(sorted(ms_of))
    rng = random.Random(seed)

    def timed(ms: float) -> float | None:  # a step's time as the planner sees it (None: given costs)
        return ms / 1e3 * math.exp(noise * rng.gauss(0, 1)) if noise else None

    def grown(ms: float, done: float, total: int) -> float:  # a step's true cost, ``done`` of ``total`` steps in
        return ms * (1 + growth * done / max(total, 1))

    tokens, ms, ones, steps, plain_reqs = 0, 0.0, 0, 0, 0
    by_width: collections.Counter = collections.Counter()
    admits = planner is not None and plain_ms is not None

    def alone(rest: list[int], steps_of: int) -> None:
        """The text's remaining tokens (``rest``: the last of its ``steps_of`` traced steps) by the target
        alone, a step each."""
        nonlocal tokens, ms
        left = sum(n + 1 for n in rest)
        for k in range(left):
            c = grown(plain_ms, steps_of - len(rest) + len(rest) * k / left, steps_of)
            tokens, ms = tokens + 1, ms + c
            planner.observe_plain(1, timed(c), fade=fade)

    for k, ns in enumerate(reqs):
        rid = f"r{k}"
        i = 0
        if admits and not planner.speculate_new(1, 1):
            alone(ns, len(ns))
            i, plain_reqs = len(ns), plain_reqs + 1
        ahead: int | None = None  # (lag) the width chosen while the last step ran
        retire_ahead = False  # (lag) the retirement found while the last step ran
        while i < len(ns):
            retire = retire_ahead if lag else admits and planner.retire(1, None if retire_global else [rid])
            if retire:
                alone(ns[i:], len(ns))
                break
            n = ns[i]
            if planner is None:
                w = fixed or width
            else:
                w = ahead if ahead is not None else planner.choose([rid], 1)
            if lag and planner is not None:  # the step's overlap: the last step's counts, the next width
                planner.fold()
                ahead = planner.choose_ahead([rid], 1, w)
                retire_ahead = admits and planner.retire(1, None if retire_global else [rid])
            got, c = min(n, w - 1), grown(ms_of[w], i, len(ns))
            i += 1 if w > 1 or not stay else 0
            tokens, ms, ones, steps = tokens + got + 1, ms + c, ones + (w == 1), steps + 1
            by_width[w] += 1
            if planner is not None:
                planner.observe([rid], [got], w, 1, timed(c), defer=lag)
        if planner is not None:
            planner.fold()
            planner.forget(rid)
    return {
        "tokens_per_ms": tokens / ms,
        "width1_share": ones / max(steps, 1),
        "plain_requests": plain_reqs,
        "by_width": dict(sorted(by_width.items())),
    }


def replay_batch(
    reqs: list[list[int]],
    width: int,
    costs: tuple[float, float],
    plain_ms: float,
    overrides: dict | None,
    batch: int,
    join_priced: bool = False,
) -> dict:
    """Tokens per ms of ``batch`` requests at a time, as the engine serves a steady queue: a finished request's
    place is taken by the next at once, one width a step for the batch (every request's step at that width's
    cost, ``costs`` at ``batch``: ms of a drafting batch's width-1 step and of its full-width one; ``plain_ms``:
    the target alone's). The planner's rules as the engine applies them: a request admitted into a batch that
    does not draft does not draft; a batch that mixes cannot draft (the drafting ones retire); retirement on the
    batch's own acceptance, for good. ``overrides`` None: the fixed width. A request that does not draft runs
    its text's remaining tokens one a step; a drafting step takes its traced step's accepted drafts.
    ``join_priced``: every admission into a drafting batch priced with the hysteresis (the rule before the
    fifty-first session) instead of joining it."""
    from dflash2.engine.planner import Planner, PlannerConfig

    planner = None
    if overrides is not None:
        given = {(batch, 1): costs[0] / 1e3, (batch, width): costs[1] / 1e3, (batch, 0): plain_ms / 1e3}
        planner = Planner(width, PlannerConfig(mode="auto", **overrides), costs=given, profile=given)
        planner.widths = (1, width)
    queue = list(enumerate(reqs))[::-1]
    running: list[dict] = []
    drafted = False  # the last step drafted (every request)
    tokens, ms, by_width, plain_steps, retired, not_drafting = 0, 0.0, collections.Counter(), 0, 0, 0
    while queue or running:
        while queue and len(running) < batch:  # admissions
            k, ns = queue.pop()
            plain = planner is not None and not all(r["drafts"] for r in running)
            # (the engine's LLMEngine._joins: a drafting batch at this load takes new requests unpriced)
            joins = drafted and bool(running) and not plain and not join_priced
            drafts = planner is None or (not plain and (joins or planner.speculate_new(batch, batch)))
            not_drafting += not drafts
            running.append({"rid": f"r{k}", "ns": ns, "i": 0, "left": sum(n + 1 for n in ns), "drafts": drafts})
        rids = [r["rid"] for r in running]
        drafters = sum(r["drafts"] for r in running)
        if planner is not None and drafters and (drafters < len(running) or planner.retire(batch, rids)):
            for r in running:
                if r["drafts"]:
                    r["drafts"], retired = False, retired + 1
                    r["left"] = sum(n + 1 for n in r["ns"][r["i"] :])
            drafters = 0
        drafted = bool(drafters)
        if drafters:
            w = width if planner is None else planner.choose(rids, batch)
            got = []
            for r in running:
                n = r["ns"][r["i"]]
                got.append(min(n, w - 1))
                r["i"] += 1
                tokens += got[-1] + 1
            ms += costs[0] if w == 1 else costs[1]
            by_width[w] += 1
            if planner is not None:
                planner.observe(rids, got, w, batch, None)
        else:
            for r in running:
                r["left"] -= 1
            tokens, ms, plain_steps = tokens + len(running), ms + plain_ms, plain_steps + 1
            planner.observe_plain(batch, None, fade=True)
        for r in [r for r in running if (r["i"] >= len(r["ns"]) if r["drafts"] else r["left"] <= 0)]:
            running.remove(r)
            if planner is not None:
                planner.forget(r["rid"])
    return {
        "tokens_per_ms": tokens / ms,
        "plain_steps": plain_steps,
        "retired": retired,
        "not_drafting": not_drafting,
        "by_width": dict(sorted(by_width.items())),
    }


def recovery(reqs: list[list[int]], run: int) -> tuple[float, float, int]:
    """P(a step accepts any draft), unconditionally and after ``run`` empty steps in a row (and how
    many such steps there were)."""
    after, hits, total, any_ = 0, 0, 0, 0
    for ns in reqs:
        for i, n in enumerate(ns):
            total += 1
            any_ += n > 0
            if i >= run and all(x == 0 for x in ns[i - run : i]):
                after += 1
                hits += n > 0
    return any_ / total, hits / max(after, 1), after


def log_loss(reqs: list[list[int]], width: int, overrides: dict) -> float:
    """Mean log-loss of each request's estimated acceptance per position (the planner's
    AcceptanceCounts with this config), every estimate made before its step is seen: how well a
    config's per-request estimate predicts the next step."""
    import math

    import numpy as np

    from dflash2.engine.planner import AcceptanceCounts, PlannerConfig

    cfg = PlannerConfig(mode="auto", **overrides)
    counts = AcceptanceCounts(width - 1, cfg.prior, cfg.prior_weight, cfg.prior_drafts)
    loss, seen = 0.0, 0
    for k, ns in enumerate(reqs):
        rid = f"r{k}"
        for n in ns:
            rates = np.clip(counts.rates([rid])[0], 1e-4, 1 - 1e-4)
            for i in range(min(n + 1, width - 1)):  # positions reached: i <= n
                loss -= math.log(rates[i] if i < n else 1 - rates[i])
                seen += 1
            counts.observe([rid], [n], width - 1, cfg.decay, cfg.global_decay)
        counts.forget(rid)
    return loss / max(seen, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--costs", default="1.82,2.71", help="ms of a width-1 step and of a full-width one")
    ap.add_argument("--width", type=int, default=5)
    ap.add_argument("--temperature", type=float, default=None)
    ap.add_argument("--suite", default=None, help="only the trace's suites that start so (heldout, gsm8k)")
    ap.add_argument("--configs", default="default", help="';'-separated PlannerConfig overrides, k=v,k=v")
    ap.add_argument("--plain-ms", type=float, default=None, help="the target alone's step: admission too")
    ap.add_argument("--repeat", type=int, default=1, help="the requests this many times over, in turn")
    ap.add_argument("--retire-global", action="store_true", help="retirement on every request's rates (before)")
    ap.add_argument(
        "--between", default="", help="verify widths between 1 and --width the planner may pick, with their ms: 5:2.68"
    )
    ap.add_argument("--cost-noise", type=float, default=0.0, help="the planner learns costs from times this noisy")
    ap.add_argument("--seeds", type=int, default=1, help="with --cost-noise: the replay's mean over this many seeds")
    ap.add_argument(
        "--cost-growth", type=float, default=0.0, help="a step at a request's end costs 1 + this times more"
    )
    ap.add_argument("--lag", action="store_true", help="as the engine: counts folded and the width chosen a step late")
    ap.add_argument(
        "--batch", type=int, default=0, help="this many requests at a time, a steady queue (needs --plain-ms)"
    )
    args = ap.parse_args()
    between = {int(w): float(c) for w, c in (x.split(":") for x in args.between.split(",") if x)}
    reqs = load(args.trace, args.temperature, args.suite) * args.repeat
    c1, cw = (float(x) for x in args.costs.split(","))
    steps = sum(len(ns) for ns in reqs)
    al = sum(n + 1 for ns in reqs for n in ns) / steps
    print(f"{len(reqs)} requests, {steps} full-width steps, AL {al:.2f}; costs {c1} / {cw} ms")
    for run in (1, 2, 3):
        p, q, m = recovery(reqs, run)
        print(f"  P(any draft accepted) {p:.3f}; after {run} empty step(s) {q:.3f} ({m} steps)")
    if args.batch:
        if args.plain_ms is None:
            raise SystemExit("--batch needs --plain-ms (the target alone's step at that batch)")
        fixed = replay_batch(reqs, args.width, (c1, cw), args.plain_ms, None, args.batch)["tokens_per_ms"]
        alone = args.batch / args.plain_ms
        print(f"  batch {args.batch}: target alone {alone:.3f} tokens/ms; fixed w{args.width} {fixed / alone:.3f}x")
        for spec in args.configs.split(";"):
            over = {} if spec == "default" else {k: float(v) for k, v in (kv.split("=") for kv in spec.split(","))}
            over = {k: int(v) if k in INT_FIELDS else v for k, v in over.items()}
            for priced in (False, True):
                r = replay_batch(reqs, args.width, (c1, cw), args.plain_ms, over, args.batch, join_priced=priced)
                print(
                    f"  auto {spec:<28}{' priced' if priced else ' joins '} {r['tokens_per_ms'] / alone:.3f}x "
                    f"({r['tokens_per_ms'] / fixed:.3f} of fixed); {r['plain_steps']} steps of the target alone, "
                    f"{r['retired']} retired, {r['not_drafting']} admitted not drafting; drafting steps by width "
                    f"{r['by_width']}"
                )
        return
    fixed = replay(reqs, args.width, (c1, cw), None, growth=args.cost_growth)["tokens_per_ms"]
    alone_ms = c1 * (1 + args.cost_growth / 2)  # (the target alone's mean step, as it grows)
    print(f"  target alone {1 / alone_ms:.3f} tokens/ms; fixed w{args.width} {fixed:.3f} ({fixed * alone_ms:.3f}x)")
    for w in sorted(between):  # (from the full width's trace: its first w - 1 drafts)
        r = replay(reqs, args.width, (c1, cw), None, between=between, fixed=w, growth=args.cost_growth)["tokens_per_ms"]
        print(f"  fixed w{w} {r:.3f} ({r * alone_ms:.3f}x; {r / fixed:.3f} of fixed w{args.width})")
    for spec in args.configs.split(";"):
        over = {} if spec == "default" else {k: float(v) for k, v in (kv.split("=") for kv in spec.split(","))}
        over = {k: int(v) if k in INT_FIELDS else v for k, v in over.items()}
        print(f"  auto {spec:<32} log-loss of the per-request estimate {log_loss(reqs, args.width, over):.4f}")
        for stay in (False, True):
            for fade in (True, False) if args.plain_ms else (True,):
                runs = [
                    replay(reqs, args.width, (c1, cw), over, stay, args.plain_ms, fade, args.retire_global, between,
                           noise=args.cost_noise, seed=k, growth=args.cost_growth, lag=args.lag)
                    for k in range(args.seeds if args.cost_noise else 1)
                ]  # fmt: skip
                r = {
                    k: sum(x[k] for x in runs) / len(runs) for k in ("tokens_per_ms", "width1_share", "plain_requests")
                }
                r["by_width"] = runs[0]["by_width"]
                tag = f"{'stays' if stay else 'skips'}{(' fade ' + ('on' if fade else 'off')) if args.plain_ms else ''}"
                print(
                    f"  auto {spec:<32} {tag} {r['tokens_per_ms']:.3f} tokens/ms ({r['tokens_per_ms'] / fixed:.3f} "
                    f"of fixed), width 1 in {100 * r['width1_share']:.1f}% of steps, {r['plain_requests']} of "
                    f"{len(reqs)} requests admitted without drafting; steps by width {r['by_width']}"
                )


if __name__ == "__main__":
    main()
