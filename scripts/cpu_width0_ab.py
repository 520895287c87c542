"""#22 on the CPU: is a target-alone step slower in an engine that has a drafter (auto, requests admitted
without drafting: width 0) than in the engine without one (``--speculative-algorithm NONE``)? Both engines
in one process, the same 16 held-out chat prompts running in each (sampled, T=1, no end of sequence), their
decode steps timed alternately, one of each in turn, so the machine's drift falls on both.

    .venv/bin/python scripts/cpu_width0_ab.py --steps 60

Prints the median and mean step ms of each and their ratio (``--output``: JSON with every step)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def engine(flags: list[str], running: int):
    from dflash2.cli import build_parser
    from dflash2.engine.engine import LLMEngine
    from dflash2.entry import load_models
    from dflash2.server.launch import engine_config

    args = build_parser().parse_args(["serve", "--max-running-requests", str(running), *flags])
    target, draft, width = load_models(args)
    eng = LLMEngine(target, draft, engine_config(args, target, draft, width))
    eng.warm_up()
    return eng, target.tokenizer


def main() -> None:
    from dflash2.engine.request import Request
    from dflash2.sampling import SamplingParams
    from dflash2.training.sources import load_prompts

    ap = argparse.ArgumentParser()
    ap.add_argument("--running", type=int, default=16)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--output")
    args = ap.parse_args()
    engines = {
        "none": engine(["--speculative-algorithm", "NONE"], args.running),
        "auto width 0": engine(["--speculative-planner", "auto"], args.running),
    }
    engines["auto width 0"][0]._speculation = lambda: lambda n: False  # type: ignore[method-assign]  # none drafts
    tok = engines["none"][1]
    texts = [p.messages[-1]["content"] for p in load_prompts(ROOT / "work" / "recipe" / "heldout_prompts.jsonl")]
    ids = [
        tok.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=False
        )  # fmt: skip
        for t in texts[: args.running]
    ]
    for eng, _ in engines.values():
        for i, p in enumerate(ids):
            sp = SamplingParams(max_new_tokens=args.steps + 64, temperature=1.0, top_p=0.95, seed=i, ignore_eos=True)
            eng.add_request(Request(p, sp))
        while eng.prefilling or eng.scheduler.waiting or eng.stats.steps < 4:  # all admitted and prefilled
            eng.step()
    times: dict[str, list[float]] = {k: [] for k in engines}
    for _ in range(args.steps):
        for name, (eng, _) in engines.items():
            t = time.perf_counter()
            eng.step()
            times[name].append(1e3 * (time.perf_counter() - t))
    ref = statistics.median(times["none"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:>14}: median {med:.1f} ms, mean {statistics.fmean(ts):.1f} ms, x{med / ref:.3f}", flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps(times))


if __name__ == "__main__":
    main()
