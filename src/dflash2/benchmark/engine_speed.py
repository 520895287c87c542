"""Side-by-side speed through the serving engine at several concurrencies (continuous batching):
the target alone and DFlash2 at each width and verifier, on the same prompts and hardware."""

from __future__ import annotations

import gc
import json
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..engine.config import EngineConfig
from ..engine.engine import LLMEngine
from ..engine.gc_utils import GCPauses, freeze_gc
from ..engine.stats import EngineStats
from ..engine.steps import GraphTimer
from ..training.data import render
from ..verification import SamplingParams

ROUND_SEEDS = 1_000_000  # round k's request i samples with seed k * ROUND_SEEDS + i (run's rounds)


@dataclass
class ConcurrencyRow:
    config: str
    concurrency: int
    requests: int
    output_tokens: int
    seconds: float
    tokens_per_s: float
    accept_length: float
    draft_ms_per_step: float
    verify_ms_per_step: float
    overhead_ms_per_step: float
    speedup: float = 1.0
    rounds: int = 1
    tokens_per_s_min: float = 0.0  # spread over the rounds
    tokens_per_s_max: float = 0.0
    round_tokens_per_s: list = field(default_factory=list)  # round by round, to see drift over time
    round_slots: list = field(default_factory=list)  # each round's place in the whole run's order
    mean_width: float = 0.0  # verify width per step, averaged (the planner's choices; fixed rows: their width)
    # each round's steps by verify width ("plain": those of width 1 that were the target alone beside a
    # drafter), its drafting requests retired and those admitted without drafting: where a planner
    # row's rounds differ (its cold start is in the first), what each ran
    round_widths: list = field(default_factory=list)
    # Python's cyclic collections during the run (they pause the host wherever they land): their time per
    # step and their number by generation (0, 1, 2)
    gc_ms_per_step: float = 0.0
    gc_collections: list = field(default_factory=lambda: [0, 0, 0])
    gc_seconds: float = 0.0  # their whole time (all rounds: the table's "gc ms")
    step_seconds: float = 0.0  # of ``seconds``: in batched decode steps
    prefill_seconds: float = 0.0  # of ``seconds``: in prefill chunks (the rest: the host between them)
    # what the prefills run inside steps added to them, in all (overlap_ms_per_step's total), and the packed
    # prefill replays' device time (GraphModelRunner.take_prefill_device_s; 0 elsewhere): how much of the
    # prefills' share of the wall is the device computing them
    overlap_seconds: float = 0.0
    prefill_device_seconds: float = 0.0
    admissions_held: int = 0  # steps whose admission round waited (EngineConfig.num_continuous_decode_steps)
    # with the planner on: its step costs (ms by "bucket x width") and every request's acceptance per
    # draft position, as it stood when the round ended
    planner_state: dict = field(default_factory=dict)
    # mean live step ms and step count by "bucket x width" (width 0: the target alone beside a drafter)
    step_ms_by_shape: dict = field(default_factory=dict)
    # the same shapes' graphs timed on the device (GraphTimer): where the wall over them is host or wait
    device_ms_by_shape: dict = field(default_factory=dict)
    # the graph runner's packed prefills: "T" (tokens) or "mixT" (in a step) -> [replays, real tokens] (a pooled
    # row: every round's; before the sixty-second session the last round's)
    prefill_shapes: dict = field(default_factory=dict)
    # of a step: host time outside the runner's step (the planner's choice before it, observation and
    # bookkeeping after), where a fixed width and the planner differ
    host_ms_per_step: float = 0.0
    plan_ms_per_step: float = 0.0  # of host_ms_per_step: the planner's calls (and the retirement check)
    draw_ms_per_step: float = 0.0  # of host_ms_per_step: the sampled batch's parameters and uniforms
    commit_ms_per_step: float = 0.0  # of host_ms_per_step: the tokens into each request after the read-back
    overlap_ms_per_step: float = 0.0  # what the prefills run inside steps added to a step's wall
    # the host blocked at a step's read-back, waiting for the device: about the step's device time less the host
    # work queued behind it (near 0: the device waits for the host; under async scheduling too)
    wait_ms_per_step: float = 0.0


