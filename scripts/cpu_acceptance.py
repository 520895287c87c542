"""CPU acceptance run of the shipped drafter on GSM8K test (writes JSON lines)."""
import json, sys, torch, warnings
warnings.filterwarnings("ignore")
torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
from dflash2.cli import DEFAULT_DRAFT, REPO
from dflash2.model.checkpoint import load_draft
from dflash2.target.loading import load_target
from dflash2.benchmark.acceptance import gsm8k_prompts, run_suite
limit, out = int(sys.argv[1]), sys.argv[2]
draft = load_draft(DEFAULT_DRAFT, dtype=torch.float32)
target = load_target(None, "float32", layer_ids=draft.config.target_layer_ids)
prompts = gsm8k_prompts(REPO.parent / "shared/data/gsm8k/test.jsonl", limit)
for w, verify, temp, top_p in [(5, None, 0.0, 1.0), (8, None, 0.0, 1.0), (5, "token", 1.0, 0.95), (5, "block", 1.0, 0.95),
                               (8, "token", 1.0, 0.95), (8, "block", 1.0, 0.95)]:
    r = run_suite(target, draft, prompts, w, verify, temp, top_p, max_tokens=256)
    with open(out, "a") as f:
        f.write(json.dumps(r) + "\n")
    print({k: r[k] for k in ("width", "verify", "temperature", "samples", "acc_len", "weighted_al", "pooled_al")}, flush=True)
