"""What the engine counts (the /metrics and ``bench speed`` figures): :class:`EngineStats` and its
latency histograms."""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 300.0)


@dataclass
class LatencyHistogram:
    """Counts per upper bound of ``LATENCY_BUCKETS`` (the last entry: above them all), and the sum."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.total += seconds


@dataclass
class EngineStats:
    """The engine's counters since start-up (or since a benchmark swapped in fresh ones)."""

    completed: int = 0  # finished normally (stop or length)
    aborted: int = 0  # cancelled (client gone, shutdown)
    failed: int = 0  # ended by an error
    generated_tokens: int = 0
    verify_steps: int = 0  # per request per step, summed
    accepted_by_position: list[int] = field(default_factory=list)
    preemptions: int = 0
    requests_not_drafting: int = 0  # admitted without drafting (Planner.speculate_new)
    requests_retired: int = 0  # stopped drafting while running (Planner.retire)
    prompts_mixed: int = 0  # prompts that ran inside a decode step's forward (--enable-mixed-chunk)
    steps: int = 0  # batched steps
    draft_s: float = 0.0  # time in draft forward + selector
    verify_s: float = 0.0  # time in the target verify forward
    step_s: float = 0.0  # whole batched steps (prefills excluded)
    host_s: float = 0.0  # of step_s: outside runner.step (the planner before it, bookkeeping after)
    plan_s: float = 0.0  # of host_s: the planner's calls (retirement, the width, the observation)
    draw_s: float = 0.0  # of host_s: the batch's parameters and uniforms (BatchSampling.draw)
    # of host_s: the step's tokens into each request (stop rules, streaming, counts) on the critical path (the
    # overlap schedule's: the rows that may end their request; its other rows go in while the next step runs)
    commit_s: float = 0.0
    overlap_s: float = 0.0  # what the work run inside steps (prefills) added to their wall (OverlapClock)
    wait_s: float = 0.0  # the host blocked at steps' read-backs, waiting for the device (StepOutput.wait_s)
    prefill_s: float = 0.0  # prefill chunks, first tokens included
    admissions_held: int = 0  # steps whose admission round waited for more requests to share a prefill
    steps_by_width: dict[int, int] = field(default_factory=dict)  # the widths verified
    steps_trimmed: int = 0  # drafting steps verified narrower than drafted (Planner.trim)
    # "bucket x width" -> [steps, seconds] (width 0: the target alone, no drafter upkeep); what the
    # planner's step costs are checked against
    step_s_by_shape: dict[str, list] = field(default_factory=dict)
    # the same shapes' graph time on the device (the runner's timer, where a benchmark set one): [steps, s]
    device_s_by_shape: dict[str, list] = field(default_factory=dict)
    drafts_proposed: int = 0  # draft tokens put to the verifier (width - 1 per request per step)
    prompt_tokens: int = 0  # prompts whose prefill finished, in tokens
    ttft: LatencyHistogram = field(default_factory=LatencyHistogram)  # arrival -> first token
    e2e: LatencyHistogram = field(default_factory=LatencyHistogram)  # arrival -> finished (stop or length)
    itl: LatencyHistogram = field(default_factory=LatencyHistogram)  # per request: its mean gap between tokens
    started: float = field(default_factory=time.perf_counter)
