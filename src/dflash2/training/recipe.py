"""The data half of a training recipe: which prompts, answered how, and the held-out split.

A recipe is the ``prepare`` section of a ``dflash2 train --config`` file; when the config's
``data`` file does not exist yet, ``train`` builds it from the recipe with the target itself,
so one command reruns the whole recipe for any target.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from .data import TokenDataset, engine_responses, generate_responses, render
from .sources import Prompt, PromptSet, build_prompts, load_prompts, save_prompts


@dataclass
class AnswerPass:
    """A share of the training prompts answered at one temperature. The passes without ``again`` deal the
    prompts among themselves (each prompt answered once by them, their fractions summing to at most 1); a
    pass with ``again`` answers its fraction of the prompts once more, drawn by its own seed, for example a
    second T=1 answer to every math prompt (``domains``: only prompts of these domains)."""

    fraction: float
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    again: bool = False
    domains: list[str] | None = None

    def takes(self, prompt: Prompt) -> bool:
        """Whether this pass answers prompts of ``prompt``'s domain."""
        return self.domains is None or prompt.domain in self.domains


@dataclass
class DataRecipe:
    sources: dict[str, int | None]  # source name -> at most this many training prompts (None: all)
    answers: list[AnswerPass] = field(default_factory=lambda: [AnswerPass(1.0)])
    heldout_percent: float = 2.0  # of conversations / questions / modules, never trained on
    heldout_per_domain: int = 40
    max_new_tokens: int = 384
    max_prompt_tokens: int = 1024
    gen_batch: int = 256  # prompts per HF generate batch, or the engine's running requests
    seed: int = 0  # the held-out split and, unless answer_order_seed is set, which pass answers which prompt
    # Why apart from seed: a rerun with new answer seeds and another order answers each prompt at another
    # temperature than before (new greedy answers too), while the held-out split stays put.
    answer_order_seed: int | None = None
    generator: str = "hf"  # "hf": Hugging Face generate in padded batches; "engine": our serving engine

    @classmethod
    def from_dict(cls, raw: dict) -> "DataRecipe":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(raw) - names
        if unknown:
            raise ValueError(f"unknown data recipe key(s): {sorted(unknown)}; known: {sorted(names)}")
        if "sources" not in raw or not raw["sources"]:
            raise ValueError("data recipe: 'sources' must name at least one prompt source")
        answers = []
        for a in raw.get("answers", [{"fraction": 1.0}]):
            bad = set(a) - {f.name for f in dataclasses.fields(AnswerPass)}
            if bad:
                raise ValueError(f"data recipe answers: unknown key(s) {sorted(bad)}")
            answers.append(AnswerPass(**a))
        total = sum(a.fraction for a in answers if not a.again)
        if not answers or any(not 0 < a.fraction <= 1 for a in answers) or total > 1 + 1e-6:
            raise ValueError(
                f"data recipe answers: fractions must be in (0, 1] and those without 'again' sum to at most 1 (got {total})"
            )
        if any(a.domains is not None and not (isinstance(a.domains, list) and a.domains) for a in answers):
            raise ValueError("data recipe answers: 'domains' must be a non-empty list of domain names")
        if any(a.temperature < 0 or not 0 < a.top_p <= 1 for a in answers):
            raise ValueError("data recipe answers: temperature >= 0 and 0 < top_p <= 1")
        order = raw.get("answer_order_seed")
        if order is not None and (isinstance(order, bool) or not isinstance(order, int)):
            raise ValueError(f"data recipe answer_order_seed must be an integer or null, got {order!r}")
        if raw.get("generator", "hf") not in ("hf", "engine"):
            raise ValueError(f"data recipe generator must be 'hf' or 'engine', got {raw['generator']!r}")
        return cls(**{**raw, "answers": answers})

    @property
    def order_seed(self) -> int:
        return self.seed if self.answer_order_seed is None else self.answer_order_seed


def build_prompt_files(recipe: DataRecipe, folder: str | Path) -> PromptSet:
    """``train_prompts.jsonl.gz``, ``heldout_prompts.jsonl`` and ``prompts_report.json`` in ``folder``."""
    folder = Path(folder)
    ps = build_prompts(recipe.sources, recipe.heldout_percent, recipe.heldout_per_domain, recipe.seed)
    save_prompts(ps.train, folder / "train_prompts.jsonl.gz")
    save_prompts(ps.heldout, folder / "heldout_prompts.jsonl")
    (folder / "prompts_report.json").write_text(json.dumps(ps.report, indent=1))
    return ps


