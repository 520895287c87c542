"""#22 on the CPU, offline: the server's engine (embedded SmolLM2 + shipped drafter, eager paged runner)
over the recipe's held-out chat prompts, every step traced: rows, width, drafting rows, step ms (without
its overlap), accepted counts; every admission's drafting decision with the planner's costs and rates.
A run takes ~70 s on the 2-core EPYC; the machine's own speed moves ~10% between runs, so alternate modes.

    .venv/bin/python scripts/cpu_planner_trace.py --modes none,auto,none,auto --temperature 1
    .venv/bin/python scripts/cpu_planner_trace.py --modes off --force 3-1   # widths forced in turn

Writes ``--output`` (JSON: per run the trace, the admissions and the planner's state)."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def run(mode: str, temperature: float, prompts: int, running: int, force: str | None) -> dict:
    from dflash2.cli import build_parser
    from dflash2.engine.engine import LLMEngine
    from dflash2.engine.planner import Planner
    from dflash2.entry import load_models
    from dflash2.sampling import SamplingParams
    from dflash2.server.launch import engine_config
    from dflash2.training.sources import load_prompts

    base, *overrides = mode.split(":")  # e.g. auto:prior_drafts=4 (PlannerConfig fields, for experiments)
    flags = ["--speculative-algorithm", "NONE"] if base == "none" else ["--speculative-planner", base]
    args = build_parser().parse_args(["serve", "--max-running-requests", str(running), *flags])
    target, draft, width = load_models(args)
    cfg = engine_config(args, target, draft, width)
    eng = LLMEngine(target, draft, cfg)
    if overrides:
        fields = {k: float(v) for k, v in (o.split("=") for o in overrides)}
        pcfg = dataclasses.replace(eng.planner.cfg, **fields)
        eng.planner = Planner(eng.planner.width, pcfg, widths=eng.planner.widths)
    tok = target.tokenizer
    texts = [p.messages[-1]["content"] for p in load_prompts(ROOT / "work" / "recipe" / "heldout_prompts.jsonl")]
    ids = [
        tok.apply_chat_template(
            [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for t in texts[:prompts]
    ]
    eng.warm_up()  # as `dflash2 serve` does: then the planner starts afresh
    trace: list[tuple] = []
    admissions: list[tuple] = []
    runner_step, planner = eng.runner.step, eng.planner

    def step(reqs, sampling, width=None, **kw):  # (overlap, prefill, trim: the runner's own)
        t = time.perf_counter()
        out = runner_step(reqs, sampling, width, **kw)
        ms = round(1e3 * (time.perf_counter() - t - out.overlap_s), 1)
        trace.append((len(reqs), width, sum(r.speculate for r in reqs), ms, list(out.num_accepted)))
        return out

    eng.runner.step = step  # type: ignore[method-assign,assignment]
    speculate_new, retire = planner.speculate_new, planner.retire

    def admitted(n: int, bucket: int) -> bool:
        drafts, gain = speculate_new(n, bucket), planner.drafting_gain(bucket)
        costs = {w: planner.cost(bucket, w) for w in (0, *planner.widths)}
        ms = {w: round(1e3 * c, 1) for w, c in costs.items() if c is not None}
        rates = [round(float(x), 2) for x in planner.counts.prior_rates()]
        admissions.append((len(trace), n, drafts, None if gain is None else round(gain, 2), ms, rates))
        return drafts

    def retired(bucket: int) -> bool:
        out = retire(bucket)
        if out:
            admissions.append((len(trace), "retire", bucket, planner.drafting_gain(bucket)))
        return out

    planner.speculate_new = admitted  # type: ignore[method-assign,assignment]
    planner.retire = retired  # type: ignore[method-assign,assignment]
    force = force if base == "off" else None  # (auto chooses ahead, past ``choose``)
    if force:  # widths in turn, where the planner is off
        seq, k = [int(x) for x in force.split("-")], [0]

        def forced(rids, bucket):
            k[0] += 1
            return seq[(k[0] - 1) % len(seq)]

        planner.choose = forced  # type: ignore[method-assign,assignment]
    sps = [SamplingParams(max_new_tokens=128, temperature=temperature, top_p=0.95, seed=i) for i in range(len(ids))]
    t0 = time.perf_counter()
    res = eng.generate(ids, sps)
    wall = time.perf_counter() - t0
    tokens = sum(r.completion_tokens for r in res)
    by_width: dict[int, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for rows, w, drafting, ms, _ in trace:
        key = w if drafting else 0  # 0: the target alone (no request of the batch drafts)
        by_width[key][0] += 1
        by_width[key][1] += ms / 1e3
    one = [t[3] for t in trace if t[0] == running and t[1] == 1]
    row = {
        "mode": mode if not force else f"force {force}",
        "tok_s": round(tokens / wall, 1),
        "wall_s": round(wall, 1),
        "tokens": tokens,
        "retired": eng.stats.requests_retired,
        "steps_s_by_width": {k: (v[0], round(v[1], 1)) for k, v in sorted(by_width.items())},
        f"one_token_ms_at_{running}_rows": round(sum(one) / max(len(one), 1), 1),
    }
    print(json.dumps(row), flush=True)
    return {**row, "trace": trace, "admissions": admissions, "planner": planner.state()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="none,auto")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--running", type=int, default=16)
    ap.add_argument("--force", help="widths in turn, e.g. 3-1 (the runs of mode off only)")
    ap.add_argument("--output")
    args = ap.parse_args()
    runs = [run(m, args.temperature, args.prompts, args.running, args.force) for m in args.modes.split(",")]
    if args.output:
        Path(args.output).write_text(json.dumps(runs))


if __name__ == "__main__":
    main()
