"""The serving engine's config (one typed dataclass: every flag the engine reads, checked where it is
built) and the error for a request the engine cannot take."""

from __future__ import annotations

from dataclasses import dataclass

from ..sampling import SamplingParams
from .planner import PlannerConfig, parse_schedule, parse_widths

ATTENTION_BACKENDS = {"auto": None, "triton": "live", "torch_native": "sdpa"}  # flag -> StaticTarget's name


class RequestError(ValueError):
    """A request the engine cannot take (bad token ids, does not fit); ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


# EngineConfig.graph_sampling -> the static runner's batch kinds (greedy batch or not) made at start-up
GRAPH_SAMPLING = {"both": (True, False), "greedy": (True,), "sampled": (False,)}


@dataclass
class EngineConfig:
    max_running_requests: int = 16
    speculative: bool = True
    num_draft_tokens: int = 5  # verification width, counting the current token
    block_verification: bool = False
    context_length: int = 2048
    max_total_tokens: int = 65536  # KV pool size in tokens (CPU budget; on GPU set from mem fraction)
    page_size: int = 16
    runner: str = "auto"  # auto: static buffers + CUDA graphs where they apply, else paged
    disable_cuda_graph: bool = False  # SGLang's flag: the paged runner on CUDA too (static: eager)
    # the graph runner's draft layers and latents through torch.compile (CUDA only); this turns it off
    disable_torch_compile: bool = False
    chunked_prefill_size: int | None = None  # SGLang's flag: prompt tokens per step (-1: whole prompts;
    #                                      None: 256 on the CPU, 2048 on CUDA; docs/benchmarks.md, chunked prefill)
    stall_s: float = 120.0  # /health fails when the loop has work but has not come round for this long
    speculative_planner: str = "off"  # auto: each step's width by expected tokens/s (among the runner's widths); off
    speculative_width_schedule: str | None = None  # "BATCH:WIDTH,...": pinned widths by decode batch size
    # auto, eager runners: the verify width cut after the draft from its confidence (Planner.trim); off by
    # default: on the CPU it lost at one request, its gain at 16 (T=0) within the planner's run-to-run spread
    # (docs/benchmarks.md, thirty-eighth session)
    speculative_trim: bool = False
    # auto, CUDA graphs: verify widths between 1 and the full one that the runner captures too, for the
    # planner to pick among ("3" or "2,3"; eager runners run every width already). Off by default: each
    # costs a set of step graphs at start-up, and its gain is unmeasured
    speculative_planner_widths: str | None = None
    # SGLang's flag: the static runner's target attention. triton: the live-KV kernel (reads each row's
    # live keys only); torch_native: masked SDPA over a buffer prefix; auto: triton on CUDA
    attention_backend: str = "auto"
    # benchmarks only (bench speed), NOT lossless: accept draft position i with probability rates[i]
    # (one value: every position) whatever the target says, as vLLM's synthetic rejection method
    synthetic_acceptance: tuple[float, ...] | None = None
    # the static runner's sampled truncation (top-k / top-p / min-p) inside its graphs: sort (every row
    # of the vocabulary sorted), triton (kernels/truncate.py, sort-free: 0.21 vs 0.51 ms for 64 rows on
    # the H200) or auto: triton on CUDA in the static runner, sort elsewhere
    sampler_backend: str = "auto"
    # SGLang's flag: a new request's whole prompt runs inside a small decode step's forward, sharing its
    # read of the weights (the static runner's paged pool: graph_runner.MIXED_PREFILL_LENGTHS). None:
    # mixed_chunk_default (off since the packed prefill); True: required (an error where it cannot apply)
    enable_mixed_chunk: bool | None = None
    # the static runner's step graphs made at start-up: "both" (serving), or "greedy" / "sampled" alone for
    # a run whose requests are all one kind (bench acceptance: half the captures); a request of the other
    # kind is refused (the planner's start-up profile then times that kind's steps)
    graph_sampling: str = "both"
    # SGLang's flag: commit each step (its tokens into the requests: stop rules, streaming, counts) before the
    # next is launched. By default the static runner commits a step while the device runs the next (the
    # requests whose tokens may end them first, so the next batch leaves them out). Why: at 128 requests on
    # the H100 a step's wall was 1.5x its graphs' device time, the commit ~0.3 ms of the gap (fifty-first
    # session)
    disable_overlap_schedule: bool = False
    # vLLM's --async-scheduling: the overlap schedule one step deeper, where it applies: step N + 1 is launched
    # before step N is read back (its batch the running requests as the host knows them, so a request that N
    # ends runs one wasted row; KV held a block further ahead), and N is read back and committed while N + 1
    # runs: the device need not wait for the host between steps. Off by default until measured on a GPU
    async_scheduling: bool = False
    # SGLang's flag: while requests decode, new ones are admitted (and prefilled) once every this many decode
    # steps, so requests that finish a few steps apart share one prefill; 1: at every step. None (auto): where
    # the runner prices a prefill replay (CUDA graphs: timed at start-up), the interval of least expected cost
    # (admission_interval), else every step. Why: speculative requests finish apart, and at the 8B shape each
    # trickled admission is a prefill replay of its own (141 replays against the target alone's 32 at 32
    # requests on the H100, 4.0 s of prefill against 1.2 s: docs/benchmarks.md, fifty-fourth session)
    num_continuous_decode_steps: int | None = None

    def admits(self, sampling: SamplingParams) -> bool:
        """Whether a request of this kind (greedy or sampled) has step graphs here (``graph_sampling``)."""
        return self.graph_sampling == "both" or sampling.greedy == (self.graph_sampling == "greedy")

    @classmethod
    def for_models(cls, target, draft, width: int, context_length: int | None = None, **fields) -> "EngineConfig":
        """The one place an engine's config is derived from loaded models: speculative when there is a
        drafter, at its width; the context defaults to the target's ``max_position_embeddings``."""
        ctx = context_length or int(getattr(target.config, "max_position_embeddings", 2048))
        return cls(
            speculative=draft is not None,
            num_draft_tokens=width if draft is not None else 2,
            context_length=ctx,
            **fields,
        )

    def __post_init__(self):
        if self.max_running_requests < 1:
            raise ValueError(f"--max-running-requests must be >= 1, got {self.max_running_requests}")
        if self.speculative and self.num_draft_tokens < 2:
            raise ValueError(f"--speculative-num-draft-tokens must be >= 2, got {self.num_draft_tokens}")
        if self.context_length < 2:
            raise ValueError(f"--context-length must be >= 2, got {self.context_length}")
        if self.runner not in ("auto", "paged", "static"):
            raise ValueError(f"runner must be auto, paged or static, got {self.runner!r}")
        if self.max_total_tokens < self.page_size:
            raise ValueError(f"KV budget {self.max_total_tokens} tokens is smaller than one page")
        if self.num_continuous_decode_steps is not None and self.num_continuous_decode_steps < 1:
            raise ValueError(f"--num-continuous-decode-steps must be >= 1, got {self.num_continuous_decode_steps}")
        if self.chunked_prefill_size is not None and (self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1):
            raise ValueError(f"--chunked-prefill-size must be -1 (off) or >= 1, got {self.chunked_prefill_size}")
        if self.sampler_backend not in ("auto", "sort", "triton", "triton-fused"):
            raise ValueError(
                f"--sampler-backend must be auto, sort, triton or triton-fused, got {self.sampler_backend!r}"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}"
            )
        rates = self.synthetic_acceptance
        if rates is not None and (
            not rates or any(not 0 <= r <= 1 for r in rates) or len(rates) not in (1, self.num_draft_tokens - 1)
        ):
            raise ValueError(
                f"--synthetic-acceptance: one rate in [0, 1], or one per draft position "
                f"({self.num_draft_tokens - 1}), got {rates}"
            )
        if self.graph_sampling not in GRAPH_SAMPLING:
            raise ValueError(f"graph_sampling must be one of {', '.join(GRAPH_SAMPLING)}, got {self.graph_sampling!r}")
        PlannerConfig(mode=self.speculative_planner)  # checks the name
        between = parse_widths(self.speculative_planner_widths, self.num_draft_tokens)
        if between and (self.speculative_planner != "auto" or self.speculative_width_schedule):
            raise ValueError(
                "--speculative-planner-widths needs --speculative-planner auto and no --speculative-width-schedule "
                "(the planner picks among them; a schedule pins 1 or the full width)"
            )
        parse_schedule(self.speculative_width_schedule, self.num_draft_tokens)