# ``run(schedules=...)``: the engine fields each schedule sets on a row's engine (every field, as the engine
# keeps them for the rows after; admissions as by default); "cdsN": the overlap schedule admitting once every N
# decode steps (``--num-continuous-decode-steps N``)
SCHEDULES: dict[str, dict] = {
    name: {"disable_overlap_schedule": off, "async_scheduling": ahead, "num_continuous_decode_steps": None}
    for name, off, ahead in (("no-overlap", True, False), ("overlap", False, False), ("async", False, True))
}


def schedule_fields(name: str) -> dict:
    """The engine fields of a ``--schedules`` entry (:data:`SCHEDULES`, or ``cdsN``)."""
    if name in SCHEDULES:
        return SCHEDULES[name]
    if name.startswith("cds") and name[3:].isdigit() and int(name[3:]) >= 1:
        return {**SCHEDULES["overlap"], "num_continuous_decode_steps": int(name[3:])}
    raise ValueError(f"schedule {name!r}: one of {', '.join(SCHEDULES)} or cdsN (N >= 1)")


def build_planner(adaptive: bool, planner_widths: str | None) -> str:
    """The planner that :func:`run`'s shared engines are built with: graphs for every planner row."""
    if not adaptive:
        return "off"
    return "auto" + (f":{planner_widths}" if planner_widths else "")


def _planner_at(planner: str, width: int) -> tuple[str, str]:
    """``"auto:5"`` -> the mode and the widths between that lie under ``width`` (``"auto:5"`` at width 5 is
    plain auto: a run's widths between serve its wider engines, e.g. ``--speed-widths 5,8 --planner-widths 5``)."""
    mode, _, between = planner.partition(":")
    return mode, ",".join(w for w in between.split(",") if w and int(w) < width)


@dataclass
class SharedEngines:
    """What :func:`run` keeps across levels and calls with ``slots``: one engine per runner (width,
    verifier, attention backend), captured with ``build_planner``'s graphs (the union of the rows'),
    and one planner per row config, swapped into its engine for the row."""

    build_planner: str = "off"
    slots: int = 0  # the running requests each engine is built for (run's ``slots``, on first use)
    engines: dict = field(default_factory=dict)
    planners: dict = field(default_factory=dict)

    def restart(self) -> None:
        """Every planner as it started (its start-up profile, nothing learnt), for a new level."""
        self.planners = {k: p.fresh() for k, p in self.planners.items()}


