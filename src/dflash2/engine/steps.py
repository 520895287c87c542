"""The pieces of one speculative step, defined once and shared by the engine's runners and the
reference loop (:func:`.speculative.speculative_generate`): the draw order of a request's
uniforms, the first token, the stop rule, the verifier choice, and the batched propose / accept
math. The paged runner calls these eagerly, the static-slot runner inside its CUDA graphs
(``capturable=True``: no host reads). Greedy batches need only argmaxes; sampled ones carry
per-request parameters and uniforms as ``[B]`` / ``[B, n]`` tensors (:class:`BatchSampling`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol

from functools import partial

import numpy as np
import torch

from ..model.context_cache import greedy_walk
from ..sampling import CandidateQ, SamplingParams, probs_from_logits, sample_from_probs
from ..verification import VerifyResult, block_verify, greedy_verify, synthetic_verify, token_level_verify

VERIFY_METHODS = ("greedy", "token", "block")


# ---- per request ----------------------------------------------------------------------------------
def draw_seed() -> int:
    """An unseeded request's seed, from torch's global generator (``--random-seed`` seeds it)."""
    return int(torch.randint(0, 2**62, ()).item())


class Uniforms:
    """A request's stream of uniforms: its own generator (``seed``), read through a buffer of
    ``chunk`` draws. The same numbers, in the same order, as one ``torch.rand`` call per take (the
    CPU generator spends one draw per float, however a length is split; a test holds this). Why:
    a ``torch.rand`` call a request a step cost ~2 us on the host at 128 requests, on the critical path
    of every sampled step."""

    def __init__(self, seed: int | None, chunk: int = 512):
        self.gen = torch.Generator()
        self.gen.manual_seed(seed if seed is not None else draw_seed())
        self.chunk, self.buf, self.pos = chunk, np.empty(0, np.float32), 0

    def take(self, n: int) -> np.ndarray:
        """The next ``n`` uniforms in [0, 1) (float32)."""
        if self.pos + n > len(self.buf):
            fresh = torch.rand(max(self.chunk, n), generator=self.gen).numpy()
            self.buf, self.pos = np.concatenate([self.buf[self.pos :], fresh]), 0
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out


def make_generator(seed: int | None) -> Uniforms:
    return Uniforms(seed)


def draw_uniforms(gen: Uniforms, g: int) -> np.ndarray:
    """A request's uniforms for one step of ``g`` drafts, in the one draw order: the selector's ``g``,
    the verifier's ``g`` acceptance draws, then the emitted token's draw (``[2g + 1]``). The serving
    engine draws at its full width's ``g`` whatever width a step runs (a narrower step reads the first
    of each kind: :meth:`BatchSampling.from_rows`), so a step's draws need not wait for its width."""
    return gen.take(2 * g + 1)


def sampling_params(sp: SamplingParams) -> tuple[float, int, float, float]:
    """A request's parameters in the order of a sampled step's block (:meth:`BatchSampling.from_rows`)."""
    return sp.temperature, sp.top_k, sp.top_p, sp.min_p


def sampling_row(sampling: SamplingParams, gen: Uniforms, g: int) -> np.ndarray:
    """A request's row of a sampled step's block (:meth:`BatchSampling.from_rows`' layout at ``g``
    draws of each kind): its parameters, then its next ``2g + 1`` uniforms."""
    return np.concatenate([np.array(sampling_params(sampling), np.float32), draw_uniforms(gen, g)])


def row_draws(req, g: int) -> int:
    """The draws of each kind in a request's row of a step at the engine's full ``g``: ``g``, or 0 where
    it does not draft (admitted not drafting, or retired: for good), which draws one uniform a step as
    the target alone does. Why: a seeded request the planner keeps from drafting samples the target
    alone's text, and the two engines' benchmark rows compare the same texts (on an H100 at 32 held-out
    requests, T=1, the other samples alone moved the tokens of a round by 2%, fifty-ninth session)."""
    return g if req.speculate else 0