def load_prompt_files(folder: str | Path) -> PromptSet | None:
    folder = Path(folder)
    if not (folder / "train_prompts.jsonl.gz").is_file():
        return None
    report = folder / "prompts_report.json"
    return PromptSet(
        load_prompts(folder / "train_prompts.jsonl.gz"),
        load_prompts(folder / "heldout_prompts.jsonl"),
        json.loads(report.read_text()) if report.is_file() else {},
    )


def heldout_rows(tokenizer, prompts: list[Prompt], max_prompt_tokens: int) -> list[dict]:
    """Held-out prompts as token rows (no response: ``prompt_len`` is the whole row)."""
    rows = []
    for p in prompts:
        ids = render(tokenizer, p.messages)
        if len(ids) <= max_prompt_tokens:
            import torch

            rows.append({"ids": torch.tensor(ids, dtype=torch.int32), "prompt_len": len(ids), "domain": p.domain})
    return rows


def answer_chunks(prompts: list[Prompt], recipe: DataRecipe) -> list[list[Prompt]]:
    """Each answer pass's prompts: those of its domains (all without ``domains``), shuffled by the order
    seed and dealt in turn to the passes without ``again`` (so they answer each prompt at most once); a pass
    with ``again`` takes its fraction of its own shuffle (by its seed)."""
    order = list(prompts)
    random.Random(recipe.order_seed).shuffle(order)
    chunks, start = [], 0
    for a in recipe.answers:
        if a.again:
            mine = [p for p in order if a.takes(p)]
            random.Random(a.seed).shuffle(mine)
            chunks.append(mine[: round(a.fraction * len(mine))])
        else:
            n = round(a.fraction * len(order))
            chunks.append([p for p in order[start : start + n] if a.takes(p)])
            start += n
    return chunks


def prepare_data(
    recipe: DataRecipe, target, data_path: str | Path, heldout_path: str | Path, time_budget_s: float | None = None
) -> dict:
    """Answer the recipe's training prompts with the target, save them and the held-out prompts.

    Prompt files already in the data file's folder are reused (a run split over several calls,
    or prompts built on another machine); otherwise they are built here. With ``time_budget_s``
    each pass gets the share of the budget that its prompts are of all the passes' prompts and stops
    starting batches when that is spent (the report says how many prompts each pass answered).
    Returns the data report, also written beside the data as ``data_report.json``."""
    folder = Path(data_path).parent
    folder.mkdir(parents=True, exist_ok=True)
    ps = load_prompt_files(folder) or build_prompt_files(recipe, folder)
    t0, rows = time.perf_counter(), []
    passes = []
    chunks = answer_chunks(ps.train, recipe)
    used, total = 0, max(1, sum(map(len, chunks)))
    for a, chunk in zip(recipe.answers, chunks):
        used += len(chunk)  # each pass's share of the budget: its share of the prompts
        deadline = None if time_budget_s is None else t0 + time_budget_s * used / total
        before = len(rows)
        kw = dict(
            max_new_tokens=recipe.max_new_tokens,
            temperature=a.temperature,
            top_p=a.top_p,
            seed=a.seed,
            domains=[p.domain for p in chunk],
            max_prompt_tokens=recipe.max_prompt_tokens,
            deadline=deadline,
        )
        if recipe.generator == "engine":
            rows += engine_responses(target, [p.messages for p in chunk], recipe.gen_batch, **kw)
        else:
            rows += generate_responses(
                target.model, target.tokenizer, [p.messages for p in chunk], recipe.gen_batch, **kw
            )
        passes.append({**dataclasses.asdict(a), "prompts": len(chunk), "sequences": len(rows) - before})
    TokenDataset(rows).save(data_path)
    held = heldout_rows(target.tokenizer, ps.heldout, recipe.max_prompt_tokens)
    TokenDataset(held).save(heldout_path)
    by_domain: dict[str, dict[str, int]] = {}
    for r in rows:
        d = by_domain.setdefault(r["domain"], {"sequences": 0, "response_tokens": 0})
        d["sequences"] += 1
        d["response_tokens"] += len(r["ids"]) - r["prompt_len"]
    report = {
        "prompts": ps.report,
        "answer_order_seed": recipe.order_seed,
        "passes": passes,
        "sequences": len(rows),
        "tokens": sum(len(r["ids"]) for r in rows),
        "by_domain": by_domain,
        "heldout_prompts": {d: sum(r["domain"] == d for r in held) for d in sorted({r["domain"] for r in held})},
        "generation_seconds": time.perf_counter() - t0,
    }
    (folder / "data_report.json").write_text(json.dumps(report, indent=1))
    return report
