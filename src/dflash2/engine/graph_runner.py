"""The serving engine's model runner over static buffers, replayed as CUDA graphs per batch size.

Why: the paged runner rebuilds a left-padded Hugging Face cache every step and runs HF's
forward, which on the H200 is ~40 ms of host work a step for a 135M target (the GPU is idle).
Here each running request owns one slot of a :class:`StaticTarget` cache and of a draft latent
buffer, both over every position up to ``max_len``. Running requests fill slots ``0 .. n-1``
(a finished request's slot takes the last one's rows), so a step of ``n`` requests is one replay
of the graphs captured for the smallest bucket ``>= n``; the rows past ``n`` are idle slots.
Verify writes the target K/V and the draft latents of every block row at its position; rows
past what is accepted stay hidden (target: key <= query position; draft: key < anchor) and
are overwritten later, so commit only counts. A step is two replays (draft block + selector
walk; target verify + latents + verifier) whose math is :mod:`.steps`, shared with
:class:`ModelRunner`; sampled batches read per-request parameters and uniforms from slot
buffers. Graphs are keyed by batch bucket, attention prefix (``KV_BUCKETS``), greedy or
sampled, draft or verify. Same methods as :class:`ModelRunner` (the :class:`.steps.Runner` protocol).
"""

from __future__ import annotations

