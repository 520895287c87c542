"""#22's CPU target through the server, with the official ``openai`` client (no vLLM venv needed):
``dflash2 serve`` with ``--speculative-algorithm NONE`` and with the planner (auto), one server at a
time, the same held-out chat prompts (the last user turn of the recipe's held-out conversations, no
drafter trained on them) at a fixed concurrency, 128 new tokens, top-p 0.95; output tokens/s = completion
tokens of all requests / wall of the batch. Greedy outputs are compared across servers (lossless).

    .venv/bin/python scripts/cpu_server_client_ab.py --concurrency 16 --prompts 32 --temperatures 0,1

``--interleave N``: every server up at once (idle ones wait on their queue), the batch sent to each in
turn, N rounds, the order reversed every round (ABBA): drift on a shared machine (one server alone
moved 41.6-52.1 tok/s between sequential runs, docs/benchmarks.md, twenty-ninth session) then falls on
both sides alike. Each server's tokens/s is its tokens over its walls, summed over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def wait_healthy(port: int, proc: subprocess.Popen, timeout: float = 240) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise SystemExit("the server did not become healthy")


async def run_batch(
    port: int, prompts: list[str], conc: int, temperature: float, tokens: int, ignore_eos: bool = False
) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    sem = asyncio.Semaphore(conc)
    outs: list[tuple[int, str]] = [(0, "")] * len(prompts)

    async def one(i: int, p: str) -> None:
        async with sem:
            r = await client.chat.completions.create(
                model="default",
                messages=[{"role": "user", "content": p}],
                max_tokens=tokens,
                temperature=temperature,
                top_p=0.95,
                seed=i,
                # every output the same length where asked (SGLang's ignore_eos): at T=1 the servers
                # draw other texts, and tok/s of texts of other lengths mixes in each prompt's prefill
                extra_body={"ignore_eos": True} if ignore_eos else None,
            )
            outs[i] = (r.usage.completion_tokens, r.choices[0].message.content or "")

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - t0
    await client.close()  # (else its connections close after the event loop, with a traceback each)
    n = sum(c for c, _ in outs)
    return {"tokens": n, "wall_s": round(wall, 2), "tok_s": round(n / wall, 2), "texts": [t for _, t in outs]}


def spec_metrics(port: int) -> dict[str, float]:
    """What the planner did (widths, retirements, acceptance), from the server's ``/metrics``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return {k: float(v) for k, v in (ln.rsplit(" ", 1) for ln in lines if ln.startswith("dflash2_spec"))}


