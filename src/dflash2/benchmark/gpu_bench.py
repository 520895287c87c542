"""The GPU part of scripts/gpu.py: acceptance and side-by-side speed on GSM8K test prompts."""
from __future__ import annotations

import time
from pathlib import Path

from ..model.checkpoint import load_draft
from ..target.loading import load_target
from .speed import format_table, gsm8k_test_prompts, save_rows, side_by_side

ROOT = Path(__file__).resolve().parents[3]


def run_gpu_bench(target_folder, draft_folder, out: Path, seconds: float = 150, n_prompts: int = 4,
                  max_new_tokens: int = 128) -> None:
    import torch
    draft = load_draft(draft_folder, device="cuda", dtype=torch.bfloat16)
    target = load_target(target_folder, "bfloat16", "cuda", layer_ids=draft.config.target_layer_ids)
    prompts = gsm8k_test_prompts(ROOT / "work" / "gsm8k_test.jsonl", n_prompts)
    t0 = time.time()
    rows = side_by_side(target, draft, prompts, widths=(5, 8), temperatures=(0.0, 1.0),
                        max_new_tokens=max_new_tokens, verifies=("token", "block"))
    save_rows(rows, out / "gpu_speed.json")
    print(f"GPU side-by-side ({n_prompts} GSM8K test prompts, {max_new_tokens} new tokens, batch 1, "
          f"{time.time() - t0:.0f}s):\n" + format_table(rows), flush=True)
