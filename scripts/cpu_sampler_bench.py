"""The sampled verify's host-side cost on the CPU (#21/#22's T=1 lever), on real logits: SmolLM2-135M's own
rows over the recipe's held-out chat prompts with sampled continuations (T=1, top-p 0.95), then
``probs_from_logits`` and ``steps.accept`` (block and token-level) timed at the engine's shapes, q_draft as
the runner builds it (this checkout's form: candidates, or the dense rows of a checkout before them).

    .venv/bin/python scripts/cpu_sampler_bench.py                          # this checkout
    PYTHONPATH=/tmp/old/src .venv/bin/python scripts/cpu_sampler_bench.py   # a checkout of an older commit

The logits are cached in --logits (collected once, ~1 min)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def collect(path: Path, prompts: int, new_tokens: int) -> torch.Tensor:
    import transformers as tf

    from dflash2.target.loading import default_target_path

    src = default_target_path()
    tok = tf.AutoTokenizer.from_pretrained(src)
    model = tf.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    rows = [json.loads(x) for x in open(ROOT / "work" / "recipe" / "heldout_prompts.jsonl")][1::6][:prompts]
    out = []
    for r in rows:
        ids = tok.apply_chat_template(r["messages"][:1], add_generation_prompt=True, return_tensors="pt")
        ids = (ids if isinstance(ids, torch.Tensor) else ids["input_ids"])[:, -300:]
        with torch.no_grad():
            seq = model.generate(ids, do_sample=True, temperature=1.0, top_p=0.95, top_k=0, max_new_tokens=new_tokens)
            out.append(model(seq).logits[0, ids.shape[1] - 1 : -1])
    logits = torch.cat(out)
    torch.save(logits, path)
    return logits


def timed(fn, n: int = 9) -> float:
    fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e3 * sorted(ts)[n // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--logits", default="/tmp/dflash2_heldout_logits.pt")
    ap.add_argument("--shapes", default="1x7,16x7,64x4", help="rows x drafts")
    ap.add_argument("--temperatures", default="1,0.7")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    from dflash2.engine import steps
    from dflash2.engine.model_runner import tune_cpu_malloc
    from dflash2.engine.steps import BatchSampling
    from dflash2.sampling import SamplingParams, probs_from_logits

    tune_cpu_malloc()  # as the engine's runner does
    path = Path(args.logits)
    L = torch.load(path) if path.is_file() else collect(path, 24, 48)
    V, k = L.shape[1], 8
    try:
        from dflash2.sampling import CandidateQ

        form = "candidates"
    except ImportError:
        from dflash2.model.selector import SelectorOutput

        form = "dense"
    print(f"{len(L)} rows of real logits; q_draft form: {form}")
    for shape in args.shapes.split(","):
        B, g = (int(x) for x in shape.split("x"))
        logits = L[torch.randperm(len(L))[: B * (g + 1)]].reshape(B, g + 1, V)
        cand = logits[:, :g].topk(k, -1).indices  # the draft's candidates, near the target's own top
        qv = torch.softmax(torch.randn(B, g, k), -1)
        if form == "candidates":
            q = lambda: CandidateQ(cand, qv)  # noqa: E731
        else:
            q = lambda: SelectorOutput(cand[..., 0], cand, qv).dense_q(V)  # noqa: E731
        for T in (float(x) for x in args.temperatures.split(",")):
            sp = [SamplingParams(temperature=T, top_p=0.95)] * B
            rows = BatchSampling.of(sp, torch.rand(B, 2 * g + 1), "cpu")
            pl = timed(lambda: probs_from_logits(logits, *rows.params()))
            blk = timed(lambda: steps.accept(logits, cand[..., 0], q(), rows, True))
            tok = timed(lambda: steps.accept(logits, cand[..., 0], q(), rows, False))
            print(
                f"{B} rows x {g} drafts, T={T:g}: probs_from_logits {pl:.1f} ms; accept (q_draft built): "
                f"block {blk:.1f} ms, token-level {tok:.1f} ms",
                flush=True,
            )


if __name__ == "__main__":
    main()