def measure(
    target,
    draft,
    prompt_ids,
    width: int,
    block: bool,
    concurrency: int,
    max_new_tokens: int,
    temperature: float,
    name: str,
    requests_per_slot: int | None = None,
    engines: dict | None = None,
    planner: str = "off",
    attention_backend: str = "auto",
    engine_kw: dict | None = None,
    shared: SharedEngines | None = None,
    seed: int = 0,
    schedule: dict | None = None,
) -> ConcurrencyRow:
    """One config at one concurrency (request ``i`` sampled with seed ``seed + i``). ``engines``: engines
    kept across calls, one per config and concurrency, so the warm-up pass and the timed rounds run on the
    same engine, as a warmed-up server would (on CUDA an engine captures its graphs when it is built).
    ``shared`` (instead of ``engines``): one engine per runner for every concurrency up to ``shared.slots``
    (built with that many running requests, each call capped at its ``concurrency``), either temperature
    (both kinds of step graph) and every planner row (built with ``shared.build_planner``'s graphs, the
    row's planner swapped in). ``schedule``: :class:`EngineConfig` fields read each step (the overlap
    schedule, async scheduling) set on its engine for the row (None: as the engine was built)."""
    row_planner = planner
    # one planner per row config and schedule: what it learns (step costs: walls, or device times under async
    # scheduling) stays with its schedule's rows
    sched = ",".join(f"{k}={v}" for k, v in sorted((schedule or {}).items()))
    if shared is not None:
        engines, key = shared.engines, (width if draft is not None else 1, block, attention_backend)
        planner = shared.build_planner if draft is not None else "off"
    else:
        key = (width if draft is not None else 1, block, concurrency, planner, attention_backend)
    eng = (engines or {}).get(key)
    slots = (shared.slots if shared is not None else 0) or concurrency
    if eng is None:
        mode, between = _planner_at(planner, width)  # "auto:3": the planner with verify widths between (graphs)
        eng = LLMEngine(
            target,
            draft,
            EngineConfig.for_models(
                target,
                draft,
                width,
                context_length=4096,
                max_running_requests=slots,
                block_verification=block,
                max_total_tokens=max(65536, slots * 2048),
                speculative_planner=mode,
                speculative_planner_widths=between or None,
                attention_backend=attention_backend,
                # a level runs one temperature: that kind's step graphs only (half the captures)
                **{
                    "graph_sampling": "both" if shared else "greedy" if temperature == 0 else "sampled",
                    **(engine_kw or {}),
                },
            ),
        )
        if engines is not None:
            engines[key] = eng
        if shared is not None:
            shared.planners[(key, planner, sched)] = eng.planner
    if shared is not None and draft is not None:
        if (key, row_planner, sched) not in shared.planners:
            mode, between = _planner_at(row_planner, width)
            shared.planners[(key, row_planner, sched)] = eng.planner_for(mode, between or None)
        eng.use_planner(shared.planners[(key, row_planner, sched)])
    if concurrency > eng.cfg.max_running_requests:
        raise ValueError(f"concurrency {concurrency} above the engine's {eng.cfg.max_running_requests} slots")
    eng.scheduler.max_running = concurrency
    if schedule:  # (read each step: the engine is idle between rows)
        eng.cfg = replace(eng.cfg, **schedule)
    eng.stats = EngineStats(accepted_by_position=[0] * max(eng.width - 1, 0))
    if hasattr(eng.runner, "timer") and eng.runner.timer is None:  # every row's graphs timed alike
        eng.runner.timer = GraphTimer(eng.target.device)
    n = len(prompt_ids) if requests_per_slot is None else min(len(prompt_ids), requests_per_slot * concurrency)
    n = max(concurrency, n)
    top_p = 0.95 if temperature else 1.0
    sps = [
        SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, seed=seed + i)
        for i in range(n)
    ]
    shapes0 = {k: list(v) for k, v in getattr(eng.runner, "prefill_shapes", {}).items()}
    prefill_device = getattr(eng.runner, "take_prefill_device_s", lambda: 0.0)
    prefill_device()  # (the replays before this row: its warm-up)
    freeze_gc("bench row")  # what lives now (engines, earlier rows) is not walked by a collection in this row
    pauses = GCPauses()
    gc.callbacks.append(pauses)
    t0 = time.perf_counter()
    try:
        out = eng.generate([prompt_ids[i % len(prompt_ids)] for i in range(n)], sps)  # (every rank, under --tp-size)
    finally:
        gc.callbacks.remove(pauses)
    secs = time.perf_counter() - t0
    prefill_device_s = prefill_device()
    prefill_shapes = {
        k: [n - shapes0.get(k, [0, 0])[0], t - shapes0.get(k, [0, 0])[1]]
        for k, (n, t) in sorted(getattr(eng.runner, "prefill_shapes", {}).items())
        if n > shapes0.get(k, [0, 0])[0]
    }
    s = eng.stats
    C = sum(len(r.token_ids) for r in out)
    V = sum(r.verify_steps for r in out)
    steps = max(s.steps, 1)
    return ConcurrencyRow(
        name,
        concurrency,
        n,
        C,
        secs,
        C / secs,
        C / max(V, 1),
        1e3 * s.draft_s / steps,
        1e3 * s.verify_s / steps,
        1e3 * (s.step_s - s.draft_s - s.verify_s) / steps,
        tokens_per_s_min=C / secs,
        tokens_per_s_max=C / secs,
        mean_width=sum(w * k for w, k in s.steps_by_width.items()) / steps,
        round_widths=[
            {
                **{str(w): k for w, k in sorted(s.steps_by_width.items())},
                "plain": sum(n for shape, (n, _) in s.step_s_by_shape.items() if shape.endswith("x0")),
                "retired": s.requests_retired,
                "not_drafting": s.requests_not_drafting,
            }
        ],
        step_seconds=s.step_s,
        overlap_seconds=s.overlap_s,
        prefill_seconds=s.prefill_s,
        prefill_device_seconds=prefill_device_s,
        admissions_held=s.admissions_held,
        planner_state=eng.planner.state() if eng.planner.adapts else {},
        step_ms_by_shape={k: [n, round(1e3 * t / n, 3)] for k, (n, t) in sorted(s.step_s_by_shape.items())},
        device_ms_by_shape={k: [n, round(1e3 * t / n, 3)] for k, (n, t) in sorted(s.device_s_by_shape.items())},
        host_ms_per_step=1e3 * s.host_s / steps,
        plan_ms_per_step=1e3 * s.plan_s / steps,
        draw_ms_per_step=1e3 * s.draw_s / steps,
        commit_ms_per_step=1e3 * s.commit_s / steps,
        overlap_ms_per_step=1e3 * s.overlap_s / steps,
        wait_ms_per_step=1e3 * s.wait_s / steps,
        prefill_shapes=prefill_shapes,
        gc_ms_per_step=1e3 * pauses.seconds / steps,
        gc_seconds=pauses.seconds,
        gc_collections=list(pauses.count),
    )