def laid_out(rows: np.ndarray, G: int) -> np.ndarray:
    """Rows of ``S`` draws of each kind (:func:`sampling_row`) laid out at ``G >= S`` (zeros where no step of
    theirs reads), so that a batch's block has the runner's layout whatever its rows drew (one copy into the
    graph runner's slots: :meth:`GraphModelRunner._load_sampling`)."""
    S = (rows.shape[1] - 5) // 2
    if S == G:
        return rows
    out = np.zeros((len(rows), 5 + 2 * G), np.float32)
    out[:, : 4 + S] = rows[:, : 4 + S]
    out[:, 4 + G : 4 + G + S] = rows[:, 4 + S : 4 + 2 * S]
    out[:, 4 + 2 * G] = rows[:, 4 + 2 * S]
    return out


def draw_ahead(reqs, g: int, device=None) -> tuple[list, list, torch.Tensor] | None:
    """Each live request's row for its next sampled step (:func:`sampling_row` at :func:`row_draws`), drawn
    while the device runs this one: the same numbers in the same order as drawn at that step (a request's
    stream is its own); a request that finishes leaves its row unread. Why: drawing a batch's rows was
    0.18-0.41 ms of host work before each sampled step at 64-128 requests on an H100, the device idle; drawn
    ahead, 0.05-0.09 ms of it left the critical path, +1-3% tok/s (docs/benchmarks.md, forty-fifth session).
    ``device``: also the rows of every live request, in order, as one block on it laid out at ``g``
    (``(requests, rows, block)``, :meth:`BatchSampling.draw`'s ``ahead``), for a next step whose batch is the
    same. Why: stacking and copying the rows was most of what was left, ~0.06 of 0.09 ms at 64 requests on the
    CPU, and on the H100 the step's "draw" was 0.27-0.31 ms of a 2.4-2.6 ms one-token step at 64 (forty-ninth
    session)."""
    for r in reqs:
        if r.drawn is None and not r.finished:
            r.drawn = sampling_row(r.sampling, r.generator, row_draws(r, g))
    if device is None:
        return None
    live = [r for r in reqs if not r.finished]
    rows = [r.drawn for r in live]
    if not rows or len({len(x) for x in rows}) > 1:
        return None
    return live, rows, h2d(laid_out(np.stack(rows), g), torch.float32, device)


