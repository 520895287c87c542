"""In-process side-by-side speed: the target alone and speculative decoding on the same
prompts, hardware and run (batch 1). Reports tokens/s, acceptance length and speedup."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from ..engine.engine import EngineConfig, LLMEngine
from ..training.data import gsm8k_prompts, render
from ..verification import SamplingParams


@dataclass
class SpeedRow:
    name: str
    width: int
    verify: str
    temperature: float
    prompts: int
    completion_tokens: int
    verify_steps: int
    seconds: float
    tokens_per_s: float
    accept_length: float
    speedup: float = 1.0
    accept_hist: list | None = None


def gsm8k_test_prompts(path: str | Path, n: int) -> list[str]:
    return gsm8k_prompts(path, n)


class _Tally:
    """Tokens, verify steps, seconds and the accept histogram of one config, summed over prompts."""

    def __init__(self, name, width, verify, temperature):
        self.name, self.width, self.verify, self.temperature = name, width, verify, temperature
        self.C = self.V = self.prompts = 0
        self.secs = 0.0
        self.hist = [0] * max(width, 1)

    def add(self, r) -> None:
        self.C += r.completion_tokens
        self.V += r.verify_steps
        self.secs += r.total_s
        self.prompts += 1
        for k, c in enumerate(r.accept_hist):
            self.hist[k] += c

    def row(self) -> SpeedRow:
        return SpeedRow(
            self.name,
            self.width,
            self.verify,
            self.temperature,
            self.prompts,
            self.C,
            self.V,
            self.secs,
            self.C / self.secs,
            self.C / max(self.V, 1),
            accept_hist=self.hist,
        )


def side_by_side(
    target,
    draft,
    prompts: list[str],
    widths=(5, 8),
    temperatures=(0.0, 1.0),
    max_new_tokens: int = 256,
    verifies=("token",),
    engine_kw: dict | None = None,
) -> list[SpeedRow]:
    """The target alone and every (width, verifier), batch 1: each through an engine with one slot
    (static buffers, CUDA graphs on CUDA, the target alone included, so both sides get the same
    treatment). Paired: each prompt runs every config back to back, in an order rotated per prompt,
    so a drift of the machine's speed (seen at 10-20% on the CPU VM) hits all configs alike instead
    of whichever ran in that stretch. Speedup is tokens/s over the target's, same prompts and seeds.
    ``engine_kw``: further :class:`EngineConfig` fields for every engine (``disable_cuda_graph``,
    ``attention_backend``, ``synthetic_acceptance``)."""
    prompt_ids = [render(target.tokenizer, p) for p in prompts]
    longest = max(len(x) for x in prompt_ids) + max_new_tokens
    rows: list[SpeedRow] = []
    engines: dict = {}
    for temp in temperatures:
        kw = {"temperature": temp} | ({"top_p": 0.95} if temp > 0 else {})
        configs = [(f"target T={temp}", None, 1, "greedy" if temp == 0 else "token")]
        for w in widths:
            for v in verifies:
                vm = "greedy" if temp == 0 and v == "token" else v
                sfx = " synthetic" if (engine_kw or {}).get("synthetic_acceptance") else ""
                configs.append((f"dflash2 w={w} {vm} T={temp}{sfx}", draft, w, vm))
        tally = {name: _Tally(name, w if d is not None else 1, vm, temp) for name, d, w, vm in configs}

        def generate(d, w, vm, ids, sp):
            key = (w if d is not None else 1, vm == "block")
            if key not in engines:
                engines[key] = LLMEngine(
                    target,
                    d,
                    EngineConfig.for_models(
                        target,
                        d,
                        w,
                        context_length=longest + 1,
                        max_running_requests=1,
                        block_verification=vm == "block",
                        speculative_planner="off",  # each row is its width
                        chunked_prefill_size=-1,
                        **(engine_kw or {}),
                    ),
                )
            return engines[key].generate([ids], sp)[0]

        for name, d, w, vm in configs:  # untimed: lazy init and first-shape costs stay out of every row
            generate(d, w, vm, prompt_ids[0][:32], SamplingParams(max_new_tokens=8, **kw))
        for i, ids in enumerate(tqdm(prompt_ids, desc=f"T={temp}", leave=False)):
            k = i % len(configs)
            for name, d, w, vm in configs[k:] + configs[:k]:
                tally[name].add(generate(d, w, vm, ids, SamplingParams(max_new_tokens=max_new_tokens, seed=i, **kw)))
        level = [tally[name].row() for name, *_ in configs]
        for r in level[1:]:
            r.speedup = r.tokens_per_s / level[0].tokens_per_s
        rows += level
    return rows


def format_table(rows: list[SpeedRow]) -> str:
    lines = [f"{'config':<30}{'tok/s':>9}{'AL':>7}{'speedup':>9}{'C':>7}{'V':>6}"]
    for r in rows:
        lines.append(
            f"{r.name:<30}{r.tokens_per_s:>9.1f}{r.accept_length:>7.2f}{r.speedup:>8.2f}x{r.completion_tokens:>7}{r.verify_steps:>6}"
        )
    return "\n".join(lines)


def save_rows(rows: list[SpeedRow], path: str | Path) -> None:
    Path(path).write_text(json.dumps([asdict(r) for r in rows], indent=2))
