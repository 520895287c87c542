"""What trickled admissions' prefill costs at the 8B shape, by a roofline model (no GPU): each prefill
graph costs the larger of its weight read and its compute; admissions arrive in Poisson groups a step
(the rate from the engine runs: requests finished a step); ``plan_prefill`` groups them over the
captured (rows, length) shapes, as the graph runner does. Prints ms of prefill a request for the
current buckets and for finer ones (docs/benchmarks.md, thirtieth session).

    .venv/bin/python scripts/prefill_model.py [--weights-ms 3.8] [--tflops 700]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def main() -> None:
    from transformers import AutoTokenizer

    from dflash2.benchmark import engine_speed
    from dflash2.benchmark.speed import gsm8k_test_prompts
    from dflash2.engine.graph_runner import PREFILL_BUCKETS, PREFILL_GRAPH_TOKENS, PREFILL_ROWS, plan_prefill

    ap = argparse.ArgumentParser()
    ap.add_argument("--weights-ms", type=float, default=3.8, help="the 8B's 16 GB at the measured 4.27 TB/s")
    ap.add_argument("--tflops", type=float, default=700.0, help="dense bf16 reached (the verify's GEMMs: ~690)")
    ap.add_argument("--gflop-per-token", type=float, default=16.06)
    ap.add_argument("--groups", type=int, default=3000)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(ROOT / "work" / "tok")
    prompts = gsm8k_test_prompts(ROOT / "work" / "gsm8k_test.jsonl", 512)
    lengths = [len(engine_speed.render(tok, p)) for p in prompts]

    def cost(R: int, L: int) -> float:
        return max(args.weights_ms, R * L * args.gflop_per_token / args.tflops)  # GFLOP / (TFLOP/s) = ms

    def per_request(rows, buckets, rate: float) -> float:
        rng = np.random.default_rng(0)
        shapes = [(R, L) for L in buckets for R in rows if R == 1 or R * L <= PREFILL_GRAPH_TOKENS]
        c = {s: cost(*s) for s in shapes}
        total, n = 0.0, 0
        for _ in range(args.groups):
            k = int(rng.poisson(rate))
            if k:
                plan = plan_prefill([int(x) for x in rng.choice(lengths, k)], shapes, c)
                assert plan is not None
                total += sum(c[R, L] for R, L, _ in plan)
                n += k
        return total / n

    finer = (1, 2, 4, 8, 16), (32, 64, 96, 128, 160, 192, 256, 512, 1024, 2048)
    print(f"prompts: mean {np.mean(lengths):.1f} tokens; ms of prefill a request")
    for rate, name in ((2.1, "DFlash2 c=64"), (0.5, "target c=64"), (0.27, "DFlash2 c=8")):
        now = per_request(PREFILL_ROWS, PREFILL_BUCKETS, rate)
        rows = per_request(finer[0], PREFILL_BUCKETS, rate)
        both = per_request(*finer, rate)
        print(
            f"{name:>13} ({rate} a step): now {now:.2f}, rows 1,2,4,8,16 {rows:.2f}, and lengths 96,160,192 {both:.2f}"
        )
        # admissions held k steps and prefilled together, finer buckets (the slots idle meanwhile: not counted)
        held = ", ".join(f"{k} steps {per_request(*finer, rate * k):.2f}" for k in (2, 3))
        print(f"{'':>13} and admissions held: {held}")


if __name__ == "__main__":
    main()
