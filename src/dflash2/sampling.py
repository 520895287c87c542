"""Sampling values and the logits processing shared by target and draft rows (SGLang/vLLM semantics);
its own module, so the draft model needs nothing of ``verification/``.

``probs = softmax(logits / T)``; then top-k, top-p and min-p masks are all computed on those
same probabilities (so top-k and top-p commute, as in SGLang), and the survivors renormalised.
Temperature 0 (or anything below ``GREEDY_BELOW``) means greedy: a one-hot row at the argmax
(first index on ties).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

GREEDY_BELOW = 1e-5  # as vLLM: smaller temperatures are greedy (1/T would overflow the logits)
MAX_TEMPERATURE = 100.0  # T=100 is already uniform to float32 precision; larger values overflow
MAX_TOP_K = 2**31 - 1  # beyond int32 nothing changes (no vocabulary is that large)
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


MAX_LOGPROBS = 20  # top log-probabilities per token (OpenAI's top_logprobs bound)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    max_new_tokens: int = 128
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k: each output token's log-probability and the top k (<= 20)
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (vLLM's name; the first has none)
    min_tokens: int = 0  # EOS, stop ids and stop strings cannot end the output before this many tokens

    def __post_init__(self):
        def num(x) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        def whole(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        checks = (
            (
                "temperature",
                num(self.temperature) and 0 <= self.temperature <= MAX_TEMPERATURE,
                f"a finite number in [0, {MAX_TEMPERATURE:g}]",
            ),
            ("top_p", num(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("min_p", num(self.min_p) and 0 <= self.min_p <= 1, "a number in [0, 1]"),
            ("top_k", whole(self.top_k) and -1 <= self.top_k <= MAX_TOP_K, f"-1 or 0 (off), or in [1, {MAX_TOP_K}]"),
            ("max_new_tokens", whole(self.max_new_tokens) and self.max_new_tokens >= 1, "an integer >= 1"),
            (
                "seed",
                self.seed is None or (whole(self.seed) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]),
                f"null or an integer in [{SEED_RANGE[0]}, {SEED_RANGE[1]}]",
            ),
            ("stop_token_ids", all(whole(t) and t >= 0 for t in self.stop_token_ids), "non-negative token ids"),
            (
                "logprobs",
                self.logprobs is None or (whole(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
                f"null or an integer in [0, {MAX_LOGPROBS}]",
            ),
            (
                "min_tokens",
                whole(self.min_tokens) and 0 <= self.min_tokens <= self.max_new_tokens,
                "an integer in [0, max_new_tokens]",
            ),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None
                or (whole(self.prompt_logprobs) and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
                f"null or an integer in [0, {MAX_LOGPROBS}]",
            ),
        )
        for name, ok, want in checks:
            if not ok:
                raise ValueError(f"invalid sampling parameter {name}={getattr(self, name)!r}: must be {want}")
        if self.temperature < GREEDY_BELOW:
            object.__setattr__(self, "temperature", 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass(frozen=True)
class CandidateQ:
    """A ``q_draft`` that is zero outside a few tokens: ``probs [B, g, k]`` at the token ids ``ids
    [B, g, k]`` (distinct within a row). What the DFlash2 selector draws from (its k candidates a slot);
    the verifiers read it as they read a dense ``q_draft [B, g, V]``, which would be mostly zeros and
    cost more in its fills and passes than the verifier's own work (the CPU's sampled accept at 16
    rows x 7 drafts, T=1: 94.7 ms dense, 49.3 ms so; docs/benchmarks.md, forty-first session)."""

    ids: torch.Tensor
    probs: torch.Tensor

    def head(self, g: int) -> "CandidateQ":
        """The first ``g`` slots (drafts cut after the walk)."""
        return CandidateQ(self.ids[:, :g], self.probs[:, :g])

    def to(self, device) -> "CandidateQ":
        return CandidateQ(self.ids.to(device), self.probs.to(device))

    def dense(self, vocab_size: int) -> torch.Tensor:
        """``[..., V]``, zero outside the candidates (the reference form)."""
        out = torch.zeros(*self.probs.shape[:-1], vocab_size, dtype=torch.float32, device=self.probs.device)
        return out.scatter_(-1, self.ids, self.probs.float())


def _col(x, like: torch.Tensor, dtype) -> torch.Tensor:
    """A per-row parameter as a tensor that broadcasts over every trailing dim of ``like``."""
    if isinstance(x, (int, float)):  # a fill on the device, not a host copy (allowed in a CUDA graph)
        return torch.full((1,) * like.dim(), x, dtype=dtype, device=like.device)
    t = torch.as_tensor(x, dtype=dtype, device=like.device)
    return t.reshape(tuple(t.shape) + (1,) * (like.dim() - t.dim()))


# truncation first tries the top 64 entries of each row, then 16x and 128x that, before sorting all V. Why:
# a CPU topk costs by its k (128 rows of 49,152: 5.7 ms for 64, 25 ms for 1,024), and SmolLM2's T=1,
# top-p 0.95 nucleus on held-out chat is under 64 tokens in 50% of steps, under 1,024 in 90%, under
# 8,192 in all (docs/benchmarks.md, forty-first session)
FAST_TOP = 64


def _drop(sorted_p, k, tp, mp) -> torch.Tensor:
    """What top-k / top-p / min-p drop from rows sorted descending (ties by id): a suffix of each row."""
    rank = torch.arange(sorted_p.shape[-1], device=sorted_p.device)
    # top_p 1 drops nothing (the cumulative sum may round past 1 in the tail)
    return (
        ((k > 0) & (rank >= k))
        | (((sorted_p.cumsum(-1) - sorted_p) > tp) & (tp < 1))
        | (sorted_p < sorted_p[..., :1] * mp)
    )  # top-k | smallest prefix reaching top_p | min-p


def _truncate(probs, sorted_p, idx, k, tp, mp) -> torch.Tensor:
    """Zero what :func:`_drop` drops, given each row sorted."""
    return torch.zeros_like(probs).scatter_(-1, idx, sorted_p.masked_fill(_drop(sorted_p, k, tp, mp), 0.0))


def truncate_sorted(probs, k, tp, mp) -> torch.Tensor:
    """The reference truncation: every row sorted (descending, ties by id), :func:`_drop` applied."""
    vals, idx = probs.sort(dim=-1, descending=True, stable=True)
    return _truncate(probs, vals, idx, k, tp, mp)


def _top_kept(probs, k, tp, mp, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`_drop` applied to each row's top ``n`` only (a full sort of a 49k row costs tens of ms on
    a CPU): ``(kept, ids, ok)``, the kept values renormalised there (``[R, n]``, sorted as the full
    sort sorts, zero where dropped) at their token ids. A row is exact (``ok``) when its last kept value
    is above its n-th value: then every token at least as likely as a kept one is among the n."""
    vals, idx = probs.topk(n, dim=-1)
    idx, order = idx.sort(dim=-1)  # ties by id, as the stable full sort
    vals, order = vals.gather(-1, order).sort(dim=-1, descending=True, stable=True)
    idx = idx.gather(-1, order)
    keep = ~_drop(vals, k, tp, mp)
    kept = vals.masked_fill(~keep, 0.0)
    last = vals.gather(-1, keep.sum(-1, keepdim=True) - 1)
    return kept / kept.sum(-1, keepdim=True), idx, (last > vals[..., -1:]).squeeze(-1)


