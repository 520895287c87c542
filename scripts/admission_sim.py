"""Admission batching (``--num-continuous-decode-steps``) simulated on measured 8B-shape costs: which rule a
device run would favour, between device runs. Slots, a deep queue of fixed-length requests (the engine
benchmark's: 128 new tokens, GSM8K-sized prompts), synthetic acceptance per draft position (block verify at
width 5: a row commits 1 + the accepted run of 4 drafts); each step costs the measured step of its batch
bucket, each admission round its packed prefill replays (the measured replay by padded total, plus what the
engine adds around one), chunked at 2048 prompt tokens a step. Rules: ``cdsN`` (every N decode steps),
``auto`` (the engine's default: ``engine.admission_interval``), and two rejected in the fifty-fifth session:
``idle`` (wait until idle rows have cost one replay) and ``marginX`` (wait while a step's expected saving, a
replay times the requests finishing a step, is X times its idle rows' cost). Prints tok/s of each rule over
the target alone's with admission every step, per (requests, acceptance); the last column is the target
alone's own auto over its every step. ``--scale`` shrinks the costs toward a small model's. Costs: H100,
docs/benchmarks.md, fifty-fourth and fifty-fifth sessions.

    python scripts/admission_sim.py [--seeds 20] [--requests-per-slot 8] [--rules cds1,cds4,auto] [--scale 0.25,0.12]
        [--prompt-tokens 80,140]
"""

from __future__ import annotations

