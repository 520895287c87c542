"""In-process side-by-side speed: the target alone and speculative decoding on the same
prompts, hardware and run (batch 1). Reports tokens/s, acceptance length and speedup."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from ..engine import DFlashProposer, speculative_generate
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


def run_config(target, draft, prompt_ids, name, width, verify, sampling_kw, max_new_tokens, seed=0) -> SpeedRow:
    C = V = 0
    secs = 0.0
    hist = [0] * max(width, 1)
    for i, ids in enumerate(tqdm(prompt_ids, desc=name, leave=False)):
        sp = SamplingParams(max_new_tokens=max_new_tokens, seed=seed + i, **sampling_kw)
        proposer = DFlashProposer(draft, target.embed, target.lm_head_weight) if draft is not None else None
        r = speculative_generate(target, proposer, ids, sp, width=width if draft is not None else 1,
                                 verify_method=verify)
        C += r.completion_tokens; V += r.verify_steps; secs += r.total_s
        for k, c in enumerate(r.accept_hist):
            hist[k] += c
    return SpeedRow(name, width if draft is not None else 1, verify, sampling_kw.get("temperature", 0.0),
                    len(prompt_ids), C, V, secs, C / secs, C / max(V, 1), accept_hist=hist)


def side_by_side(target, draft, prompts: list[str], widths=(5, 8), temperatures=(0.0, 1.0),
                 max_new_tokens: int = 256, verifies=("token",)) -> list[SpeedRow]:
    """Baseline first for each temperature, then every (width, verifier); speedup vs that baseline."""
    if draft is not None:
        target.set_layer_ids(draft.config.target_layer_ids)
    prompt_ids = [render(target.tokenizer, p) for p in prompts]
    rows: list[SpeedRow] = []
    for temp in temperatures:
        kw = {"temperature": temp} | ({"top_p": 0.95} if temp > 0 else {})
        base_verify = "greedy" if temp == 0 else "token"
        base = run_config(target, None, prompt_ids, f"target T={temp}", 1, base_verify, kw, max_new_tokens)
        rows.append(base)
        for w in widths:
            for v in verifies:
                vm = "greedy" if temp == 0 and v == "token" else v
                r = run_config(target, draft, prompt_ids, f"dflash2 w={w} {vm} T={temp}", w, vm, kw, max_new_tokens)
                r.speedup = r.tokens_per_s / base.tokens_per_s
                rows.append(r)
    return rows


def format_table(rows: list[SpeedRow]) -> str:
    lines = [f"{'config':<30}{'tok/s':>9}{'AL':>7}{'speedup':>9}{'C':>7}{'V':>6}"]
    for r in rows:
        lines.append(f"{r.name:<30}{r.tokens_per_s:>9.1f}{r.accept_length:>7.2f}{r.speedup:>8.2f}x{r.completion_tokens:>7}{r.verify_steps:>6}")
    return "\n".join(lines)


def save_rows(rows: list[SpeedRow], path: str | Path) -> None:
    Path(path).write_text(json.dumps([asdict(r) for r in rows], indent=2))