def h2d(data, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Host values as a tensor on ``device``. On CUDA through pinned memory, asynchronously: a copy
    from pageable memory waits for the work queued on the stream, so a prefill launched while the
    device runs a decode step would wait for that step (the caching host allocator keeps the pinned
    block until the copy is done)."""
    t = torch.as_tensor(data, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def first_token(
    logits_row: torch.Tensor, sampling: SamplingParams, gen: Uniforms, stops: list[int] | None = None
) -> int:
    """The token the prefill emits, from the prompt's last logits row (one uniform of ``gen``);
    ``stops``: ids it may not be (``min_tokens``, :func:`stop_ids`)."""
    return int(first_tokens(logits_row.view(1, -1), [sampling], [gen], [stops])[0])


def first_tokens(
    logits: torch.Tensor,
    samplings: list[SamplingParams],
    gens: list[Uniforms],
    stops: list[list[int] | None],
    kernel: str | None = None,
    sync_free: bool | None = None,
) -> torch.Tensor:
    """:func:`first_token` of every row of ``logits [R, V]`` at once: one processing of the rows
    and one host read (the caller's), not a few per request. Why: per request, at 14 prompts a
    prefill call, it was about half of that call's ~1,800 kernel launches on the H200
    (docs/benchmarks.md, seventeenth session). Row ``i`` draws one uniform of ``gens[i]``, as one call for it would.
    ``sync_free`` (default: on CUDA): the graphs' truncation (``kernel``: the Triton kernel the
    engine's decode graphs use, see ``probs_from_logits``), no host read but the tokens. Why: the eager path's
    reads made the first token cost ~3 ms a prefill call on the H200, more than a 150-token
    prompt's forward (docs/benchmarks.md, twenty-first session); on the CPU its top-entries
    shortcut is cheaper than sorting whole rows. The tokens stay on the device (a tensor, not read):
    the engine launches them beside a decode step and reads them after that step's read-back."""
    dev = logits.device
    if any(stops):
        rows = [i for i, ids in enumerate(stops) for _ in ids or ()]
        cols = [t for ids in stops for t in ids or ()]
        logits = logits.index_put(
            (h2d(rows, torch.long, dev), h2d(cols, torch.long, dev)), logits.new_full((), float("-inf"))
        )
    u = torch.from_numpy(np.concatenate([g.take(1) for g in gens]))  # one uniform per row, in order
    if all(s.greedy for s in samplings):
        return logits.argmax(-1)
    col = partial(h2d, device=dev)
    p_last = probs_from_logits(
        logits,
        col([s.temperature for s in samplings], torch.float32),
        col([s.top_k for s in samplings], torch.long),
        col([s.top_p for s in samplings], torch.float32),
        col([s.min_p for s in samplings], torch.float32),
        capturable=logits.is_cuda if sync_free is None else sync_free,
        kernel=kernel,
    )
    return sample_from_probs(p_last, h2d(u, torch.float32, dev))


def eos_ids(target) -> set[int]:
    ids = getattr(getattr(target.model, "generation_config", None), "eos_token_id", None)
    ids = ids if ids is not None else getattr(target.config, "eos_token_id", None)
    if ids is None:
        return set()
    return set(ids) if isinstance(ids, (list, tuple)) else {int(ids)}


def stop_ids(sampling: SamplingParams, eos: set[int]) -> list[int]:
    """The ids that would end the output (EOS unless ``ignore_eos``, and the stop ids)."""
    return sorted((set() if sampling.ignore_eos else set(eos)) | set(sampling.stop_token_ids))


def min_tokens_left(req) -> int:
    """Output tokens still owed before a stop may come (``min_tokens``)."""
    return max(0, req.sampling.min_tokens - len(req.output_ids))


def suppress_stops(logits: torch.Tensor, stop_mask: torch.Tensor, left: torch.Tensor) -> torch.Tensor:
    """``min_tokens`` on the verify rows ``logits [B, w, V]``: row ``i`` of request ``b`` is output
    token ``i + 1`` of the step, so its stop ids (``stop_mask [B, V]``) are -inf while ``i < left[b]``.
    The target's distribution itself changes (as vLLM's min_tokens processor does), so the verifiers
    stay exact against it; a draft's stop token is simply rejected. No host reads."""
    w = logits.shape[1]
    owed = torch.arange(w, device=logits.device)[None, :] < left[:, None]  # [B, w]
    return logits.masked_fill(stop_mask[:, None, :] & owed[..., None], float("-inf"))


def stop_reason(tok: int, num_out: int, sampling: SamplingParams, eos: set[int]) -> str | None:
    """The stop rule after appending ``tok`` as output token number ``num_out``: "stop" at EOS (unless
    ``ignore_eos``) or a stop id, "length" at ``max_new_tokens``, else None. (The engine adds its
    context length and stop strings.)"""
    if ((tok in eos and not sampling.ignore_eos) or tok in sampling.stop_token_ids) and num_out >= sampling.min_tokens:
        return "stop"
    return "length" if num_out >= sampling.max_new_tokens else None


def resolve_verify_method(sampling: SamplingParams, verify_method: str | None) -> str:
    """The verifier to use (default: greedy at temperature 0, token-level otherwise), checked."""
    if verify_method is None:
        verify_method = "greedy" if sampling.greedy else "token"
    if verify_method not in VERIFY_METHODS:
        raise ValueError(f"verify_method must be one of {VERIFY_METHODS}, got {verify_method!r}")
    if verify_method == "greedy" and not sampling.greedy:
        raise ValueError("the greedy verifier is only lossless at temperature 0")
    return verify_method


@dataclass
class GenerationResult:
    token_ids: list[int]
    completion_tokens: int  # C (the first token, from prefill, included)
    verify_steps: int  # V (target forwards after prefill)
    accept_hist: list[int] = field(default_factory=list)  # accept_hist[n] = steps that accepted n drafts
    finish_reason: str = "length"  # "stop" (EOS / stop token) or "length"
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0

    @property
    def accept_length(self) -> float:
        return self.completion_tokens / max(self.verify_steps, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.total_s if self.total_s > 0 else 0.0

    def per_position_acceptance(self) -> list[float]:
        """Fraction of steps whose draft position i (1-based) was accepted."""
        from ..benchmark.metrics import per_position

        return per_position(self.accept_hist)


# ---- per batch ------------------------------------------------------------------------------------
@dataclass
class BatchSampling:
    temperature: torch.Tensor  # [B] float (0: a greedy row in a sampled batch)
    top_k: torch.Tensor  # [B] long (-1 or 0: off)
    top_p: torch.Tensor  # [B] float
    min_p: torch.Tensor  # [B] float
    propose_u: torch.Tensor  # [B, g] the selector's draws
    accept_u: torch.Tensor  # [B, g] the verifier's acceptance draws
    emit_u: torch.Tensor  # [B] the draw of the emitted token
    # the block the columns are views of, where they came from one (:meth:`of`): the graph runner copies
    # it into its slots' block (:meth:`from_rows`' layout) in one go
    rows: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_rows(cls, rows: torch.Tensor, g: int, stride: int | None = None) -> "BatchSampling":
        """Views of a ``[B, 4 + 2G + 1]`` float block, the one layout: temperature, top_k (a float, exact
        below 2**24), top_p, min_p, then ``G`` selector draws, ``G`` acceptance draws and the emitted
        token's draw (:func:`draw_uniforms`' order). ``G`` = ``stride`` (default ``g``); the first ``g`` of
        each kind of draw are read (a narrower step than the block was laid out for)."""
        G = g if stride is None else stride
        return cls(
            rows[:, 0],
            rows[:, 1].long(),
            rows[:, 2],
            rows[:, 3],
            rows[:, 4 : 4 + g],
            rows[:, 4 + G : 4 + G + g],
            rows[:, 4 + 2 * G],
            rows,
        )

    @classmethod
    def of(cls, params: list[SamplingParams], uniforms, device) -> "BatchSampling":
        """Rows of ``params`` with their uniforms ``[B, 2g + 1]`` (in :func:`draw_uniforms`' order), copied
        as one block (:meth:`from_rows`) with :func:`h2d` (on CUDA a copy from pageable memory would wait
        for the work queued on the stream, a prefill launched beside the last step for one: every sampled
        step, never a greedy one; one copy, not five: ~15 us of host each)."""
        host = np.asarray(uniforms, dtype=np.float32)
        cols = np.array([sampling_params(sp) for sp in params], np.float32)
        block = h2d(np.concatenate([cols.reshape(-1, 4), host], 1), torch.float32, device)
        return cls.from_rows(block, (host.shape[1] - 1) // 2)

    @classmethod
    def draw(
        cls, reqs, g: int, device, stride: int | None = None, ahead=None, layout: int | None = None
    ) -> "BatchSampling":
        """Each request's parameters and this step's uniforms from its own generator, drawn at ``stride``
        draws of each kind (default ``g``; the engine's full width: :func:`draw_uniforms`, or 0 where the
        batch does not draft: :func:`row_draws`), ``g`` read, laid out at ``layout`` (default ``stride``:
        :func:`laid_out`). ``ahead``: :func:`draw_ahead`'s block, taken where it holds these requests'
        unread rows in this order, drawn at ``stride`` and laid out at ``layout``."""
        G = g if stride is None else stride
        L = G if layout is None else layout
        if (
            ahead is not None
            and len(ahead[0]) == len(reqs)
            and ahead[2].shape[1] == 5 + 2 * L
            and all(a is r and r.drawn is row and len(row) == 5 + 2 * G for a, row, r in zip(*ahead[:2], reqs))
        ):
            for r in reqs:  # (their rows are read: the next ones are drawn afresh)
                r.drawn = None
            return cls.from_rows(ahead[2], g, L)
        rows = []
        for r in reqs:  # each row drawn ahead (draw_ahead) and read once, or drawn now
            row, r.drawn = r.drawn, None
            rows.append(row if row is not None and len(row) == 5 + 2 * G else sampling_row(r.sampling, r.generator, G))
        return cls.from_rows(h2d(laid_out(np.stack(rows), L), torch.float32, device), g, L)

    def params(self) -> tuple[torch.Tensor, ...]:
        return self.temperature, self.top_k, self.top_p, self.min_p

    def trimmed(self, g: int) -> "BatchSampling":
        """The draws of a step whose drafts were cut to the first ``g`` after the walk (the planner's
        :meth:`~dflash2.engine.planner.Planner.trim`): the verifier's first ``g``, the same emitted
        token's draw."""
        return replace(self, accept_u=self.accept_u[:, :g], rows=None)


@dataclass
class StepOutput:
    """What one batched step gave each request: its accepted drafts, then the emitted token."""

    tokens: list[list[int]]
    draft_s: float = 0.0  # draft forward + selector walk (0 without a draft)
    verify_s: float = 0.0  # target verify + verifier + the read-back (the overlap's part taken out)
    overlap_s: float = 0.0  # of the step's wall: what the overlap work (a prefill) added (OverlapClock)
    num_accepted: list[int] = field(init=False)
    # the verify forward's logits [B, w, V] (row i predicts token i), when a request asked for logprobs
    logits: torch.Tensor | None = None
    # the last logits row of the prompt that went in with this step's forward (--enable-mixed-chunk)
    prefilled: torch.Tensor | None = None
    # where the draft's confidence cut the step (``trim``): the width verified, and the confidence
    # ``[B, g]`` of every slot drafted (what the planner's calibration learns from)
    width: int | None = None
    confidence: np.ndarray | None = None
    # the step's own graphs' device time, first replay to last (benchmarks: :class:`GraphTimer`)
    device_s: float | None = None
    # of the step's wall: the host blocked at the read-back, waiting for the device (near 0 where the host is
    # what the device waits for: then a step's wall over its device time is host work, not a wait)
    wait_s: float = 0.0

    def __post_init__(self):
        self.num_accepted = [len(t) - 1 for t in self.tokens]


class KVManager(Protocol):
    """A runner's KV memory as the scheduler sees it: pages of a pool, or whole slots."""

    num_blocks: int
    block_size: int

    @property
    def num_free(self) -> int: ...

    @property
    def capacity(self) -> int: ...  # the most positions one request can hold

    def can_grow(self, req, num_tokens: int) -> bool: ...

    def grow(self, req, num_tokens: int) -> None: ...

    def release(self, req) -> None: ...


class Runner(Protocol):
    """What the engine asks of a model runner (width and verifier are fixed when it is built)."""

    use_graph: bool  # whether its steps replay CUDA graphs

    @property
    def kv(self) -> KVManager: ...  # what the scheduler admits and reserves against: pages or slots

    @property
    def widths(self) -> tuple[int, ...]: ...  # the verify widths a step can run (the planner's choices)

    @property
    def trim_widths(self) -> tuple[int, ...]: ...  # the widths a drafted step may be cut to (step's trim)

    def prefill(self, req, max_tokens: int | None = None) -> torch.Tensor | None: ...

    # overlap: host work to run while the device computes the step (before its read-back); prefill: a
    # new request's next prompt tokens, run inside the step's forward where the runner can (then
    # StepOutput.prefilled holds its last logits row; else the overlap's prefill takes them)
    # trim: after the draft, its confidence [B, g] (numpy) -> the width to verify (a runner that cannot
    # verify another width than it drafted ignores it)
    def step(
        self,
        reqs: list,
        sampling: BatchSampling | None,
        width: int | None = None,
        overlap=None,
        prefill=None,
        trim: Callable[[np.ndarray], int] | None = None,
    ) -> StepOutput: ...

    def bucket(self, n: int) -> int: ...  # the batch size a step of n requests is costed under

    def release(self, req) -> None: ...


class GraphTimer:
    """Work timed on the device (CUDA events around it, read after the step's read-back), else on the
    host (the CPU runs it in order): a step's graphs, or (:class:`OverlapClock`) its overlap work. Why
    the graphs: the live step's wall at 128 requests ran 1-9% over the same graph replayed alone, beside
    the target alone's engine, and the wall cannot say whether the device or the host made the difference
    (fifty-first session)."""

    def __init__(self, device: torch.device):
        cuda = torch.device(device).type == "cuda"
        self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None
        self._t = 0.0

    def start(self) -> None:
        if self._events is None:
            self._t = time.perf_counter()
        else:
            self._events[0].record()

    def stop(self) -> None:
        if self._events is None:
            self._t = time.perf_counter() - self._t
        else:
            self._events[1].record()

    def seconds(self) -> float:
        """After the step's read-back (the events have run)."""
        return self._t if self._events is None else self._events[0].elapsed_time(self._events[1]) / 1e3


class OverlapClock:
    """Runs a step's overlap work (:meth:`run`, once the step is launched) and says, after the step's
    read-back, how much of the step's wall that work took (:meth:`seconds`): on CUDA, the device time
    from the step's last kernel to the overlap's last (one stream runs them in order, so the read-back
    waits for both; a device idle while the host was still busy counts too); elsewhere the overlap's
    host time (nothing runs meanwhile). Why: the planner's step costs must be the step's own. With a
    prefill's device time in them, the cold start's drafting steps at 64 requests on the H200 cost
    4.85 ms against 3.89 ms for the same steps later, and the planner stopped drafting where the
    fixed width served 1.05x (docs/benchmarks.md, twenty-fourth session)."""

    def __init__(self, device: torch.device):
        self._timer = GraphTimer(device)
        self._ran = False

    def run(self, overlap) -> None:
        self._ran = overlap is not None
        if overlap is not None:
            self._timer.start()
            overlap()
            self._timer.stop()

    def seconds(self) -> float:
        return self._timer.seconds() if self._ran else 0.0


def finish_step(rows: torch.Tensor, t0: float, t1: float, clock: OverlapClock | None = None) -> StepOutput:
    """One read-back of the batch's ``[B, g + 2]`` rows (the verifier's tokens, then the number
    accepted), split per request; ``clock``: the step's overlap work, its part of the wall reported
    apart."""
    t_read = time.perf_counter()
    out = rows.tolist()  # (a device tensor: waits for the step)
    t_end = time.perf_counter()
    ov = clock.seconds() if clock is not None else 0.0
    return StepOutput(
        [row[: row[-1] + 1] for row in out], t1 - t0, t_end - t1 - ov, overlap_s=ov, wait_s=t_end - t_read
    )


def wants_logprobs(reqs) -> bool:
    return any(r.sampling.logprobs is not None for r in reqs)


def token_logprobs(
    logits: torch.Tensor, tokens: list[int], k: int
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """The target's own log-probabilities (log-softmax of its raw logits, float32, before temperature or
    truncation, as vLLM's default) of ``tokens``, row ``i`` of ``logits [n, V]`` predicting token ``i``,
    and each row's top ``k`` as (id, logprob), most likely first. What the draft proposed does not enter:
    the rows are the verify forward's."""
    lp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    if k <= 0:
        return chosen, [[] for _ in tokens]
    vals, ids = lp.topk(k, dim=-1)
    return chosen, [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]


def record_prompt_logprobs(req, logits: torch.Tensor, start: int) -> None:
    """A prefill chunk's rows ``logits [L, V]`` (positions ``start ..``) give the log-probabilities of
    the prompt tokens after them, with ``sampling.prompt_logprobs`` alternatives (first prefill only:
    a re-prefill after preemption has them already)."""
    k = req.sampling.prompt_logprobs
    if k is None or req.output_ids:
        return
    nxt = req.prompt_ids[start + 1 : start + 1 + logits.shape[0]]
    if nxt:
        chosen, top = token_logprobs(logits, nxt, k)
        req.prompt_logprobs += chosen
        req.prompt_top_logprobs += top


def result_rows(res: VerifyResult) -> torch.Tensor:
    """The verifier's result as the rows :func:`finish_step` reads back in one transfer."""
    return torch.cat([res.tokens, res.num_accepted[:, None]], dim=1)


def propose(
    draft,
    hidden: torch.Tensor,
    anchors: torch.Tensor,
    lm_head_weight: torch.Tensor,
    sampling: BatchSampling | None,
    capturable: bool = False,
    candidates: tuple[torch.Tensor, torch.Tensor] | None = None,
):
    """Draft tokens ``[B, g]`` from the block's hidden states, and ``q_draft`` over the selector's
    candidates (None when the batch is greedy: argmax acceptance does not read it). ``candidates``: the slots' top-k, where
    the caller took them already (``scored_candidates``)."""
    cands = candidates if candidates is not None else draft.candidates(hidden, lm_head_weight)
    if sampling is None:
        return greedy_walk(draft, hidden, anchors, lm_head_weight, cands), None
    sel = draft.candidate_selector.walk(
        cands,
        hidden,
        anchors,
        sampling.temperature,
        sampling.propose_u,
        *sampling.params()[1:],
        all_greedy=False,
        capturable=capturable,
    )
    return sel.tokens, sel.candidate_q()


def synthetic_rates(rates: tuple[float, ...] | None, width: int, device) -> torch.Tensor | None:
    """``--synthetic-acceptance`` as a device tensor of ``width - 1`` rates (one value repeats)."""
    if rates is None:
        return None
    return torch.tensor(
        (list(rates) * (width - 1))[: width - 1] if len(rates) == 1 else rates[: width - 1], device=device
    )


def accept(
    logits: torch.Tensor,
    drafts: torch.Tensor,
    q_draft: torch.Tensor | CandidateQ | None,
    sampling: BatchSampling | None,
    block: bool,
    capturable: bool = False,
    synthetic: torch.Tensor | None = None,
    kernel: str | None = None,
) -> VerifyResult:
    """The verifier choice, made here only: over the target's ``logits [B, g+1, V]``, greedy for a
    greedy batch, else token-level or block verification against the processed ``p_target``.
    ``synthetic`` (per-position acceptance rates, benchmarks only): :func:`synthetic_verify`, after
    the same target-side work (a sampled batch still processes ``p_target``)."""
    if synthetic is not None:
        if sampling is None:
            u = torch.rand(drafts.shape, device=logits.device)  # graph-safe: CUDA's generator is captured
            return synthetic_verify(drafts, logits, synthetic, u, None)
        temperature, top_k, top_p, min_p = sampling.params()
        p_target = probs_from_logits(logits, temperature, top_k, top_p, min_p, capturable, kernel)
        return synthetic_verify(drafts, p_target, synthetic, sampling.accept_u, sampling.emit_u)
    if sampling is None:
        return greedy_verify(drafts, logits)
    if q_draft is None:
        raise ValueError("a sampled batch needs q_draft")
    temperature, top_k, top_p, min_p = sampling.params()
    p_target = probs_from_logits(logits, temperature, top_k, top_p, min_p, capturable, kernel)
    verify = block_verify if block else token_level_verify
    return verify(drafts, q_draft, p_target, sampling.accept_u, sampling.emit_u)
