# 8B shape, synthetic 0.92, T=0, w5: the target alone against DFlash2 with admission batching
# (--admission-min-free-slots) at several values, one engine per concurrency, values alternated.
import sys, time, json, os, torch
sys.path.insert(0, "scripts"); sys.path.insert(0, "src")
from pathlib import Path
from transformers import AutoTokenizer
from dflash2.benchmark import engine_speed, shapes
from dflash2.benchmark.speed import gsm8k_test_prompts
from dflash2.training.data import render
concs = [int(c) for c in sys.argv[1].split(",")]
values = [int(v) for v in sys.argv[2].split(",")]
per_slot = int(sys.argv[3]) if len(sys.argv) > 3 else 8
deadline = time.time() + float(sys.argv[4]) if len(sys.argv) > 4 else None
tok = AutoTokenizer.from_pretrained("work/tok")
target, draft = shapes.random_models("llama-8b", "cuda", torch.bfloat16, 5, tok)
ids = [render(target.tokenizer, p) for p in gsm8k_test_prompts(Path("work/gsm8k_test.jsonl"), 1024)]
kw = {"synthetic_acceptance": (0.92,), "enable_mixed_chunk": False}
out = []
def row(name, r, mf):
    d = {"config": name, "min_free": mf, "tok_s": round(r.tokens_per_s, 1), "AL": round(r.accept_length, 2),
         "seconds": round(r.seconds, 3), "step_s": round(r.step_seconds, 3), "prefill_s": round(r.prefill_seconds, 3),
         "prefill_shapes": r.prefill_shapes, "steps_by_shape": r.step_ms_by_shape}
    out.append(d)
    n = sum(v[0] for v in r.prefill_shapes.values()); t = sum(v[1] for v in r.prefill_shapes.values())
    print(f"{name:10s} c={r.concurrency:3d} mf={mf:3d} tok/s {r.tokens_per_s:8.1f} AL {r.accept_length:.2f} "
          f"wall {r.seconds:.2f} steps {r.step_seconds:.2f} prefill {r.prefill_seconds:.2f} replays {n} tokens {t}", flush=True)
    Path(os.environ.get("OUT", "/tmp"), "admit.json").write_text(json.dumps(out, indent=1, default=str))
for c in concs:
    if deadline and time.time() > deadline: break
    engines = {}
    t0 = time.time()
    for k in range(2):
        row("target", engine_speed.measure(target, None, ids, 1, False, c, 128, 0.0, "target", per_slot,
                                           engines=engines, engine_kw=kw), 0)
    eng_key = None
    for mf in values + values:
        if deadline and time.time() > deadline: break
        r = engine_speed.measure(target, draft, ids, 5, False, c, 128, 0.0, "dflash2", per_slot, engines=engines,
                                 engine_kw=kw) if eng_key is None else None
        if eng_key is None:  # first pass built the engine at min_free 0: set and rerun from here on
            eng_key = next(k for k in engines if k[0] == 5)
            row("dflash2", r, 0) if mf == 0 else None
            if mf == 0: continue
        engines[eng_key].scheduler.min_free = mf
        row("dflash2", engine_speed.measure(target, draft, ids, 5, False, c, 128, 0.0, "dflash2", per_slot,
                                            engines=engines, engine_kw=kw), mf)
    print(f"c={c}: {time.time() - t0:.0f} s", flush=True)
    del engines
    torch.cuda.empty_cache()