import gc
import time
import warnings
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from ..kernels.live_attention import use_triton
from ..model.attention import paged_context
from ..model.context_cache import block_hidden
from ..sampling import CandidateQ
from ..target import TargetModel
from ..target.static_llama import Rows, StaticTarget, unsupported_reason
from . import steps
from .block_manager import BlockManager, SlotManager
from .request import Request, prefill_ids
from .steps import BatchSampling, StepOutput

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# The masked SDPA reads whole buffers, so a step attends over the shortest of these prefixes that
# holds every running request (on the H200 a 5-row verify took 4.6 ms over 1,029 positions, 7.3 over
# 4,101). Each prefix is another set of graphs on CUDA; eager (the CPU) they cost nothing, so finer
# there. With the live kernel (CUDA) the target's verify reads only live keys and has one prefix;
# the prefixes then bound only the draft's window of context latents.
KV_BUCKETS = (1024,)
# With the live kernel the prefixes cost draft graphs only (the verify graphs have one prefix), and
# the draft attends over its whole window of latents, masked: at positions ~300 of a 1,024 window,
# 70% of what it gathered and multiplied was masked out.
KV_BUCKETS_LIVE = (256, 512, 1024)
KV_BUCKETS_EAGER = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# New requests' first prompt chunks go through captured graphs, back to back in one token dimension
# (a packed group: StaticTarget's Rows.segment), padded at the end to one of these totals. Why graphs:
# eager, a 30-layer prefill was ~2,400 kernel launches, 20-50 ms on the H200 for any length, against
# 2-6 ms for a decode step (docs/benchmarks.md, sixteenth session); every total is captured at
# start-up, none while serving (captured at first use, the shapes a changed admission pattern met cost
# ~0.15 s each inside the run, eighteenth session). Why packed: padded to shared (rows, length) buckets
# the prompts did 1.6x the compute of their tokens at 64 requests of the 8B shape and prefill was 43%
# of the wall (thirty-fourth session); packed, only the total is rounded up.
PREFILL_TOKENS = (32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
# Several prompts share a replay up to this many tokens (one longer prompt goes alone, up to the
# largest total): the packed attention is one masked [T, T] product, so past ~1,000 tokens it costs
# more than a second replay saves (a replay of that many tokens is compute-bound anyway).
PACKED_MAX_TOKENS = 1024
# --enable-mixed-chunk: a new request's whole prompt, padded to one of these lengths, runs inside a
# decode step's forward (StaticTarget.forward_rows), so it shares that step's read of the weights. Why: at
# the 8B shape a small batch's step and a ~110-token prefill each cost a read of the 16 GB of weights
# (~3.8 ms on the H200), and speculative requests finish at different steps, so they are admitted one
# at a time, each with a prefill of its own: 17% of the wall at 8 requests (docs/benchmarks.md,
# thirtieth session). One more graph per length for each decode graph.
MIXED_PREFILL_LENGTHS = (128, 256, 512)
# ... only in steps of at most this many verify tokens (batch bucket x width): there the step reads the
# weights anyway and the prompt rides along. At 8B, 8 requests x 5 (40) it raised the speedup 2.28 ->
# 2.40x; at 64 x 5 (320) the step is compute-bound, the padded prompt adds its full cost and one prompt
# a step admits slower than a batched prefill: 1.25-1.28 -> 1.19x (docs/benchmarks.md, 32nd session).
MIXED_MAX_STEP_TOKENS = 128
# Replay each graph once right after its capture (untimed; at start-up, over the idle slots that the
# warm-up calls before the capture wrote twice already): its first replay is then not a live step's nor
# a profiled one's. Why: a step shape that runs seldom (a planner probe's) is priced from a few
# samples, and the first replay after capture is a cold one (the graph's upload, where the driver does it
# at the first launch). A switch for `gpu.py steps --cold-replays`, which times that first replay.
WARM_REPLAY = True


def pack_prefill(lengths: list[int], totals: tuple[int, ...], rows: int) -> list[tuple[int, list[int]]] | None:
    """First chunks of ``lengths`` tokens packed into replays of the token ``totals`` (smallest
    first): ``[(total, chunk indices)]``, longest chunk first into the first replay that holds it
    (at most ``rows`` chunks and :data:`PACKED_MAX_TOKENS` tokens a replay, a longer chunk alone),
    each replay the smallest total that holds its chunks; None where a chunk is past every total."""
    if not totals or max(lengths) > totals[-1]:
        return None
    cap = min(PACKED_MAX_TOKENS, totals[-1])
    bins: list[list[int]] = []
    used: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        k = next((b for b, u in enumerate(used) if u + lengths[i] <= cap and len(bins[b]) < rows), None)
        if k is None:
            bins.append([])
            used.append(0)
            k = len(bins) - 1
        bins[k].append(i)
        used[k] += lengths[i]
    return [(next(t for t in totals if t >= u), idx) for u, idx in zip(used, bins)]


def page_of(tables: torch.Tensor, pos: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Page and offset of positions ``pos [B, n]`` through block tables ``tables [B, pages]``."""
    return tables.gather(1, pos // page).long(), pos % page


def paged_block_hidden(draft, embed, lat, tables, page: int, anchors, apos, ctx_offsets, width: int) -> torch.Tensor:
    """The draft block's hidden states (:func:`block_hidden`) over the ``W`` latents before each
    anchor (``ctx_offsets [1, W]`` = 0 .. W-1: its sliding window, or the whole prefix when that is
    shorter), gathered per row from the pages of ``lat`` through ``tables``: its cost does not grow
    with the buffer."""
    ctx_pos = apos[:, None] - ctx_offsets.shape[1] + ctx_offsets  # [B, W]; negative before the prompt
    pages, off = page_of(tables, ctx_pos.clamp(min=0), page)
    # rows of the flattened pages: gathered, or read in place by the fused attention kernel
    ctx = paged_context(lat.flatten(1, 2), pages * page + off, draft.config)
    return block_hidden(draft, embed, anchors, apos, ctx, ctx_pos, ctx_pos >= 0, width)


class Replay:
    """``fn()`` over static buffers: captured once as a CUDA graph (after two warm-up calls on a
    side stream, as PyTorch requires), or called directly when graphs are off."""

    def __init__(self, fn, use_graph: bool, pool=None):
        self.fn, self.graph = fn, None
        if use_graph:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(stream)
            # Python's cyclic GC must not run inside the capture: collecting an earlier engine frees
            # its graphs' memory, which invalidates the capture (seen on the H200 when bench speed
            # built engine after engine). Collect now, pause it while capturing.
            gc.collect()
            gc.disable()
            try:
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph, pool=pool):
                    fn()
            finally:
                gc.enable()
            if WARM_REPLAY:
                self.graph.replay()

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.fn()


def static_supported(target: TargetModel) -> bool:
    return unsupported_reason(target) is None


def cuda_graphs_apply(target: TargetModel, disable_cuda_graph: bool = False) -> bool:
    """Whether ``target`` is served from static slots replayed as CUDA graphs: on CUDA, a supported
    target, graphs not disabled. Says why when a CUDA target cannot have them."""
    if disable_cuda_graph or target.device.type != "cuda":
        return False
    if target.tp is not None:
        warnings.warn(
            "CUDA graphs off: a target split over ranks (--tp-size) has not been captured on GPUs yet "
            "(--model-runner static captures it all the same)"
        )
        return False
    reason = unsupported_reason(target)
    if reason:
        warnings.warn(f"CUDA graphs off: the static forward does not support {reason}")
    return reason is None


def static_bytes(target: TargetModel, draft, slots: int, max_len: int) -> int:
    """Memory the buffers take: target K and V plus the draft's latents, per position, for ``slots``
    slots of ``max_len`` positions (paged: pages x page size as ``slots x max_len``)."""
    per_pos = target.kv_bytes_per_token
    if draft is not None:
        d = draft.config
        per_pos += d.num_hidden_layers * (d.kv_lora_rank + d.qk_rope_head_dim) * next(draft.parameters()).element_size()
    return slots * max_len * per_pos


@dataclass
class Launched:
    """A step whose replays are queued (:meth:`GraphModelRunner.launch`), not yet read back."""

    reqs: list[Request]
    rows: torch.Tensor  # the verifier's rows of the batch: on the device, or (ahead) a host copy behind the step
    done: torch.cuda.Event | None  # (ahead, CUDA) recorded after the copy
    t0: float
    t1: float
    timer: steps.GraphTimer | None
    first: torch.Tensor | None  # a mixed prompt's last logits row
    width: int | None  # where the draft's confidence cut the step: the width verified
    confidence: np.ndarray | None
    logits: torch.Tensor | None


class GraphModelRunner:
    # each slot's anchor and position live on the device (the verify writes them): a step needs no host
    # token of the step before, so the engine may commit that step while this one runs (overlap schedule)
    defers_commit = True

    def __init__(
        self,
        target: TargetModel,
        draft,
        width: int,
        num_slots: int,
        max_len: int,
        cuda_graph: bool = True,
        block_verification: bool = False,
        attention: str | None = None,
        kv_buckets: tuple[int, ...] | None = None,
        verify_widths: tuple[int, ...] = (),
        page_size: int | None = None,
        num_pages: int | None = None,
        synthetic_acceptance: tuple[float, ...] | None = None,
        sampler: str = "auto",
        compile_draft: bool = True,
        mixed_chunk: bool = False,
        prefill_graphs: bool | None = None,
        batch_kinds: tuple[bool, ...] = (True, False),
        trim: bool = False,
    ):
        """``page_size`` / ``num_pages``: KV (target and draft) in a pool of pages that requests
        take as they grow (the scheduler's :class:`BlockManager`), read through per-slot block tables
        on the device; without them each slot holds ``max_len`` positions (the one-slot engine).
        ``compile_draft``: the draft's layers and latents through ``torch.compile`` where the graphs
        are captured (:meth:`DFlash2DraftModel.compile_layers`). ``mixed_chunk``: a new request's prompt
        may run inside a step's forward (:data:`MIXED_PREFILL_LENGTHS`; paged pools only).
        ``prefill_graphs``: first prompt chunks packed through the functions of :data:`PREFILL_TOKENS`
        (default: with a paged pool, or one slot where graphs are captured). ``batch_kinds``: the step
        graphs made at start-up, greedy batches (True) and / or sampled ones (False); a run whose
        requests are all of one kind (``bench acceptance``) captures half as many. ``trim``: where
        steps run eagerly (no CUDA graphs), a full-width step may be verified at any width 2 .. full
        after its draft (:attr:`trim_widths`, the planner's ``trim``; with graphs that would read the
        draft's confidence back between the two replays and capture every width: not yet measured)."""
        self.target, self.draft, self.w, self.max_len = target, draft, width, max_len
        # the widths a step may verify (the planner's choices): the full one, 1 = the target alone, and
        # any between (--speculative-planner-widths: the draft builds the full block, the verify reads
        # its first drafts)
        self.verify_widths = tuple(sorted(set(verify_widths) | {width}))
        if any(not 1 <= w <= width for w in self.verify_widths):
            raise ValueError(f"verify widths must lie in 1 .. {width}, got {verify_widths}")
        self.block = block_verification
        self.synthetic = steps.synthetic_rates(synthetic_acceptance, width, target.device)  # benchmarks only
        self.clock = steps.OverlapClock(target.device)
        self.timer: steps.GraphTimer | None = None  # benchmarks: each step's graphs timed (StepOutput.device_s)
        # with the timer set (benchmarks), each packed prefill replay timed too (:meth:`take_prefill_device_s`)
        self._prefill_timers: list[steps.GraphTimer] = []
        # async scheduling (:meth:`launch` ahead): two steps in flight, each with its timer and host rows
        self._timers = (steps.GraphTimer(target.device), steps.GraphTimer(target.device))
        self._parity = 0
        pin = target.device.type == "cuda"
        self._host_rows = tuple(torch.zeros(num_slots * (width + 1), dtype=torch.long, pin_memory=pin) for _ in "ab")
        # sampled verify's truncation in the graph: "sort" (every row sorted), "triton" (sort-free
        # kernel) or "triton-fused" (the whole processing in one kernel); auto: triton-fused on CUDA (on
        # the H200 its rows cost 0.36 ms against 0.82 for the unfused kernel's seven passes at 320 rows, and
        # at T=1, 64-128 requests, it served 1.10-1.18x of the target alone where the unfused kernel served
        # 1.03-1.09x: docs/benchmarks.md, forty-second session). They keep the same set but at a top-p
        # boundary within rounding of the sums (3 of 320 rows), so one engine uses one for every width
        if sampler == "auto":
            sampler = "triton-fused" if target.device.type == "cuda" and use_triton(target.device) else "sort"
        kernels = {"sort": None, "triton": "truncate", "triton-fused": "fused"}
        if sampler not in kernels or (sampler != "sort" and not use_triton(target.device)):
            raise ValueError(
                f"--sampler-backend {sampler!r}: auto, sort, or triton / triton-fused where Triton runs (CUDA)"
            )
        self.kernel = kernels[sampler]
        # the target's attention: the live kernel where Triton runs it (CUDA), else the masked SDPA
        attention = attention or ("live" if target.device.type == "cuda" and use_triton(target.device) else "sdpa")
        if attention == "live" and not use_triton(target.device):
            raise ValueError(
                "--attention-backend triton: Triton cannot run on this device (CUDA, or TRITON_INTERPRET=1 on the CPU)"
            )
        self.static = StaticTarget(target, max_len, num_slots, attention, page_size, num_pages)
        self.static.check()  # refuse a layout the hand-written forward does not reproduce
        dev = target.device
        self.use_graph = cuda_graph and dev.type == "cuda"
        # the widths a drafted step may be cut to after its draft (the draft's confidence per slot in ``conf``)
        self.trim_widths = tuple(range(2, width + 1)) if trim and draft is not None and not self.use_graph else ()
        self.conf = torch.zeros(num_slots, max(width - 1, 1), device=dev) if self.trim_widths else None
        st = self.static
        self.paged, self.page = st.paged, st.page_size
        self.kv: BlockManager | SlotManager = (
            BlockManager(st.scratch, st.page_size) if st.paged else SlotManager(num_slots, max_len)
        )
        # each slot's pages (slot mode: slot s is page s); rows past a request's pages, and idle
        # slots, point at the scratch page, where idle rows' writes land
        self.tables = (
            torch.full((num_slots, st.max_pages), st.scratch, dtype=torch.int32, device=dev)
            if st.paged
            else torch.arange(num_slots, dtype=torch.int32, device=dev)[:, None]
        )
        self.synced = [0] * num_slots  # table entries written per slot
        self.buckets = [b for b in BUCKETS if b < num_slots] + [num_slots]
        self.live = attention == "live"
        kv_buckets = kv_buckets or (
            (KV_BUCKETS_LIVE if self.live else KV_BUCKETS) if self.use_graph else KV_BUCKETS_EAGER
        )
        self.kv_buckets = sorted({b for b in kv_buckets if b < max_len} | {max_len})
        if draft is not None and compile_draft and self.use_graph:
            draft.compile_layers()
        elif draft is not None:  # eager, even where an earlier engine in the process compiled it
            draft.compile_off()
        lng = dict(dtype=torch.long, device=dev)
        self.ids = torch.zeros(num_slots, width, **lng)  # per slot: [anchor, drafts...]
        self.start = torch.zeros(num_slots, **lng)  # per slot: the anchor's position
        self.ar = torch.arange(width, **lng)
        self.occupant: list[Request] = []  # occupant[s] holds slot s
        self.stale: set[int] = set()  # slots whose anchor / position the host must write
        # slots whose occupant moved in (its anchor and position copied on the device): their min_tokens state
        # is written again. Why not the host's anchor: with the engine's commit deferred past the next launch
        # (the overlap schedule) a running request's host tokens may lag the device's by a step
        self.moved: set[int] = set()
        # per slot, for sampled batches: parameters and uniforms (one block, BatchSampling.from_rows'
        # layout), and q_draft from the draft graph (idle slots keep a previous occupant's values: valid
        # inputs whose results nobody reads)
        f32 = dict(dtype=torch.float32, device=dev)
        g, V = width - 1, target.lm_head_weight.shape[0]
        self.sampling = torch.tensor([1.0, -1.0, 1.0, 0.0] + [0.5] * (2 * g + 1), **f32).repeat(num_slots, 1)
        # q_draft over the selector's candidates (a [slots, g, V] buffer: 176 MB at 128 slots, width 8)
        k = draft.candidate_selector.top_k if draft is not None else 1
        self.q_ids = torch.zeros(num_slots, g, k, **lng)
        self.q_probs = torch.zeros(num_slots, g, k, **f32)
        # min_tokens: per slot its stop ids and the output tokens still owed (0: nothing suppressed)
        self.eos = steps.eos_ids(target)
        self.stop_mask = torch.zeros(num_slots, V, dtype=torch.bool, device=dev)
        self.owed = torch.zeros(num_slots, **lng)
        self.owed_host = [0] * num_slots
        if draft is not None:
            d = draft.config
            p = next(draft.parameters())
            self.lat = torch.zeros(  # the draft's latents, in the same pages as the target's K/V
                d.num_hidden_layers,
                st.k_cache.shape[1],
                st.page_size,
                d.kv_lora_rank + d.qk_rope_head_dim,
                dtype=p.dtype,
                device=dev,
            )
            self.ctx_pos = torch.arange(max_len, **lng)[None]
        self.pool = torch.cuda.graph_pool_handle() if self.use_graph else None
        # new requests' first prompt chunks, packed (PREFILL_TOKENS; paged pools: a padded token
        # continues the last prompt, its K/V past that prompt or on the scratch page, as in
        # prefill_batch). One slot (batch 1) packs where graphs are captured only: eager, padding is
        # only more work. Why: eager, an 8B prompt's prefill took ~26 ms at batch 1 on the H200, 11%
        # of DFlash2's wall against 4% of the target alone's (docs/benchmarks.md, thirty-first session).
        packed = self.paged or (num_slots == 1 and self.use_graph) if prefill_graphs is None else prefill_graphs
        self.prefill_tokens = tuple(t for t in PREFILL_TOKENS if t <= max_len) if packed else ()
        if mixed_chunk and not st.paged:
            raise ValueError("--enable-mixed-chunk: needs a paged KV pool (more than one running request)")
        # a step's graphs may carry one new request's prompt of these (padded) lengths
        self.mixed_lengths = tuple(L for L in MIXED_PREFILL_LENGTHS if L <= max_len) if mixed_chunk else ()
        # the packed tokens: id, position, prompt (row of pf_table); each prompt's last token and table
        T, R = max(self.prefill_tokens + self.mixed_lengths, default=0), min(num_slots, PACKED_MAX_TOKENS)
        self.pf = torch.zeros(3, T, **lng)
        self.pf_last = torch.zeros(R, **lng)
        self.pf_table = self.tables[:R].clone()
        self.prefill_graphs: dict[tuple[int, bool], tuple[Replay, dict]] = {}  # (tokens, latents)
        self.prefill_shapes: dict[str, list[int]] = {}  # "T" / "mixT": [replays, real tokens]
        # a batch of requests that do not draft runs the target alone: width 1 without the latent writes
        self.plain_graphs = draft is not None and 1 in self.verify_widths
        # kind, B, greedy, kv_len, w, and the padded length of a prompt run with the step (0: none)
        self.graphs: dict[tuple[str, int, bool, int, int, int], tuple[Replay, dict]] = {}
        # Capture every bucket now, largest first so smaller ones reuse its memory (a capture inside a
        # step would cost that step ~0.1 s, and run the step's in-place updates in its warm-up); the
        # idle slots the warm-up calls write into are overwritten by each request's prefill. Eager (off
        # CUDA) the same table of functions, so that a step asking for a graph that was never made
        # fails on the CPU too (:meth:`_graph`).
        # Greedy graphs first; a failed capture leaves that kind of step eager over the same buffers
        # (slower, still correct) rather than the engine down.
        self.graphed = {True: self.use_graph, False: self.use_graph}  # by "greedy batch"
        self.batch_kinds = batch_kinds
        for greedy in batch_kinds:
            try:
                self._make_graphs(greedy)
            except RuntimeError as e:
                warnings.warn(
                    f"CUDA graph capture failed ({type(e).__name__}: {e}); "
                    f"{'greedy' if greedy else 'sampled'} steps run eagerly"
                )
                self.graphed[greedy] = False
                self.graphs = {k: v for k, v in self.graphs.items() if k[2] != greedy}
                self._make_graphs(greedy)
        self.prefill_graphed = self.use_graph
        try:  # (off CUDA: the same functions, called eagerly)
            for T in reversed(self.prefill_tokens):
                self._capture_prefill(T)
        except RuntimeError as e:
            warnings.warn(f"CUDA graph capture of prefill failed ({type(e).__name__}: {e}); prefill runs eagerly")
            self.prefill_graphed, self.prefill_graphs = False, {}
            for T in self.prefill_tokens:
                self._capture_prefill(T)
        # what one more prefill replay costs the running requests (LLMEngine._admits_now), of requests that
        # draft (with the drafter's latents, where there is a drafter) and of requests that do not; 0: not priced
        timed = self.prefill_graphed and self.prefill_graphs
        self.plain_prefill_replay_s = self._time_prefill(False) if timed else 0.0
        has_latents = timed and self.draft is not None  # (else the same replay as the plain one)
        self.prefill_replay_s = self._time_prefill(True) if has_latents else self.plain_prefill_replay_s

    def _time_prefill(self, latents: bool, repeats: int = 3) -> float:
        """Seconds of the smallest packed prefill replay (``latents``: with the drafter's), synchronised, at
        start-up (its rows the idle slots' scratch, as the capture's were): the part of a prefill that two
        prompts prefilled together pay once."""
        replay, _ = self.prefill_graphs[(self.prefill_tokens[0], latents)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeats):
            replay()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / repeats

    # ---- slots --------------------------------------------------------------------------------
    def _index(self, reqs: list[Request], slack: int = 0) -> tuple[torch.Tensor | slice, int, int]:
        """Slot of each request (a slice when they are slots ``0 .. n-1`` in order, the usual case,
        else a device index), the batch bucket that covers every occupied slot, and the buffer
        prefix that holds every occupant's next block (and ``slack`` positions more: a step in flight's)."""
        slots = [r.slot for r in reqs]
        idx: torch.Tensor | slice = (
            slice(0, len(reqs)) if slots == list(range(len(reqs))) else steps.h2d(slots, torch.long, self.target.device)
        )
        n = len(self.occupant)
        end = max(r.num_committed for r in self.occupant) + self.w + slack
        return idx, next(b for b in self.buckets if b >= n), next(k for k in self.kv_buckets if k >= end)

    def bucket(self, n: int, seating: bool = False) -> int:
        """The batch bucket a step of ``n`` requests replays (every occupied slot runs; ``seating``:
        and one more request takes a slot first)."""
        m = max(n, len(self.occupant) + seating)
        return next(b for b in self.buckets if b >= m)

    @torch.no_grad()
    def profile(self, repeats: int = 5) -> dict[tuple[int, int], float]:
        """Seconds per step by (bucket, verify width), replayed over the shortest attention prefix,
        synchronised (before any request: the rows written are idle slots'), of greedy batches where
        their graphs were made, else of sampled ones (``batch_kinds``). Width 0: the target alone,
        without the drafter's latent writes (a batch of requests that do not draft)."""
        sync = torch.cuda.synchronize if self.use_graph else (lambda: None)
        out: dict[tuple[int, int], float] = {}
        kv_len, greedy = self.kv_buckets[0], True in self.batch_kinds
        for B in self.buckets:
            for w in self.verify_widths + ((0,) if self.plain_graphs else ()):
                fns = ([self._graph("draft", B, greedy, kv_len)[0]] if w > 1 and self.draft is not None else []) + [
                    self._graph("plain" if w == 0 else "verify", B, greedy, self._verify_kv(kv_len), max(w, 1))[0]
                ]
                for fn in fns:  # once untimed
                    fn()
                sync()
                t0 = time.perf_counter()
                for _ in range(repeats):
                    for fn in fns:
                        fn()
                sync()
                out[(B, w)] = (time.perf_counter() - t0) / repeats
        self.start.zero_()
        return out

    def release(self, req: Request) -> None:
        req.draft_cache = req.target_state = None
        req.prefill_pos = 0
        if req.slot is None:
            return
        s, last = req.slot, len(self.occupant) - 1
        req.slot = None
        if s != last:  # keep occupied slots contiguous: the last occupant moves into the hole
            mover = self.occupant[last]
            if self.paged:  # its pages stay; its table moves
                self.tables[s], self.synced[s] = self.tables[last], self.synced[last]
            else:
                n = min(mover.num_committed + self.w, self.max_len)
                for cache in (self.static.k_cache, self.static.v_cache):
                    cache[:, s, :, :n] = cache[:, last, :, :n]
                if self.draft is not None:
                    self.lat[:, s, :n] = self.lat[:, last, :n]
            self.occupant[s], mover.slot = mover, s
            self.stale.discard(s)
            self.moved.discard(s)
            if last in self.stale:  # (not loaded since its prefill: its anchor is the host's)
                self.stale.add(s)
            else:  # queued after any step in flight, so the copy is of where that step leaves the slot
                self.ids[s, 0], self.start[s] = self.ids[last, 0], self.start[last]
                self.moved.add(s)
        if self.paged:  # the freed slot's rows write to the scratch page from now on
            self.tables[last], self.synced[last] = self.static.scratch, 0
        self.stale.discard(last)
        self.moved.discard(last)
        self.occupant.pop()

    def _sync_table(self, req: Request) -> None:
        """The request's pages (the scheduler grows ``req.block_table``) into its slot's device table."""
        s, n = req.slot, len(req.block_table)
        assert s is not None
        if self.paged and n != self.synced[s]:
            if n > self.static.max_pages:
                raise MemoryError(f"{n} pages exceed the {self.static.max_pages} a slot's table holds")
            self.tables[s, :n] = steps.h2d(req.block_table, torch.int32, self.tables.device)
            self.synced[s] = n

    def _sync_owed(self, req: Request, moved: bool) -> None:
        """The slot's min_tokens state: its stop ids when a request with min_tokens enters it, and the
        tokens still owed whenever that count changes (written only then)."""
        s, left = req.slot, steps.min_tokens_left(req)
        assert s is not None
        if moved or left != self.owed_host[s]:
            if moved or self.owed_host[s] == 0:
                self.stop_mask[s] = False
                if left:
                    self.stop_mask[s, steps.stop_ids(req.sampling, self.eos)] = True
            self.owed[s], self.owed_host[s] = left, left

    # ---- the captured functions ---------------------------------------------------------------
    def _make_graphs(self, greedy: bool) -> None:
        """Every step graph of greedy (or sampled) batches: each bucket, attention prefix, width and
        mixed prompt length that a step may ask for."""
        for kv_len in reversed(self.kv_buckets):
            for B in reversed(self.buckets):
                for mix in (0, *self.mixed_lengths):
                    for w in sorted(set(self.verify_widths) | set(self.trim_widths)):
                        if not mix or (self.mixes(B, w) and w in self.verify_widths):
                            self._graph("verify", B, greedy, self._verify_kv(kv_len), w, mix, make=True)
                    if self.plain_graphs and (not mix or self.mixes(B, 1)):
                        self._graph("plain", B, greedy, self._verify_kv(kv_len), 1, mix, make=True)
                if self.draft is not None:
                    self._graph("draft", B, greedy, kv_len, make=True)

    def _graph(
        self, kind: str, B: int, greedy: bool, kv_len: int, width: int = 0, mix: int = 0, make: bool = False
    ) -> tuple[Replay, dict]:
        """The buckets' graph (captured at start-up on CUDA; eager functions otherwise). ``width``:
        the verify width (the draft always builds the full block); ``mix``: the padded length of the
        new prompt run with the step (``pf[:, :mix]``, packed; 0: none). Only start-up makes one
        (``make``): a graph captured inside a step ran that step's in-place updates in its warm-up,
        and its outputs took memory of the pool that graphs replayed before they are read use too (an
        8B step returned accepted counts past its width on the H200, thirty-sixth session)."""
        key = (kind, B, greedy, kv_len, width or self.w, mix)
        if key not in self.graphs:
            if not make:
                raise RuntimeError(f"no graph was made at start-up for the step {key}")
            out: dict = {}
            if kind in ("verify", "plain"):
                fn = partial(self._verify_fn, B, greedy, kv_len, out, key[4], kind == "verify", mix)
            else:
                fn = partial(self._draft_fn, B, greedy, kv_len, out)
            with torch.no_grad():
                self.graphs[key] = (Replay(fn, self.graphed[greedy], self.pool), out)
        return self.graphs[key]

    def _seat(self, req: Request) -> int:
        """The request's slot, taken at its first chunk (or a retry of it after a failed batched
        prefill), with its table synced and its position at the prompt's end (a decode step meanwhile
        runs it as an idle row, whose writes land there, rows its own first verify overwrites)."""
        if req.slot is None:
            req.slot = len(self.occupant)
            self.occupant.append(req)
        self._sync_table(req)
        self.start[req.slot] = len(prefill_ids(req))
        return req.slot

    def _prefilled(self, req: Request, n: int, last: torch.Tensor) -> torch.Tensor | None:
        """``n`` more prompt tokens are in: ``last`` (the chunk's last logits row) once all of them are."""
        req.prefill_pos = req.num_committed = req.prefill_pos + n
        assert req.slot is not None
        self.stale.add(req.slot)
        return last if req.prefill_pos == len(prefill_ids(req)) else None

    def _capture_prefill(self, T: int) -> None:
        """Both variants of a total: with the draft's latents (requests that draft) and without
        (requests the planner admitted not drafting: no drafter work in their prefill)."""
        for latents in (True, False) if self.draft is not None else (False,):
            out: dict = {}
            with torch.no_grad():
                self.prefill_graphs[(T, latents)] = (
                    Replay(partial(self._prefill_fn, T, latents, out), self.prefill_graphed, self.pool),
                    out,
                )

    def _prefill_fn(self, T: int, latents: bool, out: dict) -> None:
        """The packed first chunks, ``T`` tokens of ``pf``: K/V (and the draft's latents) of every
        token, padding included (never read: a query reads keys up to its own position, each written
        before it is read), and each prompt's last logits row at ``pf_last``."""
        rows = self._prefill_rows(T)
        self._prefill_out(rows, latents, self.static.forward_rows([rows])[0], out)

    def _prefill_rows(self, T: int) -> Rows:
        ids, pos, seg = self.pf[:, :T]
        return Rows(ids[:, None], pos, self.pf_table[seg], last=self.pf_last, segment=seg)

    def _prefill_out(self, rows: Rows, latents: bool, result: tuple, out: dict) -> None:
        """A prefill's outputs: the draft's latents of its tokens (``latents``), its logits to ``out``."""
        logits, feats = result
        if latents:
            pos = rows.start[:, None]
            page, off = page_of(rows.tables, pos, self.page)
            self.lat[:, page, off] = self.draft.graph_rows(feats, pos).to(self.lat.dtype)
        out["pf_logits"] = logits

    def _prefill_packed(self, chunks: list[tuple[Request, int]]) -> list[torch.Tensor | None] | None:
        """Requests' first chunks through the packed graphs, as :func:`pack_prefill` groups them; None
        where no plan fits (a later chunk, prompt logprobs, a chunk past every total): the caller runs
        them eagerly."""
        if not self.prefill_graphs or any(
            r.prefill_pos or (r.sampling.prompt_logprobs is not None and not r.output_ids) for r, _ in chunks
        ):
            return None
        plan = pack_prefill([k for _, k in chunks], self.prefill_tokens, self.pf_last.shape[0])
        if plan is None:
            return None
        out: list[torch.Tensor | None] = [None] * len(chunks)
        for T, idx in plan:
            last = self._replay_prefill([chunks[i] for i in idx], T)
            if len(plan) > 1:  # a later replay overwrites the graph's output
                last = [x if x is None else x.clone() for x in last]
            for i, x in zip(idx, last):
                out[i] = x
        return out

    def _replay_prefill(self, chunks: list[tuple[Request, int]], T: int) -> list[torch.Tensor | None]:
        """First chunks (``T`` tokens at most in all) through the packed graph of ``T`` tokens."""
        self._load_prefill(chunks, T)
        replay, out = self.prefill_graphs[(T, self.draft is not None and any(r.speculate for r, _ in chunks))]
        timer = None if self.timer is None else steps.GraphTimer(self.target.device)
        if timer is not None:
            timer.start()
        replay()
        if timer is not None:
            timer.stop()
            self._prefill_timers.append(timer)
        self._count_prefill(str(T), chunks)
        return [self._prefilled(req, k, out["pf_logits"][b, 0]) for b, (req, k) in enumerate(chunks)]

    def take_prefill_device_s(self) -> float:
        """The packed prefill replays' time on the device since the last call (benchmarks: only while
        :attr:`timer` is set; waits for the device). Why: a step's overlap clock counts a prefill's device
        time together with any device idle before it; at 64 requests of the 8B shape the speculative
        engine's overlap was 3.94 s against the target alone's 3.10 s for the same prompts, which a model of
        its replays explains (sixty-second session): this measures it."""
        if self.target.device.type == "cuda":
            torch.cuda.synchronize(self.target.device)
        timers, self._prefill_timers = self._prefill_timers, []
        return sum(t.seconds() for t in timers)

    def _count_prefill(self, shape: str, chunks: list[tuple[Request, int]]) -> None:
        # packed replays by total: [replays, real prompt tokens] (bench speed reports the padding)
        n = self.prefill_shapes.setdefault(shape, [0, 0])
        n[0], n[1] = n[0] + 1, n[1] + sum(k for _, k in chunks)

    def _load_prefill(self, chunks: list[tuple[Request, int]], T: int) -> None:
        """First chunks (each request seated) back to back into ``pf[:, :T]``, each prompt's last
        token into ``pf_last``, its table into ``pf_table``; the padding continues the last prompt."""
        dev = self.target.device
        ids: list[int] = []
        pos: list[int] = []
        seg: list[int] = []
        last = [0] * self.pf_last.shape[0]
        for b, (req, k) in enumerate(chunks):
            self._seat(req)
            ids += prefill_ids(req)[:k]
            pos += range(k)
            seg += [b] * k
            last[b] = len(ids) - 1
        pad = T - len(ids)
        meta = [ids + [0] * pad, pos + list(range(pos[-1] + 1, pos[-1] + 1 + pad)), seg + [len(chunks) - 1] * pad]
        self.pf[:, :T] = steps.h2d(meta, torch.long, dev)
        self.pf_last.copy_(steps.h2d(last, torch.long, dev))
        self.pf_table[: len(chunks)] = self.tables[steps.h2d([r.slot for r, _ in chunks], torch.long, dev)]

    def _verify_kv(self, kv_len: int) -> int:
        """The prefix a verify graph is keyed by: the live kernel reads live keys whatever the prefix."""
        return self.max_len if self.live else kv_len

    def _rows(self, B: int, greedy: bool, g: int | None = None) -> BatchSampling | None:
        """The first ``B`` slots' sampling buffers, their first ``g`` draws (None: a greedy batch)."""
        if greedy:
            return None
        return BatchSampling.from_rows(self.sampling[:B], self.w - 1 if g is None else g, stride=self.w - 1)

    def _verify_fn(
        self, B: int, greedy: bool, kv_len: int, out: dict, w: int, latents: bool = True, mix: int = 0
    ) -> None:
        groups = [Rows(self.ids[:B, :w], self.start[:B], self.tables[:B], kv_len)]
        if mix:  # a new prompt in the same forward (its latents where the step's are written)
            groups.append(self._prefill_rows(mix))
        (logits, feats), *prefill = self.static.forward_rows(groups)
        if prefill:
            self._prefill_out(groups[1], latents and self.draft is not None, prefill[0], out)
        logits = steps.suppress_stops(logits, self.stop_mask[:B], self.owed[:B])
        if (
            self.draft is not None and latents
        ):  # every row's latent at its position (rows past the accepted ones stay masked)
            pos = self.start[:B, None] + self.ar[:w]
            page, off = page_of(self.tables[:B], pos, self.page)
            self.lat[:, page, off] = self.draft.graph_rows(feats, pos).to(self.lat.dtype)
        res = steps.accept(
            logits,
            self.ids[:B, 1:w],
            CandidateQ(self.q_ids[:B, : w - 1], self.q_probs[:B, : w - 1]),
            self._rows(B, greedy, w - 1),
            self.block,
            capturable=True,
            synthetic=None if self.synthetic is None else self.synthetic[: w - 1],
            kernel=self.kernel,
        )
        out["rows"] = steps.result_rows(res)
        out["logits"] = logits  # read after the replay only when a request asks for logprobs
        # the next step's anchor and position, in place (the host writes them only for stale slots); an
        # idle row's position stops where its block still fits the buffer
        n = res.num_accepted
        self.ids[:B, 0] = res.tokens.gather(1, n[:, None])[:, 0]
        self.start[:B] = (self.start[:B] + n + 1).clamp_(max=self.max_len - self.w)

    def _draft_fn(self, B: int, greedy: bool, kv_len: int, out: dict) -> None:
        """The draft block over each row's window of latents (at most the prefix ``kv_len``), then the
        selector's walk; the drafts go beside the anchors in the slots' id buffer."""
        d, W = self.draft, min(self.draft.config.sliding_window, kv_len)
        hidden = paged_block_hidden(
            d, self.target.embed, self.lat, self.tables[:B], self.page, self.ids[:B, 0], self.start[:B],
            self.ctx_pos[:, :W], self.w,
        )  # fmt: skip
        head, cands = self.target.lm_head_weight, None
        if self.conf is not None:  # (trimming: eager only, so the extra scores cost no capture)
            vals, ids, conf = d.scored_candidates(hidden, head)
            cands = (vals, ids)
            self.conf[:B].copy_(conf)
        tokens, q = steps.propose(
            d, hidden, self.ids[:B, 0], head, self._rows(B, greedy), capturable=True, candidates=cands
        )
        if q is not None:
            self.q_ids[:B].copy_(q.ids)
            self.q_probs[:B].copy_(q.probs)
        self.ids[:B, 1:].copy_(tokens)  # the verify graph reads them there

    # ---- the runner's methods -----------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, req: Request, max_tokens: int | None = None) -> torch.Tensor | None:
        """The next ``max_tokens`` (default: all) of ``prefill_ids(req)`` into the request's slot,
        eagerly; the last row's logits once the whole prompt is in, else None. The slot is taken at
        the first chunk: a decode step meanwhile runs it as an idle row, whose writes land at
        ``start`` = the prompt's end, rows its own first verify overwrites."""
        ids, p, dev = prefill_ids(req), req.prefill_pos, self.target.device
        chunk = ids[p : p + (max_tokens or len(ids))]
        if chunk and (packed := self._prefill_packed([(req, len(chunk))])) is not None:
            return packed[0]
        s = self._seat(req)
        table = self.tables[s : s + 1]
        every_row = req.sampling.prompt_logprobs is not None and not req.output_ids
        logits, feats = self.static.forward(
            steps.h2d(chunk, torch.long, dev)[None],
            torch.full((1,), p, dtype=torch.long, device=dev),
            slot=s,  # slot mode reads slot s's buffer directly
            kv_len=p + len(chunk),
            tables=table,
            last=None if every_row else torch.full((1,), len(chunk) - 1, device=dev),
        )
        logits, feats = logits[0], feats[0]
        if every_row:
            steps.record_prompt_logprobs(req, logits, p)
        if self.draft is not None and req.speculate:
            pos = torch.arange(p, p + len(chunk), device=dev)
            page, off = table[0, pos // self.page].long(), pos % self.page
            self.lat[:, page, off] = self.draft.context_rows(feats, pos).to(self.lat.dtype)
        return self._prefilled(req, len(chunk), logits[-1])

    def prefill_batch(self, chunks: list[tuple[Request, int]]) -> list[torch.Tensor | None]:
        """:meth:`prefill` of several requests' next chunks (``(request, tokens)``) as one eager
        forward: rows padded to the longest chunk, each row at its own position through its table.
        A padded row's K/V land past its prompt (hidden by the causal mask, overwritten later) or on
        the scratch page; only each row's last token goes through the LM head. A request that asks
        for prompt logprobs (every row through the LM head: ``[L, V]`` floats) goes alone. Why: one
        forward per request made admission, not decoding, the cost of a step at 8-64 running
        requests (docs/benchmarks.md, fourteenth session)."""
        alone = {i for i, (r, _) in enumerate(chunks) if r.sampling.prompt_logprobs is not None and not r.output_ids}
        if alone:
            return self._apart(chunks, alone, lambda part: [self.prefill(*c) for c in part])
        # a later chunk (the rest of a prompt cut by the chunked-prefill budget) reads the K/V before it,
        # which the packed graphs do not: it goes apart, so that the first chunks beside it still pack
        later = {i for i, (r, _) in enumerate(chunks) if r.prefill_pos}
        if self.prefill_graphs and 0 < len(later) < len(chunks):
            return self._apart(chunks, later, self.prefill_batch)
        cap = self.static.max_pages * self.page
        width = max(n for _, n in chunks)
        batchable = self.paged and len(chunks) > 1
        if not batchable or any(r.prefill_pos + width > cap for r, _ in chunks):
            return [self.prefill(r, n) for r, n in chunks]  # a row near the end of its table goes alone
        if (packed := self._prefill_packed(chunks)) is not None:  # first chunks: a graph's replay
            return packed
        dev = self.target.device
        rows, starts, lens = [], [], []
        for req, n in chunks:
            self._seat(req)
            p = req.prefill_pos
            rows.append(prefill_ids(req)[p : p + n] + [0] * (width - n))
            starts.append(p)
            lens.append(n)
        ids = steps.h2d(rows, torch.long, dev)
        tables = self.tables[steps.h2d([r.slot for r, _ in chunks], torch.long, dev)]
        start = steps.h2d(starts, torch.long, dev)
        n_real = steps.h2d(lens, torch.long, dev)
        logits, feats = self.static.forward(
            ids,
            start,
            kv_len=max(p + n for p, n in zip(starts, lens)),
            tables=tables,
            last=n_real - 1,
        )
        if self.draft is not None and any(r.speculate for r, _ in chunks):
            # the draft's latents of the real rows of requests that draft; the other rows (padding, requests
            # that do not draft) write the scratch page. Why not a boolean index: it reads the mask on the
            # host, which waits for the decode step that this prefill runs beside
            offs = torch.arange(width, device=dev)[None]
            drafts = steps.h2d([r.speculate for r, _ in chunks], torch.bool, dev)[:, None]
            pos, real = start[:, None] + offs, (offs < n_real[:, None]) & drafts
            page, off = page_of(tables, pos, self.page)
            page = torch.where(real, page, self.static.scratch)
            self.lat[:, page, off] = self.draft.context_rows(feats, pos).to(self.lat.dtype)
        return [self._prefilled(req, n, logits[b, 0]) for b, (req, n) in enumerate(chunks)]

    def _apart(self, chunks: list[tuple[Request, int]], apart: set[int], run) -> list[torch.Tensor | None]:
        """``run`` over the chunks at ``apart``, :meth:`prefill_batch` over the others; results in order."""
        rest = [c for i, c in enumerate(chunks) if i not in apart]
        mine = iter(run([c for i, c in enumerate(chunks) if i in apart]))
        others = iter(self.prefill_batch(rest) if rest else [])
        return [next(mine) if i in apart else next(others) for i in range(len(chunks))]

    def _load(self, reqs: list[Request], sampling: BatchSampling | None, slack: int = 0):
        """The anchor and position of each stale slot (a new request, or one moved), and every
        request's sampling rows, into the slot buffers (``slack``: :meth:`_index`'s)."""
        idx, B, kv_len = self._index(reqs, slack)
        synced, owed, fresh, moved = self.synced, self.owed_host, self.stale, self.moved
        for r in reqs:  # (the calls only where there is something to write: this loop is per request, per step)
            s = r.slot
            assert s is not None
            if self.paged and len(r.block_table) != synced[s]:
                self._sync_table(r)
            if r.sampling.min_tokens or owed[s] or s in fresh or s in moved:
                self._sync_owed(r, s in fresh or s in moved)
        stale = [r for r in reqs if r.slot in self.stale]
        if stale:
            dev = self.ids.device
            at = steps.h2d([r.slot for r in stale], torch.long, dev)
            self.ids[at, 0] = steps.h2d([r.last_id for r in stale], torch.long, dev)
            self.start[at] = steps.h2d([r.num_committed for r in stale], torch.long, dev)
            self.stale.difference_update(r.slot for r in stale)
        if self.moved:
            self.moved.difference_update(r.slot for r in reqs)
        if sampling is not None:
            self._load_sampling(idx, sampling)
        return idx, B, kv_len

    def _load_sampling(self, idx: torch.Tensor | slice, sampling: BatchSampling) -> None:
        """A sampled batch's block (:meth:`BatchSampling.from_rows`' layout) into its slots' rows: one
        copy where it is laid out at the full width (the engine's, whatever the step's width), else its
        draws where the graphs read them."""
        src, g, G = sampling.rows, sampling.propose_u.shape[1], self.w - 1
        if src is None:
            raise ValueError("the graph runner loads a sampled batch from BatchSampling.of's block")
        S = (src.shape[1] - 5) // 2  # the block's draws of each kind (the engine's: the full width's)
        if S == G:
            self.sampling[idx] = src
            return
        self.sampling[idx, : 4 + g] = src[:, : 4 + g]
        if g:
            self.sampling[idx, 4 + G : 4 + G + g] = src[:, 4 + S : 4 + S + g]
        self.sampling[idx, 4 + 2 * G] = src[:, 4 + 2 * S]

    @property
    def widths(self) -> tuple[int, ...]:
        """The verify widths a step can run: those with captured graphs."""
        return self.verify_widths

    def mixes(self, B: int, width: int) -> bool:
        """Whether a step of ``B`` rows (a bucket) at ``width`` takes a new prompt
        (:data:`MIXED_MAX_STEP_TOKENS`)."""
        return bool(self.mixed_lengths) and B * width <= MIXED_MAX_STEP_TOKENS

    def mixable(self, req: Request, n: int) -> bool:
        """Whether ``n`` prompt tokens of ``req`` can run inside a step's forward: its whole prompt,
        first chunk, no prompt logprobs (those need every row's logits), a mixed length that holds it."""
        return (
            req.prefill_pos == 0
            and n == len(prefill_ids(req))
            and req.sampling.prompt_logprobs is None
            and any(n <= L for L in self.mixed_lengths)
        )

    @torch.no_grad()
    def step(
        self,
        reqs: list[Request],
        sampling: BatchSampling | None,
        width: int | None = None,
        overlap=None,
        prefill: tuple[Request, int] | None = None,
        trim=None,
    ) -> StepOutput:
        """Two replays: the draft block + selector walk writes the drafts beside the anchors in the
        slots' id buffer (and q_draft into its slot buffer); the verify graph runs the target over
        them, writes K/V and draft latents in place, runs the verifier and moves each slot's anchor
        and position on. One read-back; a commit only counts. ``width`` 1: the target alone this
        step (the verify graph over the anchors only, no draft replay). ``prefill``: a new request's
        whole prompt (:meth:`mixable`), run in the verify forward where it can be; ``prefilled`` then
        holds its last logits row. ``trim``: where :attr:`trim_widths` allow, the draft's confidence
        per slot -> the width to verify (a full-width step without a prompt in it). ``overlap``: host
        work run while the device computes the step (before its read-back)."""
        launched = self.launch(reqs, sampling, width, prefill, trim)
        self.clock.run(overlap)  # host work while the GPU runs (replays are asynchronous on CUDA)
        return self.collect(launched, self.clock)

    @torch.no_grad()
    def launch(
        self,
        reqs: list[Request],
        sampling: BatchSampling | None,
        width: int | None = None,
        prefill: tuple[Request, int] | None = None,
        trim=None,
        ahead: bool = False,
    ) -> Launched:
        """:meth:`step`'s replays, queued; :meth:`collect` reads them back. ``ahead``: a step launched
        while the last one is not read back yet (async scheduling): its rows are copied to host memory
        behind it (the next step's replays overwrite the graphs' outputs), its graphs timed on the device,
        and its attention prefix holds one more block (the requests' host lengths lag the last step)."""
        t0 = time.perf_counter()
        w = width or self.w
        # no request of the batch drafts: the target alone (the occupied slots outside the batch are
        # prefilling, and their own prefill writes their latents)
        kind = "plain" if w == 1 and self.plain_graphs and not any(r.speculate for r in reqs) else "verify"
        # a prompt joins where its latents come out as it needs them (a plain step writes none), keyed
        # on the bucket with its slot taken: seating it may move the step to the next bucket
        mix = 0
        if (
            prefill is not None
            and not (kind == "plain" and prefill[0].speculate)
            and self.mixes(self.bucket(len(reqs), seating=prefill[0].slot is None), w)
            and self.mixable(*prefill)
        ):
            mix = next(L for L in self.mixed_lengths if prefill[1] <= L)
            self._load_prefill([prefill], mix)  # (seated first: the step's bucket covers its slot)
        idx, B, kv_len = self._load(reqs, sampling, self.w if ahead else 0)
        greedy = sampling is None
        conf = None
        k = self._parity  # (ahead: this launch's timer and host rows, the last launch's the other pair)
        self._parity ^= ahead
        timer = self._timers[k] if ahead else self.timer
        if timer is not None:
            timer.start()
        if w > 1:
            self._graph("draft", B, greedy, kv_len)[0]()
            if trim is not None and self.conf is not None and w == self.w and not mix:
                conf = self.conf[idx].cpu().numpy()
                w = trim(conf)
        t1 = time.perf_counter()
        replay, out = self._graph(kind, B, greedy, self._verify_kv(kv_len), w, mix)
        replay()
        if timer is not None:
            timer.stop()
        first = None
        if mix and prefill:
            first = self._prefilled(prefill[0], prefill[1], out["pf_logits"][0, 0])
            self._count_prefill(f"mix{mix}", [prefill])
        rows, done = out["rows"][idx], None
        if ahead and rows.is_cuda:  # (a copy behind the step, before the next step's replays)
            host = self._host_rows[k][: rows.numel()].view(rows.shape)
            host.copy_(rows, non_blocking=True)
            rows, done = host, torch.cuda.Event()
            done.record()
        elif ahead:
            rows = rows.clone()
        logits = out["logits"][idx] if steps.wants_logprobs(reqs) else None
        return Launched(reqs, rows, done, t0, t1, timer, first, w if conf is not None else None, conf, logits)

    def collect(self, launched: Launched, clock: steps.OverlapClock | None = None) -> StepOutput:
        """A launched step read back (waiting for it), its requests' committed lengths moved on; ``clock``:
        the host work run meanwhile, its part of the wall taken out."""
        h, t = launched, time.perf_counter()
        if h.done is not None:
            h.done.synchronize()
        waited = time.perf_counter() - t
        res = steps.finish_step(h.rows, h.t0, h.t1, clock)
        res.wait_s += waited
        res.prefilled = h.first
        if h.timer is not None:
            res.device_s = h.timer.seconds()
        if h.confidence is not None:
            res.width, res.confidence = h.width, h.confidence
        res.logits = h.logits
        for r, tokens in zip(h.reqs, res.tokens):
            r.num_committed += len(tokens)
        return res