def pool_rounds(rows: list[ConcurrencyRow]) -> ConcurrencyRow:
    """One row from repeats of the same config: tokens over seconds summed across rounds (so a
    slow round weighs by its time, not as one vote), per-step times weighted by each round's steps."""
    first = rows[0]
    tok, secs = sum(r.output_tokens for r in rows), sum(r.seconds for r in rows)
    steps = [r.output_tokens / max(r.accept_length, 1e-9) for r in rows]  # verify steps of each round
    w = sum(steps)
    avg = lambda f: sum(getattr(r, f) * n for r, n in zip(rows, steps)) / w  # noqa: E731
    return ConcurrencyRow(
        first.config,
        first.concurrency,
        sum(r.requests for r in rows),
        tok,
        secs,
        tok / secs,
        tok / w,
        avg("draft_ms_per_step"),
        avg("verify_ms_per_step"),
        avg("overhead_ms_per_step"),
        rounds=len(rows),
        tokens_per_s_min=min(r.tokens_per_s for r in rows),
        tokens_per_s_max=max(r.tokens_per_s for r in rows),
        round_tokens_per_s=[r.tokens_per_s for r in rows],
        round_slots=[s for r in rows for s in r.round_slots],
        mean_width=avg("mean_width"),
        round_widths=[x for r in rows for x in r.round_widths],
        step_seconds=sum(r.step_seconds for r in rows),
        overlap_seconds=sum(r.overlap_seconds for r in rows),
        prefill_seconds=sum(r.prefill_seconds for r in rows),
        prefill_device_seconds=sum(r.prefill_device_seconds for r in rows),
        admissions_held=sum(r.admissions_held for r in rows),
        planner_state=rows[-1].planner_state,
        step_ms_by_shape=rows[-1].step_ms_by_shape,
        device_ms_by_shape=rows[-1].device_ms_by_shape,
        host_ms_per_step=avg("host_ms_per_step"),
        plan_ms_per_step=avg("plan_ms_per_step"),
        draw_ms_per_step=avg("draw_ms_per_step"),
        commit_ms_per_step=avg("commit_ms_per_step"),
        overlap_ms_per_step=avg("overlap_ms_per_step"),
        wait_ms_per_step=avg("wait_ms_per_step"),
        prefill_shapes=_sum_shapes(r.prefill_shapes for r in rows),
        gc_ms_per_step=avg("gc_ms_per_step"),
        gc_collections=[sum(c) for c in zip(*(r.gc_collections for r in rows))],
        gc_seconds=sum(r.gc_seconds for r in rows),
    )


def _sum_shapes(shapes) -> dict:
    """``{shape: [replays, tokens]}`` dicts added up (every round's, as a pooled row's other counts)."""
    out: dict = {}
    for one in shapes:
        for k, (n, t) in one.items():
            acc = out.setdefault(k, [0, 0])
            acc[0], acc[1] = acc[0] + n, acc[1] + t
    return dict(sorted(out.items()))