import argparse
import bisect

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from dflash2.engine.engine import ADMIT_RATE_DECAY, admission_interval  # noqa: E402
from dflash2.engine.graph_runner import PACKED_MAX_TOKENS  # noqa: E402

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
# step ms by bucket, measured on the H100 (8B shape, graphs): width 5 with the drafter, and the target alone
STEP_W5 = {1: 9.8, 2: 10.1, 4: 10.2, 8: 10.4, 12: 11.1, 16: 11.6, 24: 12.7, 32: 13.4, 48: 16.0, 64: 18.9}
STEP_T = {1: 6.9, 2: 6.9, 4: 7.0, 8: 7.3, 12: 7.4, 16: 7.7, 24: 8.6, 32: 8.0, 48: 8.8, 64: 8.4}
PREFILL_TOKENS = (32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
REPLAY_MS = (7.0, 7.3, 7.8, 8.6, 9.1, 11.8, 13.6, 21.1, 23.7, 41.5, 50.4)  # with the drafter's latents
REPLAY_EXTRA_MS = 2.0  # what the engine adds around a replay (its in-run cost over the replay alone, ~9.8 vs ~8)
PACKED_MAX, CHUNK, NEW, WAIT_MAX, MARGIN, DECAY = PACKED_MAX_TOKENS, 2048, 128, 8, 2.0, ADMIT_RATE_DECAY


SCALE = [1.0, 1.0]  # (steps, replays): --scale, a smaller model's costs as a fraction of these
# prompt tokens, uniform in [lo, hi): --prompt-tokens. The default is this script's first setting; GSM8K test
# prompts through the chat template average ~109 tokens (the 8B rows' prefill_shapes: 55,970 for 512 requests)
PROMPT = [35, 80]


def replay_ms(tokens: int) -> float:
    i = bisect.bisect_left(PREFILL_TOKENS, tokens)
    return (REPLAY_MS[min(i, len(REPLAY_MS) - 1)] + REPLAY_EXTRA_MS) * SCALE[1]


def run(slots: int, acceptance: float | None, rule: str, n_req: int, rng: np.random.Generator) -> float:
    """tok/s of ``n_req`` requests through ``slots`` slots under ``rule``; ``acceptance`` None: the target alone."""
    prompts = rng.integers(PROMPT[0], PROMPT[1], n_req)
    queue, running, prefill = list(range(n_req)), {}, []  # running: request -> tokens so far
    t = tokens = 0.0
    since, idle_s, row_s, finish_rate, done_before = 0, 0.0, 0.0, 0.0, 0
    done = 0
    price = (REPLAY_MS[0] + REPLAY_EXTRA_MS) / 1e3 * SCALE[1]
    steps = {b: ms * SCALE[0] for b, ms in (STEP_T if acceptance is None else STEP_W5).items()}
    while queue or running or prefill:
        decoding = [r for r in running if r not in prefill]
        admit = True
        free = slots - len(running)
        if queue and decoding and free > 0:
            if rule.startswith("cds"):
                admit = since >= int(rule[3:])
            elif rule == "auto":  # the engine's (LLMEngine._admits_now): the cheapest interval, or a full replay waits
                full = sum(prompts[r] for r in queue[:free]) >= PACKED_MAX
                admit = full or since >= admission_interval(price, finish_rate, row_s)
            elif since < WAIT_MAX:
                idle = min(len(queue), free)
                if rule == "idle":
                    idle_s += idle * row_s
                    admit = idle_s >= price
                else:  # "margin": wait while a step's expected saving is MARGIN x its idle rows' cost
                    full = sum(prompts[r] for r in queue[:idle]) >= PACKED_MAX  # (a joiner would need a replay too)
                    margin = float(rule[6:]) if len(rule) > 6 else MARGIN  # ("margin1.5": another margin)
                    admit = full or margin * idle * row_s >= min(1.0, finish_rate) * price
        if admit and queue and free > 0:
            new = queue[:free]
            del queue[:free]
            for r in new:
                running[r] = 0
            prefill += new
            since, idle_s = 0, 0.0
        # this step's prefill: up to CHUNK prompt tokens, packed into replays of at most PACKED_MAX
        budget, group, now = CHUNK, 0, []
        while prefill and prompts[prefill[0]] <= budget:
            r = prefill.pop(0)
            budget -= prompts[r]
            if group + prompts[r] > PACKED_MAX:
                t += replay_ms(group) / 1e3
                group = 0
            group += prompts[r]
            now.append(r)
        if group:
            t += replay_ms(group) / 1e3
        if decoding:
            b = BUCKETS[bisect.bisect_left(BUCKETS, len(running))]
            t += steps[b] / 1e3
            row_s = steps[b] / 1e3 / len(decoding)
            since += 1
            for r in decoding:
                k = 1
                if acceptance is not None:
                    while k < 5 and rng.random() < acceptance:
                        k += 1
                running[r] += k
                if running[r] >= NEW:
                    tokens += NEW
                    del running[r]
                    done += 1
            finish_rate = DECAY * finish_rate + (1 - DECAY) * (done - done_before)
            done_before = done
        for r in now:  # (their first token from the prefill)
            running[r] += 1
    return tokens / t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--requests-per-slot", type=int, default=8)
    ap.add_argument("--rules", default="cds1,cds2,cds3,cds4,idle,margin2,auto")
    ap.add_argument("--scale", default="1,1", help="STEPS,REPLAYS: the costs times these (e.g. 0.25,0.15)")
    ap.add_argument("--prompt-tokens", default="35,80", help="LO,HI: each prompt's length, uniform in [LO, HI)")
    args = ap.parse_args()
    SCALE[:] = [float(x) for x in args.scale.split(",")]
    PROMPT[:] = [int(x) for x in args.prompt_tokens.split(",")]
    rules = args.rules.split(",")
    print("requests acceptance " + " ".join(f"{r:>7}" for r in rules) + "   (target alone: cds1 / auto)")
    for slots in (1, 8, 32, 64):
        for acc in (0.92, 0.5):
            n = slots * args.requests_per_slot

            def mean(a, rule):
                return np.mean([run(slots, a, rule, n, np.random.default_rng(s)) for s in range(args.seeds)])

            base = mean(None, "cds1")
            row = [mean(acc, r) / base for r in rules]
            print(
                f"{slots:8d} {acc:10.2f} " + " ".join(f"{x:7.3f}" for x in row) + f"   {mean(None, 'auto') / base:.3f}"
            )


if __name__ == "__main__":
    main()
