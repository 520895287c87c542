import sys, time, json, torch, traceback
sys.path.insert(0, "scripts"); sys.path.insert(0, "src")
from pathlib import Path
from transformers import AutoTokenizer
from dflash2.benchmark import engine_speed, shapes
from dflash2.benchmark.speed import gsm8k_test_prompts
from dflash2.engine import graph_runner
shape, concs, modes = sys.argv[1], [int(c) for c in sys.argv[2].split(",")], sys.argv[3].split(",")
per_slot = int(sys.argv[4]) if len(sys.argv) > 4 else 4
orig = graph_runner.GraphModelRunner.step
def step(self, reqs, sampling, width=None, overlap=None, prefill=None):
    w = width or self.w
    res = orig(self, reqs, sampling, width, overlap, prefill)
    bad = [n for n in res.num_accepted if not 0 <= n < w]
    if bad:
        print(f"BAD step: B={self.bucket(len(reqs))} reqs={len(reqs)} w={w} prefill={None if prefill is None else prefill[1]} "
              f"occupants={len(self.occupant)} bad={bad[:5]} draft={self.draft is not None}", flush=True)
    return res
graph_runner.GraphModelRunner.step = step
tok = AutoTokenizer.from_pretrained("work/tok")
target, draft = shapes.random_models(shape, "cuda", torch.bfloat16, 5, tok)
prompts = gsm8k_test_prompts(Path("work/gsm8k_test.jsonl"), 512)
out = {}
for c in concs:
    for mode in modes:
        mixed = {"on": True, "off": False}[mode]
        t0 = time.time()
        try:
            rows = engine_speed.run(target, draft, prompts, [5], ["token"], [c], 128, 0.0, requests_per_slot=per_slot,
                rounds=1, warmup=False, engine_kw={"synthetic_acceptance": (0.92,), "enable_mixed_chunk": mixed})
            print(f"c={c} mixed={mode}\n", engine_speed.table(rows), flush=True)
            out[f"c{c} {mode}"] = [r.__dict__ for r in rows]
        except Exception:
            traceback.print_exc()
        print(f"c={c} mixed={mode}: {time.time() - t0:.0f} s", flush=True)
        import os
        Path(os.environ.get("OUT", "/tmp"), "repro.json").write_text(json.dumps(out, default=str, indent=1))