def run(
    target,
    draft,
    prompts: list[str],
    widths,
    verifiers,
    concurrencies,
    max_new_tokens: int,
    temperature: float,
    requests_per_slot: int | None = None,
    rounds: int = 1,
    on_level=None,
    warmup: bool = True,
    adaptive: bool = False,
    attention_backends: tuple[str, ...] = ("auto",),
    engine_kw: dict | None = None,
    deadline: float | None = None,
    planner_widths: str | None = None,
    slots: int | None = None,
    shared: SharedEngines | None = None,
    schedules: str = "",
) -> list[ConcurrencyRow]:
    """Every config at every concurrency, ``rounds`` times. Round k runs the configs in an order
    rotated by k (target included), so no config is always the first after a change: on a lent,
    host-bound GPU one row's speed moved 2-3x with its place in the order. ``on_level(rows so far)``
    runs after each concurrency level, so a run cut by a time limit keeps the levels it finished.
    ``adaptive``: each DFlash2 config again with the planner choosing its width per step (and, with
    ``planner_widths``, once more with those widths between 1 and the full one to choose among).
    ``attention_backends``: every config (the target too) once per backend, each speedup against
    the target on the same backend. ``engine_kw``: further :class:`EngineConfig` fields for every
    engine (``disable_cuda_graph``, ``synthetic_acceptance``: then every name says "synthetic").
    ``deadline`` (a ``time.time()``): no round after a level's first starts past it, and no level
    starts with less time left than the last level took. Why: on the H200 a call's c=128 level
    started 3.6 min before the script's deadline, ran past the call's limit, and its 4 minutes of
    device time came back with nothing (docs/gpu_runs.md, twenty-sixth session).
    Each round samples its own texts (request ``i`` of round ``k`` seeded ``k * ROUND_SEEDS + i``). Why: with one
    seed per request in every round a fixed width repeated the same sampled texts each round, while the
    planner's rows (whose widths change the draws) sampled new ones: at one held-out request, T=1, 24 a round,
    the rows' outputs differed by 10% in length (7,476-8,346 tokens) on text alone (forty-ninth session).
    ``slots`` (at least every concurrency): one engine per runner for all levels and planner rows,
    kept in ``shared`` (pass it to another call, at another temperature, to keep them there too),
    the planners restarted at each level. Why: building the engines (graph capture) took most of a
    level's time on the H200, each level and row building its own (docs/benchmarks.md, fortieth
    session). ``schedules``: e.g. "no-overlap,overlap,async": every row once per schedule (:data:`SCHEDULES`),
    each against the target with the same schedule, in one run (on one warm machine: an A/B in two calls
    compares machines as much as schedules)."""
    if slots is not None and slots < max(concurrencies):
        raise ValueError(f"slots {slots} below the largest concurrency {max(concurrencies)}")
    ids = [render(target.tokenizer, p) for p in prompts]
    if slots is not None:  # the engines capture the graphs of every planner row
        build = build_planner(adaptive, planner_widths)
        shared = shared or SharedEngines(build)
        shared.slots = shared.slots or slots
        if shared.build_planner != build:
            raise ValueError(f"shared engines built for planner {shared.build_planner!r}, this run needs {build!r}")
    configs = []
    for a in attention_backends:
        sfx = f" [{a}]" if len(attention_backends) > 1 else ""
        sfx += " synthetic" if (engine_kw or {}).get("synthetic_acceptance") else ""
        planners = [("off", "")] + [("auto", " adaptive")] * adaptive  # (measure's planner, the row's label)
        planners += [(f"auto:{planner_widths}", f" adaptive+w{planner_widths}")] * bool(adaptive and planner_widths)
        for o, osfx in [(schedule_fields(k), f" {k}") for k in schedules.split(",")] if schedules else [(None, "")]:
            configs += [("target" + sfx + osfx, None, 1, False, "off", a, o)] + [
                (f"dflash2 w={w} {v}{label}{sfx}{osfx}", draft, w, v == "block", p, a, o)
                for p, label in planners
                for w in widths
                for v in verifiers
                if ":" not in p or _planner_at(p, w)[1]  # (no row of widths between where none lie under w)
            ]
    rows, slot, level_s = [], 0, 0.0
    try:
        for c in concurrencies:
            t_level = time.time()
            if deadline is not None and rows and deadline - t_level < level_s:
                break
            done: dict[str, list[ConcurrencyRow]] = {name: [] for name, *_ in configs}
            # this level's engines, dropped before the next level builds its own (no slots): unfrozen first, so
            # the collector frees them (a frozen cycle would keep an engine's graphs and buffers for good)
            gc.unfreeze()
            engines: dict = {}
            if shared is not None:  # each level starts with planners that know their start-up profile only
                shared.restart()

            def one(name: str, d, w: int, block: bool, p: str, a: str, o, k: int = 0) -> ConcurrencyRow:
                return measure(
                    target, d, ids, w, block, c, max_new_tokens, temperature, name, requests_per_slot,
                    engines=engines, planner=p, attention_backend=a, engine_kw=engine_kw, shared=shared,
                    seed=k * ROUND_SEEDS, schedule=o,
                )  # fmt: skip

            # An untimed pass of every config at this level first: on the H200 the first run of each
            # (concurrency, width) shape set was 2-3x slower than the next ones (15 vs 36 tok/s for the
            # target at c=1; the token rows, which ran before the block rows of the same width, took
            # the hit and the block rows after them did not), which skewed every speedup.
            for _, *config in configs if warmup else []:
                one("warm-up", *config, k=rounds)  # (texts of no timed round)
            for k in range(rounds):
                if k and deadline is not None and time.time() > deadline:
                    break
                for name, *config in configs[k % len(configs) :] + configs[: k % len(configs)]:
                    row = one(name, *config, k=k)
                    row.round_slots, slot = [slot], slot + 1
                    done[name].append(row)
            level = [pool_rounds(done[name]) for name, *_ in configs]
            base = {(a, str(o)): r for r, (_, d, *_, a, o) in zip(level, configs) if d is None}
            for r, (_, d, *_, a, o) in zip(level, configs):
                if d is not None:
                    r.speedup = r.tokens_per_s / base[a, str(o)].tokens_per_s
            rows += level
            level_s = time.time() - t_level
            if on_level is not None:
                on_level(rows)
    finally:
        gc.unfreeze()  # what the rows froze (:func:`measure`) is the collector's again
    return rows