def _truncate_staged(P, K, TP, MP) -> torch.Tensor:
    """Truncation of rows ``P [R, V]`` from their top FAST_TOP entries, then 16x and 128x that for the
    rows whose kept set reaches further, then a full sort for the rest; renormalised. Each row's kept
    values are written once into the output (no dense row a stage)."""
    R, V = P.shape
    out = torch.zeros_like(P)
    todo = torch.arange(R, device=P.device)
    n = max(FAST_TOP, int(K.max()))
    for stage in (n, 16 * n, 128 * n):
        if stage >= V or not len(todo):
            break
        sub = (P, K, TP, MP) if len(todo) == R else (P[todo], K[todo], TP[todo], MP[todo])
        kept, ids, ok = _top_kept(*sub, stage)
        rows = todo[ok]
        out.view(-1).scatter_(0, (rows[:, None] * V + ids[ok]).flatten(), kept[ok].flatten())
        todo = todo[~ok]
    if len(todo):
        rest = truncate_sorted(P[todo], K[todo], TP[todo], MP[todo])
        out[todo] = rest / rest.sum(-1, keepdim=True)
    return out


# the fused kernel's threshold search over the entries still in its bracket (False: over the whole row,
# as before the forty-sixth session; kernels/truncate.fused_probs), for an A/B
FUSED_SHRINK = True


