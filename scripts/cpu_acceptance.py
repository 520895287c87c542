"""CPU acceptance of the shipped drafter on GSM8K test, one config per line of JSON.
Usage: python scripts/cpu_acceptance.py LIMIT OUT.jsonl THREADS [w:verify:T ...]  (verify: greedy|token|block)"""

import json
import sys
import warnings

import torch

warnings.filterwarnings("ignore")
torch.set_num_threads(int(sys.argv[3]))
from dflash2.benchmark.acceptance import gsm8k_prompts, run_suite
from dflash2.cli import DEFAULT_DRAFT, REPO
from dflash2.model.checkpoint import load_draft
from dflash2.target.loading import load_target

limit, out = int(sys.argv[1]), sys.argv[2]
configs = sys.argv[4:] or ["5:greedy:0", "8:greedy:0", "5:token:1", "5:block:1", "8:token:1", "8:block:1"]
draft = load_draft(DEFAULT_DRAFT, dtype=torch.float32)
target = load_target(None, "float32", layer_ids=draft.config.target_layer_ids)
prompts = gsm8k_prompts(REPO.parent / "shared/data/gsm8k/test.jsonl", limit)
for c in configs:
    w, verify, temp = c.split(":")
    r = run_suite(
        target,
        draft,
        prompts,
        int(w),
        None if verify == "greedy" else verify,
        float(temp),
        0.95 if float(temp) else 1.0,
        max_tokens=256,
    )
    with open(out, "a") as f:
        f.write(json.dumps(r) + "\n")
    print(
        {
            k: r[k]
            for k in (
                "width",
                "verify",
                "temperature",
                "samples",
                "acc_len",
                "weighted_al",
                "pooled_al",
                "per_position",
            )
        },
        flush=True,
    )