def _mean_ms(by_shape: dict) -> float | None:
    """The steps' mean ms over a ``{shape: [steps, mean ms]}`` dict (None: empty)."""
    n = sum(k for k, _ in by_shape.values())
    return sum(k * ms for k, ms in by_shape.values()) / n if n else None


def table(rows: list[ConcurrencyRow]) -> str:
    """One line a row; "step/dev ms": a step's mean wall (prefill out) over its graphs' device time (the last
    round's), where the gap is host work the device waits for; "wait ms": the host blocked at a step's read-back
    (near 0 where the device waits for the host); "prefill ovl/dev s": what the prefills launched inside steps
    added to them (overlap) over the packed replays' device time, inside steps or not (where all ran inside
    steps, the overlap's excess is the device idle while the host prepared them)."""
    out = [
        f"{'config':<40}{'conc':>5}{'tok/s':>9}{'AL':>6}{'speedup':>9}{'width':>7}{'draft ms':>10}{'verify ms':>10}"
        f"{'other ms':>9}{'rounds':>7}{'tok/s range':>16}{'wall % decode/prefill/host':>28}{'gc ms':>8}"
        f"{'step/dev ms':>13}{'wait ms':>9}{'prefill ovl/dev s':>19}"
    ]
    for r in rows:
        split = [r.step_seconds, r.prefill_seconds, r.seconds - r.step_seconds - r.prefill_seconds]
        split_txt = "/".join(f"{100 * x / max(r.seconds, 1e-9):.0f}" for x in split)
        wall, dev = _mean_ms(r.step_ms_by_shape), _mean_ms(r.device_ms_by_shape)
        timed = "-" if wall is None or dev is None else f"{wall:.2f}/{dev:.2f}"
        prefill = f"{r.overlap_seconds:.2f}/{r.prefill_device_seconds:.2f}"
        out.append(
            f"{r.config:<40}{r.concurrency:>5}{r.tokens_per_s:>9.1f}{r.accept_length:>6.2f}{r.speedup:>8.2f}x"
            f"{r.mean_width:>7.2f}{r.draft_ms_per_step:>10.1f}{r.verify_ms_per_step:>10.1f}{r.overhead_ms_per_step:>9.1f}"
            f"{r.rounds:>7}{f'{r.tokens_per_s_min:.1f}-{r.tokens_per_s_max:.1f}':>16}{split_txt:>28}"
            f"{1e3 * r.gc_seconds:>8.0f}{timed:>13}{r.wait_ms_per_step:>9.2f}{prefill:>19}"
        )
    return "\n".join(out)


