"""The serving engine: a queue, a scheduler, a model runner, and one batched speculative step.

``step``: aborts and admissions; up to ``chunked_prefill_size`` prompt tokens of the admitted
requests (a new request's first token comes from its prefill); then ``runner.step`` for every
running request: one batched draft forward with the selector's walk, one batched target verify
forward and the verifier (each request keeps what it accepted; nothing crosses rows), and the
engine appends the tokens and applies the stop rules. The same engine runs the target alone
(width 1). A step that raises fails its requests, never the loop.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import threading
import time
import warnings
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable

import torch

from ..sampling import SamplingParams
from .block_manager import BlockManager
from .config import ATTENTION_BACKENDS, GRAPH_SAMPLING, EngineConfig, RequestError
from .graph_runner import (
    PACKED_MAX_TOKENS,
    GraphModelRunner,
    Launched,
    cuda_graphs_apply,
    static_bytes,
    static_supported,
)
from .model_runner import ModelRunner, tune_cpu_malloc
from .planner import Planner, PlannerConfig, cached_profile, parse_schedule, parse_widths
from .request import Request, prefill_ids
from .scheduler import Scheduler
from .stats import EngineStats
from .steps import (
    BatchSampling,
    GenerationResult,
    draw_ahead,
    draw_seed,
    Runner,
    StepOutput,
    eos_ids,
    first_tokens,
    make_generator,
    stop_ids,
    stop_reason,
    token_logprobs,
)

log = logging.getLogger("dflash2.engine")


# num_continuous_decode_steps auto: the longest interval between admission rounds (admission_interval)
ADMIT_MAX_INTERVAL = 4
ADMIT_RATE_DECAY = 0.9  # per decode step, on the averages of requests finished and arrived
GRAPH_PAGE = 64  # the static runner's page: the live kernel's key tile


def admission_interval(price_s: float, rate: float, row_s: float) -> int:
    """Decode steps between admission rounds, 1 .. ``ADMIT_MAX_INTERVAL``, of least cost a step in the steady
    state: a round with a request in it pays a prefill replay (``price_s``: its part that prompts prefilled
    together pay once), and requests that join at ``rate`` a step wait ``rate * m / 2`` rows on average, each
    costing ``row_s`` a step (the throughput its row would have had). Why: speculative requests finish
    apart, so admitted every step each was a replay of its own (8B shape, 32 requests, acceptance 0.5 on the
    H100: 103 replays against the target alone's 24, 0.97x of it). Simulated on the 8B shape's measured costs
    (scripts/admission_sim.py, 20 seeds) it is within 0.7% of the best fixed interval 1-4 at 8-64 requests
    (1.010x of the target alone at 32, 0.5, against 0.956x admitting every step), and, with costs scaled to a
    small model's, never below admitting every step; a rule that waited while idle rows had cost less than
    one replay lost 2-5% at 8 requests on the H100 (fifty-fifth session; this rule is not measured on a device
    yet)."""
    cost = {m: price_s * (1 - math.exp(-rate * m)) / m + rate * m * row_s / 2 for m in range(1, ADMIT_MAX_INTERVAL + 1)}
    return min(cost, key=cost.__getitem__)


def mixed_chunk_default(paged: bool, device: torch.device, disable_cuda_graph: bool) -> bool:
    """``--enable-mixed-chunk`` unset: off. Why: with the packed prefill it no longer pays. 8B shape
    on the H200, one call: 8 requests 2.36x mixed against 2.42x unmixed, 32 requests 8,628 tok/s
    either way, and the target alone at 32 fell from 4,896 to 3,223 tok/s mixed (one padded prompt a
    step admits slower than a packed prefill). docs/benchmarks.md, thirty-sixth session."""
    return False


@dataclass
class InFlight:
    """A decode step launched ahead of the last one's read-back (async scheduling), not read back yet."""

    launched: Launched
    reqs: list[Request]
    width: int
    drafting: bool
    plain: bool
    bucket: int


@dataclass
class PendingStep:
    """A decode step read back and not yet committed (the overlap schedule): its rows wait for
    :meth:`LLMEngine._settle`, those whose tokens may end their request first."""

    reqs: list[Request]
    out: StepOutput
    width: int
    drafting: bool
    plain: bool
    bucket: int
    seconds: float  # its wall (without its commit, which runs while the next step does)
    left: list[int]  # its rows not committed yet


class LLMEngine:
    def __init__(self, target, draft, cfg: EngineConfig):
        if cfg.chunked_prefill_size is None:
            cfg = dataclasses.replace(cfg, chunked_prefill_size=2048 if target.device.type == "cuda" else 256)
        self.cfg = cfg
        if target.device.type == "cpu":
            tune_cpu_malloc()
        self.target, self.draft = target, (draft if cfg.speculative else None)
        self.width = cfg.num_draft_tokens if self.draft is not None else 1
        self.planner = Planner(
            self.width,
            PlannerConfig(
                mode=cfg.speculative_planner,
                schedule=parse_schedule(cfg.speculative_width_schedule, self.width),
                trim=cfg.speculative_trim,
                widths=parse_widths(cfg.speculative_planner_widths, self.width),
            ),
        )
        self.runner: Runner = self._make_runner()
        self.planner.widths = self.runner.widths  # the widths the planner may choose among
        self.planner.trim_widths = self.runner.trim_widths  # and cut a drafted step to (Planner.trim)
        if self.planner.adapts and self.runner.use_graph:  # step costs of every bucket, before any request
            self.planner.profile.update(cached_profile(self.runner, target, self.draft))
        self.scheduler = Scheduler(self.runner.kv, cfg.max_running_requests, self.width)
        self.stats = self._new_stats()
        self.eos = eos_ids(target)
        self.vocab_size = min(target.embed.num_embeddings, target.lm_head_weight.shape[0])
        self.prefilling: deque[Request] = deque()  # admitted, prompt not all in the runner yet (FIFO)
        # new requests whose prompt is in, and their first tokens on the device, read after the step
        self._due: list[tuple[list[tuple[Request, torch.Tensor]], torch.Tensor]] = []
        self._ahead: tuple[int, int] | None = None  # (bucket, width): the next step's, chosen during this one
        # (bucket, whether a request admitted there drafts): the next admission round's answer, priced
        # during this step (auto: the answer depends on the bucket alone)
        self._admit_ahead: tuple[int, bool] | None = None
        self._since_admit = 0  # decode steps since an admission round last admitted (num_continuous_decode_steps)
        self._row_s = 0.0  # the last decode step's seconds per row (_admits_now)
        # requests finished and arrived per decode step (averages), and the counts they were last taken at
        self._finish_rate, self._arrival_rate, self._counted, self._arrived = 0.0, 0.0, (0, 0), 0
        self._drafted_at = 0  # the bucket of the last step where every request drafted (0: none since a plain one)
        self._pending: PendingStep | None = None  # the last step, read back, its commit deferred (overlap schedule)
        self._inflight: InFlight | None = None  # the last step, launched, not read back (async scheduling)
        # the bucket where the check made during this step says its drafting requests stop for good
        # (Planner.retire, acted on at the next step there)
        self._retire_ahead: int | None = None
        self._draws_ahead: tuple | None = None  # the next step's sampling rows as one block (steps.draw_ahead)
        self.heartbeat = time.monotonic()  # the loop's last pass (for /health)
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self._aborts: set[str] = set()
        self._thread: threading.Thread | None = None
        self._stop = False
        # tensor parallel: every rank runs this engine in lockstep; rank 0's requests and aborts wait
        # here for the next step, which hands them to every rank at once (_share_inbox)
        self.tp = getattr(target, "tp", None)
        self._inbox: list[tuple[str, Any]] = []
        self._followed: list[Request] | None = None  # a following rank's copies of rank 0's requests

    def _make_runner(self) -> Runner:
        """Static slots replayed as CUDA graphs where they apply (CUDA, a dense Llama-family target,
        graphs not disabled, the slots fit in half the free memory), and for one slot on the CPU (batch
        1: the static forward over one slot is as fast as Hugging Face's own cache there, the paged
        runner's per-step cache rebuild is not); else the paged runner."""
        cfg, target = self.cfg, self.target
        max_len = cfg.context_length + self.width + 1  # the last verify block may run past the context
        one_slot = cfg.max_running_requests == 1 and target.device.type == "cpu" and static_supported(target)
        static = cfg.runner == "static" or (
            cfg.runner == "auto" and (one_slot or cuda_graphs_apply(target, cfg.disable_cuda_graph))
        )
        # several slots share a pool of pages (the KV budget, --max-total-tokens); one slot holds its context
        page = cfg.page_size if cfg.page_size % GRAPH_PAGE == 0 else GRAPH_PAGE
        per_slot = -(-max_len // page)
        pages = (
            None
            if cfg.max_running_requests == 1
            else min(cfg.max_total_tokens // page, cfg.max_running_requests * per_slot)
        )
        if pages is not None and pages < 1:
            raise ValueError(f"KV budget {cfg.max_total_tokens} tokens is smaller than one page of {page}")
        if static and cfg.runner == "auto" and target.device.type == "cuda":
            # the buffers take at most half the free memory (the rest: graphs, activations, the
            # sampler's [batch, width, vocab] rows); a page pool shrinks to fit, one slot must fit whole
            free, per_pos = torch.cuda.mem_get_info()[0], static_bytes(target, self.draft, 1, 1)
            fit = free // 2 // per_pos
            if pages is not None and fit >= page:
                if pages * page > fit:
                    warnings.warn(f"KV pool capped at {fit // page} pages of {page} (half the free memory)")
                pages = min(pages, fit // page)
            elif (max_len if pages is None else page) > fit:
                warnings.warn(
                    f"CUDA graphs off: {max_len if pages is None else page} positions of KV need "
                    f"{per_pos * max_len / 2**30:.1f} GiB ({free / 2**30:.1f} free); lower --context-length"
                )
                static = False
        if not static and cfg.sampler_backend in ("triton", "triton-fused"):
            raise ValueError(
                f"--sampler-backend {cfg.sampler_backend}: the kernel serves the static-slot runner's graphs only"
            )
        if not static and cfg.enable_mixed_chunk:
            raise ValueError(
                "--enable-mixed-chunk: the static-slot runner only (a dense Llama/Qwen/Mistral target on "
                "CUDA, or --model-runner static); this one runs the paged runner"
            )
        if not static and cfg.attention_backend == "triton":
            raise ValueError(
                "--attention-backend triton: the kernel serves the static-slot runner only (a dense "
                "Llama/Qwen/Mistral target, or --model-runner static); this one runs the paged runner"
            )
        mixed = cfg.enable_mixed_chunk
        if mixed is None:
            mixed = static and mixed_chunk_default(pages is not None, target.device, cfg.disable_cuda_graph)
        if static:
            return GraphModelRunner(
                target,
                self.draft,
                self.width,
                cfg.max_running_requests,
                max_len,
                cuda_graph=not cfg.disable_cuda_graph,
                block_verification=cfg.block_verification,
                verify_widths=tuple(w for w in range(1, self.width) if self.planner.can_pick(w)),
                attention=ATTENTION_BACKENDS[cfg.attention_backend],
                page_size=None if pages is None else page,
                num_pages=pages,
                synthetic_acceptance=cfg.synthetic_acceptance,
                sampler=cfg.sampler_backend,
                compile_draft=not cfg.disable_torch_compile,
                mixed_chunk=mixed,
                batch_kinds=GRAPH_SAMPLING[cfg.graph_sampling],
                trim=self.planner.adapts and self.planner.cfg.trim,
            )
        pool = BlockManager(cfg.max_total_tokens // cfg.page_size, cfg.page_size)
        return ModelRunner(target, self.draft, pool, self.width, cfg.block_verification, cfg.synthetic_acceptance)

    # ---- API (any thread) -------------------------------------------------------------------
    def add_request(self, req: Request) -> Request:
        """Queue a request, or raise :class:`RequestError` for one that can never run."""
        n, V, ctx = len(req.prompt_ids), self.vocab_size, self.cfg.context_length
        if n == 0:
            raise RequestError("the prompt is empty", "prompt")
        for name, ids in (("prompt", req.prompt_ids), ("stop_token_ids", req.sampling.stop_token_ids)):
            bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < V), None)
            if bad is not None:
                raise RequestError(f"{name}: token id {bad!r} is outside the vocabulary [0, {V})", name)
        if n + 1 > ctx:
            raise RequestError(
                f"prompt has {n} tokens; the context length is {ctx}", "prompt", "context_length_exceeded"
            )
        need, kv = min(n + req.sampling.max_new_tokens, ctx) + self.width + 1, self.runner.kv
        if need > kv.capacity:
            raise RequestError(
                f"prompt ({n} tokens) + max_tokens ({req.sampling.max_new_tokens}) need {need} KV "
                f"positions; the KV pool holds {kv.capacity}",
                "max_tokens",
                "context_length_exceeded",
            )
        if not self.cfg.admits(req.sampling):
            raise RequestError(
                f"this engine runs {self.cfg.graph_sampling} requests only (graph_sampling); "
                f"got temperature {req.sampling.temperature}",
                "temperature",
            )
        if self.tp is not None and req.sampling.seed is None:  # every rank draws the same uniforms
            req.sampling = dataclasses.replace(req.sampling, seed=draw_seed())
        self._seat(req)
        with self.lock:
            self._arrived += 1
            if self.tp is None:
                self.scheduler.add(req)
            else:
                self._inbox.append(("add", req))
        self.wake.set()
        return req

    def _seat(self, req: Request) -> None:
        req.generator = make_generator(req.sampling.seed)
        req.accept_hist = [0] * self.width

    def abort(self, request_id: str) -> None:
        with self.lock:
            if self.tp is None:
                self._aborts.add(request_id)
            else:
                self._inbox.append(("abort", request_id))
        self.wake.set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="dflash2-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        self.wake.set()
        if self._thread:
            self._thread.join(timeout=10)
        if self.tp is not None and self.tp.leader:  # the other ranks leave follow()
            self.tp.share([("stop", None)])

    def follow(self) -> list[Request]:
        """Tensor parallel, a rank other than 0: step whenever rank 0 steps, until it shuts down (or
        its :meth:`generate` call ends); returns this rank's copies of the requests rank 0 added."""
        followed = self._followed = []
        while self._followed is not None and not self._stop:
            self._guarded_step()  # as rank 0's loop does, so both fail the same requests
        return followed

    def _share_inbox(self) -> bool:
        """Tensor parallel: rank 0's requests, aborts and resets since the last step, on every rank in
        the same order, so every rank admits the same batches; False once rank 0 has shut down."""
        assert self.tp is not None
        if self.tp.leader:
            with self.lock:
                items, self._inbox = self._inbox, []
            self.tp.share(
                [(k, (x.request_id, x.prompt_ids, x.sampling, x.stop_strings) if k == "add" else x) for k, x in items]
            )
        else:
            items = []
            for kind, x in self.tp.share(None):
                if kind == "add":
                    x = Request(list(x[1]), x[2], x[3], request_id=x[0])
                    self._seat(x)
                items.append((kind, x))
        with self.lock:
            for kind, x in items:
                if kind in ("stop", "done"):  # rank 0 shut down, or its generate() call returned
                    self._stop = self._stop or kind == "stop"
                    self._followed = None
                    return False
                if kind == "add":
                    self.scheduler.add(x)
                    if self._followed is not None:
                        self._followed.append(x)
                else:  # "abort"
                    self._aborts.add(x)
        return True

    def _loop(self) -> None:
        while not self._stop:
            self.heartbeat = time.monotonic()
            if not self.has_work():
                self.wake.wait(0.05)
                self.wake.clear()
                continue
            self._guarded_step()

    def _guarded_step(self) -> None:
        try:
            self.step()
        except Exception as e:  # the loop must not die: fail what was in flight, keep serving
            log.exception("engine step failed")
            self.fail_running(f"engine step failed: {type(e).__name__}: {e}")

    def fail_running(self, why: str) -> None:
        with self.lock:
            for req in list(self.scheduler.running) + list(self.prefilling):
                try:
                    self._finish(req, "error", why)
                except Exception:  # a runner in a bad state: the request is failed all the same
                    log.exception("releasing a failed request")
                    self.scheduler.finish(req)
            self.prefilling.clear()
            self._due.clear()
            self._pending = self._inflight = None

    def health(self) -> str | None:
        """None when the engine is stepping, else why not."""
        if self._thread is None or not self._thread.is_alive():
            return "the engine thread is not running"
        stalled = time.monotonic() - self.heartbeat
        if self.has_work() and stalled > self.cfg.stall_s:
            return f"the engine has not completed a step for {stalled:.0f} s"
        return None

    def request_ids(self) -> list[str]:
        """Every request not finished: running, waiting, and (tensor parallel) not yet handed out."""
        with self.lock:
            queued = [x for kind, x in self._inbox if kind == "add"]
            return [r.request_id for r in [*self.scheduler.running, *self.scheduler.waiting, *queued]]

    def has_work(self) -> bool:
        return bool(
            self.scheduler.waiting
            or self.scheduler.running
            or self._aborts
            or self._inbox
            or self._pending is not None
            or self._inflight is not None
        )

    def run_until_done(self) -> None:
        while self.has_work():
            self.step()

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams]
    ) -> list[GenerationResult]:
        """Offline generation (vLLM's ``LLM.generate``; the engine thread must not be running): every
        prompt through the engine, results in order, timed from when each was added. Batch 1 is one
        prompt at a time through an engine with one slot. Tensor parallel: every rank calls it (the
        same program on every rank); rank 0's requests run, and each rank returns their results."""
        if self.tp is not None and not self.tp.leader:
            reqs = self.follow()
        else:
            sps = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
            reqs = [self.add_request(Request(list(p), sp)) for p, sp in zip(prompts, sps)]
            self.run_until_done()
            if self.tp is not None:  # the other ranks return from generate() too
                self.tp.share([("done", None)])
        for r in reqs:
            if r.finish_reason == "error":
                raise RuntimeError(f"request {r.request_id} failed: {r.error}")
        return [r.result() for r in reqs]

    def _new_stats(self) -> EngineStats:
        return EngineStats(accepted_by_position=[0] * max(self.width - 1, 0))

    def warm_up(self, prompt_tokens: int = 32, new_tokens: int = 8) -> None:
        """A short generation through every stage (prefill, draft, verify, greedy and sampled), as
        SGLang's server sends itself a warm-up request before it serves, so the first real requests do
        not pay a cold process's one-time costs (on the CPU the heap's first-touch faults and kernel
        set-up: the first steps of a run cost several times the later ones). Then the planner and the
        counters start afresh: neither those steps' costs nor the made-up prompt's acceptance count.
        Through the server at 16 requests, T=1, on the CPU it did not move auto/none measurably (0.97x
        without, 0.975x with: docs/benchmarks.md, twenty-eighth session). Called before :meth:`start` (on
        every rank under tensor parallelism, as :meth:`generate`)."""
        n = min(2, self.cfg.max_running_requests)
        prompt_tokens = min(prompt_tokens, self.cfg.context_length - new_tokens - self.width - 1)
        if prompt_tokens < 1:
            return
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, self.vocab_size, (prompt_tokens,), generator=g).tolist()
        sps = [SamplingParams(max_new_tokens=new_tokens, temperature=0.0, seed=0)]
        sps.append(SamplingParams(max_new_tokens=new_tokens, temperature=1.0, top_p=0.95, seed=1))
        sps = [sp for sp in sps if self.cfg.admits(sp)][:n]
        self.generate([ids] * len(sps), sps)
        self.restart_planner()
        self.stats = self._new_stats()

    def restart_planner(self) -> None:
        """A planner with what this one was given at start-up (the profile, the widths) and nothing it
        learnt (step costs, acceptance): as after a fresh start, without capturing again."""
        self.use_planner(self.planner.fresh())

    def use_planner(self, planner: Planner) -> None:
        """Swap in another planner (:meth:`planner_for`, or one set aside): between generations only."""
        self.planner, self._ahead, self._admit_ahead, self._retire_ahead = planner, None, None, None
        self._drafted_at = 0

    def planner_for(self, mode: str, widths: str | None = None) -> Planner:
        """A fresh planner of ``mode`` choosing among ``widths`` between 1 and the full one, as an
        engine built with those flags would have, over this engine's runner and start-up profile. Why:
        the benchmarks run the fixed width, the planner and the planner with widths between on one
        engine (one capture of the union of their graphs) instead of one engine each."""
        p = self.planner
        cfg = dataclasses.replace(p.cfg, mode=mode, widths=parse_widths(widths, self.width))
        new = Planner(self.width, cfg, profile=p.profile, trim_widths=p.trim_widths)
        runs = self.runner.widths
        if isinstance(self.runner, GraphModelRunner):  # the graphs such an engine would have captured
            missing = sorted(set(cfg.widths) - set(runs))
            if missing:
                raise ValueError(f"this engine has no verify graphs at width(s) {missing}")
            runs = tuple(w for w in runs if w == self.width or new.can_pick(w))
        new.widths = runs
        return new

    # ---- one step ---------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """The last step's requests that its tokens may end, committed; aborts and admissions; then one
        speculative step of every running request whose prompt is in, with the last step's other commits
        and the next chunk of prefill run while the device computes that step (or alone, when nothing
        decodes), then the new requests' first tokens. Why the prefill inside the step: at 64
        requests on the H200 a prefill call after each step, with its own read-back, took 19-25% of
        the wall (docs/benchmarks.md, twenty-third session)."""
        if self.tp is not None and not self._share_inbox():
            return
        self._settle_ending()
        self._admit()
        reqs = self._decode_batch()
        if reqs:
            self._decode(reqs)
        else:
            self._prefill_alone()
        self._end_step()

    def _settle_ending(self) -> None:
        """The last step's rows whose tokens may end their request, committed, so that this step's batch
        leaves those requests out (the overlap schedule commits the other rows inside this step)."""
        if self._pending is not None:
            self._settle(self._pending, self._ending(self._pending))

    def _prefill_alone(self) -> None:
        """Nothing decodes: every step read back and committed, then the next prefill chunk."""
        self._drain()
        if self._pending is not None:
            self._settle(self._pending)
        self._prefill_some(defer=True)

    def _end_step(self) -> None:
        """A step in flight whose requests all finished, read back; the new requests' first tokens read
        (under async scheduling with a step in flight: after the next launch, inside :meth:`_decode`, so
        that the device is busy meanwhile)."""
        if self._inflight is not None and not self.scheduler.running:  # (its rows all of finished requests)
            self._drain()
        if self._inflight is None:
            self._emit_first_tokens()

    def _admit(self) -> None:
        with self.lock:
            for rid in list(self._aborts):
                for req in list(self.scheduler.running) + list(self.scheduler.waiting):
                    if req.request_id == rid:
                        self._finish(req, "abort")
            self._aborts.clear()
            if not self._admits_now():
                return
            admitted = self.scheduler.admit(self._speculation() if self.draft is not None else None)
            if admitted:
                self._since_admit = 0
            self.stats.requests_not_drafting += sum(not r.speculate for r in admitted if not r.num_preemptions)
            self.prefilling.extend(admitted)

    def _admits_now(self) -> bool:
        """Whether this step's admission round runs (``num_continuous_decode_steps``): always where nothing
        waits or nothing decodes; else once that many decode steps have run since the last round that
        admitted, auto: :func:`admission_interval` of the runner's prefill replay price (none: every step; the
        replay without the drafter's latents where the admissions would not draft: :meth:`_admits_plain`), the
        rate requests join (those finishing, where more wait than fit; else those arriving) and the last step's
        seconds per row."""
        sched, n = self.scheduler, self.cfg.num_continuous_decode_steps
        if not sched.waiting or len(sched.running) <= len(self.prefilling):  # (prefilling: running, prompt not in)
            return True
        if n is None:
            price = getattr(self.runner, "plain_prefill_replay_s" if self._admits_plain() else "prefill_replay_s", 0.0)
            # (no step timed yet, or its prefill's share took all of it; under --tp ranks must admit alike)
            if not price or self._row_s <= 0 or self.tp is not None:
                return True
            free = sched.max_running - len(sched.running)
            if sum(len(prefill_ids(r)) for r in itertools.islice(sched.waiting, free)) >= PACKED_MAX_TOKENS:
                return True  # (they fill a packed replay already: one who joins would need another)
            deep = len(sched.waiting) > free
            n = admission_interval(price, self._finish_rate if deep else self._arrival_rate, self._row_s)
        if n <= 1 or self._since_admit >= n:
            return True
        self.stats.admissions_held += 1
        return False

    def _admits_plain(self) -> bool:
        """Whether this round's admissions would not draft: no drafter, or auto with a running batch that does
        not draft, which new requests join without drafting (:meth:`_speculation`). Why: near break-even,
        admissions flipped either way and a mixed batch runs width 1 with the drafter's upkeep (1.2x the
        target alone's step): on the H200 at 8 requests, T=1, half the steps (docs/benchmarks.md, nineteenth
        session)."""
        return self.draft is None or (self.planner.adapts and not all(r.speculate for r in self.scheduler.running))

    def _count_rates(self) -> None:
        """Per decode step, the averages of the requests that finished and arrived (:meth:`_admits_now`)."""
        s = self.stats
        done, arrived = s.completed + s.aborted + s.failed, self._arrived
        a = ADMIT_RATE_DECAY
        # (at least 0: a benchmark swaps in fresh stats between rows)
        self._finish_rate = a * self._finish_rate + (1 - a) * max(0, done - self._counted[0])
        self._arrival_rate = a * self._arrival_rate + (1 - a) * max(0, arrived - self._counted[1])
        self._counted = (done, arrived)

    def _speculation(self) -> Callable[[int], bool]:
        """``speculate(n)`` for one round of admissions: whether a request that makes ``n`` running
        ones drafts, each batch size priced once (nothing the planner learns changes while it
        admits). Why once: priced per admission it was ~14 us of host work each on the step's
        critical path, ~4 admissions a step at 128 requests (forty-fourth session)."""
        planner, answers = self.planner, {}
        ahead, self._admit_ahead = self._admit_ahead, None
        plain = self._admits_plain()  # (auto: batches are either drafting or not, never mixed for long)

        def speculate(n_running: int) -> bool:
            nonlocal plain
            if plain:
                return False
            # keyed on the batch these admissions make, the queue's included: admitted one by one, the
            # first of a burst saw a small batch where drafting pays and drafted into a large one
            n = max(n_running, self._admission_size())
            if n not in answers:  # (with a queue, n is the same for every admission of the round)
                b = self.runner.bucket(n)
                if self._joins(b):
                    answers[n] = True
                else:
                    answers[n] = ahead[1] if ahead is not None and ahead[0] == b else planner.speculate_new(n, b)
            plain = planner.adapts and not answers[n]
            return answers[n]

        return speculate

    def _price_admission(self) -> tuple[int, bool] | None:
        """The next admission round's answer (:meth:`_speculation`), priced while the device runs a step,
        where requests wait and new ones would draft into a drafting batch (auto, whose answer depends on
        the batch's bucket alone). Why: priced at admission it was ~0.06 ms of host work a step on the
        critical path on the CPU at 128 requests, requests finishing every step (forty-fifth session)."""
        sched = self.scheduler
        if not (self.planner.adapts and sched.waiting and all(r.speculate for r in sched.running)):
            return None
        n = self._admission_size()
        b = self.runner.bucket(n)
        return None if self._joins(b) else (b, self.planner.speculate_new(n, b))

    def _joins(self, bucket: int) -> bool:
        """Whether an admission that makes a batch at ``bucket`` joins the drafting batch as it is, unpriced
        (auto): every running request drafts and drafting ran at this load or a larger one, where retirement
        (averaged over its checks, :attr:`PlannerConfig.retire_smoothing`) decides whether it still pays.
        Why: priced at each admission round with the hysteresis (a new request drafts at 1.05x the target
        alone's tokens/s), a batch at a true 1.07x flipped to not drafting at the first low reading of the
        estimate (sd ~0.05 at 8 held-out requests, rounds every few steps); its drafting requests then
        retired, and at a steady queue the batch never drained to draft again: 0.955 of the fixed width on
        the H100 and in the batch replay (scripts/cpu_planner_replay.py --batch 8, fifty-first session)."""
        sched = self.scheduler
        if not (self.planner.adapts and sched.running and bucket <= self._drafted_at):
            return False
        return all(r.speculate for r in sched.running)

    def _admission_size(self) -> int:
        """The batch an admission round makes, the queue's requests included (as many as fit)."""
        sched = self.scheduler
        return min(sched.max_running, len(sched.running) + len(sched.waiting))

    def _decode_batch(self) -> list[Request]:
        """The running requests whose prompt is in, once KV room for their next block is reserved
        (preempting the newest when the pool is short)."""
        f = self._inflight
        if f is not None and not self.scheduler.can_reserve(f.width):  # (a preemption reads its tokens first)
            self._drain()
        with self.lock:
            preempted = self.scheduler.reserve_step(self._inflight.width if self._inflight is not None else 0)
        if preempted and self._pending is not None:  # (their tokens into their prompt for the re-prefill)
            self._settle(self._pending, [b for b, r in enumerate(self._pending.reqs) if r in preempted])
        for req in preempted:
            self.runner.release(req)
            if req in self.prefilling:
                self.prefilling.remove(req)
            self.stats.preemptions += 1
        due = {id(r) for done, _ in self._due for r, _ in done}  # (first tokens not read yet: async scheduling)
        reqs = [r for r in self.scheduler.running if not r.finished and r not in self.prefilling and id(r) not in due]
        waiting = self.scheduler.waiting
        if not reqs and waiting and not self.scheduler.running and not self.scheduler.fits(waiting[0]):
            with self.lock:  # nothing running, so all KV is free, and still no room: it can never fit
                self._finish(waiting[0], "error", "request does not fit the KV pool")
        return reqs

    def _decode(self, reqs: list[Request]) -> None:
        """One step of the decode batch: its width (the planner's), the runner's step (draft, verify,
        accept; the last step's commit and a prefill run inside it), then each request's tokens and the
        planner's counts: at once, or (the overlap schedule, :meth:`_defers`) inside the next step; under
        async scheduling (:meth:`_launches_ahead`) the step is launched before the last one is read back."""
        prev, self._pending = self._pending, None
        self._since_admit += 1
        if self.cfg.num_continuous_decode_steps is None:  # (only auto reads the rates)
            self._count_rates()
        defer = self._defers(reqs)
        early = defer and self._launches_ahead()  # async scheduling: launched before the last step's read-back
        if not early:
            self._drain()
        if prev is not None and not defer:  # this step reads its requests' host tokens: the last one's first
            self._settle(prev)
            prev = None
        t0 = time.perf_counter()
        # all greedy (the usual batch): argmax acceptance needs no distributions, uniforms or parameters
        greedy = all(r.sampling.greedy for r in reqs)
        rids, bucket = [r.request_id for r in reqs], self.runner.bucket(len(reqs))
        drafters, width = self._width(reqs, rids, bucket)
        drafting = 0 < drafters == len(reqs)
        self._drafted_at = bucket if drafting else 0
        plain = self.draft is not None and not drafters  # the target alone, no drafter upkeep
        t_plan = time.perf_counter()
        # laid out at the full width: a drafting batch draws G of each kind (a narrower step reads the first of
        # each kind), one that does not draws one uniform a row as the target alone does (steps.row_draws);
        # the next step's rows are drawn while the device runs this one (draw_ahead)
        G = self.width - 1 if drafters else 0
        ahead, self._draws_ahead = self._draws_ahead, None
        sampling = None if greedy else BatchSampling.draw(reqs, width - 1, self.target.device, G, ahead, self.width - 1)
        t_run = time.perf_counter()
        s = self.stats
        s.host_s += t_run - t0
        s.plan_s += t_plan - t0
        s.draw_s += t_run - t_plan

        def overlap() -> None:
            # host work while the device runs the step: the last step's commit, the next step's draws, the
            # last step's counts, the next step's width, a prefill
            for p in (prev, collected):
                if p is not None:
                    self._settle(p, overlapped=True)
            if not greedy:
                self._draws_ahead = draw_ahead(reqs, self.width - 1, self.target.device)
            self.planner.fold()
            if drafting:  # (None where the planner does not adapt)
                nxt = self.planner.choose_ahead(rids, bucket, width)
                self._ahead = None if nxt is None else (bucket, nxt)
                self._retire_ahead = bucket if self.planner.retire(bucket, rids) else None
            self._admit_ahead = self._price_admission()
            self._prefill_some(defer=True)

        collected: PendingStep | None = None
        mix = None if early else self._mixed_chunk()
        trim = partial(self.planner.trim, bucket, width) if drafting and width > 2 and self.planner.trims else None
        try:
            if early:  # this step queued behind the last, which is read back and committed while this one runs
                launched = self._graphs().launch(reqs, sampling, width, ahead=True)
                f, self._inflight = self._inflight, InFlight(launched, reqs, width, drafting, plain, bucket)
                collected = None if f is None else self._collect(f)
                # the last overlap's prefills' first tokens: read with this step queued (their requests join the
                # next batch). Why not at the step's end: the read waits for the step in flight, and the device
                # then idles while the host forms the next batch
                self._emit_first_tokens()
                overlap()
                return
            out = self.runner.step(reqs, sampling, width, overlap=overlap, prefill=mix, trim=trim)
        except Exception as e:  # a failing batch fails its requests, not the server
            log.exception("speculative step failed")
            if early and self._inflight is not None and self._inflight.reqs is not reqs:
                self._drain()  # (the step before: read back whole, its tokens first)
            self._inflight = None
            if prev is not None and prev.left:  # (the last step's tokens were read back whole: theirs first)
                self._settle(prev)
            with self.lock:
                # (a prompt that ran with the failed step fails with it: its K/V may be half written)
                for r in reqs + ([mix[0]] if mix is not None and mix[0].prefill_pos else []):
                    self._finish(r, "error", f"{type(e).__name__}: {e}")
            return
        t_back = time.perf_counter()
        if out.width is not None and out.width < width:  # the draft's confidence cut the step
            self.stats.steps_trimmed += 1
            width = out.width
        if mix is not None and out.prefilled is not None:  # the prompt went in with the step
            self.stats.prompts_mixed += 1
            self._take_prefilled([mix], [out.prefilled])
        self._count(out, width)
        # the step's own wall: without what the prefill launched inside it added (OverlapClock); a deferred
        # commit's runs while the next step does
        step = PendingStep(reqs, out, width, drafting, plain, bucket, t_back - t0 - out.overlap_s, [*range(len(reqs))])
        if defer:
            self._pending = step
        else:
            self._settle(step, t0=t0)

    def _launches_ahead(self) -> bool:
        """Whether this step may be launched before the last one is read back (async scheduling): on, and every
        slot's next two blocks within its buffer (the host's lengths lag the step in flight by one block)."""
        runner = self.runner
        if not (self.cfg.async_scheduling and isinstance(runner, GraphModelRunner)):
            return False
        return max((r.num_committed for r in runner.occupant), default=0) + 2 * self.width <= runner.max_len

    def _graphs(self) -> GraphModelRunner:
        """The runner, under async scheduling (:meth:`_launches_ahead`: the graph runner)."""
        assert isinstance(self.runner, GraphModelRunner)
        return self.runner

    def _collect(self, f: InFlight) -> PendingStep:
        """The step in flight read back, to commit: the rows of requests still running (one that the step
        before ended ran a wasted row), counted."""
        out = self._graphs().collect(f.launched)
        live = [b for b, r in enumerate(f.reqs) if not r.finished]
        self._count(out, f.width, live)
        # its cost to the planner: its graphs' device time (launched ahead, the host's work between steps is
        # off the device's path)
        return PendingStep(f.reqs, out, f.width, f.drafting, f.plain, f.bucket, out.device_s or 0.0, live)

    def _drain(self) -> None:
        """The step in flight (async scheduling), if any, read back and committed."""
        f, self._inflight = self._inflight, None
        if f is not None:
            self._settle(self._collect(f))

    def _defers(self, reqs: list[Request]) -> bool:
        """Whether this step's commit may wait for the next step's launch (the overlap schedule): the runner
        keeps every anchor on the device, one rank, and no request reads the step's device buffers or its
        own host tokens at the next launch (logprobs: the logits, overwritten; min_tokens: the tokens owed)."""
        return (
            not self.cfg.disable_overlap_schedule
            and getattr(self.runner, "defers_commit", False)
            and self.tp is None
            and not any(r.sampling.logprobs is not None or r.sampling.min_tokens for r in reqs)
        )

    def _ending(self, p: PendingStep) -> list[int]:
        """The rows of ``p`` whose tokens may end their request (:meth:`_cannot_end` false)."""
        return [b for b in p.left if not self._cannot_end(p.reqs[b], p.out.tokens[b])]

    def _cannot_end(self, req: Request, tokens: list[int]) -> bool:
        """Whether appending ``tokens`` cannot end ``req``: within its length, no stop token, no stop strings
        (the usual step, where no rule need be read a token)."""
        sp = req.sampling
        room = min(sp.max_new_tokens - len(req.output_ids), self.cfg.context_length - req.num_tokens)
        return (
            len(tokens) < room
            and not req.stop_strings
            and (sp.ignore_eos or self.eos.isdisjoint(tokens))
            and (not sp.stop_token_ids or set(sp.stop_token_ids).isdisjoint(tokens))
        )

    def _settle(
        self, p: PendingStep, rows: list[int] | None = None, overlapped: bool = False, t0: float | None = None
    ) -> None:
        """Commit ``rows`` of a step read back (default: all it has left); once all are in, what the planner
        learns from it. ``t0``: committed at once, its wall taken to the commit's end. ``overlapped``: inside
        the next step's overlap, off the step's critical path (not counted as host time)."""
        t_c = time.perf_counter()
        todo = p.left if rows is None else [b for b in rows if b in p.left]  # (a row is committed once)
        for b in todo:
            r = p.reqs[b]
            if not r.finished:  # (aborted meanwhile)
                self._commit_row(r, p.out, b, p.width)
        done = set(todo)
        p.left = [b for b in p.left if b not in done]
        t_obs = time.perf_counter()
        s = self.stats
        if not overlapped:  # (the overlap's work is not host time of the step: it runs while the device does)
            s.commit_s += t_obs - t_c
            s.host_s += t_obs - t_c
        if p.left:  # (a part: of the pending step, which keeps the rest)
            return
        if self._pending is p:
            self._pending = None
        if t0 is not None:
            p.seconds = t_obs - t0 - p.out.overlap_s
        if self.tp is not None:  # the planner learns rank 0's clock everywhere, so every rank chooses alike
            p.seconds = self.tp.share(p.seconds)
        t_o = time.perf_counter()
        self._observe(p.reqs, p.out, p.drafting, p.plain, p.width, p.bucket, p.seconds)
        if all(r.finished for r in p.reqs):  # no step of theirs follows whose overlap would free their rows
            self.planner.fold()
        t_end = time.perf_counter()
        if not overlapped:
            s.plan_s += t_end - t_o
            s.host_s += t_end - t_obs

    def _width(self, reqs: list[Request], rids: list[str], bucket: int) -> tuple[int, int]:
        """How many of the batch's requests draft, and the step's verify width (1: the target alone, or a
        batch of which some do not draft). Retires the batch's drafting requests for good where drafting
        cannot pay at this load, or where the batch mixes in requests that do not draft (so it cannot
        draft: in auto always, pinned where new ones would not draft)."""
        drafters = sum(r.speculate for r in reqs) if self.draft is not None else 0
        mixed = 0 < drafters < len(reqs) and (self.planner.adapts or not self.planner.speculate_new(len(reqs), bucket))
        # the check ran while the last step did (its overlap), a step late: retirement is for good and
        # checked every retire_every steps. Why not here: at one request on the H100 the planner's host work
        # between steps was 0.03-0.04 ms over the fixed width's, ~2% of a step (forty-ninth session)
        retire, self._retire_ahead = self._retire_ahead == bucket, None
        if drafters and (retire or mixed):
            for r in reqs:
                if r.speculate:
                    r.speculate, r.draft_cache = False, None
                    self.stats.requests_retired += 1
            drafters = 0
        ahead, self._ahead = self._ahead, None
        if not 0 < drafters == len(reqs):  # a request that does not draft: width 1
            return drafters, 1
        if ahead is not None and ahead[0] == bucket:  # chosen while the last step ran
            return drafters, ahead[1]
        return drafters, self.planner.choose(rids, bucket)

    def _commit(self, reqs: list[Request], out: StepOutput, width: int) -> None:
        """Each request's tokens of the step (stop rules, streaming) and the step's counts, at once."""
        for b, r in enumerate(reqs):
            self._commit_row(r, out, b, width)
        self._count(out, width)

    def _commit_row(self, r: Request, out: StepOutput, b: int, width: int) -> None:
        """Row ``b`` of the step: its request's tokens (stop rules, streaming) and per-request counts."""
        tokens, n = out.tokens[b], out.num_accepted[b]
        if r.sampling.logprobs is not None and out.logits is not None:
            self._record_logprobs(r, out.logits[b], tokens)
        r.verify_steps += 1
        r.draft_s += out.draft_s
        r.verify_s += out.verify_s
        r.accept_hist[n] += 1
        r.width_sum += width
        self._append(r, tokens)

    def _count(self, out: StepOutput, width: int, rows: list[int] | None = None) -> None:
        """The step's counts (every row's accepted drafts, or ``rows``', its width, its times)."""
        s, hist = self.stats, [0] * (width + 1)  # (hist: the step's requests by accepted drafts)
        accepted = out.num_accepted if rows is None else [out.num_accepted[b] for b in rows]
        for n in accepted:
            hist[n] += 1
        s.verify_steps += len(accepted)
        beyond = 0  # requests that accepted more than i drafts: draft i + 1 accepted
        for i in range(width - 1, 0, -1):
            beyond += hist[i]
            s.accepted_by_position[i - 1] += beyond
        s.steps += 1
        s.steps_by_width[width] = s.steps_by_width.get(width, 0) + 1
        s.drafts_proposed += (width - 1) * len(accepted)
        s.draft_s += out.draft_s
        s.verify_s += out.verify_s
        s.wait_s += out.wait_s

    def _observe(
        self,
        reqs: list[Request],
        out: StepOutput,
        drafting: bool,
        plain: bool,
        width: int,
        bucket: int,
        seconds: float,
    ) -> None:
        """The step's wall by shape, and what the planner learns from it: its cost at (bucket, width) and
        each live request's accepted drafts (folded while the next step runs)."""
        s = self.stats
        s.step_s += seconds
        s.overlap_s += out.overlap_s
        self._row_s = seconds / len(reqs)
        key = f"{bucket}x{0 if plain else width}"
        shape = s.step_s_by_shape.setdefault(key, [0, 0.0])
        shape[0], shape[1] = shape[0] + 1, shape[1] + seconds
        if out.device_s is not None:
            dev = s.device_s_by_shape.setdefault(key, [0, 0.0])
            dev[0], dev[1] = dev[0] + 1, dev[1] + out.device_s
        cost = None if out.prefilled is not None else seconds  # (a prompt's share is not the width's)
        if drafting and cost is not None and self.planner.trims:
            self.planner.observe_split(bucket, width, out.draft_s, out.verify_s)
        if (drafting or self.draft is None) and self.planner.adapts:  # (else nothing to learn: no per-request work)
            live = [b for b, r in enumerate(reqs) if not r.finished]  # finished requests are gone
            self.planner.observe(
                [reqs[b].request_id for b in live],
                [out.num_accepted[b] for b in live],
                width,
                bucket,
                cost,
                defer=True,
                confidence=None if out.confidence is None else out.confidence[live],
            )
        elif plain:
            self.planner.observe_plain(bucket, cost, fade=True, defer=True)

    def _prefill_some(self, defer: bool = False) -> None:
        """Up to ``chunked_prefill_size`` prompt tokens, oldest admitted first; a request whose prompt
        is all in gets its first token (``defer``: computed on the device, read by
        :meth:`_emit_first_tokens`). A prompt that one step's budget holds is not cut where others
        spent part of it: it waits for the next step. Why: the rest of a cut prompt reads the K/V
        before it, so it cannot join the packed prefill graphs; at 64 requests of the 8B shape every
        wave of admissions cut ~3 prompts, each rest an eager forward (thirty-sixth session)."""
        size = self.cfg.chunked_prefill_size or -1
        budget = size if size > 0 else None
        chunks: list[tuple[Request, int]] = []
        for req in self.prefilling:  # oldest first, each its next chunk, until the budget is spent
            if budget is not None and budget <= 0:
                break
            n = len(prefill_ids(req)) - req.prefill_pos
            if n <= 0:  # all in, with the step running now (--enable-mixed-chunk)
                continue
            if budget is not None:
                if chunks and budget < n <= size:
                    break
                n = min(n, budget)
                budget -= n
            chunks.append((req, n))
        if not chunks:
            return
        t0 = time.perf_counter()
        try:
            self._prefill_chunks(chunks)
        finally:
            self.stats.prefill_s += time.perf_counter() - t0
        if not defer:
            self._emit_first_tokens()

    def _mixed_chunk(self) -> tuple[Request, int] | None:
        """With ``--enable-mixed-chunk``: the oldest admitted request's rest of prompt, within the
        chunked-prefill budget, offered to the step (the runner takes it where it can)."""
        # the runner's lengths, not the flag: the flag's default (None) is resolved where the runner is built
        if not getattr(self.runner, "mixed_lengths", ()) or not self.prefilling:
            return None
        req = self.prefilling[0]
        n = len(prefill_ids(req)) - req.prefill_pos
        size = self.cfg.chunked_prefill_size
        return (req, n) if size is None or size < 0 or n <= size else None

    def _prefill_chunks(self, chunks: list[tuple[Request, int]]) -> None:
        batch = getattr(self.runner, "prefill_batch", None)
        try:  # one forward for all the chunks where the runner can; else (or if it fails) one each
            results = batch(chunks) if batch is not None else None
        except Exception:
            log.exception("batched prefill failed; prefilling one request at a time")
            results = None
        self._take_prefilled(chunks, results)

    def _take_prefilled(self, chunks: list[tuple[Request, int]], results: list[torch.Tensor | None] | None) -> None:
        """The chunks' outcome (``results``: each one's last logits once its prompt is all in, or None:
        prefill each alone now): requests whose prompt is in leave ``prefilling``, new ones get their
        first token."""
        done: list[tuple[Request, torch.Tensor]] = []  # new requests whose prompt is now in
        for i, (req, n) in enumerate(chunks):
            try:
                logits = results[i] if results is not None else self.runner.prefill(req, n)
                if logits is None:
                    continue
                self.prefilling.remove(req)
                if not req.output_ids:  # a new request: its first token comes from the prefill
                    done.append((req, logits))
            except Exception as e:
                self._prefill_failed(req, e)
        if done:
            self._first_tokens(done)

    def _first_tokens(self, done: list[tuple[Request, torch.Tensor]]) -> None:
        """Each new request's first token, from its prompt's last logits, all in one
        :func:`first_tokens` call (if that fails, one request at a time, each failing alone),
        left on the device for :meth:`_emit_first_tokens`."""
        reqs = [r for r, _ in done]
        try:
            stops = [stop_ids(r.sampling, self.eos) if r.sampling.min_tokens > 0 else None for r in reqs]
            rows = torch.stack([lg.reshape(-1) for _, lg in done])
            gens = [r.generator for r in reqs]
            if any(g is None for g in gens):
                raise RuntimeError("a request reached prefill without its generator")
            kernel = getattr(self.runner, "kernel", None)  # the decode graphs' sampler kernel
            toks = first_tokens(rows, [r.sampling for r in reqs], gens, stops, kernel)  # type: ignore[arg-type]
        except Exception as e:
            if len(done) == 1:
                return self._prefill_failed(reqs[0], e)
            log.exception("batched first tokens failed; one request at a time")
            for one in done:
                self._first_tokens([one])
            return
        self._due.append((done, toks))

    def _emit_first_tokens(self) -> None:
        """The first tokens :meth:`_first_tokens` left on the device, read (one read per prefill call,
        after the step's own) and appended; a request failed or aborted meanwhile is skipped."""
        due, self._due = self._due, []
        for done, toks in due:
            t0 = time.perf_counter()
            try:
                tokens = toks.tolist()
            except Exception as e:
                for req, _ in done:
                    self._prefill_failed(req, e)
                continue
            for (req, logits), tok in zip(done, tokens):
                if req.finished:
                    continue
                try:
                    if req.sampling.logprobs is not None:
                        self._record_logprobs(req, logits.view(1, -1), [tok])
                    req.first_token_at = time.perf_counter()
                    self.stats.prompt_tokens += len(req.prompt_ids)
                    self.stats.ttft.observe(req.first_token_at - req.arrival)
                    self._append(req, [tok])
                except Exception as e:
                    self._prefill_failed(req, e)
            self.stats.prefill_s += time.perf_counter() - t0

    def _prefill_failed(self, req: Request, e: Exception) -> None:
        log.exception("prefill failed")
        with self.lock:
            self._finish(req, "error", f"prefill failed: {type(e).__name__}: {e}")

    @staticmethod
    def _record_logprobs(req: Request, logits: torch.Tensor, tokens: list[int]) -> None:
        """The target's log-probabilities of ``tokens`` (row i of ``logits`` predicts token i); trimmed
        to the output when a stop ends the request inside the block (:meth:`_append`)."""
        k = req.sampling.logprobs
        assert k is not None
        chosen, top = token_logprobs(logits, tokens, k)
        req.logprobs += chosen
        req.top_logprobs += top

    # ---- tokens and stopping ------------------------------------------------------------------
    def _append(self, req: Request, tokens: list[int]) -> None:
        sp, new = req.sampling, []
        # the usual step: nothing in it can end the request, so no rule a token. Why: the rules a token were 40%
        # of the commit's host time (0.20 -> 0.12 ms a step at 128 requests, scripts/cpu_commit_bench.py;
        # forty-seventh session)
        if self._cannot_end(req, tokens):
            req.output_ids += tokens
            self.stats.generated_tokens += len(tokens)
            self._notify(req, tokens)
            return
        reason = None
        # stop strings: one decode of the tail with the step's tokens; only where it holds one, the
        # token that completed it, a decode a token (each was ~10 us at 32 tokens, per token of the step)
        strings = bool(req.stop_strings) and self._hits_stop_string(req, tokens) is not None
        for tok in tokens:
            req.output_ids.append(tok)
            new.append(tok)
            reason = stop_reason(tok, len(req.output_ids), sp, self.eos)
            if reason == "stop":
                req.matched_stop = tok
            elif reason is None and req.num_tokens >= self.cfg.context_length:
                reason = "length"
            elif strings and len(req.output_ids) >= sp.min_tokens and (hit := self._hits_stop_string(req)) is not None:
                reason, req.matched_stop = "stop", hit
            if reason:
                break
        self.stats.generated_tokens += len(new)
        if req.sampling.logprobs is not None:  # the block's tokens past a stop were not emitted
            del req.logprobs[len(req.output_ids) :], req.top_logprobs[len(req.output_ids) :]
        if reason:
            with self.lock:
                self._finish(req, reason, notify=False)
        self._notify(req, new)

    def _hits_stop_string(self, req: Request, more: list[int] | None = None) -> str | None:
        """The stop string the output's tail holds (the first listed), if any; ``more``: with these tokens
        appended (a tail as long as ``more`` on top, so it holds every tail the tokens make one by one)."""
        ids = req.output_ids[-32:] + more if more else req.output_ids[-32:]
        tail = self.target.tokenizer.decode(ids, skip_special_tokens=True)
        return next((s for s in req.stop_strings if s in tail), None)

    def _finish(self, req: Request, reason: str, error: str | None = None, notify: bool = True) -> None:
        if req.finished:
            return
        self.scheduler.finish(req)
        if req in self.prefilling:
            self.prefilling.remove(req)
        req.finish_reason, req.error, req.finished_at = reason, error, time.perf_counter()
        self.planner.forget(req.request_id)
        s = self.stats
        if reason == "abort":
            s.aborted += 1
        elif reason == "error":
            s.failed += 1
        else:
            s.completed += 1
            s.e2e.observe(req.finished_at - req.arrival)
            if req.first_token_at is not None and len(req.output_ids) > 1:
                s.itl.observe((req.finished_at - req.first_token_at) / (len(req.output_ids) - 1))
        try:
            self.runner.release(req)
        finally:
            if notify:
                self._notify(req, [])

    @staticmethod
    def _notify(req: Request, new: list[int]) -> None:
        """Tell the request's owner; a failing callback (its event loop gone) does not reach the engine."""
        if req.on_update:
            try:
                req.on_update(req, new)
            except Exception:
                log.exception("request update callback failed")

    # ---- introspection ------------------------------------------------------------------------
    def pool_usage(self) -> tuple[int, int]:
        """KV in use and in all, in the runner's units (pages of the pool, or slots)."""
        kv = self.runner.kv
        return kv.num_blocks - kv.num_free, kv.num_blocks
