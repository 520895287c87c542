"""Paired CPU A/B of the shipped drafter in fp32 and w8a8_int8: one target, the same 20 GSM8K test prompts,
configs rotated per prompt. Usage: python scripts/cpu_int8_ab.py 5,8 OUT.json  (docs/benchmarks.md, seventh session)"""

# paired A/B in one process: fp32 drafter vs w8a8_int8 drafter, same prompts, rotated order per prompt
import sys, time, warnings, json

warnings.filterwarnings("ignore")
import torch
from dflash2.cli import build_parser, load_models, REPO
from dflash2.engine import DFlashProposer, speculative_generate
from dflash2.training.data import render, gsm8k_prompts
from dflash2.model.checkpoint import load_draft
from dflash2.model.token_map import load_token_map
from dflash2.verification import SamplingParams

args = build_parser().parse_args(
    ["generate", "--prompt", "x", "--dtype", "float32", "--speculative-draft-model-quantization", "none"]
)
target, d32, _ = load_models(args)
d8 = load_draft(REPO / "models/smollm2-135m-dflash2", dtype=torch.float32)
d8.pack_cpu_linears("w8a8_int8")
d8.set_token_map(
    load_token_map(REPO / "models/smollm2-135m-dflash2/token_map.pt", d8.config.vocab_size), target.lm_head_weight
)
prompts = gsm8k_prompts(REPO / "work/gsm8k_test.jsonl", 20)
widths = [int(w) for w in sys.argv[1].split(",")]
cfgs = [(w, n, d) for w in widths for n, d in (("fp32", d32), ("int8", d8))]
stats = {f"w{w}_{n}": [0, 0, 0.0] for w, n, _ in cfgs}
for i, p in enumerate(prompts):
    ids = render(target.tokenizer, p)
    order = cfgs[i % len(cfgs) :] + cfgs[: i % len(cfgs)]
    for w, n, d in order:
        t0 = time.perf_counter()
        r = speculative_generate(
            target,
            DFlashProposer(d, target.embed, target.lm_head_weight),
            ids,
            SamplingParams(max_new_tokens=256),
            width=w,
        )
        s = stats[f"w{w}_{n}"]
        s[0] += r.completion_tokens
        s[1] += r.verify_steps
        s[2] += time.perf_counter() - t0
    print(i, {k: round(v[0] / v[2], 2) for k, v in stats.items()}, flush=True)
out = {
    k: {"tokens": v[0], "verify_steps": v[1], "seconds": v[2], "tok_s": v[0] / v[2], "AL": v[0] / v[1]}
    for k, v in stats.items()
}
print(json.dumps(out, indent=1))
json.dump(out, open(sys.argv[2], "w"), indent=1)