def save(rows, json_path=None, png_path=None) -> None:
    if json_path:
        Path(json_path).write_text(json.dumps([asdict(r) for r in rows], indent=2))
    if png_path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for name in dict.fromkeys(r.config for r in rows if r.config != "target"):
            pts = [(r.concurrency, r.speedup) for r in rows if r.config == name]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("speedup over the target alone")
        ax.legend()
        fig.tight_layout()
        fig.savefig(png_path, dpi=120)
        plt.close(fig)


def step_cost_table(
    target, draft, width: int, slots: int, *, context_length: int = 1024, disable_cuda_graph=False, attention=None
) -> str:
    """``GraphModelRunner.profile`` as a table: ms per greedy step by batch bucket, at ``width`` and at
    width 1 (the target alone: no draft forward), and their ratio (what the planner weighs). Options by
    keyword: passed by position, the CLI's once landed one place off (an eager table on the GPU)."""
    from ..engine.graph_runner import GraphModelRunner, static_supported

    if not static_supported(target):
        raise SystemExit("--breakdown profiles the static-slot runner, which this target cannot use")
    runner = GraphModelRunner(
        target,
        draft,
        width,
        slots,
        context_length + width + 1,
        cuda_graph=not disable_cuda_graph,
        verify_widths=(1,),
        attention=attention,
    )
    costs = runner.profile()
    # the weight-read floor: every weight read once per step, at the device's measured copy bandwidth
    bandwidth = copy_bandwidth(target.device)
    t_bytes = sum(p.numel() * p.element_size() for p in target.model.parameters())
    d_bytes = sum(p.numel() * p.element_size() for p in draft.parameters()) if draft is not None else 0
    floor_1, floor_w = 1e3 * t_bytes / bandwidth, 1e3 * (t_bytes + d_bytes) / bandwidth
    lines = [
        f"weight-read floor: target {t_bytes / 1e9:.2f} GB, drafter {d_bytes / 1e9:.2f} GB at {bandwidth / 1e12:.2f} "
        f"TB/s copy bandwidth: {floor_1:.3f} ms (w=1), {floor_w:.3f} ms (w={width})",
        f"{'bucket':>7}{f'w={width} ms':>11}{'w=1 ms':>9}{'ratio':>8}{'w=1/floor':>11}{f'w={width}/floor':>11}"
        f"   ({'CUDA graphs' if runner.use_graph else 'eager'})",
    ]
    for b in runner.buckets:
        full, plain = 1e3 * costs[(b, width)], 1e3 * costs[(b, 1)]
        lines.append(
            f"{b:>7}{full:>11.2f}{plain:>9.2f}{full / plain:>8.2f}{plain / floor_1:>11.2f}{full / floor_w:>11.2f}"
        )
    return "\n".join(lines)


def copy_bandwidth(device, nbytes: int | None = None, repeats: int = 5) -> float:
    """Bytes per second read + written by ``Tensor.copy_`` of one buffer (the best of ``repeats``)."""
    import time

    import torch

    cuda = torch.device(device).type == "cuda"
    n = nbytes or (1 << 30 if cuda else 1 << 26)
    x = torch.empty(n, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    best = float("inf")
    for _ in range(repeats + 1):  # the first is untimed
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        y.copy_(x)
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return 2 * n / best
