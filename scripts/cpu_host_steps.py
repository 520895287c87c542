"""The serving engine's host work per decode step, on the CPU: the graph runner (static slots, run
eagerly here) over a tiny random Llama and drafter, N running sampled requests, each engine function
on the step's critical path timed apart from the forwards ("replays"). Why: on the H200 at 64-128
requests the host's share of a step is 0.8-1.6 ms of 3.5-7.4 (docs/benchmarks.md, forty-second
session), and a GPU step waits for it; this shows where it goes without a GPU.

  .venv/bin/python scripts/cpu_host_steps.py --requests 128 --steps 40
  .venv/bin/python scripts/cpu_host_steps.py --model embedded --requests 64 --steps 20 --planner auto
      # the embedded SmolLM2 + shipped drafter (the server's engine, --model-runner static) on GSM8K test
      # prompts (work/gsm8k_test.jsonl), where drafting is accepted: auto's host work at full width

"critical" = the decode step's wall less the forwards and less the overlap work (which runs while the
GPU computes), plus the batch's reservation and admissions."""

from __future__ import annotations

import argparse
import collections
import gc
import json
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--prompt-tokens", type=int, default=12, help="tiny model: each prompt's length (context 512)")
    ap.add_argument("--planner", default="off", choices=["off", "auto", "none"], help="none: the target alone")
    ap.add_argument("--model", default="tiny", choices=["tiny", "embedded"])
    ap.add_argument("--new-tokens", type=int, default=0, help="each request's output (0: long enough not to finish)")
    ap.add_argument("--queued", type=int, default=0, help="requests waiting beyond --requests (finishes admit them)")
    ap.add_argument("--synthetic", type=float, default=None, help="tiny model: accept each draft with this probability")
    ap.add_argument("--disable-overlap-schedule", action="store_true", help="commit each step before the next")
    ap.add_argument("--async-scheduling", action="store_true", help="launch each step before the last is read back")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    import torch

    from dflash2.engine import steps
    from dflash2.engine.engine import EngineConfig, LLMEngine
    from dflash2.engine.request import Request
    from dflash2.target import TargetModel
    from dflash2.verification import SamplingParams
    from targets import VOCAB, build
    from test_speculative import random_draft

    N, T = args.requests, args.temperature
    new_tokens = args.new_tokens or (400 if args.model == "embedded" else 500 - args.prompt_tokens)
    total = N + args.queued
    sp = SamplingParams(temperature=T, top_p=0.95 if T else 1.0, max_new_tokens=new_tokens, ignore_eos=True)
    if args.model == "tiny":
        torch.set_num_threads(1)
        target = TargetModel(build("llama"), layer_ids=[0, 2])
        draft = None if args.planner == "none" else random_draft(target).draft
        eng = LLMEngine(
            target,
            draft,
            EngineConfig(
                max_running_requests=N, num_draft_tokens=5, block_verification=True, context_length=512,
                runner="static", speculative=draft is not None,
                speculative_planner="off" if draft is None else args.planner, sampler_backend="sort",
                synthetic_acceptance=None if args.synthetic is None else (args.synthetic,),
                disable_overlap_schedule=args.disable_overlap_schedule,
                async_scheduling=args.async_scheduling,
            ),
        )  # fmt: skip
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, VOCAB, (args.prompt_tokens,), generator=g).tolist() for _ in range(total)]
    else:
        from dflash2.cli import build_parser
        from dflash2.entry import load_models
        from dflash2.server.launch import engine_config

        flags = (
            ["--speculative-algorithm", "NONE"] if args.planner == "none" else ["--speculative-planner", args.planner]
        )
        cli = ["serve", "--max-running-requests", str(N), "--model-runner", "static", *flags]
        cli += ["--disable-overlap-schedule"] if args.disable_overlap_schedule else []
        cli += ["--async-scheduling"] if args.async_scheduling else []
        parsed = build_parser().parse_args(cli)
        target, draft, width = load_models(parsed)
        eng = LLMEngine(target, draft, engine_config(parsed, target, draft, width))
        lines = (ROOT / "work" / "gsm8k_test.jsonl").read_text().splitlines()[:total]
        tok = target.tokenizer
        prompts = [
            tok.apply_chat_template(
                [{"role": "user", "content": json.loads(x)["question"]}], add_generation_prompt=True, tokenize=True,
                return_dict=False,
            )
            for x in lines
        ]  # fmt: skip
    for ids in prompts:
        eng.add_request(Request(ids, sp))
    while eng.prefilling or eng.stats.steps < 4 or (eng.scheduler.waiting and not args.queued):
        eng.step()  # the running requests' prompts in, a few steps run

    spent: dict[str, float] = collections.defaultdict(float)

    def timed(obj, name: str, key: str | None = None) -> None:
        fn = getattr(obj, name)

        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[key or name] += time.perf_counter() - t

        setattr(obj, name, wrapper)

    for obj, names in (
        (eng, ("_decode", "_decode_batch", "_admit", "_settle", "_observe", "_width", "_append", "_emit_first_tokens")),
        (eng.scheduler, ("reserve_step",)),
        (eng.runner, ("step", "_load")),
        (eng.runner.clock, ("run",)),
        (eng.planner, ("observe", "fold", "choose_ahead", "forget", "speculate_new", "retire", "choose")),
        (eng.planner.counts, ("observe", "refresh", "rows", "forget")),
        (eng.planner.calibration, ("observe", "refit")),
        (steps.BatchSampling, ("draw",)),
        (steps, ("finish_step",)),
    ):
        for name in names:  # (the planner's: its class in the key, their names repeat)
            cls = type(obj).__name__
            timed(
                obj, name, f"{cls}.{name}" if cls in ("Planner", "AcceptanceCounts", "ConfidenceCalibration") else None
            )
    timed(eng, "step", "engine step")
    graph = eng.runner._graph

    def graph_timed(*a, **kw):
        replay, out = graph(*a, **kw)

        def run() -> None:
            t = time.perf_counter()
            replay()
            spent["replays"] += time.perf_counter() - t

        return run, out

    eng.runner._graph = graph_timed

    def gc_timed(phase: str, info: dict) -> None:  # Python's cyclic collections, wherever they land
        if phase == "start":
            spent["gc start"] = time.perf_counter()
        else:
            spent["gc"] += time.perf_counter() - spent.pop("gc start")
            spent[f"gc gen{info['generation']} count"] += 1

    gc.callbacks.append(gc_timed)
    s0, t0 = eng.stats.steps, time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    gc.callbacks.remove(gc_timed)
    n = eng.stats.steps - s0
    ms = {k: v / n * 1e3 for k, v in spent.items()}
    # (the engine's step, less its forwards, the overlap work, which runs while a GPU computes, and first tokens)
    # (async scheduling: no overlap callback; the whole host work between launches is what a device waits on
    # only where it exceeds the device's step)
    critical = ms["engine step"] - ms["replays"] - ms.get("run", 0.0) - ms.get("_emit_first_tokens", 0.0)
    print(
        f"{N} requests, T={T}, planner {args.planner}: {n} steps, {(time.perf_counter() - t0) / n * 1e3:.2f} ms a step"
    )
    for k, v in sorted(ms.items(), key=lambda kv: -kv[1]):
        if k.endswith(" count"):
            print(f"  {k:<20} {spent[k]:7.0f} in {n} steps")
        else:
            print(f"  {k:<20} {v:7.3f} ms/step")
    print(f"  {'critical host':<20} {critical:7.3f} ms/step")
    if eng.planner.adapts:
        print("  planner", json.dumps(eng.planner.state()))
    print(
        "  widths",
        dict(eng.stats.steps_by_width),
        "mean accepted",
        round(eng.stats.generated_tokens / max(eng.stats.verify_steps, 1), 2),
    )


if __name__ == "__main__":
    main()
