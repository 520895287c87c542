"""Typed requests for the serving engine."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..sampling import SamplingParams
from .steps import GenerationResult, Uniforms

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: `req in running` must not compare prompts and outputs field by field
class Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    stop_strings: tuple[str, ...] = ()
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    on_update: Callable[["Request", list[int]], Any] | None = None  # called from the engine thread
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    matched_stop: int | str | None = None  # the stop token id or stop string that ended it (SGLang's matched_stop)
    error: str | None = None
    verify_steps: int = 0
    accept_hist: list[int] = field(default_factory=list)
    # with sampling.logprobs: per output token, the target's log-probability of it and its top k
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)  # of prompt tokens 1 .. n-1
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    num_committed: int = 0  # tokens whose KV is in the pool (all but the pending anchor)
    block_table: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    arrival: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished_at: float | None = None
    generator: Uniforms | None = None  # its uniforms (steps.Uniforms: its own seeded generator)
    drawn: Any = None  # its next sampled step's row, drawn while the device ran the last (steps.draw_ahead)
    draft_cache: Any = None
    target_state: Any = None  # per-request target state (hybrid targets)
    slot: int | None = None  # its slot in the static-buffer runner, while it holds one
    prefill_pos: int = 0  # tokens of prefill_ids(self) in the runner so far (chunked prefill)
    draft_s: float = 0.0  # its steps' draft and verify time (a batched step counts in full)
    verify_s: float = 0.0
    width_sum: int = 0  # verify widths of its steps, summed (the planner's choices)
    # whether it drafts: decided at admission (Planner.speculate_new), and turned off for good when
    # drafting stops paying (Planner.retire); a request that does not keeps no draft context and
    # reserves one token of KV lookahead, not a block
    speculate: bool = True

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """``len(all_ids)`` without building it (a copy of the whole context: per token, per step)."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_id(self) -> int:
        """``all_ids[-1]``: the anchor the next step starts from."""
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def accept_length(self) -> float:
        return len(self.output_ids) / max(self.verify_steps, 1)

    @property
    def spec_accept_rate(self) -> float:
        """Accepted drafts over proposed drafts (width - 1 a step)."""
        g = len(self.accept_hist) - 1
        if g <= 0 or not self.verify_steps:
            return 0.0
        return sum(n * c for n, c in enumerate(self.accept_hist)) / (g * self.verify_steps)

    @property
    def mean_width(self) -> float:
        return self.width_sum / self.verify_steps if self.verify_steps else 0.0

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def result(self) -> GenerationResult:
        """What :func:`.speculative.speculative_generate` returns for the same request."""
        done = self.finished_at or time.perf_counter()
        return GenerationResult(
            list(self.output_ids),
            len(self.output_ids),
            self.verify_steps,
            list(self.accept_hist),
            self.finish_reason or "length",
            (self.first_token_at or done) - self.arrival,
            self.draft_s,
            self.verify_s,
            done - self.arrival,
        )


def prefill_ids(req: Request) -> list[int]:
    """What a prefill runs: the prompt of a new request, ``all_ids[:-1]`` of a preempted one (its
    last token is the pending anchor of the next step)."""
    return req.prompt_ids if not req.output_ids else req.all_ids[:-1]
