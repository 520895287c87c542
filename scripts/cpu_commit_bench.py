"""The engine's commit of a step (``LLMEngine._commit``: each request's tokens, stop rules, counters) on the
host, per step, for a batch of B requests with random blocks of 1-5 tokens and no stop among them (the
usual step): the part of a step's critical path that grows with the batch. A tiny random Llama (the tests'
``targets.build``) makes the engine; the commit does not touch the model.

    .venv/bin/python scripts/cpu_commit_bench.py --batch 64,128
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="64,128")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    import torch
    from targets import build
    from test_speculative import random_draft

    from dflash2.engine.engine import EngineConfig, LLMEngine
    from dflash2.engine.request import Request
    from dflash2.engine.steps import StepOutput
    from dflash2.target import TargetModel
    from dflash2.verification import SamplingParams

    t = TargetModel(build("llama", seed=3), layer_ids=[0, 2])
    cfg = EngineConfig(max_running_requests=4, num_draft_tokens=5, context_length=1 << 16, max_total_tokens=8192)
    eng = LLMEngine(t, random_draft(t, 3).draft, cfg)
    g = torch.Generator().manual_seed(0)
    for B in (int(x) for x in args.batch.split(",")):
        reqs = [Request(list(range(3, 40)), SamplingParams(max_new_tokens=1 << 15)) for _ in range(B)]
        for r in reqs:
            r.accept_hist = [0] * 5
        blocks = []
        for _ in range(args.steps):
            n = torch.randint(0, 5, (B,), generator=g).tolist()
            blocks.append([torch.randint(10, 200, (k + 1,), generator=g).tolist() for k in n])
        times = []
        for _ in range(args.repeats):
            for r in reqs:
                r.output_ids = []
            t0 = time.perf_counter()
            for step in blocks:
                eng._commit(reqs, StepOutput([list(x) for x in step]), 5)
            times.append((time.perf_counter() - t0) / args.steps * 1e3)
        tokens = sum(len(x) for step in blocks for x in step) / args.steps
        print(
            f"B={B}: commit {statistics.median(times):.3f} ms a step (min {min(times):.3f}), {tokens:.0f} tokens a step"
        )


if __name__ == "__main__":
    main()
