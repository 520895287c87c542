"""What the padded prefill graphs compute, counted on the CPU (no timing: the same plan the GPU runs).

The static runner (graphs off, the same functions eagerly) with a tiny random Llama target and drafter,
64 running requests, 512 requests of the GSM8K test prompts' token lengths (SmolLM2's chat template),
128 new tokens, synthetic acceptance 0.92: the target alone and the drafting engine, each with the
prefill plan priced by a cost model (``--costs``: 8b, an 8B-like target where a replay's fixed cost
is ~170 tokens' compute; small, a replay's fixed cost ~3,000 tokens'; none, the plan without costs,
as before the twenty-seventh session). Prints replays, real and padded tokens, and the model's seconds.

  .venv/bin/python scripts/cpu_prefill_padding.py --costs none,8b,small
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

COSTS = {  # seconds of an (R, L) replay: a fixed part plus R x L padded tokens' compute
    "8b": lambda R, L: 0.004 + R * L * 2.3e-5,  # 3.8 ms weight read; 16 GFLOP a token at ~700 TFLOPS
    "small": lambda R, L: 0.0006 + R * L * 2e-7,
    "none": None,
}


def run(target, draft, lengths, cost_name: str, running: int, requests: int, acceptance: float) -> dict:
    from dflash2.engine.engine import EngineConfig, LLMEngine
    from dflash2.engine.request import Request
    from dflash2.verification import SamplingParams

    cfg = EngineConfig(
        max_running_requests=running,
        speculative=draft is not None,
        num_draft_tokens=5 if draft is not None else 2,
        context_length=512,
        max_total_tokens=running * 512,
        runner="static",
        speculative_planner="off",
        synthetic_acceptance=(acceptance,) if draft is not None else None,
        chunked_prefill_size=2048,  # CUDA's default
    )
    eng = LLMEngine(target, draft, cfg)
    model = COSTS[cost_name]
    if model is not None:
        eng.runner.prefill_cost = {(R, L): model(R, L) for R, L, _ in eng.runner.prefill_graphs}
    replays: list[tuple[int, int, int, int]] = []  # rows, real tokens, R, L
    inner = eng.runner._replay_prefill
    eng.runner._replay_prefill = lambda chunks, R, L: (
        replays.append((len(chunks), sum(k for _, k in chunks), R, L)) or inner(chunks, R, L)
    )
    gen = torch.Generator().manual_seed(0)
    vocab = target.config.vocab_size
    for i in range(requests):
        ids = torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=gen).tolist()
        eng.add_request(Request(ids, SamplingParams(max_new_tokens=128, ignore_eos=True, seed=i)))
    eng.run_until_done()
    real, padded = sum(x[1] for x in replays), sum(x[2] * x[3] for x in replays)
    price = COSTS["8b"]
    return {
        "engine": "dflash2 w5" if draft is not None else "target",
        "costs": cost_name,
        "replays": len(replays),
        "real_tokens_graphed": real,
        "padded_tokens": padded,
        "padded_over_real": round(padded / max(real, 1), 2),
        "8b_model_seconds": round(sum(price(R, L) for _, _, R, L in replays), 2),
        "replays_by_rows_bucket": dict(sorted(collections.Counter(f"{n}->{R}" for n, _, R, _ in replays).items())),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--costs", default="none,8b,small")
    ap.add_argument("--running", type=int, default=64)
    ap.add_argument("--requests", type=int, default=512)
    ap.add_argument("--acceptance", type=float, default=0.92)
    ap.add_argument("--output", default=None)
    args = ap.parse_args()
    from targets import build
    from test_speculative import random_draft
    from transformers import AutoTokenizer

    from dflash2.target import TargetModel
    from dflash2.target.loading import default_target_path
    from dflash2.training.data import gsm8k_prompts, render

    tok = AutoTokenizer.from_pretrained(default_target_path())
    lengths = [len(render(tok, p)) for p in gsm8k_prompts(ROOT.parent / "shared/data/gsm8k/test.jsonl", 512)]
    target = TargetModel(build("llama", seed=3), layer_ids=[0, 2])
    draft = random_draft(target, 3).draft
    rows = []
    for name in args.costs.split(","):
        for d in (None, draft):
            rows.append(run(target, d, lengths, name, args.running, args.requests, args.acceptance))
            print(json.dumps(rows[-1]), flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