def start(name: str, port: int, flags: dict, args, temp: float) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dflash2.cli", "serve", "--port", str(port),
           "--max-running-requests", str(args.concurrency), *flags[name]]  # fmt: skip
    log = open(Path(args.logs) / f"server_{name}_T{temp}.log", "w") if args.logs else subprocess.DEVNULL
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def interleaved(args, prompts: list[str], flags: dict) -> None:
    names = args.servers.split(",")
    out = []
    for temp in [float(t) for t in args.temperatures.split(",")]:
        ports = {n: args.port + i for i, n in enumerate(names)}
        procs = {}
        try:
            for n in names:  # one at a time: start-up (model load, warm-up) is CPU-heavy
                procs[n] = start(n, ports[n], flags, args, temp)
                wait_healthy(ports[n], procs[n])
                asyncio.run(run_batch(ports[n], prompts[:2], 2, temp, 8))
            rounds: list[dict] = []
            for i in range(args.interleave):
                order = names if i % 2 == 0 else names[::-1]
                got = {
                    n: asyncio.run(run_batch(ports[n], prompts, args.concurrency, temp, args.tokens, args.ignore_eos))
                    for n in order
                }
                rounds.append({n: {"tok_s": got[n]["tok_s"], "wall_s": got[n]["wall_s"], "tokens": got[n]["tokens"]}
                               for n in names})  # fmt: skip
                if temp == 0:
                    rounds[-1]["greedy_same"] = all(got[n]["texts"] == got[names[0]]["texts"] for n in names)
                print(f"T={temp} round {i} ({','.join(order)}):", {n: got[n]["tok_s"] for n in names}, flush=True)
            total = {n: sum(r[n]["tokens"] for r in rounds) / sum(r[n]["wall_s"] for r in rounds) for n in names}
            row = {"T": temp, "concurrency": args.concurrency, "rounds": rounds,
                   "tok_s": {n: round(v, 2) for n, v in total.items()},
                   "ratio": {n: round(v / total[names[0]], 3) for n, v in total.items()},
                   "metrics": {n: spec_metrics(ports[n]) for n in names}}  # fmt: skip
        finally:
            for p in procs.values():
                p.terminate()
                p.wait(30)
        out.append(row)
        print(f"T={temp} c={args.concurrency}, {args.interleave} rounds:", row["tok_s"], row["ratio"], flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps(out, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heldout", default=str(ROOT / "work" / "recipe" / "heldout_prompts.jsonl"))
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--servers", default="none,auto")
    ap.add_argument("--port", type=int, default=30013)
    ap.add_argument("--output", default=None)
    ap.add_argument("--logs", default=None, help="a folder for each server's log")
    ap.add_argument("--ignore-eos", action="store_true", help="every output --tokens long (comparable tok/s at T=1)")
    ap.add_argument("--interleave", type=int, default=0, help="rounds with every server up at once (ABBA order)")
    ap.add_argument("--draft-b", default=None, help="server auto_b: auto with this drafter (two drafters side by side)")
    args = ap.parse_args()
    from dflash2.training.sources import load_prompts

    prompts = [p.messages[-1]["content"] for p in load_prompts(args.heldout)][: args.prompts]
    flags = {"none": ["--speculative-algorithm", "NONE"], "auto": ["--speculative-planner", "auto"],
             "off": ["--speculative-planner", "off"],
             # the planner with the cut after the draft (the draft's confidence, Planner.trim)
             "trim": ["--speculative-planner", "auto", "--enable-speculative-trim"],
             # the drafter loaded, no request drafting (the schedule drafts only at 1 running request):
             # what a drafter engine's target-alone steps cost beside the target's own
             "plain": ["--speculative-width-schedule", "1:8"]}  # fmt: skip
    if args.draft_b:
        flags["auto_b"] = ["--speculative-planner", "auto", "--speculative-draft-model-path", args.draft_b]
    rows = []
    if args.interleave:
        return interleaved(args, prompts, flags)
    for temp in [float(t) for t in args.temperatures.split(",")]:
        for name in args.servers.split(","):
            cmd = [sys.executable, "-m", "dflash2.cli", "serve", "--port", str(args.port),
                   "--max-running-requests", str(args.concurrency), *flags[name]]  # fmt: skip
            log = open(Path(args.logs) / f"server_{name}_T{temp}.log", "w") if args.logs else subprocess.DEVNULL
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
            try:
                wait_healthy(args.port, proc)
                asyncio.run(run_batch(args.port, prompts[:2], 2, temp, 8))  # warm-up
                res = asyncio.run(run_batch(args.port, prompts, args.concurrency, temp, args.tokens, args.ignore_eos))
                res["metrics"] = spec_metrics(args.port)
            finally:
                proc.terminate()
                proc.wait(30)
            rows.append({"server": name, "T": temp, "concurrency": args.concurrency, **res})
            print(f"{name:>5} T={temp} c={args.concurrency}: {res['tok_s']} tok/s ({res['tokens']} tokens, "
                  f"{res['wall_s']} s)", {k[8:]: v for k, v in res["metrics"].items() if "position" not in k}, flush=True)  # fmt: skip
        base = next(r for r in rows if r["T"] == temp and r["server"] == "none")
        for r in rows:
            if r["T"] == temp:
                r["ratio"] = round(r["tok_s"] / base["tok_s"], 3)
                if temp == 0:
                    r["greedy_same_as_none"] = r["texts"] == base["texts"]
        print({r["server"]: (r["ratio"], r.get("greedy_same_as_none")) for r in rows if r["T"] == temp}, flush=True)
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
