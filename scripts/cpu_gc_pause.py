"""What Python's garbage collector costs a serving process on the CPU: ``dflash2 serve``'s engine (the embedded
models, its flags' defaults) built in process and warmed up, then, with and without ``freeze_gc`` after start-up,
(1) the collections' pauses (``GCPauses``) while 32 held-out chat requests run at 16 (T=1, 128 new tokens,
ignore_eos); (2) 8 short requests more, then five full collections timed.

    .venv/bin/python scripts/cpu_gc_pause.py none
    .venv/bin/python scripts/cpu_gc_pause.py freeze
"""

from __future__ import annotations

import gc
import json
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def main() -> None:
    warnings.filterwarnings("ignore")
    freeze = sys.argv[1:] == ["freeze"]
    from dflash2.cli import build_parser
    from dflash2.engine.engine import LLMEngine
    from dflash2.engine.gc_utils import GCPauses, freeze_gc
    from dflash2.engine.request import Request
    from dflash2.entry import load_models
    from dflash2.server.launch import engine_config
    from dflash2.training.sources import load_prompts
    from dflash2.verification import SamplingParams

    parsed = build_parser().parse_args(["serve", "--max-running-requests", "16"])
    target, draft, width = load_models(parsed)
    eng = LLMEngine(target, draft, engine_config(parsed, target, draft, width))
    eng.warm_up()
    if freeze:
        freeze_gc("cpu_gc_pause")
    print(f"{'freeze' if freeze else 'no freeze'}: {len(gc.get_objects())} tracked, {gc.get_freeze_count()} frozen")
    tok = target.tokenizer

    def ids(text: str) -> list[int]:
        msgs = [{"role": "user", "content": text}]
        return tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)

    pauses = GCPauses()
    gc.callbacks.append(pauses)
    texts = [p.messages[-1]["content"] for p in load_prompts(ROOT / "work" / "recipe" / "heldout_prompts.jsonl")][:32]
    t = time.perf_counter()
    for i, x in enumerate(texts):
        sp = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=128, ignore_eos=True, seed=i)
        eng.add_request(Request(ids(x), sp))
    eng.run_until_done()
    print(
        f"  32 held-out requests at 16: {time.perf_counter() - t:.1f} s, collections by generation {pauses.count}, "
        f"{1e3 * pauses.seconds:.0f} ms in them"
    )
    questions = [json.loads(x)["question"] for x in (ROOT / "work" / "gsm8k_test.jsonl").read_text().splitlines()[:8]]
    for q in questions:
        eng.add_request(Request(ids(q), SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=32)))
    eng.run_until_done()
    full = []
    for _ in range(5):
        t = time.perf_counter()
        gc.collect()
        full.append(round(1e3 * (time.perf_counter() - t), 2))
    print(f"  a full collection: {full} ms")


if __name__ == "__main__":
    main()
