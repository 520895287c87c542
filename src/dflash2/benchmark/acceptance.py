"""Acceptance-length benchmark in process (the card's evaluation, spec section 5)."""

from __future__ import annotations

from tqdm import tqdm

from ..engine import DFlashProposer, speculative_generate
from ..training.data import gsm8k_prompts, render  # noqa: F401 (re-exported)
from ..verification import SamplingParams
from .metrics import aggregate, per_position


def run_suite(
    target,
    draft,
    prompts: list[str],
    width: int,
    verify: str | None,
    temperature: float,
    top_p: float,
    max_tokens: int,
    seed: int = 0,
    desc: str = "",
) -> dict:
    C, V, hist, finish = [], [], [0] * width, {"stop": 0, "length": 0, "failed": 0}
    for i, p in enumerate(tqdm(prompts, desc=desc or f"w={width} T={temperature}")):
        sp = SamplingParams(temperature=temperature, top_p=top_p, max_new_tokens=max_tokens, seed=seed + i)
        try:
            r = speculative_generate(
                target,
                DFlashProposer(draft, target.embed, target.lm_head_weight),
                render(target.tokenizer, p),
                sp,
                width=width,
                verify_method=verify,
            )
        except Exception:  # counted, as the card's table does
            finish["failed"] += 1
            continue
        C.append(r.completion_tokens)
        V.append(r.verify_steps)
        finish[r.finish_reason] += 1
        for k, c in enumerate(r.accept_hist):
            hist[k] += c
    out = aggregate(C, V)
    out.update(
        {
            "width": width,
            "verify": verify or ("greedy" if temperature == 0 else "token"),
            "temperature": temperature,
            "top_p": top_p,
            "mean_completion": sum(C) / max(len(C), 1),
            "finish": finish,
            "per_position": per_position(hist),
            "accept_hist": hist,
            "C": C,
            "V": V,
        }
    )
    return out
