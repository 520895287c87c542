"""Side-by-side speed through the serving engine at several concurrencies (continuous batching):
the target alone and DFlash2 at each width and verifier, on the same prompts and hardware."""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..engine.engine import EngineConfig, LLMEngine
from ..engine.request import Request
from ..training.data import render
from ..verification import SamplingParams


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


def measure(target, draft, prompt_ids, width: int, block: bool, concurrency: int, max_new_tokens: int,
            temperature: float, name: str, requests_per_slot: int | None = None) -> ConcurrencyRow:
    eng = LLMEngine(target, draft, EngineConfig(max_running_requests=concurrency, speculative=draft is not None,
                                                num_draft_tokens=width if draft is not None else 2,
                                                block_verification=block, context_length=4096,
                                                max_total_tokens=max(65536, concurrency * 2048)))
    n = len(prompt_ids) if requests_per_slot is None else min(len(prompt_ids), requests_per_slot * concurrency)
    n = max(concurrency, n)
    reqs = [Request(prompt_ids[i % len(prompt_ids)], SamplingParams(
        temperature=temperature, top_p=0.95 if temperature else 1.0, max_new_tokens=max_new_tokens, seed=i))
        for i in range(n)]
    t0 = time.perf_counter()
    for r in reqs:
        eng.add_request(r)
    eng.run_until_done()
    secs = time.perf_counter() - t0
    s = eng.stats
    C = sum(len(r.output_ids) for r in reqs)
    V = sum(r.verify_steps for r in reqs)
    steps = max(s.steps, 1)
    return ConcurrencyRow(name, concurrency, n, C, secs, C / secs, C / max(V, 1), 1e3 * s.draft_s / steps,
                          1e3 * s.verify_s / steps, 1e3 * (s.step_s - s.draft_s - s.verify_s) / steps)


def run(target, draft, prompts: list[str], widths, verifiers, concurrencies, max_new_tokens: int,
        temperature: float, requests_per_slot: int | None = None) -> list[ConcurrencyRow]:
    target.set_layer_ids(draft.config.target_layer_ids)
    ids = [render(target.tokenizer, p) for p in prompts]
    rows = []
    # warm-up (allocator, kernels, lazy init) outside every timed row
    measure(target, None, ids[:2], 1, False, 2, 8, temperature, "warm-up")
    measure(target, draft, ids[:2], max(widths), False, 2, 8, temperature, "warm-up")
    for c in concurrencies:
        base = measure(target, None, ids, 1, False, c, max_new_tokens, temperature, "target", requests_per_slot)
        rows.append(base)
        for w in widths:
            for v in verifiers:
                r = measure(target, draft, ids, w, v == "block", c, max_new_tokens, temperature, f"dflash2 w={w} {v}",
                            requests_per_slot)
                r.speedup = r.tokens_per_s / base.tokens_per_s
                rows.append(r)
    return rows


def table(rows: list[ConcurrencyRow]) -> str:
    out = [f"{'config':<22}{'conc':>5}{'tok/s':>9}{'AL':>6}{'speedup':>9}{'draft ms':>10}{'verify ms':>10}{'other ms':>9}"]
    for r in rows:
        out.append(f"{r.config:<22}{r.concurrency:>5}{r.tokens_per_s:>9.1f}{r.accept_length:>6.2f}{r.speedup:>8.2f}x"
                   f"{r.draft_ms_per_step:>10.1f}{r.verify_ms_per_step:>10.1f}{r.overhead_ms_per_step:>9.1f}")
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
        ax.set_xscale("log", base=2); ax.set_xlabel("concurrency"); ax.set_ylabel("speedup over the target alone")
        ax.legend(); fig.tight_layout(); fig.savefig(png_path, dpi=120); plt.close(fig)
