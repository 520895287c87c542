"""How long one long prompt stalls another client's stream (issue 19), through a live server.

Starts ``dflash2 serve`` on the embedded default with each --chunked-prefill-size given, streams a
greedy chat answer (client A), and while it streams sends a long prompt (client B, about
--long-tokens tokens); reports A's longest gap between two stream events, its median gap, and how
long /health took to answer while B's prefill ran. Run: .venv/bin/python scripts/serve_stall.py --chunks=-1,256
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import threading
import time
from pathlib import Path

import httpx

from dflash2.server.launch import spawn_server

REPO = Path(__file__).resolve().parents[1]


def start(chunk: int) -> tuple[subprocess.Popen, str]:
    return spawn_server(["--context-length", "8192", "--chunked-prefill-size", str(chunk)], REPO, tries=600)


def probe(url: str, long_tokens: int) -> dict:
    gaps: list[float] = []
    health: list[float] = []
    started = threading.Event()

    def stream_a():
        body = {
            "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
            "max_tokens": 200,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        last = None
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                    if len(gaps) == 10:
                        started.set()
                last = now

    a = threading.Thread(target=stream_a)
    a.start()
    started.wait(120)
    prompt = " ".join(f"item{i}" for i in range(long_tokens // 3))  # ~3 tokens a word in SmolLM2's tokenizer

    def long_b():
        httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0}, timeout=600)

    b = threading.Thread(target=long_b)
    b.start()
    while b.is_alive():
        t0 = time.perf_counter()
        httpx.get(url + "/health", timeout=600)
        health.append(time.perf_counter() - t0)
        time.sleep(0.05)
    a.join()
    return {
        "max_gap_s": round(max(gaps), 3),
        "median_gap_s": round(statistics.median(gaps), 4),
        "max_health_s": round(max(health), 3),
        "stream_events": len(gaps) + 1,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", default="-1,512,128")
    ap.add_argument("--long-tokens", type=int, default=3500)
    args = ap.parse_args()
    rows = {}
    for chunk in [int(c) for c in args.chunks.split(",")]:
        proc, url = start(chunk)
        try:
            probe(url, 300)  # warm-up
            rows[chunk] = probe(url, args.long_tokens)
        finally:
            proc.terminate()
            proc.wait(30)
        print(f"--chunked-prefill-size {chunk}: {json.dumps(rows[chunk])}", flush=True)


if __name__ == "__main__":
    main()
