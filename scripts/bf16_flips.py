"""How often and how early bf16 rounding flips a near-tie: greedy DFlash2 vs the target alone,
same dtype, same prompts. Usage: python scripts/bf16_flips.py N_PROMPTS MAX_NEW [dtype]"""

import json
import sys
import warnings


warnings.filterwarnings("ignore")
from dflash2.benchmark.speed import gsm8k_test_prompts
from dflash2.cli import DEFAULT_DRAFT, REPO
from dflash2.engine import DFlashProposer, speculative_generate
from dflash2.model.checkpoint import load_draft
from dflash2.target.loading import load_target, resolve_dtype
from dflash2.training.data import render
from dflash2.verification import SamplingParams

n, max_new = int(sys.argv[1]), int(sys.argv[2])
dtype = sys.argv[3] if len(sys.argv) > 3 else "bfloat16"
draft = load_draft(DEFAULT_DRAFT, dtype=resolve_dtype(dtype, "cpu"))
target = load_target(None, dtype, layer_ids=draft.config.target_layer_ids)
rows = []
for i, p in enumerate(gsm8k_test_prompts(REPO.parent / "shared/data/gsm8k/test.jsonl", n)):
    ids = render(target.tokenizer, p)
    sp = SamplingParams(max_new_tokens=max_new)
    base = speculative_generate(target, None, ids, sp, width=1).token_ids
    for w in (5, 8):
        spec = speculative_generate(
            target, DFlashProposer(draft, target.embed, target.lm_head_weight), ids, sp, width=w
        ).token_ids
        first = next((j for j, (a, b) in enumerate(zip(base, spec)) if a != b), None)
        rows.append({"prompt": i, "width": w, "identical": spec == base, "first_divergence": first, "len": len(base)})
        print(rows[-1], flush=True)
flips = [r for r in rows if not r["identical"]]
print(
    json.dumps(
        {
            "dtype": dtype,
            "runs": len(rows),
            "diverged": len(flips),
            "first_divergence": sorted(r["first_divergence"] for r in flips if r["first_divergence"] is not None),
        }
    )
)