def probs_from_logits(
    logits: torch.Tensor,
    temperature=0.0,
    top_k=-1,
    top_p=1.0,
    min_p=0.0,
    capturable: bool = False,
    kernel: str | None = None,
) -> torch.Tensor:
    """Rows of ``logits [..., V]`` -> processed probabilities (float32). Parameters are scalars
    or tensors over the leading dims (e.g. one value per request). ``capturable``: no read of a
    device value on the host, so a CUDA graph can hold it: truncation sorts whole rows (the exact
    reference the top-``FAST_TOP`` shortcut falls back to), and runs whenever a Python scalar asks for
    it or any of ``top_k`` / ``top_p`` / ``min_p`` is a tensor (per-row values, read on the device);
    the greedy blend always runs. ``kernel`` (with ``capturable``): "truncate", the sort-free Triton
    truncation (:mod:`dflash2.kernels.truncate`) instead of the full sort; "fused", the whole of this
    function in one Triton kernel (:func:`~dflash2.kernels.truncate.fused_probs`)."""
    V = logits.shape[-1]
    temp, k, tp, mp = (
        _col(x, logits[..., 0], dtype).unsqueeze(-1)
        for x, dtype in zip(
            (temperature, top_k, top_p, min_p), (torch.float32, torch.long, torch.float32, torch.float32)
        )
    )

    def per_row(x: torch.Tensor) -> torch.Tensor:  # a parameter column as one value a row, [R, 1]
        return x.expand(logits.shape[:-1] + (1,)).reshape(-1, 1)

    if capturable and kernel == "fused":
        from .kernels.truncate import fused_probs

        rows = logits.reshape(-1, V)
        kept = fused_probs(rows, per_row(temp), per_row(k), per_row(tp), per_row(mp), GREEDY_BELOW, shrink=FUSED_SHRINK)
        return kept.reshape(logits.shape)
    logits = logits.float()
    greedy = temp < GREEDY_BELOW
    if capturable or not bool(((temp == 1) | greedy).all()):  # (a pass over every row: 6 ms at 128 CPU rows)
        logits = logits / torch.where(greedy, torch.ones_like(temp), temp)
    probs = torch.softmax(logits, dim=-1)
    if capturable:
        truncate = (
            any(isinstance(x, torch.Tensor) for x in (top_k, top_p, min_p)) or 0 < top_k < V or top_p < 1 or min_p > 0
        )
    else:
        truncate = bool(((k > 0) & (k < V)).any() | (tp < 1).any() | (mp > 0).any())
    if truncate and probs.numel():  # (no rows: a one-draft selector walk has no slot after the first)
        P = probs.reshape(-1, V)
        K, TP, MP = map(per_row, (k, tp, mp))
        if capturable:
            from .kernels.truncate import truncate as truncate_rows

            out = (truncate_rows if kernel == "truncate" else truncate_sorted)(P, K, TP, MP)
            out = out / out.sum(-1, keepdim=True)
        else:
            out = _truncate_staged(P, K, TP, MP)
        probs = out.reshape(probs.shape)
    if capturable or bool(greedy.any()):  # greedy rows one-hot at the argmax (one pass, not a blend)
        top = logits.argmax(-1, keepdim=True)
        at_top = torch.where(greedy, torch.ones_like(temp), probs.gather(-1, top))
        probs = probs.masked_fill(greedy, 0.0).scatter_(-1, top, at_top)
    return probs


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: one token per row of ``probs [..., V]`` from ``uniforms [...]`` in [0, 1).
    Rows need not be normalised. Zero-probability tokens are never returned."""
    cdf = probs.float().cumsum(-1)
    total = cdf[..., -1:].contiguous()
    idx = torch.searchsorted(cdf, uniforms.float().unsqueeze(-1) * total, right=True).clamp_(max=cdf.shape[-1] - 1)
    # float rounding can put the draw at or past the total, beyond the last token with mass: take the
    # first token where the cdf reaches the total instead (its cdf rose there, so it has mass; a search,
    # not another pass over the row)
    top = torch.searchsorted(cdf, total)
    return torch.minimum(idx, top).squeeze(-1)
