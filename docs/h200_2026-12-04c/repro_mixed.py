import sys, time, torch, traceback
sys.path.insert(0, "scripts"); sys.path.insert(0, "src")
from pathlib import Path
from transformers import AutoTokenizer
from dflash2.benchmark import engine_speed, shapes
from dflash2.benchmark.speed import gsm8k_test_prompts
from dflash2.engine import graph_runner
shape, c = sys.argv[1], int(sys.argv[2])
orig = graph_runner.GraphModelRunner.step
def step(self, reqs, sampling, width=None, overlap=None, prefill=None):
    w = width or self.w
    res = orig(self, reqs, sampling, width, overlap, prefill)
    bad = [n for n in res.num_accepted if not 0 <= n < w]
    if bad:
        print(f"BAD step: B={self.bucket(len(reqs))} reqs={len(reqs)} w={w} prefill={None if prefill is None else prefill[1]} "
              f"mixes={self.mixes(self.bucket(len(reqs)), w)} occupants={len(self.occupant)} bad={bad[:5]} draft={self.draft is not None}", flush=True)
    return res
graph_runner.GraphModelRunner.step = step
tok = AutoTokenizer.from_pretrained("work/tok")
target, draft = shapes.random_models(shape, "cuda", torch.bfloat16, 5, tok)
prompts = gsm8k_test_prompts(Path("work/gsm8k_test.jsonl"), 512)
for mixed in (None,):
    t0 = time.time()
    try:
        rows = engine_speed.run(target, draft, prompts, [5], ["token"], [c], 128, 0.0, requests_per_slot=4, rounds=1,
            warmup=False, engine_kw={"synthetic_acceptance": (0.92,), "enable_mixed_chunk": mixed})
        print(f"mixed={mixed}", engine_speed.table(rows), flush=True)
    except Exception:
        traceback.print_exc()
    print(f"mixed={mixed}: {time.time() - t0:.0f} s", flush=True)
